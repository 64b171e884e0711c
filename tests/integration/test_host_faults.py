"""Faults of the host in a queue root's intake: ENOSPC, EROFS and EIO injected at
the operating-system call (``os.open``, ``os.fsync``, ``os.rename``) for the paths
of one test only. A bundle, or its result, waits where it is and is tried again
with backoff until the fault clears; it is never refused for the host, and no
temporary, empty or reason file is left behind. Each test first asserts that its
fault really happened. Time is the ``now`` given to the intake: no sleeps."""

from __future__ import annotations

import errno
import os
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.command import CommandSpec
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.hostfaults import Backoff, disk_full, host_fault
from gpuwarden.intake import bundlewrite
from gpuwarden.intake.manifest import BundleLimits
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import QueueIntake
from gpuwarden.node import attemptfs
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore
from tests.conftest import MODULES

T0 = 1_000_000.0


@dataclass
class Rig:
    root: QueueRoot
    store: SqliteStore
    intake: QueueIntake
    staging: Path
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    errors: list[tuple[str, Exception]] = field(default_factory=list)

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]

    def until(self, check: Callable[[], bool], now: float, what: str) -> None:
        """Pass the intake at ``now`` until ``check()`` (extraction runs on threads:
        a slow machine may need several passes)."""
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.events}"
            self.intake.intake(now)
            time.sleep(0.02)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    store = SqliteStore(tmp_path / "store.db")
    root = QueueRoot.open(tmp_path / "queue", create=True)
    staging = tmp_path / "staging"
    events: list[tuple[str, dict[str, Any]]] = []
    errors: list[tuple[str, Exception]] = []
    intake = QueueIntake(
        store=store,
        registry=Registry.load([MODULES]),
        staging_dir=staging,
        limits=BundleLimits(),
        roots=[root],
        emit=lambda kind, **detail: events.append((kind, detail)),
        on_error=lambda where, exc: errors.append((where, exc)),
    )
    yield Rig(root, store, intake, staging, events, errors)
    intake.close()
    store.close()


def drop(rig: Rig, job_id: str) -> Path:
    spec = JobSpec(id=job_id, type="echo.echo", params={"text": job_id})
    return bundlewrite.write_bundle(rig.root.inbox, [spec], now=time.time())


def files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def assert_clean(root: QueueRoot) -> None:
    """No temporary, empty or reason file anywhere in the queue root."""
    for path in files_in(root.path):
        assert not path.name.startswith((".gw-", ".probe-")), path
        assert path.stat().st_size > 0, f"{path} is empty"
        assert not path.name.endswith(".reason.txt"), path


class Injected:
    """Make one OS call fail with ``err`` for the paths ``hit`` says, while on."""

    def __init__(self, err: int) -> None:
        self.err = err
        self.on = True
        self.count = 0
        self.paths: list[str] = []

    def fail(self, path: str) -> None:
        self.count += 1
        self.paths.append(path)
        raise OSError(self.err, os.strerror(self.err), path)


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_an_extraction_on_a_full_disk_waits_in_processing_and_goes_through_once_freed(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = Injected(errno.ENOSPC)
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if full.on and str(path).startswith(str(rig.staging)) and flags & os.O_CREAT:
            full.fail(str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_)
    bundle = drop(rig, "j1")
    rig.until(lambda: bool(rig.kinds("bundle_waiting")), T0, "the bundle to wait")
    assert full.count >= 1  # the fault happened, in the staging folder
    [first] = rig.kinds("bundle_waiting")
    assert first["where"] == "extracting it" and "ENOSPC" in first["waits_for"]
    assert first["retry_in_s"] == 1.0 and first["tries"] == 1
    assert (rig.root.processing / bundle.name).exists()  # it waits where it is
    assert rig.store.get_job("j1") is None
    assert files_in(rig.root.failed) == [] and not rig.errors
    assert not (rig.staging.exists() and files_in(rig.staging))  # what it wrote is freed

    tried = full.count
    for _ in range(5):
        rig.intake.intake(T0 + 0.9)  # its wait is not over: not tried again
    assert full.count == tried
    rig.until(lambda: len(rig.kinds("bundle_waiting")) == 2, T0 + 1.1, "a second try")
    assert rig.kinds("bundle_waiting")[1]["retry_in_s"] == 2.0  # the wait doubles

    full.on = False
    rig.until(lambda: rig.store.get_job("j1") is not None, T0 + 3.2, "the bundle accepted")
    [over] = rig.kinds("bundle_wait_over")
    assert over["tries"] == 2 and over["waited_s"] == pytest.approx(3.2)
    assert rig.store.get_bundle(str(rig.root.path), bundle.name) is not None
    assert files_in(rig.root.failed) == [] and not rig.errors
    assert_clean(rig.root)


def test_a_result_on_a_full_disk_waits_and_is_never_given_up(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = drop(rig, "r1")
    rig.until(lambda: rig.store.get_job("r1") is not None, T0, "the bundle accepted")
    rig.store.transition("r1", JobState.CANCELLED, now=T0, reason="test")

    full = Injected(errno.ENOSPC)
    real_fsync = os.fsync
    temps_seen: list[bool] = []

    def fsync(fd: int) -> None:
        path = fd_path(fd)
        if full.on and path.startswith(str(rig.root.path)) and "/.gw-" in path:
            temps_seen.append(Path(path).exists())
            full.fail(path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    now = T0
    for _ in range(6):  # twice RESULT_TRIES: a host fault is never counted
        now += 61
        rig.intake.finish_bundles(now, force=True)
    assert full.count == 6 and all(temps_seen)  # the fault happened, to a real temp file
    waits = rig.kinds("result_waiting")
    assert len(waits) == 6 and "ENOSPC" in waits[0]["waits_for"]
    assert [w["retry_in_s"] for w in waits] == [1, 2, 4, 8, 16, 32]
    assert not rig.kinds("bundle_unwritable") and not rig.errors
    assert files_in(rig.root.failed) == [] and files_in(rig.root.outbox) == []
    assert (rig.root.processing / bundle.name).exists()
    assert_clean(rig.root)

    rig.intake.finish_bundles(now + 1, force=True)  # within its wait: not tried
    assert full.count == 6
    full.on = False
    rig.intake.finish_bundles(now + 61, force=True)
    assert [p.name for p in files_in(rig.root.failed)] == [bundle.name]  # cancelled: failed/
    assert rig.kinds("result_wait_over")[0]["tries"] == 6
    rec = rig.store.get_bundle(str(rig.root.path), bundle.name)
    assert rec is not None and rec.finished_at is not None
    assert not (rig.root.processing / bundle.name).exists()
    assert_clean(rig.root)


def test_a_claim_on_a_read_only_queue_root_waits_in_inbox(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ro = Injected(errno.EROFS)
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if ro.on and str(src).startswith(str(rig.root.inbox)):
            ro.fail(str(src))
        real_rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", rename)
    bundle = drop(rig, "c1")
    rig.intake.intake(T0)
    assert ro.count == 1  # the fault happened
    [waiting] = rig.kinds("bundle_waiting")
    assert waiting["where"] == "claiming it" and "EROFS" in waiting["waits_for"]
    assert (rig.root.inbox / bundle.name).exists() and not rig.errors
    rig.intake.intake(T0 + 0.5)
    assert ro.count == 1  # it waits its second
    ro.on = False
    rig.until(lambda: rig.store.get_job("c1") is not None, T0 + 1.5, "the bundle accepted")
    assert rig.kinds("bundle_wait_over") and files_in(rig.root.failed) == []
    assert_clean(rig.root)


def test_an_io_error_listing_inbox_makes_the_root_wait(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    eio = Injected(errno.EIO)
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if eio.on and str(path) == str(rig.root.inbox):
            eio.fail(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    drop(rig, "e1")
    for _ in range(3):
        rig.intake.intake(T0)
    assert eio.count == 1  # the fault happened, once: the root then waits
    [waiting] = rig.kinds("bundle_waiting")
    assert waiting["bundle"] is None and waiting["where"] == "listing inbox/"
    assert "EIO" in waiting["waits_for"] and not rig.errors
    eio.on = False
    rig.until(lambda: rig.store.get_job("e1") is not None, T0 + 1, "the bundle accepted")


def test_the_reason_file_is_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = Injected(errno.ENOSPC)

    def fsync(fd: int) -> None:
        full.fail(fd_path(fd))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="No space left"):
        bundlewrite.write_new_file(tmp_path, "b.zip.reason.txt", b"why\n")
    assert full.count == 1 and "/.gw-" in full.paths[0]  # it failed on the temporary file
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    path = bundlewrite.write_new_file(tmp_path, "b.zip.reason.txt", b"why\n")
    assert path.read_bytes() == b"why\n" and [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(FileExistsError):
        bundlewrite.write_new_file(tmp_path, "b.zip.reason.txt", b"other\n")
    assert path.read_bytes() == b"why\n"


def test_host_faults_are_told_apart_and_the_wait_doubles_to_a_minute() -> None:
    for err in (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT):
        assert host_fault(OSError(err, os.strerror(err))) is not None
    assert host_fault(PermissionError(errno.EACCES, "denied")) is None
    assert host_fault(ValueError("x")) is None
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert host_fault(outer) is not None  # found among its causes
    b: Backoff[str] = Backoff()
    waits = [b.hold("k", 0.0, "why").wait_s for _ in range(9)]
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert b.waits("k", 59.0) and not b.waits("k", 60.0) and b.due(60.0) == ["k"]
    assert b.clear("k") is not None and "k" not in b


def test_disk_full_reads_statvfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Full:
        f_blocks, f_frsize, f_bavail, f_files, f_favail = 1000, 4096, 3, 100, 50

    monkeypatch.setattr(os, "statvfs", lambda _p: Full())
    said = disk_full(tmp_path)
    assert said is not None and "is full" in said and str(tmp_path) in said


def test_a_job_whose_write_into_its_attempt_folder_failed_for_space_names_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attemptfs, "disk_full", lambda _p: None)  # room now: freed since
    attempt = tmp_path / "jobs" / "j" / "attempt-1"
    said = f"OSError: [Errno 28] No space left on device: '{attempt}/out/big.bin'"
    assert attemptfs.host_disk_full(attempt, said) is not None
    elsewhere = "OSError: [Errno 28] No space left on device: '/dev/shm/scratch'"
    assert attemptfs.host_disk_full(attempt, elsewhere) is None  # its own scratch space
    assert attemptfs.host_disk_full(attempt, f"wrote {attempt}/out/ok.bin") is None


def test_a_command_bundle_is_refused_with_the_rule_where_bundles_may_not_hold_commands(
    rig: Rig,
) -> None:
    """[commands] bundles = false (the default): a bundle holding a command job is
    refused into failed/, its reason naming the rule; nothing is stored."""
    assert rig.intake.commands is False  # the node's default: the refusal is the rule's
    spec = JobSpec(
        id="cmd-1",
        type="command:echo[sandbox]",
        command=CommandSpec(("echo", "hi")),
    )
    bundlewrite.write_bundle(rig.root.inbox, [spec], now=time.time())

    def results() -> list[Path]:
        return [p for p in files_in(rig.root.failed) if p.name.endswith(".zip")]

    rig.until(lambda: bool(results()), T0, "the bundle refused")
    with zipfile.ZipFile(results()[0]) as result:
        assert "[commands] bundles = false" in result.read("cmd-1/result.json").decode()
    assert rig.store.get_job("cmd-1") is None
