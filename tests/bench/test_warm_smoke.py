"""bench/warm.py at its smoke size (every part, tiny): it runs, every job ends
done, and its last line is the JSON the benchmark promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_warm_bench_smoke() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "warm.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(doc) == {"warm", "warm_store", "warm_http", "bounds", "loads"}
    warm = doc["warm"]
    assert set(warm) == {"warm_jobs_per_s", "oneshot_jobs_per_s", "warm_p50_ms", "oneshot_p50_ms"}
    assert all(v > 0 for v in warm.values())
    # --smoke: 1 warm-up, 5 jobs one at a time, 20 at once; the bench checks each done
    for path in ("warm_store", "warm_http"):
        fig = doc[path]
        assert {"jobs_per_s", "result_p50_ms"} <= set(fig), path
        assert fig["jobs_per_s"] > 0 and fig["result_p50_ms"] > 0, path
        assert fig["done"] == 26, path
    bounds = doc["bounds"]
    assert set(bounds) == {
        "commit_full_us",
        "mkdir_rmdir_us",
        "exchange_slot_us",
        "exchange_rtt_ms",
        "http_roundtrip_ms",
        "http_submit_ms",
    }
    assert all(v > 0 for v in bounds.values())
    assert set(doc["loads"]) == {"gpuwarden", "belady", "fcfs_lru"}
    assert all(v > 0 for v in doc["loads"].values())
