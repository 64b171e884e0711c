"""The coordinator's copy of a running attempt's output streams, sent by its agent.

While a job runs on an agent, the agent sends the new bytes of each stream
(``stdout``, ``stderr``, ``build``) in chunks of at most :data:`MAX_CHUNK`, each
with its byte offset in the stream (``POST /v1/node/jobs/{id}/logs/{stream}``).
The coordinator keeps them in ``<state_dir>/logs/<job>/attempt-<N>/<stream>.log``:
names it makes itself (the job id checked, the attempt its lease's, the stream
one of :data:`STREAMS`), never a name or path of the agent's.

The append rule (:func:`append`): bytes before what was received already are
taken as sent again (a retried chunk is not doubled); a chunk that starts past it
is refused (:class:`Gap`, with the offset to send from). The copy holds at most
``bound`` bytes: past that its oldest part is cut (to 3/4 of the bound), and
what is read from its head (:func:`read`) says how many bytes were cut.

The file starts with a header of :data:`HEADER_LEN` bytes giving the number of
bytes cut; a cut writes a new file and renames it into place, so a reader sees
the old copy or the new one, never half of each.

Copies do not stay for good: :func:`prune` (the coordinator's sweeper, every
:data:`PRUNE_EVERY_S`) removes an attempt's copies once the attempt has ended
and none of them was written for ``[api] log_keep_days``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuwarden import safefs

#: the streams an agent may send
STREAMS = ("stdout", "stderr", "build")
#: the most bytes one request may carry
MAX_CHUNK = 64 * 1024
#: the header: how many bytes of the stream were cut from the head
HEADER_FMT = "gpuwarden-log cut=%020d\n"
HEADER_LEN = len(HEADER_FMT % 0)
#: how long a follower waits between looks at a copy that did not grow
FOLLOW_POLL_S = 0.2
#: how often the coordinator looks for copies to remove
PRUNE_EVERY_S = 600.0


class Gap(Exception):
    """A chunk that starts past what was received: send from ``offset``."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the copy has {offset} bytes: send from there")
        self.offset = offset


def log_path(root: Path, job_id: str, attempt: int, stream: str) -> Path:
    """The copy's file below ``root`` (``<state_dir>/logs``)."""
    if stream not in STREAMS:
        raise ValueError(f"no stream {stream!r}: {', '.join(STREAMS)}")
    return root / job_id / f"attempt-{int(attempt)}" / f"{stream}.log"


def _cut_of(fd: int) -> int:
    head = os.pread(fd, HEADER_LEN, 0)
    if len(head) < HEADER_LEN:
        return 0
    return int(head.split(b"=", 1)[1])


def received(path: Path) -> int:
    """How many bytes of the stream the copy has received (0: none yet)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    try:
        return _cut_of(fd) + max(0, os.fstat(fd).st_size - HEADER_LEN)
    finally:
        os.close(fd)


def append(path: Path, offset: int, data: bytes, *, bound: int) -> int:
    """Take ``data``, which starts at byte ``offset`` of the stream; the bytes
    received now. Raises :class:`Gap` when ``offset`` is past them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = received(path)
        if offset > have:
            raise Gap(have)
        new = data[have - offset :]
        if new:
            _write(path, new)
            if path.stat().st_size - HEADER_LEN > bound:
                _cut(path, keep=max(1, bound * 3 // 4))
        return have + len(new)
    finally:
        os.close(lock)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size == 0:
            os.write(fd, (HEADER_FMT % 0).encode())
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _cut(path: Path, *, keep: int) -> None:
    """Keep the last ``keep`` bytes: a new file renamed into place."""
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    tmp = path.with_name(f".{secrets.token_hex(6)}.part")
    try:
        size = os.fstat(src).st_size - HEADER_LEN
        drop = max(0, size - keep)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(out, (HEADER_FMT % (_cut_of(src) + drop)).encode())
            pos = HEADER_LEN + drop
            while chunk := os.pread(src, 1 << 20, pos):
                os.write(out, chunk)
                pos += len(chunk)
        finally:
            os.close(out)
        tmp.replace(path)
    finally:
        os.close(src)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def cut_note(cut: int, bound: int) -> bytes:
    """What the head of a cut copy says."""
    return (
        f"[gpuwarden: the first {cut} bytes of this stream were cut: the coordinator keeps "
        f"at most {bound} bytes of it]\n"
    ).encode()


def read(path: Path, start: int, *, bound: int) -> tuple[bytes, int]:
    """At most :data:`MAX_CHUNK` bytes of the copy from byte ``start`` of the stream,
    and where to read next. From before what is kept: the note of the cut first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return b"", start
    try:
        cut = _cut_of(fd)
        note = b""
        if start < cut:
            note, start = cut_note(cut, bound), cut
        data = os.pread(fd, MAX_CHUNK, HEADER_LEN + start - cut)
        return note + data, start + len(data)
    finally:
        os.close(fd)


def kept(path: Path) -> bool:
    """Whether the coordinator has a copy of this stream."""
    return path.is_file() and not path.is_symlink()


def follow(
    path: Path,
    ended: Callable[[], bool],
    *,
    bound: int,
    sleep: Callable[[float], object] = time.sleep,
) -> Iterator[bytes]:
    """The copy, then what comes, until ``ended()`` (what came up to then included)."""
    pos = 0
    done = False
    while True:
        chunk, pos = read(path, pos, bound=bound)
        if chunk:
            yield chunk
            continue
        if done:
            return
        done = ended()
        if not done:
            sleep(FOLLOW_POLL_S)


def prune(root: Path, *, now: float, keep_s: float, ended: Callable[[str, int], bool]) -> int:
    """Remove the copies below ``root`` of each attempt that ``ended(job id,
    attempt)`` says has ended and that were all last written ``keep_s`` or more
    before ``now``; a job's folder goes with its last attempt. How many attempts'
    copies went. The folders are the coordinator's own (named by it), removed
    without following a link all the same."""
    gone = 0
    try:
        jobs = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return 0
    for job in jobs:
        for folder in sorted(job.glob("attempt-*")):
            number = folder.name.removeprefix("attempt-")
            if not number.isdigit() or folder.is_symlink() or not folder.is_dir():
                continue
            newest = max((f.lstat().st_mtime for f in folder.iterdir()), default=0.0)
            if now - newest < keep_s or not ended(job.name, int(number)):
                continue
            safefs.remove_tree(folder)
            gone += 1
        with contextlib.suppress(OSError):  # not empty: attempts kept
            job.rmdir()
    return gone
