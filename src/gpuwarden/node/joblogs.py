"""A job's output streams, for ``gpuwarden logs`` and ``GET /v1/jobs/{id}/logs/{stream}``.

The launcher writes what an attempt prints to ``stdout.log`` and ``stderr.log``
in the attempt's folder (``<state_dir>/jobs/<job>/attempt-<N>/``). That folder
is the broker's, but what is in it was written beside a job that may be hostile
(a host job runs as the broker's user), so a stream file is only ever opened
through :func:`gpuwarden.safefs.open_file`: no link followed in any component
below ``jobs/``, never a FIFO or a device, a regular file only. It is read in
chunks of at most :data:`CHUNK` bytes: without ``follow`` up to the size it had
when it was opened (a job that keeps writing cannot make a read endless), with
``follow`` until the attempt has ended.

Where the file is not on this host (the attempt ran on another node, or a warm
server ran the job) or was refused, the copy the store kept with the attempt
(clipped to ``broker.clip_chars``, SPEC.md section 7) is what can be shown, and
:class:`Located` says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuwarden import safefs
from gpuwarden.core.model import Attempt, LaunchMode
from gpuwarden.registry import Registry

#: the streams a job has: what it printed, and the output of its image's build (a
#: job from a pinned commit; SPEC.md, "Jobs from a pinned commit")
STREAMS = ("stdout", "stderr", "build")
#: the most bytes read (and sent) at once
CHUNK = 64 * 1024
#: how long a follower waits between looks at a stream that did not grow
FOLLOW_POLL_S = 0.2
#: how often a follower asks the store whether the attempt has ended
ENDED_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class Located:
    """Where an attempt's stream can be read from.

    ``fd``: the stream file, open for reading (the caller closes it), or None.
    ``copy``: without a file, the copy kept with the attempt (may be empty).
    ``note``: why the file is not read, in words for the person who asked ("" when it is).
    ``refused``: the file is there but is not something the broker reads (a link,
    a FIFO, ...): the note says what it is.
    ``later``: no file yet, but the attempt runs here: it may appear (``follow``
    waits for it).
    """

    fd: int | None
    copy: bytes = b""
    note: str = ""
    refused: bool = False
    later: bool = False


def file_name(stream: str) -> str:
    """The stream's file in the attempt folder (``stdout.log``, ``stderr.log``,
    ``build.log``)."""
    if stream not in STREAMS:
        raise ValueError(f"no stream {stream!r}: {', '.join(STREAMS)}")
    return f"{stream}.log"


def locate(
    jobs_dir: Path,
    attempt: Attempt,
    stream: str,
    *,
    node: str,
    registry: Registry | None = None,
    job_type: str = "",
) -> Located:
    """Open ``stream`` of ``attempt`` below ``jobs_dir`` (``<state_dir>/jobs``) on
    the node named ``node`` (this host), or say why it cannot be read here."""
    name = file_name(stream)
    rel = f"{attempt.job_id}/attempt-{attempt.number}/{name}"
    kept = {"stdout": attempt.stdout, "stderr": attempt.stderr}.get(stream, "")
    copy = kept.encode("utf-8", "replace")
    kept = "; shown instead: the copy kept with the attempt (clipped)" if copy else ""
    try:
        return Located(safefs.open_file(rel, under=jobs_dir))
    except safefs.UnsafePathError as exc:
        note = f"{name} of attempt {attempt.number} {exc.why}: it is not read{kept}"
        return Located(None, copy, note, refused=True)
    except FileNotFoundError:
        pass
    ran = "runs" if attempt.ended_at is None else "ran"
    if attempt.node != node:
        note = (
            f"attempt {attempt.number} {ran} on node {attempt.node}: its {name} is in that "
            f"node's state directory{kept}"
        )
        return Located(None, copy, note)
    jobtype = registry.types.get(job_type) if registry is not None else None
    if jobtype is not None and jobtype.launch is LaunchMode.SERVE:
        note = (
            f"attempt {attempt.number} {ran} on a warm server of {jobtype.name}: a served "
            "job writes no streams of its own; the server's log has them (warm/ in the "
            f"state directory){kept}"
        )
        return Located(None, copy, note)
    if attempt.ended_at is None:
        return Located(None, later=True)
    return Located(None, copy, f"attempt {attempt.number} left no {name}{kept}")


def reopen(jobs_dir: Path, attempt: Attempt, stream: str) -> int | None:
    """The stream file once it is there (a follower waiting for a new attempt's
    file); None while it is not. A file that is not a regular one reached through
    no link raises :class:`gpuwarden.safefs.UnsafePathError`."""
    rel = f"{attempt.job_id}/attempt-{attempt.number}/{file_name(stream)}"
    try:
        return safefs.open_file(rel, under=jobs_dir)
    except FileNotFoundError:
        return None


def read_some(fd: int, left: int | None = None) -> bytes:
    """At most :data:`CHUNK` bytes from ``fd`` (at most ``left``); b"" at its end."""
    n = CHUNK if left is None else min(CHUNK, left)
    return os.read(fd, n) if n > 0 else b""


def read_all(fd: int) -> Iterator[bytes]:
    """The file's content up to the size it had now, chunk by chunk."""
    left = os.fstat(fd).st_size - os.lseek(fd, 0, os.SEEK_CUR)
    while left > 0:
        chunk = read_some(fd, left)
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def follow(
    fd: int,
    ended: Callable[[], bool],
    *,
    sleep: Callable[[float], object],
    clock: Callable[[], float],
) -> Iterator[bytes]:
    """The file's content, then what is written to it, until ``ended()`` says the
    attempt has ended (what was written up to then included). ``ended`` is asked
    at most every :data:`ENDED_EVERY_S` while the file does not grow."""
    next_check = 0.0
    while True:
        chunk = read_some(fd)
        if chunk:
            yield chunk
            continue
        now = clock()
        if now >= next_check:
            if ended():
                yield from read_all(fd)
                return
            next_check = now + ENDED_EVERY_S
        if os.fstat(fd).st_size < os.lseek(fd, 0, os.SEEK_CUR):  # truncated: go on at its end
            os.lseek(fd, 0, os.SEEK_END)
        sleep(FOLLOW_POLL_S)
