"""bench/claims.py at its smoke size on PostgreSQL: it still runs, every job was
claimed, started and finished once, and its JSON line has its keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

KEYS = {
    "jobs", "nodes", "threads", "claims", "claims_per_s", "jobs_per_s", "claim_p50_ms",
    "claim_p99_ms", "empty_claims", "done",
}  # fmt: skip


@pytest.mark.timeout(180)
def test_claims_bench_smoke(pg_url: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "claims.py"), "--smoke", "--url", pg_url],
        capture_output=True, text=True, timeout=150, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == KEYS
    assert out["done"] == out["jobs"] == 40
    assert out["claims"] >= 1
    assert out["claims_per_s"] > 0
    assert out["jobs_per_s"] > 0
    assert 0 <= out["claim_p50_ms"] <= out["claim_p99_ms"]
