"""A running job's output followed through the coordinator, for real (SPEC.md
section 16, "Streams while a job runs"): a coordinator on a fresh PostgreSQL
database and one agent, each a process of its own. A job that prints a line every
0.2 s until a file appears runs on the agent; ``gpuwarden logs JOB --follow --url``
against the coordinator shows its lines while it runs, and ends after it ended;
``gpuwarden logs`` on the coordinator's own store shows them too."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from tests.acceptance.test_cluster import Cluster, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(pg_url, tmp_path_factory.mktemp("xlogs"), {"l1": {"vram_gib": 24}}) as c:
        yield c


def _lines(proc: subprocess.Popen[str], into: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.put(line.rstrip("\n"))


def test_a_running_jobs_lines_arrive_through_the_coordinator(cluster: Cluster) -> None:
    c = cluster
    release = c.tmp / "release-ticker"
    with c.client() as client:
        client.submit(
            "testmods.hold", {"until": str(release), "tick_s": 0.2, "limit_s": 120}, id="ticker"
        )
    env = {**c.env, "GPUWARDEN_TOKEN": c.owner}
    follower = subprocess.Popen(
        c.cmd("logs", "ticker", "--follow", "--url", c.urls[0]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    got: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(follower, got), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while sum(line.startswith("tick ") for line in seen) < 5:
            assert time.monotonic() < deadline, f"ticks never came: {seen}"
            try:
                seen.append(got.get(timeout=1))
            except queue.Empty:
                assert follower.poll() is None, follower.stderr.read() if follower.stderr else ""
        # it still runs: the lines came while it ran, not at its end
        assert not release.exists()
        assert follower.poll() is None
        assert seen[0].startswith("pid ")
        # the coordinator's own store shows them too (no --url)
        here = c.gw("logs", "ticker", config=c.tmp / "coordinator.toml")
        assert here.returncode == 0, here.stderr
        assert "tick 3" in here.stdout
    finally:
        release.touch()
    follower.wait(60)
    while not got.empty():
        seen.append(got.get())
    assert follower.returncode == 0, follower.stderr.read() if follower.stderr else ""
    wait_for("the job's end", lambda: "released" in "\n".join(seen) or None, timeout=5)
    ticks = [int(line.split()[1]) for line in seen if line.startswith("tick ")]
    assert ticks == list(range(1, len(ticks) + 1))  # in order, none doubled
