"""QueueRoot: opening, picking up whole bundles, claiming and moving them."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.errors import BundleError, QueueRootError
from gpuwarden.intake.queueroot import SUBFOLDERS, QueueRoot


def touch(path: Path, mtime: float | None = None, data: bytes = b"PK") -> Path:
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def qr(tmp_path: Path) -> QueueRoot:
    return QueueRoot.open(tmp_path / "q", create=True)


# --- open ----------------------------------------------------------------------------


def test_create_makes_root_and_subfolders(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "q"
    qr = QueueRoot.open(root, create=True)
    assert qr.path == root
    for sub in SUBFOLDERS:
        assert (root / sub).is_dir()
    assert (qr.inbox, qr.processing, qr.outbox, qr.failed) == tuple(root / s for s in SUBFOLDERS)
    for sub in SUBFOLDERS:  # the probe files are gone again
        assert list((root / sub).iterdir()) == []


def test_create_fills_in_missing_subfolders_and_keeps_content(tmp_path: Path) -> None:
    root = tmp_path / "q"
    (root / "inbox").mkdir(parents=True)
    touch(root / "inbox" / "a.zip")
    QueueRoot.open(root, create=True)
    assert (root / "inbox" / "a.zip").exists()
    assert all((root / s).is_dir() for s in SUBFOLDERS)


def test_open_existing_without_create(qr: QueueRoot) -> None:
    again = QueueRoot.open(qr.path, create=False)
    assert again == qr


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(QueueRootError, match=r"queue root .*/nope does not exist; create it"):
        QueueRoot.open(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()


def test_missing_subfolder_without_create(tmp_path: Path) -> None:
    root = tmp_path / "q"
    root.mkdir()
    for sub in ("inbox", "processing", "outbox"):
        (root / sub).mkdir()
    with pytest.raises(
        QueueRootError,
        match=r"queue root .*/q: folder .*/q/failed is missing; create it.*create_queue_roots",
    ):
        QueueRoot.open(root, create=False)


def test_root_is_a_file(tmp_path: Path) -> None:
    touch(tmp_path / "q")
    for create in (False, True):
        with pytest.raises(QueueRootError, match=r"/q is not a directory"):
            QueueRoot.open(tmp_path / "q", create=create)


@pytest.mark.parametrize("create", [False, True])
def test_inbox_is_a_regular_file(qr: QueueRoot, create: bool) -> None:
    qr.inbox.rmdir()
    touch(qr.inbox)
    with pytest.raises(
        QueueRootError, match=r"queue root .*/q: .*/q/inbox is not a directory; move it away"
    ):
        QueueRoot.open(qr.path, create=create)
    assert qr.inbox.is_file()  # left as it was


def test_not_writable_by_permissions(qr: QueueRoot) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: permission bits do not stop root from writing")
    qr.outbox.chmod(0o500)
    try:
        with pytest.raises(QueueRootError, match=r"folder .*/outbox is not writable"):
            QueueRoot.open(qr.path, create=False)
    finally:
        qr.outbox.chmod(0o755)


def test_not_writable_probe_fails(qr: QueueRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.access says yes (as for root, or on some shares) but a write fails: the probe
    file catches it."""
    real_open = os.open

    def read_only_fs(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if Path(path).parent == qr.processing and flags & os.O_CREAT:
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", read_only_fs)
    with pytest.raises(
        QueueRootError,
        match=r"folder .*/processing is not writable \(Read-only file system\); fix its",
    ):
        QueueRoot.open(qr.path, create=False)
    assert list(qr.processing.iterdir()) == []


def test_not_writable_access_check(qr: QueueRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != qr.failed)
    with pytest.raises(QueueRootError, match=r"folder .*/failed is not writable; fix"):
        QueueRoot.open(qr.path, create=False)


# --- pending -----------------------------------------------------------------------


def test_pending_skips_temp_names_and_non_bundles(qr: QueueRoot) -> None:
    t = time.time() - 100
    touch(qr.inbox / "b.zip", t + 2)
    touch(qr.inbox / "a.zip", t + 1)
    touch(qr.inbox / "c.ZIP", t + 3)
    for name in (".hidden.zip", ".x.zip.tmp", "x.zip.tmp", "x.zip.part", "notes.txt", "zip"):
        touch(qr.inbox / name, t)
    (qr.inbox / "dir.zip").mkdir()
    (qr.inbox / "link.zip").symlink_to(qr.inbox / "a.zip")
    assert [p.name for p in qr.pending()] == ["a.zip", "b.zip", "c.ZIP"]
    assert all(p.parent == qr.inbox for p in qr.pending())


def test_pending_orders_by_mtime_then_name(qr: QueueRoot) -> None:
    t = time.time() - 100
    touch(qr.inbox / "z.zip", t)
    touch(qr.inbox / "y.zip", t)
    touch(qr.inbox / "a.zip", t + 5)
    assert [p.name for p in qr.pending()] == ["y.zip", "z.zip", "a.zip"]


def test_pending_empty(qr: QueueRoot) -> None:
    assert qr.pending() == []


# --- claim and moves ------------------------------------------------------------------


def test_claim_moves_to_processing(qr: QueueRoot) -> None:
    src = touch(qr.inbox / "a.zip", data=b"content")
    dst = qr.claim(src)
    assert dst == qr.processing / "a.zip"
    assert dst.read_bytes() == b"content"
    assert not src.exists()
    assert qr.pending() == []


def test_claim_duplicate_name(qr: QueueRoot) -> None:
    touch(qr.inbox / "a.zip", data=b"first")
    qr.claim(qr.inbox / "a.zip")
    touch(qr.inbox / "a.zip", data=b"second")
    with pytest.raises(BundleError, match=r"bundle a.zip: duplicate bundle name"):
        qr.claim(qr.inbox / "a.zip")
    assert (qr.processing / "a.zip").read_bytes() == b"first"  # never clobbered
    assert (qr.inbox / "a.zip").read_bytes() == b"second"  # left for the caller to reject
    failed = qr.move_to_failed(qr.inbox / "a.zip")
    assert failed == qr.failed / "a.zip" and failed.read_bytes() == b"second"


def test_claim_gone(qr: QueueRoot) -> None:
    with pytest.raises(FileNotFoundError):
        qr.claim(qr.inbox / "gone.zip")


def test_move_to_failed_with_name_and_remove(qr: QueueRoot) -> None:
    touch(qr.inbox / "a.zip")
    p = qr.claim(qr.inbox / "a.zip")
    moved = qr.move_to_failed(p, "a-renamed.zip")
    assert moved == qr.failed / "a-renamed.zip" and moved.exists() and not p.exists()

    touch(qr.inbox / "b.zip")
    qr.claim(qr.inbox / "b.zip")
    qr.remove_from_processing("b.zip")
    assert not (qr.processing / "b.zip").exists()
    qr.remove_from_processing("b.zip")  # already gone: fine


def test_moves_stay_inside_the_root(qr: QueueRoot, tmp_path: Path) -> None:
    outside = touch(tmp_path / "elsewhere.zip")
    with pytest.raises(ValueError, match="not in a folder of queue root"):
        qr.move_to_failed(outside)
    touch(qr.inbox / "a.zip")
    with pytest.raises(ValueError, match="not a plain file name"):
        qr.move_to_failed(qr.inbox / "a.zip", "../a.zip")
    with pytest.raises(ValueError, match="not a plain file name"):
        qr.remove_from_processing("../inbox/a.zip")
    assert (qr.inbox / "a.zip").exists()


# --- depth and waiting -----------------------------------------------------------------


def test_depth(qr: QueueRoot) -> None:
    assert qr.depth() == {"inbox": 0, "processing": 0, "outbox": 0, "failed": 0}
    for name in ("a.zip", "b.zip", "c.zip", ".d.zip.tmp", "e.zip.part"):
        touch(qr.inbox / name)
    qr.claim(qr.inbox / "a.zip")
    touch(qr.outbox / "x.zip")
    touch(qr.outbox / ".x2.zip.tmp")
    touch(qr.failed / "y.zip")
    touch(qr.failed / "y.txt")
    assert qr.depth() == {"inbox": 2, "processing": 1, "outbox": 1, "failed": 1}


def test_wait_for_result_times_out(qr: QueueRoot) -> None:
    start = time.monotonic()
    assert qr.wait_for_result("a.zip", timeout_s=0.05, poll_s=0.01) is None
    assert time.monotonic() - start < 1.0


def test_wait_for_result_finds_existing(qr: QueueRoot) -> None:
    touch(qr.failed / "a.zip")
    assert qr.wait_for_result("a.zip", timeout_s=0) == qr.failed / "a.zip"
    touch(qr.outbox / "a.zip")
    assert qr.wait_for_result("a.zip", timeout_s=0) == qr.outbox / "a.zip"  # outbox first


def test_wait_for_result_sees_a_later_result(qr: QueueRoot) -> None:
    def deliver() -> None:
        touch(qr.outbox / ".a.zip.tmp")
        (qr.outbox / ".a.zip.tmp").replace(qr.outbox / "a.zip")

    timer = threading.Timer(0.05, deliver)
    timer.start()
    try:
        got = qr.wait_for_result("a.zip", timeout_s=5, poll_s=0.01)
    finally:
        timer.join()
    assert got == qr.outbox / "a.zip"


def test_wait_for_result_ignores_directories(qr: QueueRoot) -> None:
    (qr.outbox / "a.zip").mkdir()
    assert qr.wait_for_result("a.zip", timeout_s=0) is None


# --- hostile entries and names -----------------------------------------------------------


def test_arrivals_list_every_kind_without_opening_anything(qr: QueueRoot) -> None:
    """A FIFO, a folder, a link and a socket with a bundle's name are listed with
    what they are (the caller refuses them); only regular files are pending."""
    import socket

    t = time.time() - 100
    touch(qr.inbox / "a.zip", t)
    os.mkfifo(qr.inbox / "fifo.zip")
    (qr.inbox / "dir.zip").mkdir()
    (qr.inbox / "link.zip").symlink_to("/dev/zero")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(qr.inbox / "sock.zip"))
        assert stat.S_ISFIFO(os.lstat(qr.inbox / "fifo.zip").st_mode)
        assert stat.S_ISSOCK(os.lstat(qr.inbox / "sock.zip").st_mode)
        kinds = {a.name: a.kind for a in qr.arrivals()}
    assert kinds == {
        "a.zip": "file",
        "fifo.zip": "fifo",
        "dir.zip": "folder",
        "link.zip": "symlink",
        "sock.zip": "socket",
    }
    assert [p.name for p in qr.pending()] == ["a.zip"]


def test_a_fifo_is_claimed_by_rename_without_blocking(qr: QueueRoot) -> None:
    fifo = qr.inbox / "f.zip"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    claimed = qr.claim(fifo)  # a rename: a FIFO is never opened (this would block)
    assert stat.S_ISFIFO(os.lstat(claimed).st_mode)
    assert [(a.name, a.kind) for a in qr.in_processing()] == [("f.zip", "fifo")]


@pytest.mark.parametrize(
    "raw",
    [b"back\\slash.zip", b"new\nline.zip", b"-rf.zip", b" spaced out .zip", b"caf\xe9.zip"],
)
def test_any_name_the_file_system_takes_can_be_claimed(qr: QueueRoot, raw: bytes) -> None:
    name = os.fsdecode(raw)
    touch(qr.inbox / name)
    assert [a.name for a in qr.arrivals()] == [name]
    assert qr.claim(qr.inbox / name) == qr.processing / name
    assert os.listdir(os.fsencode(qr.processing)) == [raw]


def test_upper_case_zip_is_found_in_processing_too(qr: QueueRoot) -> None:
    touch(qr.inbox / "UPPER.ZIP")
    qr.claim(qr.inbox / "UPPER.ZIP")
    assert [a.name for a in qr.in_processing()] == ["UPPER.ZIP"]
    assert qr.depth()["processing"] == 1


def test_move_to_failed_never_replaces(qr: QueueRoot) -> None:
    touch(qr.failed / "x.zip.input", data=b"earlier")
    touch(qr.inbox / "x.zip", data=b"later")
    moved = qr.move_to_failed(qr.inbox / "x.zip", "x.zip.input")
    assert moved != qr.failed / "x.zip.input" and moved.name.startswith("x.zip.input-")
    assert (qr.failed / "x.zip.input").read_bytes() == b"earlier"
    assert moved.read_bytes() == b"later"


def test_kept_inputs_and_reasons_are_not_counted_as_bundles(qr: QueueRoot) -> None:
    for name in ("a.zip", "a.zip.input", "a.zip.reason.txt", "a.zip.duplicate-1-abcdef"):
        touch(qr.failed / name)
    assert qr.depth()["failed"] == 1


def test_result_of_sees_anything_of_that_name(qr: QueueRoot) -> None:
    assert qr.result_of("a.zip") is None
    (qr.failed / "a.zip").symlink_to("/nonexistent")
    assert qr.result_of("a.zip") == qr.failed / "a.zip"
    touch(qr.outbox / "a.zip")
    assert qr.result_of("a.zip") == qr.outbox / "a.zip"


def test_own_temporaries_are_removed_and_nothing_else(qr: QueueRoot) -> None:
    touch(qr.outbox / ".gw-0123456789abcdef.tmp")
    touch(qr.failed / ".gw-fedcba9876543210.tmp")
    touch(qr.outbox / "a.zip")
    touch(qr.inbox / ".gw-client.tmp")  # inbox/ belongs to the clients
    (qr.failed / ".gw-dir.tmp").mkdir()
    removed = qr.remove_own_temporaries()
    assert sorted(Path(p).name for p in removed) == [
        ".gw-0123456789abcdef.tmp",
        ".gw-fedcba9876543210.tmp",
    ]
    assert (qr.outbox / "a.zip").exists() and (qr.inbox / ".gw-client.tmp").exists()
    assert (qr.failed / ".gw-dir.tmp").is_dir()
