"""Trust at the edges, sandboxed (issue 11): a warm server in bubblewrap or podman
that plants a link at a later job's exchange slot. Run as root, the sandbox's
user owns the slot, so this is also the check that the broker hands a sandboxed
server only folders it just created (tests/integration/test_edges.py has the
same attack on an unsandboxed server, and the other attacks)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.store.base import Submission
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES, need_tool

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"

#: the first podman test may build the base image (debootstrap, about 100 s cold)
pytestmark = pytest.mark.timeout(900)


def make_config(tmp_path: Path, runtime: str, image: str = "") -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "edgesandbox",
            "gpu": "sim",
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 1},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": 60, "stop_grace_s": 1},
            "container_runtime": runtime,
            "sandbox_image": image,
            "sandbox": {"scratch_mib": 64},
        }
    )


@pytest.fixture(params=["bubblewrap", "podman"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    if request.param == "bubblewrap":
        need_tool("bwrap")
        config = make_config(tmp_path, "bubblewrap")
    else:
        config = make_config(tmp_path, "podman", request.getfixturevalue("podman_image"))
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(2)


def ended(node: Node, job_id: str) -> bool:
    job = node.store.get_job(job_id)
    return job is not None and job.state.terminal


def events(node: Node, kind: str) -> list[dict[str, Any]]:
    return [
        e.detail | {"job": e.job_id} for e in node.store.events(limit=100_000) if e.kind == kind
    ]


def test_a_sandboxed_server_that_plants_a_link_at_a_slot_writes_nothing_outside(
    node: Node, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"  # stands for /etc
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0")
    before = os.lstat(outside)
    submit(
        node,
        JobSpec(
            id="p1",
            type="testmods.planter",
            params={"plant": "symlink", "victim": "victim", "target": str(outside)},
        ),
    )
    run_until(node, lambda: ended(node, "p1"), timeout=120)
    p1 = node.store.get_job("p1")
    assert p1 is not None and p1.state is JobState.DONE, p1.reason
    [exchange] = (node.config.state_dir / "warm").glob("testmods.planter-*/exchange")
    spot = exchange / "victim-1"
    assert spot.is_symlink() and os.readlink(spot) == str(outside)  # the attack is in place

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    inputs.chmod(0o755)
    (inputs / "data.txt").write_text("input data")
    victim = JobSpec(
        id="victim", type="testmods.planter", params={"file": "data.txt"}, inputs=("data.txt",)
    )
    node.store.submit(
        [prepare(node.broker.registry, victim)],
        now=time.time(),
        origin=Submission(input_dir=str(inputs)),
    )
    run_until(node, lambda: ended(node, "victim"), timeout=120)
    done = node.store.get_job("victim")
    assert done is not None and done.state is JobState.DONE, done.reason
    out = Path(done.result["output_dir"])
    assert (out / "copy.txt").read_text() == "input data"
    assert done.result["outputs"] == ["copy.txt", "served.txt"]
    # nothing was written through the link, nothing outside changed owner or mode
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]
    after = os.lstat(outside)
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert not os.path.lexists(spot)
    [cleared] = events(node, "exchange_slot_cleared")
    assert cleared["job"] == "victim" and cleared["found"] == "symlink"
    [planted] = done.result["refused"]  # the result says so too
    assert planted["path"] == "exchange/victim-1" and planted["kind"] == "symlink"
    if os.geteuid() == 0:
        # the server wrote as the sandbox's user, into the slot the broker made for it
        limits = node.broker.launching.sandbox_owner(node.broker.registry.get("testmods.planter"))
        assert limits is not None
        assert (os.lstat(out / "served.txt").st_uid, os.lstat(out / "served.txt").st_gid) == limits
    # the same server goes on: a following job completes on it
    submit(node, JobSpec(id="after", type="testmods.planter", params={}))
    run_until(node, lambda: ended(node, "after"), timeout=60)
    after_job = node.store.get_job("after")
    assert after_job is not None and after_job.state is JobState.DONE, after_job.reason
    assert len(events(node, "warm_server_loaded")) == 1
    assert not events(node, "loop_error")
