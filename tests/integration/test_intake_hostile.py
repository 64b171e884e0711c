"""QueueIntake against hostile entries and names, in-process and tick by tick:
FIFOs swapped in after the listing, slow extractions beside running jobs, names
that are not UTF-8, results that are already there, recovery of ``*.ZIP``."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.cluster.queues import QueueWatcher
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.eventlog import EventLog
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake import bundlewrite
from gpuwarden.intake.jobs import prepare
from gpuwarden.intake.queueroot import QueueRoot, record_name
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore
from tests.brokerkit import run_until
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def make_config(tmp_path: Path) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "testnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "queue_roots": [tmp_path / "queue"],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
        }
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(
        make_config(tmp_path), mock_gpu=True, events=EventLog(tmp_path / "events.jsonl")
    ) as n:
        yield n


def echo(i: str, **params: object) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": f"hi {i}", **params})


def sleeper(i: str, seconds: float) -> JobSpec:
    return JobSpec(id=i, type="testmods.sleep", params={"seconds": seconds})


def bundle_bytes(tmp_path: Path, *specs: JobSpec) -> bytes:
    scratch = tmp_path / f"scratch-{time.monotonic_ns()}"
    scratch.mkdir()
    return bundlewrite.write_bundle(scratch, list(specs), now=time.time()).read_bytes()


def place(folder: Path, raw_name: bytes, data: bytes) -> str:
    """Drop ``data`` into ``folder`` under exactly these name bytes, the way a
    client does (a temporary name, then a rename); return the name as listed."""
    tmp = folder / ".placing.tmp"
    tmp.write_bytes(data)
    os.rename(os.fsencode(tmp), os.fsencode(folder) + b"/" + raw_name)
    return os.fsdecode(raw_name)


def events(node: Node, kind: str) -> list[dict[str, Any]]:
    return [e.detail for e in node.store.events(limit=10_000) if e.kind == kind]


def root_of(node: Node) -> QueueRoot:
    return node.broker.roots[0]


# -- FIFOs and other files that are not regular ---------------------------------------


def test_a_fifo_swapped_in_after_the_listing_never_blocks(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = root_of(node)
    place(root.inbox, b"x.zip", bundle_bytes(tmp_path, echo("never")))
    real_claim = QueueRoot.claim

    def swap_then_claim(self: QueueRoot, path: Path) -> Path:
        # the listing said "file"; the client swaps a FIFO in before the rename
        path.unlink()
        os.mkfifo(path)
        return real_claim(self, path)

    monkeypatch.setattr(QueueRoot, "claim", swap_then_claim)
    [arrival] = root.arrivals()
    assert arrival.kind == "file"  # what the listing saw
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append((os.fsdecode(path), flags))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    done = threading.Event()

    def ticks() -> None:
        run_until(node, (root.failed / "x.zip").exists)
        done.set()

    t = threading.Thread(target=ticks, daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "the broker blocked on a FIFO"
    monkeypatch.undo()
    kept = root.failed / "x.zip.input"
    assert stat.S_ISFIFO(os.lstat(kept).st_mode)  # moved aside, as it is
    assert all(flags & os.O_PATH for name, flags in opened if name.endswith("x.zip")), opened
    reason = bundles.read_result_bundle(root.failed / "x.zip")["bundle"]["reason"]
    assert "is a fifo, not a regular file" in reason and "never opened" in reason
    assert node.store.get_bundle(str(root.path), "x.zip") is not None  # recorded
    assert node.store.get_job("never") is None
    # a following bundle completes
    good = bundlewrite.write_bundle(root.inbox, [echo("after")], now=time.time())
    run_until(node, (root.outbox / good.name).exists)


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink", "device"])
def test_what_is_not_a_regular_file_is_moved_aside_once(node: Node, kind: str) -> None:
    root = root_of(node)
    entry = root.inbox / "odd.zip"
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "folder":
        entry.mkdir()
        (entry / "manifest.json").write_text("{}")
    elif kind == "symlink":
        entry.symlink_to("/dev/zero")
    else:
        os.mknod(entry, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    mode = os.lstat(entry).st_mode
    assert {"fifo": stat.S_ISFIFO, "folder": stat.S_ISDIR, "symlink": stat.S_ISLNK}.get(
        kind, stat.S_ISCHR
    )(mode)
    run_until(node, (root.failed / "odd.zip").exists)
    shown = {"device": "character device"}.get(kind, kind)
    reason = bundles.read_result_bundle(root.failed / "odd.zip")["bundle"]["reason"]
    assert f"is a {shown}, not a regular file" in reason
    assert stat.S_IFMT(os.lstat(root.failed / "odd.zip.input").st_mode) == stat.S_IFMT(mode)
    assert root.arrivals() == [] and root.in_processing() == []  # never looked at again
    [rejected] = events(node, "bundle_rejected")
    assert rejected["bundle"] == "odd.zip" and shown in rejected["reason"]


# -- names ---------------------------------------------------------------------------------


def test_a_name_that_is_not_utf8_is_refused_and_recorded_readably(
    node: Node, tmp_path: Path
) -> None:
    root = root_of(node)
    raw = b"caf\xe9-\xff.zip"
    name = place(root.inbox, raw, bundle_bytes(tmp_path, echo("latin1")))
    assert os.listdir(os.fsencode(root.inbox)) == [raw]  # the bytes really are not UTF-8
    run_until(node, lambda: os.path.lexists(root.failed / name))
    reason = bundles.read_result_bundle(root.failed / name)["bundle"]["reason"]
    assert "caf\\xe9-\\xff.zip" in reason and "not valid UTF-8" in reason
    [rejected] = events(node, "bundle_rejected")
    assert rejected["bundle"] == record_name(name) and "not valid UTF-8" in rejected["reason"]
    rec = node.store.get_bundle(str(root.path), record_name(name))
    assert rec is not None and rec.outcome == "rejected"
    assert node.store.get_job("latin1") is None
    kept = [n for n in os.listdir(root.failed) if n.endswith(".input")]
    assert kept == [f"{record_name(name)}.input"]  # a readable name of the broker's own
    json.dumps(events(node, "bundle_rejected"), ensure_ascii=False).encode("utf-8")


def test_x_input_zip_never_overwrites_the_kept_input_of_x_zip(node: Node, tmp_path: Path) -> None:
    root = root_of(node)
    place(root.inbox, b"X.zip", b"not a zip at all")
    run_until(node, (root.failed / "X.zip").exists)
    kept = root.failed / "X.zip.input"
    assert kept.read_bytes() == b"not a zip at all"
    place(root.inbox, b"X.input.zip", bundle_bytes(tmp_path, echo("xi")))
    run_until(node, (root.outbox / "X.input.zip").exists)
    assert kept.read_bytes() == b"not a zip at all"  # untouched
    assert bundles.read_result_bundle(root.outbox / "X.input.zip")["xi"]["status"] == "done"
    assert "zip" in bundles.read_result_bundle(root.failed / "X.zip")["bundle"]["reason"]


def test_a_duplicate_refusal_never_takes_a_client_name(node: Node, tmp_path: Path) -> None:
    """The refusal of a second copy is named ``<name>.duplicate-...``: no client's
    bundle can be called that, so none is overwritten."""
    root = root_of(node)
    data = bundle_bytes(tmp_path, echo("d1"))
    place(root.inbox, b"d.zip", data)
    run_until(node, (root.outbox / "d.zip").exists)
    place(root.inbox, b"d.zip", data)  # the same name again
    run_until(node, lambda: any(root.failed.glob("d.zip.duplicate-*")))
    names = sorted(os.listdir(root.failed))
    assert len(names) == 2 and all(not n.lower().endswith(".zip") for n in names), names
    [result] = [n for n in names if not n.endswith("-input")]
    assert bundles.read_result_bundle(root.failed / result)["d1"]["status"] == "refused"


# -- extraction off the loop -------------------------------------------------------------


def test_a_slow_extraction_does_not_stall_other_bundles_or_jobs(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bundle's extraction is held up (as a big one would be); meanwhile
    another bundle is accepted, its job runs and its result is written."""
    release = threading.Event()
    started = threading.Event()
    real = bundles.extract_bundle

    def slow(path: Path, *args: Any, **kw: Any) -> Any:
        if path.name == "slow.zip":
            started.set()
            assert release.wait(60)
        return real(path, *args, **kw)

    monkeypatch.setattr(bundles, "extract_bundle", slow)
    root = root_of(node)
    place(root.inbox, b"slow.zip", bundle_bytes(tmp_path, echo("s1")))
    node.broker.tick()
    assert started.wait(10)  # the slow one is being extracted, off the loop
    place(root.inbox, b"fast.zip", bundle_bytes(tmp_path, echo("f1")))
    run_until(node, (root.outbox / "fast.zip").exists)
    job = node.store.get_job("f1")
    assert job is not None and job.state is JobState.DONE
    assert node.store.get_job("s1") is None and node.broker.queues.extracting == 1
    release.set()
    run_until(node, (root.outbox / "slow.zip").exists)


def test_shutdown_stops_an_extraction_and_the_bundle_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path)
    release = threading.Event()
    real = bundles.extract_bundle

    def held(path: Path, *args: Any, **kw: Any) -> Any:
        assert release.wait(60)
        return real(path, *args, **kw)

    with open_node(config, mock_gpu=True) as first:
        root = root_of(first)
        place(root.inbox, b"later.zip", bundle_bytes(tmp_path, echo("l1")))
        monkeypatch.setattr(bundles, "extract_bundle", held)
        first.broker.tick()
        assert first.broker.queues.extracting == 1
        first.broker.queues.close()  # what a stopping coordinator does
        release.set()
        monkeypatch.undo()
        assert (root.processing / "later.zip").exists()  # never recorded, still there
    with open_node(config, mock_gpu=True) as second:
        second.broker.recover()
        run_until(second, (root.outbox / "later.zip").exists)
        actions = [e["action"] for e in events(second, "bundle_recovered")]
        assert actions == ["never recorded: reading it again"]


# -- recovery ------------------------------------------------------------------------------


def test_an_upper_case_zip_claimed_before_a_crash_is_recovered(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:
        root = root_of(first)
        place(root.inbox, b"LOUD.ZIP", bundle_bytes(tmp_path, echo("loud")))
        root.claim(root.inbox / "LOUD.ZIP")  # crashed right after the claim
    with open_node(config, mock_gpu=True) as second:
        second.broker.recover()
        run_until(second, (root.outbox / "LOUD.ZIP").exists)
        assert [e["bundle"] for e in events(second, "bundle_recovered")] == ["LOUD.ZIP"]


def test_a_bundle_the_store_does_not_know_whose_result_exists_is_left(
    node: Node, tmp_path: Path
) -> None:
    root = root_of(node)
    place(root.processing, b"known.zip", bundle_bytes(tmp_path, echo("k1")))
    place(root.outbox, b"known.zip", b"the earlier result")
    assert node.store.get_bundle(str(root.path), "known.zip") is None
    node.broker.recover()
    for _ in range(5):
        node.broker.tick()
    assert (root.outbox / "known.zip").read_bytes() == b"the earlier result"
    assert (root.processing / "known.zip").exists()  # left for the operator
    assert node.store.get_job("k1") is None  # not run again
    [held] = events(node, "bundle_result_exists")
    assert held["bundle"] == "known.zip" and held["result"].endswith("outbox/known.zip")
    assert "processing/" in held["action"]
    # the same in inbox/: not taken in either
    place(root.inbox, b"again.zip", bundle_bytes(tmp_path, echo("a1")))
    place(root.failed, b"again.zip", b"an earlier refusal")
    run_until(node, lambda: len(events(node, "bundle_result_exists")) == 2)
    assert (root.failed / "again.zip").read_bytes() == b"an earlier refusal"
    assert node.store.get_job("a1") is None


def test_an_open_bundle_whose_result_exists_is_not_run_again(node: Node, tmp_path: Path) -> None:
    """The store lost that the result was written (an older copy came back): the
    result stands, the jobs still queued are cancelled, nothing is written again."""
    root = root_of(node)
    specs = [prepare(node.broker.registry, echo(i)) for i in ("o1", "o2")]
    node.store.submit(
        specs,
        now=time.time(),
        origin=Submission(queue_root=str(root.path), bundle="open.zip"),
    )
    place(root.outbox, b"open.zip", b"written before the store lost it")
    node.broker.recover()
    for _ in range(10):
        node.broker.tick()
    for i in ("o1", "o2"):
        job = node.store.get_job(i)
        assert job is not None and job.state is JobState.CANCELLED and job.attempts == 0
        assert "already in outbox/" in job.reason
    assert (root.outbox / "open.zip").read_bytes() == b"written before the store lost it"
    assert sorted(os.listdir(root.outbox)) == ["open.zip"]
    rec = node.store.get_bundle(str(root.path), "open.zip")
    assert rec is not None and rec.finished_at is not None
    [held] = events(node, "bundle_result_exists")
    assert held["jobs_not_run"] == ["o1", "o2"]


def test_a_result_name_that_is_taken_gets_a_new_name(node: Node, tmp_path: Path) -> None:
    root = root_of(node)
    place(root.inbox, b"taken.zip", bundle_bytes(tmp_path, sleeper("t1", 0.5)))
    run_until(node, lambda: node.store.get_job("t1") is not None)
    place(root.outbox, b"taken.zip", b"someone else's file")
    run_until(node, lambda: bool(events(node, "bundle_finished")))
    assert (root.outbox / "taken.zip").read_bytes() == b"someone else's file"
    [renamed] = events(node, "result_renamed")
    path = Path(renamed["result"])
    assert path.parent == root.outbox and path.name.startswith("taken.zip.result-")
    assert bundles.read_result_bundle(path)["t1"]["status"] == "done"
    assert renamed["wanted"].endswith("outbox/taken.zip")


# -- the coordinator's watcher uses the same intake -------------------------------------


def test_the_coordinator_watcher_takes_bundles_in_and_refuses_fifos(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    registry = Registry.load(config.module_paths)
    root = QueueRoot.open(tmp_path / "cq", create=True)
    store = SqliteStore(tmp_path / "c.db")
    watcher = QueueWatcher(store, registry, config, [root], interval_s=0.02)
    try:
        place(root.inbox, b"c.zip", bundle_bytes(tmp_path, echo("c1")))
        os.mkfifo(root.inbox / "p.zip")
        deadline = time.monotonic() + 30
        while store.get_job("c1") is None or not (root.failed / "p.zip").exists():
            assert time.monotonic() < deadline, "the watcher did not take the bundles in"
            watcher.once()
            time.sleep(0.02)
        assert stat.S_ISFIFO(os.lstat(root.failed / "p.zip.input").st_mode)
        with zipfile.ZipFile(root.failed / "p.zip") as zf:
            assert "fifo" in json.loads(zf.read("bundle/result.json"))["reason"]
    finally:
        watcher.stop()
        store.close()


def test_a_staging_folder_left_by_a_crash_after_a_bundle_ended_is_swept_at_start(
    node: Node, tmp_path: Path
) -> None:
    """A kill between finishing a bundle (its result written and recorded, its
    input gone from processing/) and removing its staging folder leaves the
    folder: the next start removes it, and leaves the staging of an open bundle."""
    root = root_of(node)
    place(root.inbox, b"done.zip", bundle_bytes(tmp_path, echo("d1")))
    run_until(node, (root.outbox / "done.zip").exists)
    intake = node.broker.queues
    left = intake.staging_for(root, "done.zip")
    (left / "inputs").mkdir(parents=True)  # the kill's leftover, as extraction made it
    (left / "manifest.json").write_text("{}")
    place(root.inbox, b"open.zip", bundle_bytes(tmp_path, sleeper("o1", 30)))
    run_until(
        node, lambda: (j := node.store.get_job("o1")) is not None and j.state.value == "running"
    )
    kept = intake.staging_for(root, "open.zip")
    assert left.is_dir() and kept.is_dir()  # both are there before the start
    intake.recover(time.time())
    assert not left.exists()
    assert kept.is_dir()  # its bundle is open: its inputs stay
    assert [e["bundle"] for e in events(node, "staging_removed")] == ["done.zip"]
    node.store.request_cancel("o1", now=time.time())
    run_until(node, lambda: (j := node.store.get_job("o1")) is not None and j.state.terminal)
