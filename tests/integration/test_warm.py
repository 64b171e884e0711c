"""Warm model servers through the broker loop, with real worker processes on the
simulated GPU: load once and serve many, idle and on-demand eviction (in
injected time), keep_warm, and a worker that crashes, hangs or fails a job."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec, Lane
from gpuwarden.core.policy import QueuedJob
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.store.base import Submission
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


class Clock:
    """Real time plus an offset the test can push forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def make_config(tmp_path: Path, *, gpus: int = 1, grace: float = 300) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "warmnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": gpus, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": grace, "stop_grace_s": 0.5},
        }
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def node(tmp_path: Path, clock: Clock) -> Iterator[Node]:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        n.broker.clock = clock
        yield n
        n.broker.shutdown(0)


def job(node: Node, job_id: str) -> JobState:
    j = node.store.get_job(job_id)
    assert j is not None
    return j.state


def served_pid(node: Node, job_id: str) -> int:
    j = node.store.get_job(job_id)
    assert j is not None and j.state is JobState.DONE, j
    return int(json.loads((Path(j.result["output_dir"]) / "served.json").read_text())["pid"])


def events(node: Node, kind: str) -> list[dict[str, object]]:
    return [e.detail | {"job": e.job_id} for e in node.store.events() if e.kind == kind]


def warm(i: str, **params: object) -> JobSpec:
    return JobSpec(id=i, type="testmods.warm", params=params)


def test_a_burst_loads_once_and_runs_back_to_back(node: Node) -> None:
    submit(node, *(warm(f"w{i}") for i in range(4)))
    run_until(node, lambda: all(job(node, f"w{i}").terminal for i in range(4)))
    pids = {served_pid(node, f"w{i}") for i in range(4)}
    assert len(pids) == 1  # one process served them all
    assert len(events(node, "warm_server_loaded")) == 1
    [server] = node.broker.status().to_json()["warm"]
    assert server["jobs_served"] == 4 and server["state"] == "idle" and server["load_s"] > 0
    # the server's memory is a warm holding in the ledger, not per job
    [gpu] = node.broker.status().to_json()["gpus"]
    assert [h["state"] for h in gpu["holdings"]] == ["warm"]


def test_idle_grace_evicts_and_reclaims_in_injected_time(node: Node, clock: Clock) -> None:
    submit(node, warm("a"))
    run_until(node, lambda: job(node, "a").terminal)
    pid = served_pid(node, "a")
    node.broker.tick()
    assert node.broker.status().to_json()["warm"], "still warm within its grace"
    clock.offset += 301  # past the 300 s grace, without waiting for it
    run_until(node, lambda: not node.broker.status().to_json()["warm"])
    [stopped] = events(node, "warm_server_stopped")
    assert "idle for" in str(stopped["reason"])
    run_until(node, lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie")
    run_until(node, lambda: not node.broker.status().to_json()["gpus"][0]["holdings"])  # reclaimed


def test_a_waiting_job_evicts_an_idle_server_on_demand(node: Node) -> None:
    submit(node, warm("a"))
    run_until(node, lambda: job(node, "a").terminal)
    # 20 GiB cannot fit beside the 6 GiB warm server on the one 24 GiB GPU
    submit(node, JobSpec(id="big", type="testmods.gpu", params={"gib": 20, "seconds": 0.1}))
    run_until(node, lambda: job(node, "big").terminal)
    assert job(node, "big") is JobState.DONE
    [stopped] = events(node, "warm_server_stopped")
    assert "needed by job big" in str(stopped["reason"])


def test_a_busy_server_is_never_evicted(node: Node) -> None:
    submit(node, warm("slow", sleep_s=1.5))
    run_until(node, lambda: job(node, "slow") is JobState.RUNNING)
    submit(node, JobSpec(id="big", type="testmods.gpu", params={"gib": 20, "seconds": 0.1}))
    run_until(node, lambda: job(node, "slow").terminal)
    # the server was not stopped while its job ran: the job finished on it
    assert job(node, "slow") is JobState.DONE
    run_until(node, lambda: job(node, "big").terminal)
    assert job(node, "big") is JobState.DONE


def test_keep_warm_yields_only_to_higher_priority(tmp_path: Path) -> None:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        submit(n, JobSpec(id="p", type="testmods.pinned", params={}))
        run_until(n, lambda: job(n, "p").terminal)
        submit(n, JobSpec(id="same", type="testmods.gpu", params={"gib": 20, "seconds": 0.1}))
        for _ in range(20):
            n.broker.tick()
            time.sleep(0.02)
        assert job(n, "same") is JobState.QUEUED  # a pinned server is not evicted for it
        assert n.broker.status().to_json()["warm"]
        submit(
            n,
            JobSpec(
                id="urgent", type="testmods.gpu", params={"gib": 20, "seconds": 0.1}, priority=5
            ),
        )
        run_until(n, lambda: job(n, "urgent").terminal)
        assert job(n, "urgent") is JobState.DONE
        [stopped] = events(n, "warm_server_stopped")
        assert "higher priority" in str(stopped["reason"])
        n.broker.shutdown(0)


def test_a_jobs_own_failure_is_not_retried_and_the_server_lives_on(node: Node) -> None:
    submit(node, warm("ok1"))
    run_until(node, lambda: job(node, "ok1").terminal)
    submit(node, warm("bad", behave="fail"))
    run_until(node, lambda: job(node, "bad").terminal)
    bad = node.store.get_job("bad")
    assert bad is not None and bad.state is JobState.FAILED and bad.attempts == 1
    assert "ValueError: this job fails by request" in bad.reason
    submit(node, warm("ok2"))
    run_until(node, lambda: job(node, "ok2").terminal)
    assert served_pid(node, "ok1") == served_pid(node, "ok2")


@pytest.mark.parametrize("behave", ["crash", "hang"])
def test_a_dead_or_hung_worker_is_replaced_and_its_job_retried(node: Node, behave: str) -> None:
    submit(node, warm("first"))
    run_until(node, lambda: job(node, "first").terminal)
    old = served_pid(node, "first")
    submit(node, warm("doomed", behave=behave))
    run_until(node, lambda: job(node, "doomed").terminal, timeout=40)
    doomed = node.store.get_job("doomed")
    assert doomed is not None and doomed.state is JobState.QUARANTINED
    assert doomed.attempts == 2  # an infrastructure failure: retried once (max_retries = 1)
    assert "its warm server failed" in doomed.reason
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie"
    submit(node, warm("after"))
    run_until(node, lambda: job(node, "after").terminal)
    assert served_pid(node, "after") != old  # a fresh worker
    assert len(events(node, "warm_server_loaded")) >= 2


def test_shutdown_stops_every_server(tmp_path: Path) -> None:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        submit(n, warm("a"))
        run_until(n, lambda: job(n, "a").terminal)
        pid = served_pid(n, "a")
        n.broker.shutdown(0)
        assert not n.broker.status().to_json()["warm"]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_the_placement_check_refuses_a_model_partly_on_the_cpu(node: Node) -> None:
    submit(node, JobSpec(id="half", type="testmods.halfway", params={}))
    run_until(node, lambda: job(node, "half").terminal)
    half = node.store.get_job("half")
    assert half is not None and half.state is JobState.QUARANTINED  # max_retries = 0
    assert "only 60% of the model" in half.reason and "fell back to the CPU" in half.reason
    assert not node.broker.status().to_json()["warm"]


def test_garbage_on_the_socket_fails_the_worker_not_the_broker(node: Node) -> None:
    submit(node, JobSpec(id="junk", type="testmods.garbage", params={}))
    run_until(node, lambda: job(node, "junk").terminal)
    junk = node.store.get_job("junk")
    assert junk is not None and junk.state is JobState.QUARANTINED and junk.attempts == 2
    assert "its warm server failed" in junk.reason
    submit(node, warm("fine"))  # the broker goes on
    run_until(node, lambda: job(node, "fine").terminal)
    assert job(node, "fine") is JobState.DONE


def test_the_templates_warm_server_serves(tmp_path: Path) -> None:
    import shutil

    dest = tmp_path / "mods" / "example"
    shutil.copytree(MODULES / "_TEMPLATE", dest)
    toml = (dest / "module.toml").read_text().replace('name = "_TEMPLATE"', 'name = "example"')
    (dest / "module.toml").write_text(toml)
    config = make_config(tmp_path).model_copy(update={"module_paths": [tmp_path / "mods"]})
    with open_node(config, mock_gpu=True) as n:
        submit(n, JobSpec(id="t1", type="example.served", params={"prompt": "world"}))
        submit(n, JobSpec(id="t2", type="example.served", params={"prompt": "again"}))
        run_until(n, lambda: job(n, "t1").terminal and job(n, "t2").terminal)
        t2 = n.store.get_job("t2")
        assert t2 is not None and t2.state is JobState.DONE, t2
        assert t2.result["message"] == "hello, again"
        assert len(events(n, "warm_server_loaded")) == 1
        n.broker.shutdown(0)


# --- regressions from review: nothing may strand a job, a server or a bundle -------------


def test_an_error_preparing_a_served_job_ends_it_and_frees_its_server(
    node: Node, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    spec = prepare(node.broker.registry, warm("bad-inputs"))
    node.store.submit([spec], now=time.time(), origin=Submission(input_dir=str(blocker / "inputs")))
    run_until(node, lambda: job(node, "bad-inputs").terminal)
    bad = node.store.get_job("bad-inputs")
    assert bad is not None and bad.state is JobState.QUARANTINED  # retried, then set aside
    assert "internal error while serving" in bad.reason
    submit(node, warm("next"))  # its type is not blocked behind a dead server
    run_until(node, lambda: job(node, "next").terminal)
    assert job(node, "next") is JobState.DONE


def test_a_cancel_racing_a_finished_served_job_does_not_reuse_the_stopping_server(
    node: Node,
) -> None:
    submit(node, warm("a", sleep_s=0.3))
    run_until(node, lambda: job(node, "a") is JobState.RUNNING)
    run = node.broker.attempts.by_job["a"]
    assert run.server is not None
    # its result is posted, not drained: the job's exchange slot is removed right
    # after its result is posted (its server's thread lives on, serving the next)
    slot = Path(run.server.worker.request.attempt_dir) / "exchange" / "a-1"
    while not slot.exists():  # the job runs (0.3 s)
        time.sleep(0.01)
    while slot.exists():
        time.sleep(0.01)
    node.store.request_cancel("a", now=time.time())
    node.broker._pass_cancels(time.time())
    submit(node, warm("b"))
    run_until(node, lambda: job(node, "b").terminal)
    b = node.store.get_job("b")
    assert b is not None and b.state is JobState.DONE and b.attempts == 1, b


def test_a_cancel_while_the_server_loads_is_a_cancel(node: Node) -> None:
    submit(node, JobSpec(id="slow", type="testmods.slowload", params={}))
    run_until(node, lambda: job(node, "slow") is JobState.RUNNING)
    node.store.request_cancel("slow", now=time.time())
    run_until(node, lambda: job(node, "slow").terminal)
    slow = node.store.get_job("slow")
    assert slow is not None and slow.state is JobState.CANCELLED and slow.attempts == 1


def test_preview_sees_the_idle_warm_server(tmp_path: Path) -> None:
    from gpuwarden.node import explain

    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        submit(n, warm("a"))
        run_until(n, lambda: job(n, "a").terminal)
        n.broker._publish(time.time(), force=True)
        status = explain.latest_status(n.store, time.time())
        assert status is not None
        view = explain.view_from_status(status, 4)
        me = QueuedJob(
            "(preview)", "testmods.warm", Lane.VRAM, 6 * 2**30, 0, 10**9, serve=True, warm=True
        )
        decision = explain.decide(view, [me], me.id)
        assert explain.describe(decision).startswith("would go now to its warm server")
        n.broker.shutdown(0)
