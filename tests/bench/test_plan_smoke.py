"""bench/plan.py at its smoke size: the benchmark still runs and says what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_bench_smoke() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures) == {"plan", "plan_adhoc", "rss_mib", "idle_tick"}
    assert figures["idle_tick"]["queued"] == 2000
    assert figures["idle_tick"]["p50_ms"] > 0
    for part in ("plan", "plan_adhoc"):  # typed jobs; command jobs, each its own size
        assert set(figures[part]) == {"200x8", "2000x16"}
        for size in figures[part].values():
            assert 0 < size["p50_ms"] <= size["p99_ms"]
    assert "plan_adhoc: the same over command jobs" in done.stdout
    # the broker held the smoke backlog in its queue index, and its RSS was read
    assert "holding 2000 queued jobs" in done.stdout
    assert figures["rss_mib"] > 10
