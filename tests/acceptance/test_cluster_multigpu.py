"""A job on two GPUs across hosts, for real: a coordinator on a fresh PostgreSQL
database, an agent with one simulated 24 GiB GPU and one with two. The coordinator
offers the two-GPU job only to the node with two GPUs with room, whose broker runs
it on both at once; a job asking for more GPUs than any node has is refused at
submission, and nothing is stored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuwarden.client import RequestRefused
from tests.acceptance.test_cluster import Cluster, wait_for
from tests.acceptance.test_cluster_preemption import ended, job, out_dir, running_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    agents = {"one": {"vram_gib": 24}, "two": {"vram_gib": 24, "count": 2}}
    with running_cluster(pg_url, tmp_path_factory.mktemp("xmulti"), agents) as c:
        yield c


def test_a_two_gpu_job_goes_only_to_the_node_with_two_gpus(cluster: Cluster) -> None:
    c = cluster
    nodes = c.nodes()
    assert len(nodes["one"]["gpus"]) == 1 and len(nodes["two"]["gpus"]) == 2  # as set up
    with c.client() as client:
        client.submit("testmods.pair", {"gib": 10, "seconds": 0.5}, id="pair")
        client.submit("testmods.gpu", {"gib": 4, "seconds": 0.2}, id="solo", vram_gib=4)
    wait_for("both ended", lambda: ended(c, "pair", "solo"), timeout=120)
    pair = job(c, "pair")
    assert pair["state"] == "done", pair
    (attempt,) = pair["attempts_detail"]
    assert attempt["node"] == "two"
    two_gpus = {g["uuid"] for g in c.nodes()["two"]["gpus"]}
    assert set(attempt["gpu"].split(",")) == two_gpus  # both of its GPUs, each once
    seen = (out_dir(c.agents["two"], "pair", 1) / "visible.txt").read_text()
    assert sorted(seen.split(",")) == sorted(two_gpus)
    assert job(c, "solo")["state"] == "done"


def test_more_gpus_than_any_node_has_is_refused_at_submission(cluster: Cluster) -> None:
    with cluster.client() as client:
        with pytest.raises(RequestRefused) as info:
            client.submit("testmods.pair", {}, id="three", gpus=3)
        assert "needs 3 GPUs at once with 8.0 GiB on each" in str(info.value)
        assert "two: " in str(info.value) and "one: " in str(info.value)
        with pytest.raises(RequestRefused):
            client.get("three")  # nothing was stored
