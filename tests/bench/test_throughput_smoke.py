"""bench/throughput.py at its smoke size: it runs, every job ends done, and its
last line is the JSON the README documents (task-spooler's figures are null
where ``tsp`` is not installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_throughput_smoke_prints_the_documented_json() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "throughput.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"noop", "tsp", "ratio_drain", "ratio_start_p50"} <= set(out)
    for key in ("drain_jobs_per_s", "start_p50_ms", "start_p99_ms"):
        assert out["noop"][key] > 0, out
        assert key in out["tsp"], out
    assert out["noop"]["start_p50_ms"] <= out["noop"]["start_p99_ms"]
    assert out["synchronous"] == "FULL"
    assert out["bundle"]["drain_s"] > 0 and set(out["starts"]) >= {"store", "bundle"}
    if shutil.which("tsp") is None:
        assert out["tsp"]["drain_jobs_per_s"] is None and out["ratio_drain"] is None
    else:
        assert out["tsp"]["drain_jobs_per_s"] > 0 and out["ratio_drain"] > 0
