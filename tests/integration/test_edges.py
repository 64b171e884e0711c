"""Trust at the edges (issue 11): the attacks a job or a warm server made on the
broker through the files it controls, each replayed with real processes through
the in-process broker.

Every test first asserts that its attack is in place (the link exists, the FIFO
is a FIFO, the folder is 1,100 levels deep...), then that the broker stayed up,
wrote nothing outside the job's folders, said in the result what it refused, and
that a following job completes.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden import safefs
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.node import attemptfs
from gpuwarden.store.base import Submission
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def make_config(tmp_path: Path, **top: Any) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "edgenode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": 300, "stop_grace_s": 0.5},
            **top,
        }
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(0)


def state(node: Node, job_id: str) -> JobState:
    job = node.store.get_job(job_id)
    assert job is not None
    return job.state


def ended(node: Node, job_id: str) -> Callable[[], bool]:
    return lambda: state(node, job_id).terminal


def events(node: Node, kind: str) -> list[dict[str, Any]]:
    return [
        e.detail | {"job": e.job_id} for e in node.store.events(limit=100_000) if e.kind == kind
    ]


def attempt_dir(node: Node, job_id: str, attempt: int = 1) -> Path:
    return node.config.state_dir / "jobs" / job_id / f"attempt-{attempt}"


def hostile(job_id: str, attack: str = "none", **params: Any) -> JobSpec:
    return JobSpec(id=job_id, type="testmods.hostile", params={"attack": attack, **params})


def plant(job_id: str, what: str = "none", **params: Any) -> JobSpec:
    return JobSpec(id=job_id, type="testmods.planter", params={"plant": what, **params})


def run_off_thread(node: Node, done: Callable[[], bool], limit: float = 60.0) -> None:
    """Tick the broker on a thread until ``done()``; a loop that blocks (in an
    ``open()`` of a FIFO, say) fails the test instead of hanging it."""
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            run_until(node, done, timeout=limit)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(limit + 10)
    assert not thread.is_alive(), "the broker loop blocked"
    if errors:
        raise errors[0]


def follow_up_completes(node: Node, job_id: str = "after") -> None:
    """The broker is still up and working: a plain job runs to done."""
    submit(node, hostile(job_id))
    run_until(node, ended(node, job_id))
    assert state(node, job_id) is JobState.DONE
    assert not events(node, "loop_error"), events(node, "loop_error")


def exchange_of(node: Node, type_name: str) -> Path:
    [exchange] = (node.config.state_dir / "warm").glob(f"{type_name}-*/exchange")
    return exchange


# -- a warm server's exchange slot ----------------------------------------------------


def test_a_link_a_warm_server_plants_at_a_slot_is_removed_never_followed(
    node: Node, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"  # stands for /etc
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0")
    before = os.lstat(outside)
    submit(node, plant("p1", "symlink", victim="victim", target=str(outside)))
    run_until(node, ended(node, "p1"))
    assert state(node, "p1") is JobState.DONE
    spot = exchange_of(node, "testmods.planter") / "victim-1"
    # the attack is in place: the victim's slot name is a link to outside
    assert spot.is_symlink() and os.readlink(spot) == str(outside)

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "data.txt").write_text("input data")
    victim = JobSpec(
        id="victim", type="testmods.planter", params={"file": "data.txt"}, inputs=("data.txt",)
    )
    node.store.submit(
        [prepare(node.broker.registry, victim)],
        now=time.time(),
        origin=Submission(input_dir=str(inputs)),
    )
    run_until(node, ended(node, "victim"))
    done = node.store.get_job("victim")
    assert done is not None and done.state is JobState.DONE, done.reason
    out = Path(done.result["output_dir"])
    assert (out / "copy.txt").read_text() == "input data"  # its inputs reached it
    assert done.result["outputs"] == ["copy.txt", "served.txt"]
    # nothing was written through the link, nothing outside changed owner or mode
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]
    after = os.lstat(outside)
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert not os.path.lexists(spot)  # the slot went with its job
    [cleared] = events(node, "exchange_slot_cleared")
    assert cleared["job"] == "victim" and cleared["found"] == "symlink"
    [planted] = done.result["refused"]  # the result says so too
    assert planted["path"] == "exchange/victim-1" and planted["kind"] == "symlink"
    # one server served both: the broker neither stopped it nor fell over
    assert len(events(node, "warm_server_loaded")) == 1
    follow_up_completes(node)


def test_a_slot_that_cannot_be_cleared_fails_the_attempt_loudly(node: Node) -> None:
    if shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs root and chattr to plant an entry nobody can remove")
    submit(node, plant("p1", "stuck", victim="victim"))
    run_until(node, ended(node, "p1"))
    p1 = node.store.get_job("p1")
    assert p1 is not None
    if p1.state is not JobState.DONE and "chattr" in p1.reason:
        pytest.skip(f"chattr +i is not supported here: {p1.reason}")
    try:
        stuck = exchange_of(node, "testmods.planter") / "victim-1" / "stuck"
        with pytest.raises(PermissionError):
            stuck.unlink()  # the attack is in place: nobody can remove it
        submit(node, plant("victim"))
        run_until(node, ended(node, "victim"), timeout=60)
        victim = node.store.get_job("victim")
        assert victim is not None
        first, second = node.store.attempts("victim")
        # the first attempt failed as an infrastructure failure, saying why, and
        # wrote nothing through the planted entry; the retry ran on a new server
        assert first.outcome == "worker_failed", first.reason
        assert "could not be removed" in first.reason, first.reason
        assert "nothing was written through it" in first.reason
        assert victim.state is JobState.DONE and second.outcome == "succeeded"
        assert stuck.read_text() == "cannot be removed"
        assert sorted(p.name for p in stuck.parent.iterdir()) == ["stuck"]
        assert len(events(node, "warm_server_loaded")) == 2
        follow_up_completes(node)
    finally:  # wherever it was planted, it must not outlive the test
        for planted in node.config.state_dir.rglob("stuck"):
            subprocess.run(["chattr", "-i", str(planted)], check=False)


# -- a job's message file ---------------------------------------------------------------


def test_a_fifo_as_message_file_never_blocks_the_loop(node: Node) -> None:
    submit(node, hostile("fifo", "fifo_message"))
    run_off_thread(node, ended(node, "fifo"))
    message = attempt_dir(node, "fifo") / "message.json"
    assert stat.S_ISFIFO(os.lstat(message).st_mode)  # the attack was in place
    job = node.store.get_job("fifo")
    assert job is not None and job.state is JobState.DONE, job.reason
    assert job.result["message"] == "done"  # no message: the reason
    assert "fifo" in job.result["message_file"] and "ignored" in job.result["message_file"]
    follow_up_completes(node)


def test_a_message_file_linked_to_another_jobs_file_leaks_nothing(node: Node) -> None:
    submit(node, hostile("owner"))
    run_until(node, ended(node, "owner"))
    theirs = attempt_dir(node, "owner") / "message.json"
    assert json.loads(theirs.read_text())["message"] == "attack none in place"
    submit(node, hostile("thief", "link_message", target=str(theirs)))
    run_until(node, ended(node, "thief"))
    link = attempt_dir(node, "thief") / "message.json"
    assert link.is_symlink() and link.read_text() == theirs.read_text()  # in place
    thief = node.store.get_job("thief")
    assert thief is not None and thief.state is JobState.DONE
    assert thief.result["message"] == "done"
    assert "attack none" not in json.dumps(thief.result)
    assert "symlink" in thief.result["message_file"]
    follow_up_completes(node)


def test_a_message_file_linked_to_dev_zero_is_not_read(node: Node) -> None:
    submit(node, hostile("zero", "link_message", target="/dev/zero"))
    run_off_thread(node, ended(node, "zero"))
    assert os.readlink(attempt_dir(node, "zero") / "message.json") == "/dev/zero"
    job = node.store.get_job("zero")
    assert job is not None and job.state is JobState.DONE
    assert "symlink" in job.result["message_file"]
    follow_up_completes(node)


def test_an_oversize_message_file_is_ignored_and_noted(node: Node) -> None:
    submit(node, hostile("big", "big_message"))
    run_until(node, ended(node, "big"))
    size = (attempt_dir(node, "big") / "message.json").stat().st_size
    assert size > attemptfs.MESSAGE_LIMIT  # in place
    job = node.store.get_job("big")
    assert job is not None and job.state is JobState.DONE
    assert job.result["message"] == "done"
    assert f"larger than {attemptfs.MESSAGE_LIMIT} bytes" in job.result["message_file"]
    follow_up_completes(node)


# -- a job's outputs -----------------------------------------------------------------------


@pytest.fixture
def deep_tree_removed(node: Node) -> Iterator[None]:
    """Remove what the deep job left (iteratively): a tree deeper than Python's
    recursion limit breaks every later ``shutil.rmtree`` of the test folder."""
    yield
    safefs.remove_tree(attempt_dir(node, "deep") / "out")


@pytest.mark.usefixtures("deep_tree_removed")
def test_outputs_1100_folders_deep_end_the_job_and_a_cancel_still_works(node: Node) -> None:
    submit(node, hostile("deep", "deep_outputs", depth=1100))
    run_until(node, ended(node, "deep"), timeout=60)
    out = attempt_dir(node, "deep") / "out"
    assert (out / ("d/" * 1100) / "bottom.txt").is_file()  # in place: 1,100 levels
    job = node.store.get_job("deep")
    assert job is not None and job.state is JobState.DONE, job.reason
    assert job.result["outputs"] == ["ok.txt"]
    [too_deep] = job.result["refused"]
    assert too_deep["kind"] == "folder" and "more than 64 levels deep" in too_deep["why"]
    # the loop is not stuck: a cancel reaches a running job
    submit(node, hostile("slow", seconds=60))
    run_until(node, lambda: state(node, "slow") is JobState.RUNNING)
    node.store.request_cancel("slow", now=time.time())
    run_until(node, ended(node, "slow"))
    assert state(node, "slow") is JobState.CANCELLED
    follow_up_completes(node)


def test_links_fifos_and_devices_in_outputs_are_refused_and_a_wanted_link_is_missing(
    node: Node, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not an output")
    spec = JobSpec(
        id="odd",
        type="testmods.hostile",
        params={"attack": "odd_outputs", "target": str(secret)},
        outputs=("ok.txt", "link"),
    )
    submit(node, spec)
    run_until(node, ended(node, "odd"))
    out = attempt_dir(node, "odd") / "out"
    assert (out / "link").is_symlink() and os.readlink(out / "link") == str(secret)
    assert stat.S_ISFIFO(os.lstat(out / "pipe").st_mode)
    assert stat.S_ISCHR(os.lstat(out / "null").st_mode)
    job = node.store.get_job("odd")
    assert job is not None and job.state is JobState.FAILED
    assert "did not write the output(s) asked for: link" in job.reason
    assert job.result["outputs"] == ["ok.txt"]
    kinds = {r["path"]: r["kind"] for r in job.result["refused"]}
    assert kinds == {"link": "symlink", "pipe": "fifo", "null": "character device"}
    assert all("not a regular file" in r["why"] for r in job.result["refused"])
    follow_up_completes(node)


# -- completion never strands a job -------------------------------------------------------


def test_an_error_while_completing_ends_the_attempt_naming_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    def recursion(attempt: Path) -> Any:
        raise RecursionError("maximum recursion depth exceeded")  # what rglob did

    monkeypatch.setattr(attemptfs, "list_outputs", recursion)
    submit(node, hostile("x"))
    run_until(node, ended(node, "x"))
    job = node.store.get_job("x")
    assert job is not None and job.state is JobState.FAILED
    assert "internal error" in job.reason and "RecursionError" in job.reason
    [attempt] = node.store.attempts("x")
    assert attempt.outcome == "internal_error"
    monkeypatch.undo()
    submit(node, hostile("slow", seconds=60))
    run_until(node, lambda: state(node, "slow") is JobState.RUNNING)
    node.store.request_cancel("slow", now=time.time())
    run_until(node, ended(node, "slow"))
    assert state(node, "slow") is JobState.CANCELLED
    follow_up_completes(node)


def test_a_store_busy_for_a_moment_keeps_the_attempt_for_the_next_tick(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = node.store.finish_attempt
    refused: list[str] = []

    def busy_once(*args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(args[0])
            raise sqlite3.OperationalError("database is locked")
        return real(*args, **kwargs)

    monkeypatch.setattr(node.store, "finish_attempt", busy_once)
    submit(node, hostile("busy"))
    run_until(node, ended(node, "busy"))
    assert refused == ["busy"]  # the store did refuse it once
    assert state(node, "busy") is JobState.DONE
    [error] = events(node, "loop_error")
    assert "database is locked" in error["message"]


def test_a_store_that_refuses_the_result_still_ends_the_attempt(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = node.store.finish_attempt

    def refuse_results(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("stdout"):  # the full record; the least record has no output
            raise ValueError("a value the store cannot hold")
        return real(*args, **kwargs)

    monkeypatch.setattr(node.store, "finish_attempt", refuse_results)
    submit(node, hostile("refused"))
    run_until(node, ended(node, "refused"))
    job = node.store.get_job("refused")
    assert job is not None and job.state is JobState.FAILED
    assert "the store refused the attempt's result" in job.reason
    assert "a value the store cannot hold" in job.reason


# -- the broker's own folders ---------------------------------------------------------------


def test_an_attempt_folder_left_by_lost_commits_is_moved_aside_not_reused(node: Node) -> None:
    stale = attempt_dir(node, "again")
    (stale / "out").mkdir(parents=True)
    (stale / "out" / "old.txt").write_text("from a run the store forgot")
    submit(node, hostile("again"))
    run_until(node, ended(node, "again"))
    job = node.store.get_job("again")
    assert job is not None and job.state is JobState.DONE
    assert job.result["outputs"] == ["ok.txt"]  # nothing of the old run
    [moved] = events(node, "attempt_dir_moved_aside")
    assert moved["job"] == "again" and moved["attempt"] == 1
    aside = Path(moved["moved_to"])
    assert aside.name.startswith("attempt-1.stale-") and aside.parent == stale.parent
    assert (aside / "out" / "old.txt").read_text() == "from a run the store forgot"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_state_directory_and_everything_in_it_are_the_owners_alone(tmp_path: Path) -> None:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        submit(n, hostile("p"))
        run_until(n, ended(n, "p"))
        state_dir = n.config.state_dir
        db = state_dir / "gpuwarden.db"
        wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
        assert wal.exists() and shm.exists()  # WAL mode, a connection open
        assert mode(state_dir) == 0o700
        for f in (db, wal, shm, state_dir / "broker.lock"):
            assert mode(f) == 0o600, f
        for d in (state_dir / "jobs", state_dir / "jobs" / "p", attempt_dir(n, "p")):
            assert mode(d) == 0o700, d
        assert mode(attempt_dir(n, "p") / "out") == 0o700
        if os.geteuid() == 0 and shutil.which("setpriv"):
            # another local user really cannot read what is in there
            for victim in (db, attempt_dir(n, "p") / "out" / "ok.txt"):
                peek = subprocess.run(
                    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", victim],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert peek.returncode != 0 and "Permission denied" in peek.stderr
        n.broker.shutdown(0)


def test_a_state_directory_others_could_read_is_tightened_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as n:
        n.broker.shutdown(0)
    state_dir = config.state_dir
    db = state_dir / "gpuwarden.db"
    state_dir.chmod(0o755)
    db.chmod(0o644)
    assert mode(state_dir) == 0o755 and mode(db) == 0o644  # as an older version left it
    with (
        caplog.at_level("WARNING", logger="gpuwarden.statelock"),
        open_node(config, mock_gpu=True) as n,
    ):
        assert mode(state_dir) == 0o700 and mode(db) == 0o600
        n.broker.shutdown(0)
    [line] = [r.getMessage() for r in caplog.records if "tightened" in r.getMessage()]
    assert f"{state_dir}: 755 -> 700" in line and f"{db}: 644 -> 600" in line


# -- host jobs beside a sandbox --------------------------------------------------------------


def test_host_jobs_beside_a_sandbox_runtime_are_marked_unsandboxed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        tmp_path,
        container_runtime="bubblewrap",
        allow_host_jobs=True,
        allow_unsandboxed_containers=False,
    )
    with (
        caplog.at_level("WARNING", logger="gpuwarden.node.loop"),
        open_node(config, mock_gpu=True) as n,
    ):
        submit(n, hostile("h1"), hostile("h2"), JobSpec(id="s1", type="testmods.sleep"))
        run_until(n, lambda: all(state(n, j).terminal for j in ("h1", "h2", "s1")))
        assert {state(n, j) for j in ("h1", "h2", "s1")} == {JobState.DONE}
        marked = sorted(e["job"] for e in events(n, "unsandboxed"))
        n.broker.shutdown(0)
    assert marked == ["h1", "h2", "s1"]  # every attempt, in the event log
    lines = [r.getMessage() for r in caplog.records if "UNSANDBOXED" in r.getMessage()]
    [line] = lines  # loud, but once: as the broker starts, naming every such type
    assert line.startswith("UNSANDBOXED on this node")
    assert "testmods.hostile" in line and "testmods.sleep" in line
    assert "host types beside the bubblewrap sandbox; allow_host_jobs = true" in line
