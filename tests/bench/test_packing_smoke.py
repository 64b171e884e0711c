"""bench/packing.py at its smoke size: every trace and policy still replays, and the
JSON line has the keys bench/README.md names, with sane figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TRACES = {"mixed-24g", "four-80g", "heavy-tail-16g-t0", "heavy-tail-16g-poisson"}
POLICIES = {
    "gpuwarden",
    "one_per_gpu",
    "all_at_once",
    "fractional",
    "first_fit",
    "first_fit_backfill",
}
KEYS = {
    "makespan_s",
    "ratio_to_bound",
    "mean_completion_s",
    "p95_completion_s",
    "p99_wait_whole_s",
    "oom_crashes",
    "model_loads",
    "done",
}
#: jobs per smoke trace (bench/packing.py ``cases(smoke=True)``)
SMOKE_JOBS = {
    "mixed-24g": 30,
    "four-80g": 30,
    "heavy-tail-16g-t0": 60,
    "heavy-tail-16g-poisson": 60,
}


def test_packing_bench_smoke() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "packing.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures) == {"traces"}
    assert set(figures["traces"]) == TRACES
    for trace, table in figures["traces"].items():
        assert set(table) == POLICIES, trace
        for policy, m in table.items():
            assert set(m) == KEYS, (trace, policy)
            assert m["makespan_s"] > 0 and m["ratio_to_bound"] > 0
            assert 0 <= m["p99_wait_whole_s"] <= m["makespan_s"]
            if policy != "gpuwarden":  # no retry: a crashed job is a failed one
                assert m["done"] + m["oom_crashes"] == SMOKE_JOBS[trace], (trace, policy)
            assert m["model_loads"] >= m["done"]
        gw = table["gpuwarden"]
        # the broker's policy runs every job, crashes none, and never beats the bound
        assert gw["done"] == SMOKE_JOBS[trace], trace
        assert gw["oom_crashes"] == 0, trace
        assert gw["ratio_to_bound"] >= 1.0, trace
        # the FIFO baselines that admit by the ledger crash nothing on a flat trace
        if trace.startswith("heavy-tail"):
            for policy in ("first_fit", "first_fit_backfill"):
                assert table[policy]["done"] == SMOKE_JOBS[trace], (trace, policy)
    assert "targets: not judged" in done.stdout
