"""bench/cluster.py at its smoke size: it still runs, and its JSON line has its keys
with sane figures (the bench itself checks that every job was leased once and
that every end-to-end job ended done)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

KEYS = {"submits_per_s", "claims_per_s", "jobs_per_s"}


def smoke(backend: str, *extra: str) -> dict[str, dict[str, float]]:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster.py"), "--smoke", "--backend", backend,
         *extra],
        capture_output=True, text=True, timeout=240, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    result: dict[str, dict[str, float]] = json.loads(last)
    return result


def check(figures: dict[str, float]) -> None:
    assert set(figures) == KEYS
    for key in KEYS:
        assert isinstance(figures[key], int | float)
        assert figures[key] > 0, (key, figures)


@pytest.mark.timeout(300)
def test_cluster_bench_smoke_sqlite() -> None:
    result = smoke("sqlite")
    assert set(result) == {"sqlite"}
    check(result["sqlite"])


@pytest.mark.timeout(300)
def test_cluster_bench_smoke_postgres(pg_url: str) -> None:
    result = smoke("postgres", "--pg", pg_url)
    assert set(result) == {"postgres"}
    check(result["postgres"])
