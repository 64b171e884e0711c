import pytest

from gpuwarden.core.units import parse_bytes, parse_duration

GIB, MIB = 1024**3, 1024**2


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("12G", 12 * GIB),
        ("12g", 12 * GIB),
        ("512M", 512 * MIB),
        ("1.5G", 3 * GIB // 2),
        ("2GiB", 2 * GIB),
        ("64K", 64 * 1024),
        ("1T", 1024 * GIB),
        (" 8 G ", 8 * GIB),
    ],
)
def test_parse_bytes(text: str, want: int) -> None:
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["10X", "G", "", "ten G", "-1G", "1e3G"])
def test_parse_bytes_refuses_with_the_option_and_an_example(text: str) -> None:
    with pytest.raises(ValueError, match=r"--vram .*write it as a number with G or M, e.g. 10G"):
        parse_bytes(text)


def test_parse_bytes_wants_a_unit_and_more_than_zero() -> None:
    with pytest.raises(ValueError, match="a unit is needed"):
        parse_bytes("12")
    with pytest.raises(ValueError, match="more than 0"):
        parse_bytes("0G")
    with pytest.raises(ValueError, match=r"^--ram 4Q: .* e\.g\. 4G"):
        parse_bytes("4Q", option="--ram", example="4G")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("90s", 90.0),
        ("90", 90.0),
        ("1d", 86400.0),
        ("1.5h", 5400.0),
    ],
)
def test_parse_duration(text: str, want: float) -> None:
    assert parse_duration(text) == want


@pytest.mark.parametrize("text", ["10x", "m", "", "-5m", "5 minutes"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(
        ValueError, match=r"--for .*write it as a number with s, m, h or d, e.g. 10m"
    ):
        parse_duration(text)


def test_parse_duration_more_than_zero() -> None:
    with pytest.raises(ValueError, match=r"--est 0s: must be more than 0"):
        parse_duration("0s", option="--est")
