"""The coordinator's copy of a running attempt's streams: the append rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwarden.cluster import logcopy


def _all(path: Path, bound: int) -> bytes:
    out, pos = b"", 0
    while True:
        chunk, pos = logcopy.read(path, pos, bound=bound)
        if not chunk:
            return out
        out += chunk


def test_appends_in_order(tmp_path: Path) -> None:
    path = logcopy.log_path(tmp_path, "j1", 1, "stdout")
    assert logcopy.append(path, 0, b"one\n", bound=1000) == 4
    assert logcopy.append(path, 4, b"two\n", bound=1000) == 8
    assert _all(path, 1000) == b"one\ntwo\n"
    assert logcopy.received(path) == 8


def test_a_retried_chunk_is_not_doubled(tmp_path: Path) -> None:
    path = logcopy.log_path(tmp_path, "j1", 1, "stdout")
    logcopy.append(path, 0, b"one\n", bound=1000)
    assert logcopy.append(path, 0, b"one\n", bound=1000) == 4
    # sent again with more: only the new part is taken
    assert logcopy.append(path, 0, b"one\ntwo\n", bound=1000) == 8
    assert _all(path, 1000) == b"one\ntwo\n"


def test_a_gap_is_refused_with_the_offset(tmp_path: Path) -> None:
    path = logcopy.log_path(tmp_path, "j1", 1, "stderr")
    logcopy.append(path, 0, b"abc", bound=1000)
    with pytest.raises(logcopy.Gap) as got:
        logcopy.append(path, 10, b"xyz", bound=1000)
    assert got.value.offset == 3
    assert _all(path, 1000) == b"abc"


def test_the_bound_cuts_the_oldest_and_says_so(tmp_path: Path) -> None:
    path = logcopy.log_path(tmp_path, "j1", 1, "stdout")
    offset = 0
    for i in range(50):
        offset = logcopy.append(path, offset, b"line %03d\n" % i, bound=100)
    assert offset == 50 * 9
    assert path.stat().st_size - logcopy.HEADER_LEN <= 100
    shown = _all(path, 100)
    assert shown.startswith(b"[gpuwarden: the first ")
    assert shown.endswith(b"line 049\n")
    cut = 50 * 9 - (path.stat().st_size - logcopy.HEADER_LEN)
    assert shown.startswith(logcopy.cut_note(cut, 100))
    # the offsets go on past the cut: a retry is still skipped, a gap still refused
    assert logcopy.append(path, offset - 9, b"line 049\n", bound=100) == offset
    with pytest.raises(logcopy.Gap):
        logcopy.append(path, offset + 1, b"x", bound=100)


def test_only_fixed_streams(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        logcopy.log_path(tmp_path, "j1", 1, "../etc")


def test_follow_until_ended(tmp_path: Path) -> None:
    path = logcopy.log_path(tmp_path, "j1", 1, "stdout")
    logcopy.append(path, 0, b"a\n", bound=1000)
    asked = []

    def ended() -> bool:
        asked.append(1)
        if len(asked) == 1:
            logcopy.append(path, 2, b"b\n", bound=1000)
            return False
        return True

    assert b"".join(logcopy.follow(path, ended, bound=1000, sleep=lambda _s: None)) == b"a\nb\n"


def _copy(root: Path, job: str, attempt: int, age_s: float, now: float) -> Path:
    path = logcopy.log_path(root, job, attempt, "stdout")
    logcopy.append(path, 0, b"line\n", bound=1000)
    for f in path.parent.iterdir():  # the copy and its lock file
        os.utime(f, (now - age_s, now - age_s))
    return path


def test_prune_removes_only_ended_attempts_not_written_for_the_keep_time(tmp_path: Path) -> None:
    now = 1_000_000.0
    old_ended = _copy(tmp_path, "j1", 1, 100.0, now)
    old_running = _copy(tmp_path, "j2", 1, 100.0, now)
    fresh_ended = _copy(tmp_path, "j3", 1, 10.0, now)
    kept_of_j1 = _copy(tmp_path, "j1", 2, 10.0, now)
    outside = tmp_path.parent / "outside"
    outside.mkdir()
    (outside / "attempt-1").mkdir()
    (outside / "attempt-1" / "stdout.log").write_bytes(b"not ours")
    (tmp_path / "planted").symlink_to(outside)  # never followed
    asked: list[tuple[str, int]] = []

    def ended(job: str, attempt: int) -> bool:
        asked.append((job, attempt))
        return job != "j2"

    assert logcopy.prune(tmp_path, now=now, keep_s=60.0, ended=ended) == 1
    assert not old_ended.exists() and not old_ended.parent.exists()
    assert old_running.exists() and fresh_ended.exists() and kept_of_j1.exists()
    assert (outside / "attempt-1" / "stdout.log").read_bytes() == b"not ours"
    assert ("j2", 1) in asked and ("j3", 1) not in asked  # fresh: not even asked
    # the last attempt of a job gone: its folder goes too
    assert logcopy.prune(tmp_path, now=now + 60, keep_s=60.0, ended=ended) == 2
    assert not (tmp_path / "j1").exists() and not (tmp_path / "j3").exists()
    assert old_running.exists()
