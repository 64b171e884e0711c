"""The coordinator's sweeper removes the stream copies of ended attempts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuwarden.cluster import logcopy
from gpuwarden.cluster.sweeper import LogCopies, Sweeper
from gpuwarden.config import ClusterSettings
from gpuwarden.core.model import Attempt


class Attempts:
    """What the sweeper asks of the store: a job's attempts."""

    def __init__(self, attempts: list[Attempt]) -> None:
        self.by_job = {a.job_id: [a] for a in attempts}

    def attempts(self, job_id: str) -> list[Attempt]:
        return self.by_job.get(job_id, [])


def test_prune_logs_asks_the_store_whether_each_attempt_ended(tmp_path: Path) -> None:
    now = 2_000_000_000.0
    store: Any = Attempts(
        [
            Attempt("done1", 1, "n1", None, started_at=1.0, ended_at=2.0),
            Attempt("runs1", 1, "n1", None, started_at=1.0),
        ]
    )
    paths = {}
    for job in ("done1", "runs1", "gone1"):  # gone1: no such job in the store
        path = logcopy.log_path(tmp_path, job, 1, "stderr")
        logcopy.append(path, 0, b"x", bound=100)
        for f in path.parent.iterdir():
            os.utime(f, (now - 3 * 86400, now - 3 * 86400))
        paths[job] = path
    sweeper = Sweeper(
        store, None, ClusterSettings(), clock=lambda: now, logs=LogCopies(tmp_path, 86400.0)
    )
    assert sweeper.prune_logs() == 2
    assert not paths["done1"].exists() and not paths["gone1"].exists()
    assert paths["runs1"].read_bytes().endswith(b"x")  # a running attempt's copy stays
    assert Sweeper(store, None, ClusterSettings()).prune_logs() == 0  # none kept: nothing
