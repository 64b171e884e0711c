"""The names the broker chooses in a queue root: never past NAME_MAX, never a name a
client's bundle (or its result) can have, distinct for distinct bundles."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.intake.queueroot import (
    NAME_MAX,
    is_bundle_name,
    is_utf8,
    own_name,
    record_name,
    short_name,
    shown_name,
    unique_tag,
)

NOW = 1_795_938_132.0

#: every tag the broker uses (SPEC section 3, "Names the broker chooses")
TAGS = [
    "input",
    "reason.txt",
    unique_tag("duplicate", NOW),
    unique_tag("duplicate", NOW) + "-input",
    unique_tag("result", NOW),
]
#: their test ids, the same in every xdist worker (a unique tag's random part is not)
TAG_IDS = ["input", "reason", "duplicate", "duplicate-input", "result"]


def fs_name(raw: bytes) -> str:
    """A name as os.listdir gives it for these bytes."""
    return os.fsdecode(raw)


def bundle_of_length(n: int, fill: bytes = b"a") -> str:
    return fs_name(fill * (n - 4) + b".zip")


@pytest.mark.parametrize("length", [5, 200, 206, 207, 250, 251, 252, 253, 254, 255])
@pytest.mark.parametrize("tag", TAGS, ids=TAG_IDS)
def test_a_name_of_any_length_gives_names_that_fit(length: int, tag: str) -> None:
    bundle = bundle_of_length(length)
    assert len(os.fsencode(bundle)) == length  # the name is as long as it says
    name = own_name(bundle, tag)
    assert len(os.fsencode(name)) <= NAME_MAX
    assert not is_bundle_name(name) and not name.lower().endswith(".zip")
    assert name.endswith(f".{tag}")
    if length + 1 + 48 <= NAME_MAX:
        assert name == f"{bundle}.{tag}"  # short names stay readable as they are
    else:
        assert name.startswith("a" * 100) and "~" in name


def test_long_names_that_share_a_prefix_stay_apart() -> None:
    a = bundle_of_length(255)
    b = fs_name(b"a" * 250 + b"b.zip")
    assert own_name(a, "input") != own_name(b, "input")
    assert short_name(a) != short_name(b)


@pytest.mark.parametrize(
    "name",
    [
        "X.input.zip",
        "X.zip.input.zip",
        "X.duplicate-1795938132-abcdef.zip",
        "X.zip.result-1795938132-abcdef.zip",
        "X.reason.txt.zip",
        "a~0123456789abcdef.zip",
    ],
)
def test_a_client_name_never_is_a_name_of_the_broker(name: str) -> None:
    """Whatever a client calls its bundle, it is a bundle name; no name the broker
    derives (for that bundle or any other) is one."""
    assert is_bundle_name(name)
    for bundle in ("X.zip", "X.ZIP", name, bundle_of_length(255)):
        for tag in TAGS:
            assert own_name(bundle, tag) != name


def test_zip_matches_in_any_letter_case_and_temporary_names_do_not() -> None:
    for name in ("a.zip", "a.ZIP", "a.Zip", "-x.zip", " .zip", "a\\b.zip", "a\nb.zip"):
        assert is_bundle_name(name), name
    for name in (".a.zip", "a.zip.tmp", "a.zip.part", "a.zi", "zip", "a.zip.input"):
        assert not is_bundle_name(name), name


def test_a_name_that_is_not_utf8_is_shown_and_recorded_readably() -> None:
    bundle = fs_name(b"caf\xe9-\xff.zip")
    assert not is_utf8(bundle)
    assert shown_name(bundle) == "caf\\xe9-\\xff.zip"
    recorded = record_name(bundle)
    assert is_utf8(recorded) and recorded.startswith("caf_-_.zip~")
    assert not is_bundle_name(recorded)  # no client's bundle can be recorded under it
    for tag in TAGS:
        assert is_utf8(own_name(bundle, tag))
    assert record_name("plain.zip") == "plain.zip"


def test_a_tag_that_ends_in_zip_is_refused() -> None:
    with pytest.raises(ValueError, match="not a tag"):
        own_name("a.zip", "copy.zip")


@given(
    a=st.binary(min_size=1, max_size=251).filter(lambda b: b"/" not in b and b"\0" not in b),
    b=st.binary(min_size=1, max_size=251).filter(lambda b: b"/" not in b and b"\0" not in b),
    tag_a=st.sampled_from(TAGS),
    tag_b=st.sampled_from(TAGS),
)
def test_derived_names_fit_and_never_collide(a: bytes, b: bytes, tag_a: str, tag_b: str) -> None:
    bundle_a, bundle_b = fs_name(a + b".zip"), fs_name(b + b".zip")
    name_a, name_b = own_name(bundle_a, tag_a), own_name(bundle_b, tag_b)
    for name in (name_a, name_b):
        assert len(os.fsencode(name)) <= NAME_MAX
        assert not is_bundle_name(name)
        assert name not in (bundle_a, bundle_b)
    if (bundle_a, tag_a) != (bundle_b, tag_b):
        assert name_a != name_b


def test_a_shortened_base_is_no_longer_than_a_kept_one() -> None:
    for raw in (b"x" * 251 + b".zip", b"\xff" * 251 + b".zip", "é".encode() * 125 + b".zip"):
        assert len(short_name(fs_name(raw)).encode()) <= 206
