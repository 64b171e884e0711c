"""Waiting for a job's end inside one request: the ``wait`` of ``POST /v1/jobs``
and of ``GET /v1/jobs/{id}/result`` (a long poll, SPEC.md section 15).

The wait runs on the event loop, not on a worker thread, so a waiting request
holds no thread. When the API runs in the broker's process (``serve --api``),
the broker's loop says when an attempt of the job has ended
(:class:`gpuwarden.node.jobends.JobEnds`) and the answer goes out at once; the
store is still read now and then (every :data:`NOTIFIED_POLL_S`), for the ends
no attempt announces (a job the plan failed, a queued job cancelled). Where no
broker runs in the process (a coordinator, whose jobs run on agents) the store
is read with a backoff from :data:`FIRST_POLL_S` to :data:`MAX_POLL_S`.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from starlette.concurrency import run_in_threadpool

from gpuwarden.api.context import ApiContext
from gpuwarden.api.errors import HttpError
from gpuwarden.core.model import Job
from gpuwarden.intake.service import result_json

#: the longest wait one request may ask for (seconds)
MAX_WAIT_S = 60.0
#: without a broker in this process: the first look at the store after the
#: first, doubling up to :data:`MAX_POLL_S`
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.25
#: with a broker in this process: how often the store is read anyway
NOTIFIED_POLL_S = 1.0
#: after the broker said an attempt ended but the store shows the job not ended
#: (it was queued again for a retry, or the end is not visible yet): look again
#: this soon, doubling
AFTER_WAKE_POLL_S = 0.001


def parse_wait(text: str | None) -> float | None:
    """The ``wait`` query parameter as seconds (None when absent). A 422 that says
    what is allowed for anything but a number from 0 to :data:`MAX_WAIT_S`."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_WAIT_S):
        raise HttpError(
            422,
            f"wait must be a number of seconds from 0 to {MAX_WAIT_S:g} (how long the "
            f"request waits for the job to end), not {text[:40]!r}",
        )
    return seconds


Ended = tuple[Job | None, dict[str, Any] | None]


def look(ctx: ApiContext, job_id: str) -> Ended:
    """The job, and its result.json when it has ended (one trip to a worker thread)."""
    job = ctx.store.get_job(job_id)
    if job is None or not job.state.terminal:
        return job, None
    return job, result_json(job, ctx.store.attempts(job.id))


async def until_ended(ctx: ApiContext, job_id: str, seconds: float) -> Ended:
    """The job and its result.json once it has ended, or the job as it is after
    ``seconds`` and None (the job None: it is gone from the store). Waits on the
    event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    woken = asyncio.Event()
    unwatch = None
    if ctx.ends is not None:  # watched before the first look: no end slips between

        def wake() -> None:
            loop.call_soon_threadsafe(woken.set)

        unwatch = ctx.ends.watch(job_id, wake)
    # watched: the broker says when to look, and the store is read every
    # NOTIFIED_POLL_S anyway; else a backoff from FIRST_POLL_S to MAX_POLL_S
    slowest = NOTIFIED_POLL_S if unwatch is not None else MAX_POLL_S
    delay = slowest if unwatch is not None else FIRST_POLL_S
    try:
        while True:
            job, result = await run_in_threadpool(look, ctx, job_id)
            left = deadline - loop.time()
            if job is None or result is not None or left <= 0:
                return job, result
            try:
                await asyncio.wait_for(woken.wait(), min(delay, left))
            except TimeoutError:
                delay = min(delay * 2, slowest)
            else:
                woken.clear()
                delay = AFTER_WAKE_POLL_S
    finally:
        if unwatch is not None:
            unwatch()
