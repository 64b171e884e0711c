"""Faults through the broker loop with real job processes on the simulated GPU:
Xid events, CUDA out-of-memory with and without another job, a worker killed
from outside, a stopped worker, quarantine, a restart's ledger, and a result
that can never be written. Each test first checks that its fault happened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.intake import bundlewrite
from gpuwarden.launch.base import ATTEMPT_ENV, attempt_marker
from gpuwarden.node import attemptfs
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def make_config(tmp_path: Path, *, gpus: int = 2) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "faultnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "queue_roots": [tmp_path / "queue"],
            "sim_gpu": {"count": gpus, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
        }
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        yield n
        n.broker.shutdown(0)


def state(node: Node, job_id: str) -> JobState:
    j = node.store.get_job(job_id)
    assert j is not None
    return j.state


def kinds(node: Node) -> list[str]:
    return [e.kind for e in node.store.events()]


def gpu_job(i: str, **params: object) -> JobSpec:
    return JobSpec(id=i, type="testmods.gpu", params={"gib": 2, "seconds": 3, **params})


def test_a_critical_xid_faults_the_gpu_requeues_its_job_and_an_operator_clears_it(
    node: Node,
) -> None:
    submit(node, gpu_job("victim"))
    run_until(node, lambda: state(node, "victim") is JobState.RUNNING)
    gpu = node.store.attempts("victim")[0].gpu_uuid
    assert gpu is not None
    node.probe.device.inject_xid(gpu, 79)  # type: ignore[attr-defined]
    run_until(node, lambda: "gpu_fault" in kinds(node))  # the fault was seen
    run_until(node, lambda: state(node, "victim").terminal)
    victim = node.store.get_job("victim")
    assert victim is not None and victim.state is JobState.DONE  # rerun on the other GPU
    first, second = node.store.attempts("victim")
    assert first.outcome == "gpu_fault" and "Xid 79" in first.reason
    assert second.gpu_uuid != gpu
    degraded = node.broker.status().to_json()["degraded"]
    assert "hardware fault" in degraded[gpu] and f"gpuwarden gpu clear {gpu}" in degraded[gpu]
    node.store.request_gpu_clear(gpu, now=time.time())  # what `gpuwarden gpu clear` does
    run_until(node, lambda: "gpu_fault_cleared" in kinds(node))
    assert gpu not in node.broker.status().to_json()["degraded"]


def test_an_application_xid_fails_the_job_not_the_gpu(node: Node) -> None:
    submit(node, gpu_job("app", seconds=5))
    run_until(node, lambda: state(node, "app") is JobState.RUNNING)
    gpu = node.store.attempts("app")[0].gpu_uuid
    assert gpu is not None
    node.probe.device.inject_xid(gpu, 13)  # type: ignore[attr-defined]
    run_until(node, lambda: state(node, "app").terminal)
    app = node.store.get_job("app")
    assert app is not None and app.state is JobState.FAILED and app.attempts == 1
    assert "its GPU reported an error in the job: Xid 13" in app.reason
    assert gpu not in node.broker.status().to_json()["degraded"]


def test_cuda_oom_alone_fails_the_job_and_raises_its_footprint(node: Node) -> None:
    submit(node, gpu_job("greedy", gib=30, seconds=0.1))  # more than the 24 GiB card
    run_until(node, lambda: state(node, "greedy").terminal)
    greedy = node.store.get_job("greedy")
    assert greedy is not None and greedy.state is JobState.FAILED and greedy.attempts == 1
    assert "CUDA out of memory with the GPU to itself" in greedy.reason
    assert node.store.footprints()["testmods.gpu"].bytes == 12 * GIB  # 8 GiB x 1.5


def test_cuda_oom_beside_another_job_is_retried(tmp_path: Path) -> None:
    with open_node(make_config(tmp_path, gpus=1), mock_gpu=True) as n:
        # a co-resident type that declares 3 GiB, then grows to 23 while another
        # co-resident job holds 2: it runs out beside it, which is not its own fault
        hog = JobSpec(
            id="hog", type="burn.embed", params={"gib": 23, "ramp_s": 1.0, "seconds": 0.2}
        )
        small = JobSpec(id="small", type="burn.whisper", params={"gib": 2, "seconds": 2})
        submit(n, hog, small)
        run_until(n, lambda: state(n, "hog").terminal and state(n, "small").terminal)
        first = n.store.attempts("hog")[0]
        assert first.outcome == "cuda_oom_shared", first  # the fault happened
        assert "CUDA out of memory beside another job" in first.reason
        assert state(n, "hog") is JobState.DONE and state(n, "small") is JobState.DONE
        n.broker.shutdown(0)


def held_pid(node: Node, job_id: str, attempt: int) -> int:
    """The PID of a testmods.hold attempt, from the line it prints first."""
    log = node.config.state_dir / "jobs" / job_id / f"attempt-{attempt}" / "stdout.log"
    run_until(node, lambda: log.exists() and "holding" in log.read_text())
    return int(log.read_text().split()[1].rstrip(":"))


def test_a_worker_killed_from_outside_is_retried(node: Node, tmp_path: Path) -> None:
    release = tmp_path / "release"  # held: it is running when it is killed, not a sleep
    submit(node, JobSpec(id="k", type="testmods.hold_retried", params={"until": str(release)}))
    os.kill(held_pid(node, "k", 1), signal.SIGKILL)
    run_until(node, lambda: len(node.store.attempts("k")) == 2)
    release.touch()  # the second attempt may end now
    run_until(node, lambda: state(node, "k").terminal)
    first, second = node.store.attempts("k")
    assert first.outcome == "killed" and "SIGKILL from outside" in first.reason
    assert second.outcome == "succeeded" and state(node, "k") is JobState.DONE


def test_a_stopped_worker_past_its_timeout_ends_once(node: Node) -> None:
    # it would sleep far past its timeout (1.5 s): only the timeout ends it
    submit(node, JobSpec(id="frozen", type="testmods.sleep", params={"seconds": 60}))
    pid_file = node.config.state_dir / "jobs" / "frozen" / "attempt-1" / "out" / "pid"
    run_until(node, pid_file.exists)
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)  # it stops answering; its timeout is 1.5 s
    run_until(node, lambda: state(node, "frozen").terminal)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # too late: it was stopped and confirmed gone
    frozen = node.store.get_job("frozen")
    assert frozen is not None and frozen.state is JobState.FAILED and "timed out" in frozen.reason
    ends = [e for e in node.store.events(job_id="frozen") if e.to_state in ("done", "failed")]
    assert len(ends) == 1  # one result, never a second


def test_infrastructure_failures_end_in_quarantine_with_their_history(
    node: Node, tmp_path: Path
) -> None:
    never = str(tmp_path / "never")  # held until killed, never by a sleep that may end first
    submit(node, JobSpec(id="doomed", type="testmods.hold_retried", params={"until": never}))
    for attempt in (1, 2):
        os.kill(held_pid(node, "doomed", attempt), signal.SIGKILL)
    run_until(node, lambda: state(node, "doomed").terminal)
    doomed = node.store.get_job("doomed")
    assert doomed is not None and doomed.state is JobState.QUARANTINED
    assert "quarantined after 2 attempts" in doomed.reason
    assert [a.outcome for a in node.store.attempts("doomed")] == ["killed", "killed"]


def test_a_restart_rebuilds_the_ledger_of_an_interrupted_attempt(tmp_path: Path) -> None:
    config = make_config(tmp_path, gpus=1)
    with open_node(config, mock_gpu=True) as first:
        submit(first, gpu_job("held"))
        first.broker._observe(time.time())
        [gpu] = first.broker.vram.views()
        first.store.start_attempt("held", node="faultnode", gpu_uuid=gpu.uuid, now=time.time())
        marker = attempt_marker(first.broker.instance, "held", 1)
        sim_path = config.state_dir / SIM_STATE_FILE
    # the dead broker's job still holds 6 GiB on the GPU
    leftover = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from gpuwarden.gpu import simclient; import time; "
            f"simclient.attach().allocate({6 * GIB}); print('ok', flush=True); time.sleep(60)",
        ],
        env={
            **os.environ,
            ATTEMPT_ENV: marker,
            "GPUWARDEN_SIM_GPU": str(sim_path),
            "CUDA_VISIBLE_DEVICES": gpu.uuid,
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    assert leftover.stdout is not None and leftover.stdout.readline().strip() == "ok"
    with open_node(config, mock_gpu=True) as second:
        second.store.set_attempt_pid("held", 1, leftover.pid)
        second.broker.recover()
        assert leftover.wait(5) is not None  # the leftover was stopped
        held = second.broker.vram.ledger.get("held/1")
        assert held is not None and held.state.value == "reclaiming"
        run_until(second, lambda: second.broker.vram.ledger.get("held/1") is None)
        assert "memory_reclaimed" in kinds(second)
        run_until(second, lambda: state(second, "held").terminal)
        assert state(second, "held") is JobState.DONE
        second.broker.shutdown(0)


def test_a_result_that_can_never_be_written_gives_its_input_to_failed(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # not a fault of the host (a full or read-only disk waits: test_host_faults.py)
    def broken(dest: Path, name: str, results: list) -> Path:  # type: ignore[type-arg]
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(bundlewrite, "write_result_bundle", broken)
    root = node.broker.roots[0]
    path = bundlewrite.write_bundle(
        root.inbox, [JobSpec(id="nowhere", type="echo.echo", params={"text": "x"})], now=time.time()
    )
    run_until(node, (root.failed / f"{path.name}.reason.txt").exists, timeout=20)
    assert "Permission denied" in (root.failed / f"{path.name}.reason.txt").read_text()
    assert (root.failed / f"{path.name}.input").exists()
    assert list(root.processing.iterdir()) == []
    assert "bundle_unwritable" in kinds(node)
    assert state(node, "nowhere") is JobState.DONE  # the job itself is not lost


def test_a_gpu_that_stops_answering_pauses_vram_admission_and_cpu_jobs_go_on(
    node: Node,
) -> None:
    device = node.probe.device  # type: ignore[attr-defined]
    [first, _] = device.uuids()
    device.set_hang(first, True)
    submit(
        node,
        gpu_job("blocked", seconds=0.1),
        JobSpec(id="cpu", type="echo.echo", params={"text": "x"}),
    )
    run_until(node, lambda: state(node, "cpu").terminal)
    assert "probe_failed" in kinds(node)  # the fault was seen
    assert state(node, "cpu") is JobState.DONE
    assert state(node, "blocked") is JobState.QUEUED
    assert "VRAM admission is paused: the GPU probe failed" in (
        node.broker.wait_reason("blocked") or ""
    )
    device.set_hang(first, False)
    run_until(node, lambda: state(node, "blocked").terminal)
    assert state(node, "blocked") is JobState.DONE and "probe_recovered" in kinds(node)


# -- interruptions by the broker's own end -----------------------------------------------


def crash_during(config: Config, job_id: str, times: int) -> None:
    """``times`` brokers in a row start the job's attempt and die before it ends
    (each next one recovers what the last left)."""
    for _ in range(times):
        with open_node(config, mock_gpu=True) as n:
            n.broker.recover()
            n.store.start_attempt(job_id, node="faultnode", gpu_uuid=None, now=time.time())
            # ...and the broker is gone: nothing finishes the attempt


def test_interruptions_spend_no_retry_until_max_interruptions(tmp_path: Path) -> None:
    base = make_config(tmp_path)
    config = base.model_copy(
        update={"broker": base.broker.model_copy(update={"max_interruptions": 2})}
    )
    with open_node(config, mock_gpu=True) as n:
        submit(n, JobSpec(id="crashy", type="testmods.sleep", params={"seconds": 0.1}))
    crash_during(config, "crashy", 2)
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        # two interruptions with max_retries = 1: still queued, its retry unspent
        assert state(n, "crashy") is JobState.QUEUED
        assert [a.outcome for a in n.store.attempts("crashy")] == ["interrupted"] * 2
    crash_during(config, "crashy", 1)
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        job = n.store.get_job("crashy")
        assert job is not None and job.state is JobState.QUARANTINED
        assert "during 3 of its attempts (max_interruptions = 2)" in job.reason
        assert "may be what takes the broker down" in job.reason
        n.broker.shutdown(0)


def test_a_type_sets_its_own_max_interruptions_in_module_toml(tmp_path: Path) -> None:
    module = tmp_path / "mods" / "fragile"
    (module / "src").mkdir(parents=True)
    (module / "module.toml").write_text(
        '[module]\nname = "fragile"\n\n[types.once]\nlane = "cpu"\n'
        'command = ["{python}", "-c", "pass"]\nmax_interruptions = 0\n'
    )
    config = make_config(tmp_path).model_copy(update={"module_paths": [tmp_path / "mods"]})
    with open_node(config, mock_gpu=True) as n:
        assert n.broker.attempts.max_interruptions(n.broker.registry.get("fragile.once")) == 0
        submit(n, JobSpec(id="f", type="fragile.once"))
    crash_during(config, "f", 1)
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        job = n.store.get_job("f")
        assert job is not None and job.state is JobState.QUARANTINED
        assert "(max_interruptions = 0)" in job.reason
        n.broker.shutdown(0)


def write_faults(node: Node, *latches: dict[str, object]) -> Path:
    path = node.broker.settings.state_dir / "faults.json"
    path.write_text(json.dumps({"node": node.broker.node, "latches": list(latches)}))
    return path


def test_a_latch_the_store_lost_is_put_back_from_the_file_and_written_again(
    node: Node,
) -> None:
    gpu = node.probe.device.uuids()[0]  # type: ignore[attr-defined]
    write_faults(node, {"gpu": gpu, "xid": 79, "latched_at": 100.0})
    assert node.store.gpu_faults() == []  # the store never had it
    node.broker.recover()
    assert "latched since" in node.broker.vram.faults[gpu]
    (row,) = node.store.gpu_faults(open_only=True)
    assert (row.node, row.gpu_uuid, row.xid, row.latched_at) == ("faultnode", gpu, 79, 100.0)
    assert "gpu_fault_restored" in kinds(node)


def test_a_latch_the_store_closed_stays_closed_whatever_the_file_says(node: Node) -> None:
    gpu = node.probe.device.uuids()[0]  # type: ignore[attr-defined]
    node.store.latch_gpu_fault(node="faultnode", gpu_uuid=gpu, xid=79, reason="x", now=100.0)
    node.store.clear_gpu_fault(node="faultnode", gpu_uuid=gpu, now=101.0, by="me", reason="ok")
    path = write_faults(node, {"gpu": gpu, "xid": 79, "latched_at": 100.0})
    node.broker.recover()
    assert gpu not in node.broker.vram.faults
    assert json.loads(path.read_text())["latches"] == []  # the file follows the store


def test_without_the_store_the_files_latch_holds(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = node.probe.device.uuids()[0]  # type: ignore[attr-defined]
    write_faults(node, {"gpu": gpu, "xid": 48, "latched_at": 100.0}, {"junk": 1})

    def unreachable(**_: object) -> list[object]:
        raise OSError("the store is unreachable")

    monkeypatch.setattr(node.store, "gpu_faults", unreachable)
    with pytest.raises(OSError):
        node.store.gpu_faults()  # the store really cannot be read
    assert node.broker.gpus.restore()
    assert "Xid 48 (latched since" in node.broker.vram.faults[gpu]
    assert list(node.broker.gpus.latches) == [gpu]


def test_a_failure_while_the_nodes_disk_is_full_is_retried_as_the_hosts(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's disk is measured when an attempt ends (``statvfs``, injected
    here): a failure then is the host's (``host_fault``, retried); the same
    failure on a disk with room is the job's own."""
    full: list[str] = []

    def measured(path: object) -> str | None:
        if state(node, "fills") is JobState.RUNNING and not full:
            full.append(str(path))
            return f"the node's disk under {path} is full (1.0 MiB free of 512 MiB)"
        return None

    monkeypatch.setattr(attemptfs, "disk_full", measured)
    submit(node, JobSpec(id="fills", type="echo.echo", params={"text": "x", "exit_code": 4}))
    run_until(node, lambda: state(node, "fills").terminal, timeout=60)
    assert full and "attempt-1" in full[0]  # the disk was full when attempt 1 ended
    first, second = node.store.attempts("fills")[:2]
    assert first.outcome == "host_fault" and "not the job's" in str(first.reason)
    assert second.outcome == "job_failed"  # the disk had room again: its own failure
    assert state(node, "fills") is JobState.FAILED


def test_a_job_sized_by_its_own_parameters_moves_no_footprint_of_its_type(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31: ``burn.llm --gib 40`` took the type from 14 to 21 GiB for every
    later job. A job that sets a ``sizes_vram`` parameter (or declares its own
    footprint) is measured for itself; a job of the type's own size still raises
    it."""
    big = JobSpec(id="big", type="burn.custom", params={"gib": 20, "seconds": 0.1})
    declared = JobSpec(id="own", type="testmods.gpu", params={"gib": 9}, vram_bytes=4 * GIB)
    caplog.set_level("INFO", logger="gpuwarden.footprint")
    submit(node, big, declared)
    run_until(node, lambda: state(node, "big").terminal and state(node, "own").terminal)
    assert state(node, "big") is JobState.DONE and state(node, "own") is JobState.DONE
    # each was measured, alone on its GPU, past its type's footprint ...
    said = {r.getMessage().split(" ")[1]: r.getMessage() for r in caplog.records}
    assert set(said) == {"big", "own"}, said
    assert "big of burn.custom peaked at 2147" in said["big"]  # 20 GiB
    assert node.store.footprints() == {}  # ... and neither moved its type's
    plain = JobSpec(id="plain", type="burn.custom", params={"seconds": 0.1, "ramp_s": 0.0})
    over = JobSpec(id="over", type="testmods.gpu", params={"gib": 9, "seconds": 0.1})
    submit(node, plain, over)
    run_until(node, lambda: state(node, "plain").terminal and state(node, "over").terminal)
    got = node.store.footprints()
    assert set(got) == {"testmods.gpu"} and got["testmods.gpu"].bytes >= 9 * GIB
    assert got["testmods.gpu"].job_id == "over"
