"""Clipping long process output: head, marker, tail."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.core.clip import clip, clip_marker, join_clipped

TEXT = "abcdefghij"  # 10 characters


def test_marker_text() -> None:
    assert clip_marker(7) == "\n[... 7 characters clipped ...]\n"
    assert clip_marker(12345) == "\n[... 12345 characters clipped ...]\n"


def test_under_limit_is_unchanged() -> None:
    assert clip(TEXT, 11) == TEXT
    assert clip(TEXT, 1000) == TEXT


def test_at_limit_is_unchanged() -> None:
    assert clip(TEXT, 10) == TEXT


def test_empty_text() -> None:
    assert clip("", 0) == ""
    assert clip("", 5) == ""


def test_one_over_limit() -> None:
    assert clip(TEXT, 9) == "abcd" + clip_marker(1) + "fghij"


def test_over_limit_even() -> None:
    assert clip(TEXT, 4) == "ab\n[... 6 characters clipped ...]\nij"


def test_over_limit_odd_gives_the_extra_character_to_the_tail() -> None:
    assert clip(TEXT, 5) == "ab" + clip_marker(5) + "hij"
    assert clip(TEXT, 3) == "a" + clip_marker(7) + "ij"


def test_limit_zero_keeps_only_the_marker() -> None:
    assert clip(TEXT, 0) == clip_marker(10)


def test_limit_one_keeps_the_last_character() -> None:
    assert clip(TEXT, 1) == clip_marker(9) + "j"


def test_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be >= 0"):
        clip(TEXT, -1)


def test_multiline_head_and_tail() -> None:
    lines = "".join(f"line {i:03d}\n" for i in range(100))  # 9 chars each
    out = clip(lines, 36)
    assert out.startswith("line 000\nline 001\n")
    assert out.endswith("line 098\nline 099\n")
    assert "[... 864 characters clipped ...]" in out
    assert "line 050" not in out


def test_unicode_keeps_whole_characters() -> None:
    text = "é" * 5 + "中" * 5 + "🙂" * 5
    out = clip(text, 6)
    assert out == "ééé" + clip_marker(9) + "🙂🙂🙂"
    out.encode("utf-8")  # never splits a code point


def test_join_clipped() -> None:
    assert join_clipped("head", "tail", 0) == "headtail"
    assert join_clipped("head", "tail", -3) == "headtail"
    assert join_clipped("head", "tail", 42) == "head\n[... 42 bytes clipped ...]\ntail"
    assert join_clipped("", "", 5) == clip_marker(5, "bytes")


def test_marker_count_matches_its_unit_for_non_ascii() -> None:
    text = "é" * 20
    out = clip(text, 4)
    m = re.search(r"\[\.\.\. (\d+) (\w+) clipped \.\.\.\]", out)
    assert m is not None
    count, unit = int(m.group(1)), m.group(2)
    cut = text[2:-2]
    expected = len(cut.encode("utf-8")) if unit == "bytes" else len(cut)
    assert count == expected


@given(text=st.text(max_size=300), limit=st.integers(min_value=0, max_value=400))
def test_clip_properties(text: str, limit: int) -> None:
    out = clip(text, limit)
    if len(text) <= limit:
        assert out == text
        return
    head = limit // 2
    tail = limit - head
    omitted = len(text) - limit
    marker = clip_marker(omitted)
    assert len(out) <= limit + len(marker)
    assert len(out) == limit + len(marker)
    assert out.startswith(text[:head])
    assert out.endswith(text[len(text) - tail :])
    assert out[head : head + len(marker)] == marker
    assert f"[... {omitted} characters clipped ...]" in out
