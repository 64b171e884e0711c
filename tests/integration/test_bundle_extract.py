"""extract_bundle against crafted and hostile archives; bundle and result round trips."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import struct
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.model import GIB, MIB, JobSpec
from gpuwarden.errors import BundleError
from gpuwarden.intake.bundle import extract_bundle, extract_outputs, read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle, write_result_bundle
from gpuwarden.intake.manifest import BundleLimits, bundle_name

NOW = 1_795_938_132.0  # 2026-11-29T07:42:12Z

GOOD_MANIFEST = json.dumps(
    {
        "version": 1,
        "jobs": [
            {
                "id": "hello-1",
                "type": "echo.echo",
                "params": {"text": "hi"},
                "inputs": ["a.txt", "sub/b.bin"],
                "outputs": ["hello.txt"],
            }
        ],
    }
).encode()

Entry = tuple[str | zipfile.ZipInfo, bytes]


def good_entries() -> list[Entry]:
    return [
        ("manifest.json", GOOD_MANIFEST),
        ("inputs/a.txt", b"hello world"),
        ("inputs/sub/", b""),
        ("inputs/sub/b.bin", bytes(range(256)) * 4),
    ]


def make_zip(path: Path, entries: list[Entry], compression: int = zipfile.ZIP_STORED) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names
        with zipfile.ZipFile(path, "w", compression=compression) as zf:
            for name, data in entries:
                zf.writestr(name, data)
    return path


def info(name: str, mode: int) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name)
    zi.create_system = 3
    zi.external_attr = mode << 16
    return zi


# --- raw header patching ---------------------------------------------------------


def _central_entries(raw: bytes) -> Iterator[tuple[int, str]]:
    """(offset of central directory header, name) for every entry."""
    eocd = raw.rindex(b"PK\x05\x06")
    count = struct.unpack_from("<H", raw, eocd + 10)[0]
    pos = struct.unpack_from("<I", raw, eocd + 16)[0]
    for _ in range(count):
        assert raw[pos : pos + 4] == b"PK\x01\x02"
        n, m, k = struct.unpack_from("<HHH", raw, pos + 28)
        yield pos, raw[pos + 46 : pos + 46 + n].decode("utf-8", "replace")
        pos += 46 + n + m + k


def patch_entry(path: Path, name: str, *, file_size: int | None = None, flags_or: int = 0) -> None:
    """Rewrite the sizes or flags of entry ``name`` in both its local and central header."""
    raw = bytearray(path.read_bytes())
    for cpos, cname in _central_entries(bytes(raw)):
        if cname != name:
            continue
        lpos = struct.unpack_from("<I", raw, cpos + 42)[0]
        assert raw[lpos : lpos + 4] == b"PK\x03\x04"
        if file_size is not None:
            struct.pack_into("<I", raw, cpos + 24, file_size)
            struct.pack_into("<I", raw, lpos + 22, file_size)
        if flags_or:
            for off in (cpos + 8, lpos + 6):
                struct.pack_into("<H", raw, off, struct.unpack_from("<H", raw, off)[0] | flags_or)
        path.write_bytes(bytes(raw))
        return
    raise AssertionError(f"no entry {name}")


# --- fixtures ----------------------------------------------------------------------


def snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "in").mkdir()
    (tmp_path / "work" / "a" / "b").mkdir(parents=True)
    return {
        "root": tmp_path,
        "zip": tmp_path / "in" / "b.zip",
        "staging": tmp_path / "work" / "a" / "b" / "staging",
    }


@pytest.fixture
def refuse(layout: dict[str, Path]) -> Callable[..., BundleError]:
    """Extract ``layout['zip']``; assert it is refused with a message matching
    ``match``, that staging is gone and that nothing changed outside it."""

    def run(match: str, limits: BundleLimits | None = None) -> BundleError:
        root, staging = layout["root"], layout["staging"]
        before = snapshot(root)
        with pytest.raises(BundleError, match=match) as excinfo:
            extract_bundle(layout["zip"], staging, limits or BundleLimits())
        assert not staging.exists() and not staging.is_symlink()
        assert snapshot(root) == before
        assert excinfo.value.message.startswith("bundle b.zip: ")
        return excinfo.value

    return run


# --- the good case -----------------------------------------------------------------


def test_good_bundle_extracts(layout: dict[str, Path]) -> None:
    make_zip(layout["zip"], good_entries(), zipfile.ZIP_DEFLATED)
    jobs = extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert [j.id for j in jobs] == ["hello-1"]
    inputs = layout["staging"] / "inputs"
    assert (inputs / "a.txt").read_bytes() == b"hello world"
    assert (inputs / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 4
    assert (layout["staging"] / "manifest.json").read_bytes() == GOOD_MANIFEST
    assert stat.S_IMODE((inputs / "a.txt").stat().st_mode) == 0o644


def test_existing_empty_staging_is_used(layout: dict[str, Path]) -> None:
    make_zip(layout["zip"], good_entries())
    layout["staging"].mkdir()
    extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert (layout["staging"] / "inputs" / "a.txt").is_file()


def test_non_empty_staging_is_refused_and_left_alone(layout: dict[str, Path]) -> None:
    make_zip(layout["zip"], good_entries())
    layout["staging"].mkdir()
    (layout["staging"] / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert (layout["staging"] / "keep").read_text() == "mine"


def test_no_inputs_still_makes_inputs_dir(layout: dict[str, Path]) -> None:
    manifest = json.dumps({"version": 1, "jobs": [{"id": "a", "type": "m.t"}]}).encode()
    make_zip(layout["zip"], [("manifest.json", manifest)])
    extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert (layout["staging"] / "inputs").is_dir()


def test_round_trip_write_then_extract(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "deep" / "b.bin").write_bytes(os.urandom(300_000))
    jobs = [
        JobSpec(
            id="hello-1",
            type="echo.echo",
            params={"text": "hi", "n": 3},
            inputs=("a.txt", "sub/b.bin"),
            outputs=("hello.txt",),
            priority=5,
            vram_bytes=8 * GIB,
        ),
        JobSpec(id="second", type="echo.echo", inputs=("a.txt",), vram_bytes=3 * MIB + 1),
    ]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    files = {"a.txt": src / "a.txt", "sub/b.bin": src / "deep" / "b.bin"}
    path = write_bundle(inbox, jobs, files, now=NOW)
    assert path.parent == inbox
    assert path.name.startswith("hello-1-20261129T074212Z-") and path.suffix == ".zip"
    assert [p.name for p in inbox.iterdir()] == [path.name]  # no temp file left

    staging = tmp_path / "staging"
    got = extract_bundle(path, staging, BundleLimits())
    assert got == tuple(jobs)
    assert (staging / "inputs" / "a.txt").read_text() == "alpha"
    assert (staging / "inputs" / "sub" / "b.bin").read_bytes() == files["sub/b.bin"].read_bytes()


def test_write_bundle_refuses_what_extract_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"jobs\[0\]\.id"):
        write_bundle(tmp_path, [JobSpec(id="bad id", type="m.t")], now=NOW)
    with pytest.raises(BundleError, match=r'input "a.txt" has no file given'):
        write_bundle(tmp_path, [JobSpec(id="a", type="m.t", inputs=("a.txt",))], now=NOW)
    with pytest.raises(BundleError, match=r"'\.\.' component"):
        write_bundle(tmp_path, [JobSpec(id="a", type="m.t")], {"../x": tmp_path}, now=NOW)
    with pytest.raises(BundleError, match=r"at least one job"):
        write_bundle(tmp_path, [], now=NOW)
    with pytest.raises(BundleError, match=r'"a" is also a file, so it cannot be a folder'):
        write_bundle(
            tmp_path, [JobSpec(id="a", type="m.t")], {"a": tmp_path, "a/b": tmp_path}, now=NOW
        )
    assert list(tmp_path.iterdir()) == []


def test_write_bundle_temp_file_is_hidden_until_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuwarden.intake.queueroot import QueueRoot

    qr = QueueRoot.open(tmp_path / "q", create=True)
    seen: list[list[str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # the bundle itself, not its folder
            seen.append(sorted(p.name for p in qr.inbox.iterdir()))
            assert qr.pending() == []  # the broker sees nothing yet
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = write_bundle(qr.inbox, [JobSpec(id="j", type="m.t")], now=NOW)
    [tmp] = seen[0]
    assert tmp.startswith(".gw-") and tmp.endswith(".tmp")  # a temporary name
    assert qr.pending() == [path]


def test_bundle_name_format() -> None:
    name = bundle_name("hello-1", NOW)
    stem, stamp, rand = name.removesuffix(".zip").rsplit("-", 2)
    assert (stem, stamp) == ("hello-1", "20261129T074212Z")
    assert len(rand) == 6 and int(rand, 16) >= 0
    assert len({bundle_name("hello-1", NOW) for _ in range(20)}) > 1  # the random part


# --- damaged archives ----------------------------------------------------------------


def test_not_a_zip(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    layout["zip"].write_bytes(b"this is not a zip file at all")
    refuse(r"not a zip file")


def test_empty_file(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    layout["zip"].write_bytes(b"")
    refuse(r"not a zip file")


def test_truncated_zip(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries())
    raw = layout["zip"].read_bytes()
    layout["zip"].write_bytes(raw[: len(raw) // 2])
    refuse(r"not a zip file")


def test_overwritten_member_data(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """Headers intact, but most of an entry's stored data overwritten."""
    make_zip(layout["zip"], [*good_entries(), ("inputs/r.bin", os.urandom(50_000))])
    raw = bytearray(layout["zip"].read_bytes())
    cpos, _ = next(e for e in _central_entries(bytes(raw)) if e[1] == "inputs/r.bin")
    lpos = struct.unpack_from("<I", raw, cpos + 42)[0]
    data_start = lpos + 30 + sum(struct.unpack_from("<HH", raw, lpos + 26))
    raw[data_start + 1000 : data_start + 50_000] = b"\x00" * 49_000  # content, not size
    layout["zip"].write_bytes(bytes(raw))
    refuse(r'entry "inputs/r.bin": bad CRC-32')


def test_bad_crc(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries())  # stored: the data sits in the file as is
    raw = layout["zip"].read_bytes()
    assert raw.count(b"hello world") == 1
    layout["zip"].write_bytes(raw.replace(b"hello world", b"hellO world"))
    refuse(r'entry "inputs/a.txt": bad CRC-32')


def test_bad_crc_in_manifest(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries())
    raw = layout["zip"].read_bytes()
    layout["zip"].write_bytes(raw.replace(b'"echo.echo"', b'"echo.ech0"', 1))
    refuse(r'entry "manifest.json": bad CRC-32')


def test_damaged_deflate_stream(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    make_zip(layout["zip"], [*good_entries(), ("inputs/z", b"ab" * 5000)], zipfile.ZIP_DEFLATED)
    raw = bytearray(layout["zip"].read_bytes())
    cpos, _ = next(e for e in _central_entries(bytes(raw)) if e[1] == "inputs/z")
    lpos = struct.unpack_from("<I", raw, cpos + 42)[0]
    data_start = lpos + 30 + sum(struct.unpack_from("<HH", raw, lpos + 26))
    raw[data_start] = 0xFF  # an invalid deflate block type
    layout["zip"].write_bytes(bytes(raw))
    refuse(r'entry "inputs/z": (damaged data|bad CRC-32)')


def test_zip_bigger_than_limit(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries())
    refuse(r"more than the limit of", BundleLimits(max_zip_bytes=100))


# --- hostile names and entry types ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "match"),
    [
        # a fresh name each run; its id is fixed (every xdist worker collects the same)
        pytest.param(f"/tmp/gw-evil-{uuid.uuid4().hex}", r"absolute path", id="tmp-absolute"),
        ("/inputs/a.txt", r"absolute path"),
        ("C:\\evil.txt", r"absolute path"),
        ("C:evil.txt", r"absolute path"),
        ("\\\\server\\share\\evil.txt", r"absolute path"),
        ("inputs/../../../../evil.txt", r"'\.\.' component"),
        ("../evil.txt", r"'\.\.' component"),
        ("inputs/..", r"'\.\.' component"),
        ("inputs\\..\\..\\evil.txt", r"backslash"),
        ("inputs\\a.txt", r"backslash"),
        ("inputs//a.txt", r"empty or '\.' component"),
        ("inputs/./a.txt", r"empty or '\.' component"),
        ("inputs/" + "x" * 300, r"longer than 255 bytes"),
    ],
)
def test_hostile_name(
    layout: dict[str, Path], refuse: Callable[..., BundleError], name: str, match: str
) -> None:
    make_zip(layout["zip"], [*good_entries(), (name, b"evil")])
    err = refuse(match)
    assert json.dumps(name)[:40] in err.message  # the entry is named (long ones shortened)
    if name.startswith("/tmp/"):
        assert not Path(name).exists()


def test_nul_in_name(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [*good_entries(), ("inputs/evil.txt\x01.png", b"evil")])
    raw = layout["zip"].read_bytes()
    assert raw.count(b"evil.txt\x01.png") == 2  # local and central header
    layout["zip"].write_bytes(raw.replace(b"evil.txt\x01.png", b"evil.txt\x00.png"))
    assert "inputs/evil.txt" in zipfile.ZipFile(layout["zip"]).namelist()  # zipfile truncates
    refuse(r"NUL byte")


def test_symlink_entry(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    link = info("inputs/link", stat.S_IFLNK | 0o777)
    make_zip(layout["zip"], [*good_entries(), (link, b"../../../../etc/passwd")])
    refuse(r'entry "inputs/link": symbolic links are not allowed')


def test_symlink_then_file_through_it(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """The classic: a symlink to outside, then a file written "into" it."""
    outside = layout["root"] / "outside"
    outside.mkdir()
    link = info("inputs/d", stat.S_IFLNK | 0o777)
    make_zip(layout["zip"], [*good_entries(), (link, str(outside).encode()), ("inputs/d/x", b"x")])
    refuse(r"symbolic links are not allowed")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("fifo", stat.S_IFIFO | 0o644),
        ("char device", stat.S_IFCHR | 0o600),
        ("block device", stat.S_IFBLK | 0o600),
        ("socket", stat.S_IFSOCK | 0o600),
    ],
)
def test_special_file_entry(
    layout: dict[str, Path], refuse: Callable[..., BundleError], kind: str, mode: int
) -> None:
    make_zip(layout["zip"], [*good_entries(), (info("inputs/dev", mode), b"")])
    refuse(r'entry "inputs/dev": a special file .*only regular files and directories')


def test_mode_contradicts_name(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [*good_entries(), (info("inputs/d", stat.S_IFDIR | 0o755), b"")])
    refuse(r"directory entry whose name does not end in '/'")


def test_duplicate_name(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [*good_entries(), ("inputs/a.txt", b"second")])
    refuse(r'entry "inputs/a.txt": duplicate name')


def test_duplicate_file_and_dir(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    make_zip(layout["zip"], [*good_entries(), ("inputs/a.txt/", b"")])
    refuse(r'entry "inputs/a.txt/": duplicate name')


def test_file_where_a_dir_is_needed(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """Passes the header checks; fails while writing, after earlier entries were written."""
    make_zip(layout["zip"], [*good_entries(), ("inputs/x", b"file"), ("inputs/x/y", b"under")])
    refuse(r'entry "inputs/x/y": .*already there and is not a directory')


def test_too_many_entries(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    entries = good_entries() + [(f"inputs/f{i}", b"x") for i in range(3)]
    make_zip(layout["zip"], entries)
    refuse(r"has 7 entries, more than the limit of 6", BundleLimits(max_entries=6))


def _patch_eocd(path: Path, *, count: int | None = None, cd_size: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    pos = raw.rindex(b"PK\x05\x06")
    if count is not None:
        struct.pack_into("<HH", raw, pos + 8, count, count)
    if cd_size is not None:
        struct.pack_into("<I", raw, pos + 12, cd_size)
    path.write_bytes(bytes(raw))


def test_too_many_entries_stated_in_end_record(
    layout: dict[str, Path], refuse: Callable[..., BundleError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused from the end record alone, before zipfile reads a single entry."""
    make_zip(layout["zip"], good_entries())
    _patch_eocd(layout["zip"], count=60_000)

    def no_zipfile(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("zipfile.ZipFile must not be reached")

    monkeypatch.setattr(zipfile, "ZipFile", no_zipfile)
    refuse(r"has 60000 entries, more than the limit of 10000")


def test_too_many_entries_in_zip64_end_record(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """Over 65535 entries: the 16-bit count says 0xFFFF, the zip64 record the truth."""
    with zipfile.ZipFile(layout["zip"], "w") as zf:
        for i in range(70_000):
            zf.writestr(f"inputs/{i}", b"")
    assert b"PK\x06\x06" in layout["zip"].read_bytes()[-200:]
    refuse(r"has 70000 entries, more than the limit of 69999", BundleLimits(max_entries=69_999))


def test_central_directory_too_big_for_entry_limit(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """The end record understates the count; the directory's size gives it away."""
    long_names = [(f"inputs/{i}" + "x" * 1000, b"") for i in range(4)]
    make_zip(layout["zip"], [*good_entries()[:1], *long_names])
    _patch_eocd(layout["zip"], count=1)
    refuse(
        r"its central directory is .*, too big for at most 2 entries", BundleLimits(max_entries=2)
    )


def test_entries_at_limit_are_fine(layout: dict[str, Path]) -> None:
    make_zip(layout["zip"], good_entries())
    extract_bundle(layout["zip"], layout["staging"], BundleLimits(max_entries=4))


def test_encrypted_entry(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries())
    patch_entry(layout["zip"], "inputs/a.txt", flags_or=0x1)
    refuse(r'entry "inputs/a.txt": encrypted entries are not supported')


def test_unsupported_compression(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    make_zip(layout["zip"], [*good_entries(), ("inputs/c", b"x" * 1000)], zipfile.ZIP_BZIP2)
    refuse(r"compression method 12 is not supported")


def test_unexpected_top_level_entry(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    make_zip(layout["zip"], [*good_entries(), ("__MACOSX/._a.txt", b"junk")])
    refuse(r'entry "__MACOSX/._a.txt": unexpected; a bundle holds only manifest.json')


def test_inputs_as_a_file(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [("manifest.json", GOOD_MANIFEST), ("inputs", b"x")])
    refuse(r'entry "inputs": unexpected')


# --- size limits ---------------------------------------------------------------------


class ReadCounter:
    """Counts the bytes zipfile hands out, to prove extraction stopped early."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = 0
        real = zipfile.ZipExtFile.read

        def read(this: zipfile.ZipExtFile, n: int = -1) -> bytes:
            data = real(this, n)
            self.total += len(data)
            return data

        monkeypatch.setattr(zipfile.ZipExtFile, "read", read)


def _zeros_entry(zf: zipfile.ZipFile, name: str, size: int) -> None:
    with zf.open(name, "w") as dst:
        chunk = bytes(MIB)
        left = size
        while left:
            dst.write(chunk[: min(left, MIB)])
            left -= min(left, MIB)


def make_bomb(path: Path, sizes: dict[str, int]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.json", GOOD_MANIFEST)
        zf.writestr("inputs/a.txt", b"hello world")
        zf.writestr("inputs/sub/b.bin", b"b")
        for name, size in sizes.items():
            _zeros_entry(zf, name, size)
    return path


LIMIT = 1 * MIB


DECLARED = r"its entries declare .* unpacked, more than the limit of 1 MiB; nothing was extracted"


def test_zip_bomb(
    layout: dict[str, Path], refuse: Callable[..., BundleError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused from the sizes its entries declare: nothing is decompressed at all
    (the manifest neither), nothing is written."""
    make_bomb(layout["zip"], {"inputs/bomb.bin": 32 * MIB})
    assert layout["zip"].stat().st_size < 100_000  # highly compressible
    with zipfile.ZipFile(layout["zip"]) as zf:
        assert zf.getinfo("inputs/bomb.bin").file_size == 32 * MIB  # it says what it holds
    counter = ReadCounter(monkeypatch)
    refuse(DECLARED, BundleLimits(max_unpacked_bytes=LIMIT))
    assert counter.total == 0


def test_zip_bomb_spread_over_entries(
    layout: dict[str, Path], refuse: Callable[..., BundleError], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_bomb(layout["zip"], {f"inputs/part{i}": 400 * 1024 for i in range(4)})
    counter = ReadCounter(monkeypatch)
    refuse(DECLARED, BundleLimits(max_unpacked_bytes=LIMIT))
    assert counter.total == 0


def test_the_bytes_are_counted_again_while_extracting(
    layout: dict[str, Path], refuse: Callable[..., BundleError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second count: with the check of the declared sizes out of the way, the
    bytes actually decompressed still stop the bomb at the limit."""
    from gpuwarden.intake import bundle as bundle_module

    make_bomb(layout["zip"], {f"inputs/part{i}": 400 * 1024 for i in range(4)})
    monkeypatch.setattr(bundle_module, "check_declared", lambda *a, **k: None)
    counter = ReadCounter(monkeypatch)
    refuse(
        r'entry "inputs/part2": the unpacked size passes', BundleLimits(max_unpacked_bytes=LIMIT)
    )
    assert counter.total <= LIMIT + 1


@pytest.mark.parametrize(
    ("claimed", "match"),
    [
        # claims a tiny size: zipfile stops at the claim and the CRC no longer matches
        (1000, r'entry "inputs/bomb.bin": bad CRC-32'),
        # claims a size under the real one but over the limit: refused from the claim
        (3 * MIB, DECLARED),
    ],
)
def test_zip_bomb_with_lying_size_header(
    layout: dict[str, Path],
    refuse: Callable[..., BundleError],
    monkeypatch: pytest.MonkeyPatch,
    claimed: int,
    match: str,
) -> None:
    make_bomb(layout["zip"], {"inputs/bomb.bin": 32 * MIB})
    patch_entry(layout["zip"], "inputs/bomb.bin", file_size=claimed)
    with zipfile.ZipFile(layout["zip"]) as zf:
        assert zf.getinfo("inputs/bomb.bin").file_size == claimed  # the lie is in place
    counter = ReadCounter(monkeypatch)
    refuse(match, BundleLimits(max_unpacked_bytes=LIMIT))
    assert counter.total <= LIMIT + 1


def test_an_entry_shorter_than_it_declares_is_refused(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """The CRC matches the real (shorter) data, only the size lies: the count of
    the bytes actually decompressed gives it away."""
    make_zip(layout["zip"], good_entries(), compression=zipfile.ZIP_DEFLATED)
    patch_entry(layout["zip"], "inputs/a.txt", file_size=5000)
    with zipfile.ZipFile(layout["zip"]) as zf:
        assert zf.read("inputs/a.txt") == b"hello world"  # zipfile itself takes it
        assert zf.getinfo("inputs/a.txt").file_size == 5000
    refuse(r'entry "inputs/a.txt": holds 11 bytes, but its header declares 5000: a damaged')


def test_manifest_too_big(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    big = GOOD_MANIFEST[:-1] + b', "pad": "' + b" " * 5000 + b'"}'
    make_zip(layout["zip"], [("manifest.json", big), *good_entries()[1:]])
    refuse(
        r'entry "manifest.json": the manifest passes the limit',
        BundleLimits(max_manifest_bytes=1000),
    )


def test_unpacked_exactly_at_limit_is_fine(layout: dict[str, Path]) -> None:
    total = sum(len(data) for _, data in good_entries())
    make_zip(layout["zip"], good_entries())
    extract_bundle(layout["zip"], layout["staging"], BundleLimits(max_unpacked_bytes=total))


def test_unpacked_one_over_limit(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    total = sum(len(data) for _, data in good_entries())
    make_zip(layout["zip"], good_entries())
    refuse(
        r"its entries declare .* more than the limit", BundleLimits(max_unpacked_bytes=total - 1)
    )


# --- manifest and inputs ----------------------------------------------------------


def test_missing_manifest(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], good_entries()[1:])
    refuse(r"manifest.json is missing")


def test_manifest_in_a_subfolder_does_not_count(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    make_zip(layout["zip"], [("inputs/manifest.json", GOOD_MANIFEST), *good_entries()[1:]])
    refuse(r"manifest.json is missing")


def test_manifest_as_directory(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [("manifest.json/", b""), *good_entries()[1:]])
    refuse(r'"manifest.json/": must be a file')


def test_invalid_manifest(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    bad = GOOD_MANIFEST.replace(b'"version": 1', b'"version": 2')
    make_zip(layout["zip"], [("manifest.json", bad), *good_entries()[1:]])
    refuse(r"bundle b.zip: manifest.json: version must be 1, got 2")


def test_missing_input_file(layout: dict[str, Path], refuse: Callable[..., BundleError]) -> None:
    make_zip(layout["zip"], [e for e in good_entries() if e[0] != "inputs/sub/b.bin"])
    refuse(
        r'jobs\[0\]\.inputs\[1\] "sub/b.bin" is not in the bundle '
        r"\(expected a file inputs/sub/b.bin\)"
    )


def test_input_that_is_a_directory(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    entries = [e for e in good_entries() if e[0] != "inputs/sub/b.bin"]
    make_zip(layout["zip"], [*entries, ("inputs/sub/b.bin/", b"")])
    refuse(r'"sub/b.bin" is not in the bundle')


def test_refusal_leaves_nothing_even_after_partial_write(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    """Entries before the bad one were written; all of it must go."""
    entries = good_entries() + [(f"inputs/ok{i}", b"data" * 100) for i in range(5)]
    entries.append(("inputs/corrupt", b"hello world 2"))
    make_zip(layout["zip"], entries)
    raw = layout["zip"].read_bytes()
    layout["zip"].write_bytes(raw.replace(b"hello world 2", b"hello world 3"))
    refuse(r'entry "inputs/corrupt": bad CRC-32')


def test_disk_error_cleans_up_and_is_not_a_bundle_error(
    layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_zip(layout["zip"], good_entries())
    real_open = os.open

    def failing_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path).endswith("b.bin"):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(OSError, match="No space left") as excinfo:
        extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert not isinstance(excinfo.value, BundleError)
    assert not layout["staging"].exists()


# --- result bundles -----------------------------------------------------------------


def _outputs(tmp_path: Path) -> Path:
    out = tmp_path / "out-hello"
    (out / "sub" / "deeper").mkdir(parents=True)
    (out / "hello.txt").write_text("hello")
    (out / "sub" / "deeper" / "img.bin").write_bytes(os.urandom(70_000))
    (out / "escape").symlink_to("/etc/passwd")  # never packed
    return out


def test_result_bundle_round_trip(tmp_path: Path) -> None:
    out = _outputs(tmp_path)
    results: list[tuple[dict[str, Any], Path | None]] = [
        ({"id": "hello-1", "state": "done", "exit_code": 0, "outputs": ["hello.txt"]}, out),
        ({"id": "broken", "state": "failed", "reason": "exit 1: ✗"}, None),
    ]
    dest_dir = tmp_path / "outbox"
    dest_dir.mkdir()
    path = write_result_bundle(dest_dir, "b.zip", results)
    assert path == dest_dir / "b.zip"
    assert [p.name for p in dest_dir.iterdir()] == ["b.zip"]

    escape = {"path": "escape", "kind": "symlink", "why": "a symlink, not a regular file or folder"}
    assert read_result_bundle(path) == {
        "hello-1": {**results[0][0], "refused_outputs": [escape]},  # listed, never opened
        "broken": results[1][0],
    }
    assert "refused_outputs" not in results[0][0]  # the caller's dict is left as it was
    with zipfile.ZipFile(path) as zf:
        names = sorted(zf.namelist())
        text = zf.read("hello-1/result.json").decode()
    assert names == [
        "broken/result.json",
        "hello-1/outputs/hello.txt",
        "hello-1/outputs/sub/deeper/img.bin",
        "hello-1/result.json",
    ]
    assert text.startswith("{\n  ")  # pretty

    dest = tmp_path / "got"
    files = extract_outputs(path, "hello-1", dest)
    assert sorted(p.relative_to(dest).as_posix() for p in files) == [
        "hello.txt",
        "sub/deeper/img.bin",
    ]
    assert (dest / "hello.txt").read_text() == "hello"
    assert (dest / "sub/deeper/img.bin").read_bytes() == (out / "sub/deeper/img.bin").read_bytes()
    assert extract_outputs(path, "broken", tmp_path / "none") == []
    with pytest.raises(BundleError, match=r"has no result for job nobody"):
        extract_outputs(path, "nobody", tmp_path / "x")
    with pytest.raises(BundleError, match=r"not a valid job id"):
        extract_outputs(path, "../x", tmp_path / "x")


def test_result_bundle_never_overwrites_and_rejects_bad_results(tmp_path: Path) -> None:
    write_result_bundle(tmp_path, "r.zip", [({"id": "a", "n": 1}, None)])
    with pytest.raises(FileExistsError):
        write_result_bundle(tmp_path, "r.zip", [({"id": "a", "n": 2}, None)])
    assert read_result_bundle(tmp_path / "r.zip") == {"a": {"id": "a", "n": 1}}  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.zip"]  # no temporary left
    with pytest.raises(ValueError, match="no valid job id"):
        write_result_bundle(tmp_path, "s.zip", [({"state": "done"}, None)])
    with pytest.raises(ValueError, match="two results for job a"):
        write_result_bundle(tmp_path, "s.zip", [({"id": "a"}, None), ({"id": "a"}, None)])
    with pytest.raises(ValueError, match="plain, non-hidden"):
        write_result_bundle(tmp_path, "../s.zip", [])
    assert not (tmp_path / "s.zip").exists()


def test_result_temp_file_never_appears_under_final_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _outputs(tmp_path)
    dest_dir = tmp_path / "outbox"
    dest_dir.mkdir()
    final = dest_dir / "b.zip"
    events: list[str] = []
    temps: list[Path] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            [tmp] = list(dest_dir.iterdir())
            assert tmp.name.startswith(".gw-") and tmp.name.endswith(".tmp")
            assert not final.exists()
            temps.append(tmp)
            events.append("fsync")
        real_fsync(fd)

    def link(src: Any, dst: Any, **kw: Any) -> None:
        assert Path(src) == temps[0] and Path(dst) == final
        assert not final.exists()
        assert events == ["fsync"]  # synced before it gets its name
        with zipfile.ZipFile(src) as zf:
            assert zf.testzip() is None  # complete and valid
            assert len(zf.namelist()) == 3
        events.append("link")
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    write_result_bundle(dest_dir, "b.zip", [({"id": "hello-1"}, out)])
    assert events == ["fsync", "link"]
    assert sorted(p.name for p in dest_dir.iterdir()) == ["b.zip"]


def test_result_is_published_without_hard_links_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A share without hard links: the name is checked, then the file renamed."""

    def no_links(src: Any, dst: Any, **kw: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    write_result_bundle(tmp_path, "r.zip", [({"id": "a", "n": 1}, None)])
    with pytest.raises(FileExistsError):
        write_result_bundle(tmp_path, "r.zip", [({"id": "a", "n": 2}, None)])
    assert read_result_bundle(tmp_path / "r.zip") == {"a": {"id": "a", "n": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.zip"]


def test_result_write_failure_leaves_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="I/O error"):
        write_result_bundle(tmp_path, "b.zip", [({"id": "a"}, None)])
    assert list(tmp_path.iterdir()) == []


def _result_zip(path: Path, extra: list[Entry]) -> Path:
    return make_zip(path, [("job/result.json", b'{"id": "job"}'), *extra])


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (("job/outputs/../../../evil", b"x"), r"'\.\.' component"),
        (("/job/outputs/evil", b"x"), r"absolute path"),
        (("job\\outputs\\evil", b"x"), r"backslash"),
        ((info("job/outputs/link", stat.S_IFLNK | 0o777), b"/etc"), r"symbolic links"),
        ((info("job/outputs/fifo", stat.S_IFIFO | 0o644), b""), r"special file"),
    ],
)
def test_extract_outputs_refuses_hostile_entries(tmp_path: Path, entry: Entry, match: str) -> None:
    path = _result_zip(tmp_path / "r.zip", [entry])
    dest = tmp_path / "a" / "b" / "dest"
    before = snapshot(tmp_path)
    with pytest.raises(BundleError, match=match):
        extract_outputs(path, "job", dest)
    assert snapshot(tmp_path) - before <= {"a/b/dest"}
    assert not (tmp_path / "evil").exists()


def test_extract_outputs_does_not_follow_symlinks_on_disk(tmp_path: Path) -> None:
    path = _result_zip(
        tmp_path / "r.zip", [("job/outputs/ok.txt", b"ok"), ("job/outputs/x.txt", b"pwned")]
    )
    victim = tmp_path / "victim.txt"
    victim.write_text("safe")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "x.txt").symlink_to(victim)
    with pytest.raises(BundleError, match=r'entry "job/outputs/x.txt": cannot be created'):
        extract_outputs(path, "job", dest)
    assert victim.read_text() == "safe"
    assert not (dest / "ok.txt").exists()  # files of a failed call are removed again


def test_extract_outputs_does_not_follow_symlinked_folders(tmp_path: Path) -> None:
    path = _result_zip(tmp_path / "r.zip", [("job/outputs/d/x.txt", b"pwned")])
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "d").symlink_to(outside)
    with pytest.raises(
        BundleError, match=r"already there and is not a directory \(a file, or a symlink\)"
    ):
        extract_outputs(path, "job", dest)
    assert list(outside.iterdir()) == []


def test_extract_outputs_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("job/result.json", b"{}")
        _zeros_entry(zf, "job/outputs/big", 8 * MIB)
    counter = ReadCounter(monkeypatch)
    with pytest.raises(BundleError, match=r"its entries declare 8 MiB unpacked, more than"):
        extract_outputs(path, "job", tmp_path / "d", BundleLimits(max_unpacked_bytes=LIMIT))
    assert counter.total == 0
    assert not (tmp_path / "d").exists()  # refused before anything was made


def test_read_result_bundle_errors(tmp_path: Path) -> None:
    (tmp_path / "x.zip").write_bytes(b"nope")
    with pytest.raises(BundleError, match=r"result bundle x.zip: not a zip file"):
        read_result_bundle(tmp_path / "x.zip")
    make_zip(tmp_path / "y.zip", [("job/result.json", b"[1]")])
    with pytest.raises(BundleError, match=r"not a JSON object"):
        read_result_bundle(tmp_path / "y.zip")
    make_zip(tmp_path / "z.zip", [("job/result.json", b"{nope")])
    with pytest.raises(BundleError, match=r"not JSON"):
        read_result_bundle(tmp_path / "z.zip")


def test_stored_bundle_from_other_tools(layout: dict[str, Path]) -> None:
    """A zip written by a tool that records no Unix mode (create_system 0, attr 0)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in good_entries():
            assert isinstance(name, str)
            zi = zipfile.ZipInfo(name)
            zi.create_system = 0
            zi.external_attr = 0x10 if name.endswith("/") else 0x20  # MS-DOS attributes
            zf.writestr(zi, data)
    layout["zip"].write_bytes(buf.getvalue())
    jobs = extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert jobs[0].inputs == ("a.txt", "sub/b.bin")


# --- forged end records, hostile files on disk -------------------------------------------


def forge_zip64(path: Path, entries: int, stated: int) -> Path:
    """A zip whose central directory holds ``entries`` records while its zip64 end
    record (the one zipfile reads: right before the locator) states ``stated``."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("manifest.json", GOOD_MANIFEST)
        zf.writestr("inputs/a.txt", b"hello world")
        zf.writestr("inputs/sub/b.bin", b"b")
        for i in range(entries - 3):
            zf.writestr(f"inputs/{i}", b"")
    raw = path.read_bytes()
    eocd = raw.rindex(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<2I", raw, eocd + 12)
    body = raw[:eocd]
    z64 = struct.pack(
        "<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, stated, stated, cd_size, cd_offset
    )
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, len(body), 1)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(body + z64 + locator + end)
    return path


def test_a_forged_zip64_count_does_not_hide_entries(
    layout: dict[str, Path], refuse: Callable[..., BundleError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zip64 end record says 5 entries; the directory holds 20 000. The real
    directory is walked before zipfile builds an object per entry."""
    forge_zip64(layout["zip"], entries=20_000, stated=5)
    with zipfile.ZipFile(layout["zip"]) as zf:  # the forgery is what zipfile reads
        assert len(zf.infolist()) == 20_000
    raw = layout["zip"].read_bytes()
    assert struct.unpack_from("<Q", raw, raw.rindex(b"PK\x06\x06") + 32)[0] == 5

    def no_zipfile(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("zipfile.ZipFile must not be reached")

    monkeypatch.setattr(zipfile, "ZipFile", no_zipfile)
    refuse(r"has 20000 entries, more than the limit of 10000")


def test_an_end_record_that_states_another_count_is_refused(
    layout: dict[str, Path], refuse: Callable[..., BundleError]
) -> None:
    forge_zip64(layout["zip"], entries=7, stated=5)
    with zipfile.ZipFile(layout["zip"]) as zf:
        assert len(zf.infolist()) == 7  # zipfile itself would take it
    refuse(r"its end record states 5 entries, but its central directory holds 7: a damaged")


def test_an_honest_zip64_bundle_extracts(layout: dict[str, Path]) -> None:
    forge_zip64(layout["zip"], entries=7, stated=7)
    jobs = extract_bundle(layout["zip"], layout["staging"], BundleLimits())
    assert [j.id for j in jobs] == ["hello-1"]
    assert (layout["staging"] / "inputs" / "3").is_file()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_bundle_path_that_is_not_a_regular_file_is_never_opened(
    layout: dict[str, Path], refuse: Callable[..., BundleError], kind: str
) -> None:
    path = layout["zip"]
    if kind == "fifo":
        os.mkfifo(path)
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
    elif kind == "symlink":
        good = make_zip(layout["root"] / "good.zip", good_entries())
        path.symlink_to(good)
        assert zipfile.is_zipfile(path)  # through the link it is a fine bundle
    else:
        path.mkdir()
    refuse(rf"bundle b.zip: is a {kind}, not a regular file")


def test_outputs_that_are_not_regular_files_are_listed_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    out = tmp_path / "out"
    out.mkdir()
    (out / "ok.txt").write_text("ok")
    os.mkfifo(out / "fifo")
    os.mknod(out / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    (out / "link").symlink_to("/etc/passwd")
    (out / "back\\slash").write_text("x")
    (out / "late").write_text("swapped for a FIFO after the listing")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(out / "sock"))
    assert stat.S_ISFIFO(os.lstat(out / "fifo").st_mode)
    assert stat.S_ISCHR(os.lstat(out / "zero").st_mode)

    from gpuwarden import safefs

    real_walk = safefs.walk

    def walk_then_swap(top: Any, **kw: Any) -> safefs.Listing:
        listing = real_walk(top, **kw)
        (out / "late").unlink()
        os.mkfifo(out / "late")
        return listing

    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append((os.fsdecode(path), flags))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(safefs, "walk", walk_then_swap)
    monkeypatch.setattr(os, "open", spy)
    try:
        path = write_result_bundle(tmp_path, "r.zip", [({"id": "j"}, out)])
    finally:
        sock.close()
    monkeypatch.undo()
    for name in ("fifo", "zero", "link", "sock", "late"):
        assert all(flags & os.O_PATH for p, flags in opened if p == name), (name, opened)
    body = read_result_bundle(path)["j"]
    refused = {e["path"]: e for e in body["refused_outputs"]}
    assert set(refused) == {"fifo", "zero", "link", "sock", "late", "back\\slash"}
    assert refused["zero"]["kind"] == "character device"
    assert "fifo" in refused["late"]["why"]
    assert "backslash" in refused["back\\slash"]["why"]
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["j/outputs/ok.txt", "j/result.json"]
