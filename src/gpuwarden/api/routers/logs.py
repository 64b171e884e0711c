"""A job's output streams: ``GET /v1/jobs/{id}/logs/{stream}`` (what `gpuwarden logs` shows).

The same role rules as the other job routes (action ``job.read``): a submitter
reads its own jobs' streams only, and another's job is the 404 of a job that does
not exist. The stream file is opened through :mod:`gpuwarden.node.joblogs` (safefs:
no link, no FIFO, regular files only) and sent in chunks; with ``follow`` the
answer goes on until the attempt has ended. At most :data:`MAX_FOLLOWERS`
answers follow a stream at once (429 past that)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from gpuwarden import safefs
from gpuwarden.api.auth import Principal, Scope
from gpuwarden.api.context import ApiContext, action, get_ctx, get_principal, get_scope
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import ErrorOut
from gpuwarden.api.routers.jobs import visible_job
from gpuwarden.cluster import logcopy
from gpuwarden.core.model import Attempt, Job
from gpuwarden.node import joblogs

log = logging.getLogger(__name__)

router = APIRouter(tags=["jobs"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]
Access = Annotated[Scope, Depends(get_scope)]

#: how many answers of one API process may follow a stream at once
MAX_FOLLOWERS = 32
#: headers of a stream's answer: the attempt it is of, and why the file is not sent
ATTEMPT_HEADER = "X-Gpuwarden-Attempt"
NOTE_HEADER = "X-Gpuwarden-Note"
REFUSED_HEADER = "X-Gpuwarden-Refused"

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 422, 429)
}


class _Slots:
    """How many answers follow a stream now, of at most ``most``."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.used = 0
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.used >= self.most:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self.lock:
            self.used -= 1


FOLLOWERS = _Slots(MAX_FOLLOWERS)


class _Open:
    """A stream file being sent (and, when followed, its slot): closed once,
    by the body when it ends or by the answer's background task when the body
    never ran (a client that went away first)."""

    def __init__(self, fd: int | None, *, slot: bool) -> None:
        self.fd = fd
        self.slot = slot
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        if self.slot:
            FOLLOWERS.give()


def not_started(job: Job) -> str:
    """What to say of a job that has no attempt (the CLI says the same)."""
    if job.state.terminal:
        return f"job {job.id} ended ({job.state.value}) without starting: it has no output"
    return (
        f"job {job.id} is {job.state.value} and has not started: no output yet "
        f"(`gpuwarden logs --follow {job.id}` waits for it; `gpuwarden explain {job.id}` "
        "says why it waits)"
    )


def pick_attempt(job: Job, attempts: list[Attempt], number: int | None) -> Attempt:
    """Attempt ``number`` of the job (default: its latest); :class:`HttpError` 409
    when it has none yet, 404 when it has no such attempt."""
    if not attempts:
        raise HttpError(409, not_started(job))
    if number is None:
        return attempts[-1]
    for a in attempts:
        if a.number == number:
            return a
    have = ", ".join(str(a.number) for a in attempts)
    raise HttpError(404, f"job {job.id} has no attempt {number} (its attempts: {have})")


def _header_text(text: str) -> str:
    """A header value: ASCII only (escapes for the rest), one line."""
    return " ".join(text.encode("ascii", "backslashreplace").decode("ascii").split())


@router.get(
    "/v1/jobs/{job_id}/logs/{stream}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
)
@action("job.read")
async def job_logs(
    job_id: str,
    stream: Literal["stdout", "stderr", "build"],
    *,
    ctx: Ctx,
    who: Who,
    access: Access,
    attempt: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="the attempt (default: the latest)")
    ] = None,
    follow: Annotated[
        bool, Query(description="go on sending what it writes until the attempt has ended")
    ] = False,
) -> StreamingResponse:
    """What an attempt of the job wrote on ``stdout`` or ``stderr``, or ``build``:
    the output of its image's build (a job from a pinned commit), as `gpuwarden
    logs`, as bytes. When the file is not on this host, or is not a regular file
    reached through no link, the copy kept with the attempt (clipped, possibly
    empty) is sent instead and the ``X-Gpuwarden-Note`` header says why
    (``X-Gpuwarden-Refused: true`` when the file was refused). A job that has not
    started: 409."""
    job = await run_in_threadpool(visible_job, ctx, who, access, job_id)
    attempts = await run_in_threadpool(ctx.store.attempts, job.id)
    chosen = pick_attempt(job, attempts, attempt)
    jobs_dir = ctx.config.state_dir / "jobs"
    where = await run_in_threadpool(
        joblogs.locate,
        jobs_dir,
        chosen,
        stream,
        node=ctx.config.node_name,
        registry=ctx.registry,
        job_type=job.type,
    )
    headers = {ATTEMPT_HEADER: str(chosen.number), "X-Content-Type-Options": "nosniff"}
    if where.note:
        headers[NOTE_HEADER] = _header_text(where.note)
    if where.refused:
        headers[REFUSED_HEADER] = "true"
    media = "application/octet-stream"
    copy = logcopy.log_path(ctx.config.state_dir / "logs", job.id, chosen.number, stream)
    elsewhere = where.fd is None and chosen.node != ctx.config.node_name and not where.refused
    if elsewhere and (logcopy.kept(copy) or (follow and chosen.ended_at is None)):
        return _from_copy(ctx, chosen, copy, follow=follow, headers=headers)
    if where.fd is None and not (follow and where.later):
        return StreamingResponse(iter([where.copy]), media_type=media, headers=headers)
    if not follow:
        assert where.fd is not None
        opened = _Open(where.fd, slot=False)
        return StreamingResponse(
            _whole(opened),
            media_type=media,
            headers=headers,
            background=BackgroundTask(opened.close),
        )
    if not FOLLOWERS.take():
        if where.fd is not None:
            os.close(where.fd)
        raise HttpError(
            429,
            f"{MAX_FOLLOWERS} streams are being followed already: try again later, "
            "or read the stream without follow",
            {"Retry-After": "5"},
        )
    opened = _Open(where.fd, slot=True)
    return StreamingResponse(
        _follow(ctx, chosen, stream, opened),
        media_type=media,
        headers=headers,
        background=BackgroundTask(opened.close),
    )


def _from_copy(
    ctx: ApiContext, attempt: Attempt, path: Path, *, follow: bool, headers: dict[str, str]
) -> StreamingResponse:
    """The stream as its node sent it while it ran (SPEC.md, section 16)."""
    bound = int(ctx.config.api.max_log_mib * (1 << 20))
    headers = {**headers, NOTE_HEADER: f"attempt {attempt.number} runs on node {attempt.node}: "
               "shown: what it sent of the stream"}  # fmt: skip
    if not follow:
        return StreamingResponse(
            _copy_once(path, bound), media_type="application/octet-stream", headers=headers
        )
    if not FOLLOWERS.take():
        raise HttpError(429, f"{MAX_FOLLOWERS} streams are being followed already",
                        {"Retry-After": "5"})  # fmt: skip
    opened = _Open(None, slot=True)

    def body() -> Iterator[bytes]:
        try:
            yield from logcopy.follow(path, lambda: _ended(ctx, attempt), bound=bound)
        finally:
            opened.close()

    return StreamingResponse(
        body(),
        media_type="application/octet-stream",
        headers=headers,
        background=BackgroundTask(opened.close),
    )


def _copy_once(path: Path, bound: int) -> Iterator[bytes]:
    pos = 0
    while True:
        chunk, pos = logcopy.read(path, pos, bound=bound)
        if not chunk:
            return
        yield chunk


def _whole(opened: _Open) -> Iterator[bytes]:
    """The file up to the size it had when opened, then it is closed."""
    try:
        assert opened.fd is not None
        yield from joblogs.read_all(opened.fd)
    finally:
        opened.close()


def _ended(ctx: ApiContext, attempt: Attempt) -> bool:
    job = ctx.store.get_job(attempt.job_id)
    if job is None or job.state.terminal:
        return True
    for a in ctx.store.attempts(attempt.job_id):
        if a.number == attempt.number:
            return a.ended_at is not None
    return True


async def _follow(
    ctx: ApiContext, attempt: Attempt, stream: str, opened: _Open
) -> AsyncIterator[bytes]:
    """The stream as it grows, until the attempt has ended. Waits on the event
    loop (``anyio.sleep``), so a client that goes away ends it at once; each read
    and each look at the store runs on a worker thread."""
    jobs_dir = ctx.config.state_dir / "jobs"
    try:
        while opened.fd is None:  # the attempt runs here but its file is not there yet
            try:
                opened.fd = await run_in_threadpool(joblogs.reopen, jobs_dir, attempt, stream)
            except safefs.UnsafePathError as exc:  # what appeared is not read; the answer ends
                log.warning("not following %s of %s: %s", stream, attempt.job_id, exc)
                return
            if opened.fd is None:
                if await run_in_threadpool(_ended, ctx, attempt):
                    return
                await anyio.sleep(joblogs.ENDED_EVERY_S)
        fd = opened.fd
        next_check = 0.0
        ended = False
        while True:
            chunk = await run_in_threadpool(joblogs.read_some, fd)
            if chunk:
                yield chunk
                continue
            if ended:  # read to the end after the attempt ended: done
                return
            now = time.monotonic()
            if now >= next_check:
                ended = await run_in_threadpool(_ended, ctx, attempt)
                next_check = now + joblogs.ENDED_EVERY_S
                if ended:
                    continue  # what it wrote last is read before the answer ends
            await anyio.sleep(joblogs.FOLLOW_POLL_S)
    finally:
        opened.close()
