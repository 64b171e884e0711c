"""The broker loop in-process, with real job processes, the simulated GPU and a
real queue root: bundles in, results out, bad input refused, cancel, timeout,
shutdown and recovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import StateDirLockedError
from gpuwarden.eventlog import EventLog
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake import bundlewrite
from gpuwarden.launch.base import ATTEMPT_ENV, attempt_marker
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def make_config(tmp_path: Path, **broker: float) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "testnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "queue_roots": [tmp_path / "queue"],
            "sim_gpu": {"count": 2, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3, **broker},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 2},
        }
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(
        make_config(tmp_path), mock_gpu=True, events=EventLog(tmp_path / "events.jsonl")
    ) as n:
        yield n


def drop(node: Node, *specs: JobSpec, files: dict[str, Path] | None = None) -> Path:
    root = node.broker.roots[0]
    return bundlewrite.write_bundle(root.inbox, list(specs), files, now=time.time())


def result_of(node: Node, name: str, timeout: float = 20.0) -> tuple[Path, dict[str, dict]]:
    root = node.broker.roots[0]
    found: list[Path] = []

    def ready() -> bool:
        for folder in (root.outbox, root.failed):
            if (folder / name).exists():
                found.append(folder / name)
                return True
        return False

    run_until(node, ready, timeout)
    return found[0], bundles.read_result_bundle(found[0])


def echo(i: str, **params: object) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": f"hi {i}", **params})


def test_bundle_runs_and_result_lands_in_outbox(node: Node, tmp_path: Path) -> None:
    path = drop(node, echo("a", output="a.txt"), echo("b"))
    where, results = result_of(node, path.name)
    assert where.parent.name == "outbox"
    assert results["a"]["status"] == "done" and results["b"]["status"] == "done"
    assert results["a"]["message"] == "wrote 4 characters to a.txt"
    assert results["a"]["exit_code"] == 0 and results["a"]["attempts"] == 1
    assert results["a"]["stdout"].strip() == "hi a"
    assert results["a"]["module_fingerprint"].startswith("sha256:")
    assert results["a"]["timings"]["run_s"] >= 0
    out = tmp_path / "out"
    assert bundles.extract_outputs(where, "a", out)
    assert (out / "a.txt").read_text() == "hi a"
    root = node.broker.roots[0]
    assert list(root.processing.iterdir()) == []
    assert not any((node.config.state_dir / "staging").rglob("*.zip"))
    lines = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {"submitted", "transition", "bundle_accepted", "bundle_finished"} <= {
        ln["event"] for ln in lines
    }


def test_inputs_reach_the_job(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "data.txt"
    src.write_text("payload")
    spec = JobSpec(id="c", type="testmods.cat", params={"file": "data.txt"}, inputs=("data.txt",))
    path = drop(node, spec, files={"data.txt": src})
    where, results = result_of(node, path.name)
    assert results["c"]["status"] == "done", results["c"]
    out = tmp_path / "o"
    bundles.extract_outputs(where, "c", out)
    assert (out / "copy").read_text() == "payload"


def test_job_failure_goes_to_failed_with_reason(node: Node) -> None:
    path = drop(node, echo("ok"), echo("bad", exit_code=3))
    where, results = result_of(node, path.name)
    assert where.parent.name == "failed"
    assert results["ok"]["status"] == "done"
    assert results["bad"]["status"] == "failed"
    assert "exited with code 3" in results["bad"]["reason"]
    assert results["bad"]["attempts"] == 1  # a job's own failure is never re-run


def test_missing_wanted_output_fails(node: Node) -> None:
    spec = JobSpec(id="w", type="echo.echo", params={"text": "x"}, outputs=("nope.txt",))
    _, results = result_of(node, drop(node, spec).name)
    assert results["w"]["status"] == "failed"
    assert "nope.txt" in results["w"]["reason"]


def test_unknown_type_refused_and_other_jobs_unaffected(node: Node) -> None:
    good = drop(node, echo("g"))
    bad = drop(node, JobSpec(id="u", type="nope.nope", params={}))
    _, good_results = result_of(node, good.name)
    where, bad_results = result_of(node, bad.name)
    assert good_results["g"]["status"] == "done"
    assert where.parent.name == "failed"
    assert "unknown job type 'nope.nope'" in bad_results["u"]["reason"]
    assert node.store.get_job("u") is None
    # the input bundle is kept beside the result: nothing is lost
    assert (where.parent / f"{bad.name}.input").exists()


def test_bad_params_refused(node: Node) -> None:
    bad = drop(node, JobSpec(id="p", type="echo.echo", params={"text": 5, "bogus": 1}))
    _, results = result_of(node, bad.name)
    reason = results["p"]["reason"]
    assert "unknown parameter 'bogus'" in reason and "'text' must be a string" in reason


def test_corrupt_zip_refused_with_reason(node: Node) -> None:
    root = node.broker.roots[0]
    (root.inbox / "junk.zip").write_bytes(b"this is not a zip")
    where, results = result_of(node, "junk.zip")
    assert where.parent.name == "failed"
    assert results["bundle"]["status"] == "failed"
    assert "zip" in results["bundle"]["reason"].lower()
    assert node.store.list_jobs() == []


def test_same_bundle_twice_is_one_job(node: Node, tmp_path: Path) -> None:
    path = drop(node, echo("once"))
    copy = tmp_path / "copy.zip"
    copy.write_bytes(path.read_bytes())
    result_of(node, path.name)
    root = node.broker.roots[0]
    os.replace(copy, root.inbox / path.name)  # the very same bundle, dropped again
    run_until(node, lambda: any(root.failed.glob("*.duplicate-*")))
    [dup] = [p for p in root.failed.glob("*.duplicate-*") if not p.name.endswith("-input")]
    reason = bundles.read_result_bundle(dup)["once"]["reason"]
    assert "already" in reason
    assert len(node.store.list_jobs()) == 1
    assert (root.outbox / path.name).exists()  # the first result is untouched


def test_same_job_id_in_another_bundle_is_refused(node: Node) -> None:
    first = drop(node, echo("dup"))
    result_of(node, first.name)
    second = drop(node, echo("dup", text="other"))
    root = node.broker.roots[0]
    run_until(node, lambda: any(root.failed.glob("*.duplicate-*")))
    job = node.store.get_job("dup")
    assert job is not None and job.state is JobState.DONE and job.params["text"] == "hi dup"
    assert (root.outbox / first.name).exists()
    assert not (root.processing / second.name).exists()


def test_cancel_running_job_stops_its_process(node: Node, tmp_path: Path) -> None:
    # held until the cancel ends it, not a sleep that may end first
    spec = JobSpec(id="s", type="testmods.hold", params={"until": str(tmp_path / "never")})
    submit(node, spec)
    run_until(node, lambda: node.broker.running == 1)
    log = node.config.state_dir / "jobs/s/attempt-1/stdout.log"
    run_until(node, lambda: log.exists() and "holding" in log.read_text())
    pid = int(log.read_text().split()[1].rstrip(":"))
    assert psutil.pid_exists(pid)
    node.store.request_cancel("s", now=time.time())
    run_until(node, lambda: node.store.get_job("s").state.terminal)  # type: ignore[union-attr]
    job = node.store.get_job("s")
    assert job is not None and job.state is JobState.CANCELLED
    assert "cancelled while running" in job.reason
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_timeout_kills_and_fails_without_retry(node: Node) -> None:
    spec = JobSpec(id="t", type="testmods.sleep", params={"seconds": 30, "ignore_term": True})
    submit(node, spec)
    run_until(node, lambda: node.store.get_job("t").state.terminal)  # type: ignore[union-attr]
    job = node.store.get_job("t")
    assert job is not None and job.state is JobState.FAILED
    assert "timed out after 1.5 s" in job.reason and job.attempts == 1


def test_vram_jobs_one_per_gpu_on_sim(node: Node) -> None:
    specs = [JobSpec(id=f"g{i}", type="testmods.gpu", params={"seconds": 0.5}) for i in range(3)]
    submit(node, *specs)
    run_until(node, lambda: node.broker.running == 2)
    status = node.broker.status().to_json()
    held = {g["uuid"]: [h["job_id"] for h in g["holdings"]] for g in status["gpus"]}
    assert len(held) == 2 and all(len(v) == 1 for v in held.values())
    assert "needs a GPU to itself" in (node.broker.wait_reason("g2") or "")
    run_until(node, lambda: all(j.state.terminal for j in node.store.list_jobs()))
    gpus = {(node.store.get_job(s.id).result or {}).get("gpu") for s in specs}  # type: ignore[union-attr]
    assert len(gpus) == 2
    for s in specs:  # each job's process saw exactly the GPU it was given, by UUID
        job = node.store.get_job(s.id)
        assert job is not None
        seen = (Path(job.result["output_dir"]) / "gpu.txt").read_text()
        assert seen == job.result["gpu"] and seen.startswith("GPU-")
    assert all(j.state is JobState.DONE for j in node.store.list_jobs())


def test_vram_job_waits_for_memory_a_foreign_process_holds(node: Node) -> None:
    device = node.probe.device  # type: ignore[attr-defined]
    for uuid in device.uuids():
        device.add_foreign(uuid, 20 * 1024**3)
    submit(node, JobSpec(id="f", type="testmods.gpu", params={}))
    node.broker.tick()
    reason = node.broker.wait_reason("f") or ""
    assert "needs 8.0 GiB on one GPU" in reason and "4.0 GiB free" in reason
    device.clear_foreign()
    run_until(node, lambda: node.store.get_job("f").state.terminal)  # type: ignore[union-attr]
    assert node.store.get_job("f").state is JobState.DONE  # type: ignore[union-attr]


def test_shutdown_fails_running_jobs_with_reason(node: Node, tmp_path: Path) -> None:
    # held past the grace: only the shutdown ends it
    spec = JobSpec(id="x", type="testmods.hold", params={"until": str(tmp_path / "never")})
    submit(node, spec)
    run_until(node, lambda: node.broker.running == 1)
    node.broker.shutdown(0.1)
    job = node.store.get_job("x")
    assert job is not None and job.state is JobState.FAILED
    assert "shut down" in job.reason
    [status] = node.store.node_statuses()
    assert status.payload["stopped"] is True


def test_recovery_requeues_an_interrupted_attempt_and_kills_its_leftovers(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:
        submit(first, echo("r"))
        first.store.start_attempt("r", node="testnode", gpu_uuid=None, now=time.time())
        marker = attempt_marker(first.broker.instance, "r", 1)
    # a process the dead broker left behind, recognisable by its marker
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, ATTEMPT_ENV: marker},
        start_new_session=True,
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open_node(config, mock_gpu=True) as second:
            second.broker.recover()
            assert leftover.wait(5) is not None
            assert stranger.poll() is None  # only our own processes are touched
            run_until(second, lambda: second.store.get_job("r").state.terminal)  # type: ignore[union-attr]
            job = second.store.get_job("r")
            assert job is not None and job.state is JobState.DONE and job.attempts == 2
            [a1, _] = second.store.attempts("r")
            assert a1.outcome == "interrupted" and "stopped unexpectedly" in a1.reason
    finally:
        stranger.kill()
        leftover.kill()
        stranger.wait()


def test_recovery_rereads_a_bundle_never_recorded(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:
        root = first.broker.roots[0]
        path = bundlewrite.write_bundle(root.inbox, [echo("z")], None, now=time.time())
        root.claim(path)  # crashed right after moving it to processing/
    with open_node(config, mock_gpu=True) as second:
        second.broker.recover()
        _, results = result_of(second, path.name)
        assert results["z"]["status"] == "done"
        kinds = [
            e.detail.get("action") for e in second.store.events() if e.kind == "bundle_recovered"
        ]
        assert kinds == ["never recorded: reading it again"]


def test_second_broker_on_same_state_dir_refused(node: Node, tmp_path: Path) -> None:
    with (
        pytest.raises(StateDirLockedError, match=f"PID {os.getpid()}"),
        open_node(make_config(tmp_path), mock_gpu=True),
    ):
        pass


def test_result_bundle_is_a_valid_zip_with_result_json(node: Node) -> None:
    path = drop(node, echo("v"))
    where, _ = result_of(node, path.name)
    with zipfile.ZipFile(where) as zf:
        names = set(zf.namelist())
    assert "v/result.json" in names and "v/outputs/echo.txt" in names


def test_cancel_asked_before_a_crash_is_honoured_after_restart(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:
        submit(first, echo("cx"))
        first.store.start_attempt("cx", node="testnode", gpu_uuid=None, now=time.time())
        first.store.request_cancel("cx", now=time.time())  # the broker died before acting
    with open_node(config, mock_gpu=True) as second:
        second.broker.recover()
        for _ in range(5):
            second.broker.tick()
        job = second.store.get_job("cx")
        assert job is not None and job.state is JobState.CANCELLED and job.attempts == 1


def test_a_retried_job_with_a_cancel_request_never_runs_again(node: Node) -> None:
    submit(node, echo("rc"))
    node.store.start_attempt("rc", node="testnode", gpu_uuid=None, now=time.time())
    node.store.request_cancel("rc", now=time.time())
    node.store.finish_attempt(
        "rc", 1, target=JobState.QUEUED, now=time.time(), outcome="launch_error", reason="retry"
    )
    node.broker.tick()
    job = node.store.get_job("rc")
    assert job is not None and job.state is JobState.CANCELLED and job.attempts == 1


def test_a_bundle_whose_result_cannot_be_written_does_not_hold_up_others(
    node: Node, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = bundlewrite.write_result_bundle

    def flaky(dest: Path, name: str, results: list) -> Path:  # type: ignore[type-arg]
        if name.startswith("poison"):
            raise PermissionError("an output file is unreadable")
        return real(dest, name, results)

    monkeypatch.setattr(bundlewrite, "write_result_bundle", flaky)
    poison = drop(node, echo("poison"))
    run_until(node, lambda: job_state(node, "poison") is JobState.DONE)
    waiter = drop(
        node, JobSpec(id="waiter", type="testmods.hold", params={"until": str(tmp_path / "never")})
    )
    run_until(node, lambda: job_state(node, "waiter") is JobState.RUNNING)
    node.store.request_cancel("waiter", now=time.time())  # as a client would
    root = node.broker.roots[0]
    run_until(node, (root.failed / waiter.name).exists, timeout=20)
    assert (root.processing / poison.name).exists()  # still waiting, not lost
    errors = [e for e in node.store.events() if e.kind == "loop_error"]
    assert errors and "unreadable" in str(errors[0].detail["message"])


def test_a_bundle_that_fails_to_be_read_for_reasons_not_its_own_is_read_again(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = node.store.submit
    calls = {"n": 0}

    def locked_once(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("database is locked")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(node.store, "submit", locked_once)
    path = drop(node, echo("retry-me"))
    _, results = result_of(node, path.name)
    assert results["retry-me"]["status"] == "done" and calls["n"] == 2


def job_state(node: Node, job_id: str) -> JobState | None:
    j = node.store.get_job(job_id)
    return None if j is None else j.state


def test_a_start_refused_while_the_job_stays_queued_is_tried_again(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses a start when another writer holds the job's row for a
    moment (on PostgreSQL, a submission naming it as a dependency): the job stays
    in the queue index and starts on a later pass, not after the index is rebuilt."""
    submit(node, JobSpec("j", "testmods.sleep", {"seconds": 0.05}))
    attempts = node.broker.attempts
    real = attempts.begin
    refused: list[str] = []

    def locked_once(job, jobtype, gpu, now):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(job.id)
            return None  # what begin() answers when the store refused the start
        return real(job, jobtype, gpu, now)

    monkeypatch.setattr(attempts, "begin", locked_once)
    node.broker.tick()
    assert refused == ["j"], "the start really was refused"
    job = node.store.get_job("j")
    assert job is not None and job.state is JobState.QUEUED
    assert "j" in node.broker.queue.index, "still in the index"
    run_until(
        node, lambda: (j := node.store.get_job("j")) is not None and j.state is JobState.DONE, 10
    )
