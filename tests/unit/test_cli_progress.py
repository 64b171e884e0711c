"""What a waiting command writes to a log (no terminal): one line per change of
what it says, where a time that ticks on is no change (issue 31: a piped
``submit --wait`` wrote a line every second because "heard from N s ago" moved)."""

from __future__ import annotations

import pytest

from gpuwarden.cli.common import Progress


def test_a_log_gets_a_line_per_change_not_per_second(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("job j1: submitted") as p:
        for age in range(1, 6):  # the node's age ticks on: the same news
            p.update(f"job j1: queued: leased to gpu-a (heard from {age} s ago)")
        p.update("job j1: queued: leased to gpu-a (heard from 7.5 s ago)")
        p.update("job j1: queued: 2 jobs ahead")  # a count is news
        p.update("job j1: queued: 1 jobs ahead")
        p.update("job j1: running for 3 s")
        p.update("job j1: running for 4 s")
    lines = [ln.split(" ", 1)[1] for ln in capsys.readouterr().err.splitlines()]
    assert lines == [
        "job j1: submitted",
        "job j1: queued: leased to gpu-a (heard from 1 s ago)",
        "job j1: queued: 2 jobs ahead",
        "job j1: queued: 1 jobs ahead",
        "job j1: running for 3 s",
    ]
