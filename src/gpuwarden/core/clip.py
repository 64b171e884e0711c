"""Clipping of long process output: keep the first and last part, mark the cut."""

from __future__ import annotations


def clip_marker(omitted: int, unit: str = "characters") -> str:
    return f"\n[... {omitted} {unit} clipped ...]\n"


def clip(text: str, limit: int) -> str:
    """Return ``text`` if it has at most ``limit`` characters, else its head and
    tail (half of ``limit`` each) with a marker between that says how much was cut."""
    if limit < 0:
        raise ValueError("limit must be >= 0")
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    omitted = len(text) - head - tail
    return text[:head] + clip_marker(omitted) + (text[-tail:] if tail else "")


def join_clipped(head: str, tail: str, omitted: int, unit: str = "bytes") -> str:
    """Assemble a clipped text from a head and tail read separately from a file,
    where what was skipped is known in bytes, not characters."""
    if omitted <= 0:
        return head + tail
    return head + clip_marker(omitted, unit) + tail
