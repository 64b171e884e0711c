"""The event stream: ``GET /v1/events`` as server-sent events (SPEC.md, section 15).

Each event goes out as ``id: <event id>``, ``event: <kind>`` and one line of
JSON (:func:`gpuwarden.api.eventfeed.as_json`). The stream starts after the
``Last-Event-ID`` header (what a browser's ``EventSource`` sends when it
reconnects), else after ``?after=ID``, else at the newest event (only what
happens from now on); it first sends ``retry:`` and an ``id:`` line with the
cursor it starts from, so a client that reconnects before any event arrived
resumes there too. While the filter skips events, an ``id:`` line with the
heartbeat (``: keep-alive`` every :data:`HEARTBEAT_S`) moves the client's cursor
past them.

The same role rules as the job routes (action ``events.read``): a submitter gets
only the events of its own jobs (:mod:`gpuwarden.api.eventfeed`). The stream
waits on the event loop; the store is asked for the newest event id at most
every :data:`POLL_S` for all streams of the app together, and each stream reads
events (on a worker thread, :data:`eventfeed.BATCH` at a time) only when there
are new ones. So an idle stream holds no thread and no store connection. At most
:data:`MAX_PER_TOKEN` streams per token and :data:`MAX_STREAMS` in all (429 past
that), of which submitters' tokens never hold the last :data:`KEPT_FOR_STAFF`. A
stream ends when its client goes away, and within :data:`POLL_S` of the server
being told to stop (:func:`stop_when`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from gpuwarden.api.auth import Principal, Scope
from gpuwarden.api.context import ApiContext, action, get_ctx, get_principal, get_scope
from gpuwarden.api.errors import HttpError
from gpuwarden.api.eventfeed import TYPE_NAME, BadCursor, EventFeed, EventFilter, parse_cursor
from gpuwarden.api.eventfeed import sse_block as block
from gpuwarden.api.models import ErrorOut
from gpuwarden.api.routers.jobs import visible_job
from gpuwarden.core.model import Role

log = logging.getLogger(__name__)

router = APIRouter(tags=["events"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]
Access = Annotated[Scope, Depends(get_scope)]

#: how often the store is asked whether there is a new event (seconds)
POLL_S = 0.25
#: a comment line at least this often, so that proxies keep the connection
HEARTBEAT_S = 15.0
#: how long a browser waits before it reconnects (milliseconds; the ``retry:`` field)
RETRY_MS = 2000
#: streams one token may hold open at once, and one API process in all
MAX_PER_TOKEN = 8
MAX_STREAMS = 128
#: of :data:`MAX_STREAMS`, the places submitters' tokens never take: many tenants
#: holding every stream must not lock the owner and operators out of theirs
KEPT_FOR_STAFF = 32

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (400, 401, 403, 404, 422, 429)
}


class Streams:
    """The open streams of one app: how many per token, the newest event id
    (read at most every :data:`POLL_S` for them all) and whether the server stops."""

    def __init__(self) -> None:
        self.per_token: dict[str, int] = {}
        self.total = 0
        #: of ``total``, the streams of submitters' tokens
        self.tenants = 0
        self.latest = 0
        self._read_at = -POLL_S
        #: True once the server is stopping: every stream ends
        self.stopping: Callable[[], bool] = lambda: False

    # everything here runs on the app's event loop: no lock is needed
    def take(self, token_id: str, *, tenant: bool) -> str | None:
        """Count one more stream for ``token_id`` (``tenant``: a submitter's, kept
        out of the last :data:`KEPT_FOR_STAFF` places); why not, when it is over a
        limit."""
        if self.per_token.get(token_id, 0) >= MAX_PER_TOKEN:
            return (
                f"this token has {MAX_PER_TOKEN} event streams open already: close one "
                "(each browser tab or `gpuwarden events --follow` holds one)"
            )
        if self.total >= MAX_STREAMS or (tenant and self.tenants >= MAX_STREAMS - KEPT_FOR_STAFF):
            return f"{MAX_STREAMS} event streams are open already: try again later"
        self.per_token[token_id] = self.per_token.get(token_id, 0) + 1
        self.total += 1
        self.tenants += tenant
        return None

    def give(self, token_id: str, *, tenant: bool) -> None:
        left = self.per_token.get(token_id, 0) - 1
        if left > 0:
            self.per_token[token_id] = left
        else:
            self.per_token.pop(token_id, None)
        self.total -= 1
        self.tenants -= tenant

    async def newest(self, ctx: ApiContext) -> int:
        """The newest event id, at most :data:`POLL_S` old."""
        now = time.monotonic()
        if now - self._read_at >= POLL_S:
            self._read_at = now
            self.latest = await run_in_threadpool(ctx.store.last_event_id)
        return self.latest


def streams_of(app: FastAPI) -> Streams:
    found = getattr(app.state, "gw_event_streams", None)
    if not isinstance(found, Streams):
        found = Streams()
        app.state.gw_event_streams = found
    return found


def stop_when(app: FastAPI, stopping: Callable[[], bool]) -> None:
    """End every stream of ``app`` once ``stopping()`` is true (the server that
    serves it is shutting down: it would otherwise wait for them to end)."""
    streams_of(app).stopping = stopping


class _Slot:
    """One stream's place in :class:`Streams`, given back once: by the stream when it
    ends, or by the answer's background task when the stream never ran."""

    def __init__(self, streams: Streams, token_id: str, *, tenant: bool) -> None:
        self.streams = streams
        self.token_id = token_id
        self.tenant = tenant
        self.held = True

    def give(self) -> None:
        if self.held:
            self.held = False
            self.streams.give(self.token_id, tenant=self.tenant)


def _cursor(last_event_id: str | None, after: str | None) -> int | None:
    """Where the client asked to start: ``Last-Event-ID`` over ``after``; 400 for
    anything but an event id."""
    try:
        if last_event_id is not None and last_event_id.strip():
            return parse_cursor(last_event_id, "the Last-Event-ID header")
        if after is not None:
            return parse_cursor(after, "after")
    except BadCursor as exc:
        raise HttpError(400, exc.message) from None
    return None


@router.get(
    "/v1/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **_ERRORS},
)
@action("events.read")
async def event_stream(
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    access: Access,
    after: Annotated[
        str | None,
        Query(description="start after this event id (0: the whole history); default: now"),
    ] = None,
    job: Annotated[str | None, Query(description="only the events of this job")] = None,
    type_name: Annotated[
        str | None, Query(alias="type", description="only the events of jobs of this type")
    ] = None,
    follow: Annotated[
        bool, Query(description="false: send the events there are now, then end")
    ] = True,
    last_event_id: Annotated[
        str | None,
        Header(alias="Last-Event-ID", description="what EventSource sends when it reconnects"),
    ] = None,
) -> StreamingResponse:
    """The event log as server-sent events (``text/event-stream``), filtered by
    job or type; a submitter gets only its own jobs' events. Resumable: the
    ``Last-Event-ID`` header (or ``after``) names the last event received."""
    start = _cursor(last_event_id, after)
    if type_name is not None and not TYPE_NAME.fullmatch(type_name):
        raise HttpError(422, f"type must be a job type, module.type, not {type_name[:80]!r}")
    job_id = None
    if job is not None:
        job_id = (await run_in_threadpool(visible_job, ctx, who, access, job)).id
    flt = EventFilter(
        job=job_id, type=type_name, owner=who.token_id if access is Scope.OWN else None
    )
    streams = streams_of(request.app)
    newest = await run_in_threadpool(ctx.store.last_event_id)
    # past the newest event: an id of another (or a reset) store, never seen here;
    # the stream goes on from now instead of waiting for ids that far on
    start = newest if start is None else min(start, newest)
    tenant = who.role not in (Role.OWNER, Role.OPERATOR)
    refused = streams.take(who.token_id, tenant=tenant)
    if refused is not None:
        raise HttpError(429, refused, {"Retry-After": "5"})
    slot = _Slot(streams, who.token_id, tenant=tenant)
    feed = EventFeed(ctx.store, flt, cursor=start)
    return StreamingResponse(
        _stream(ctx, feed, slot, follow=follow),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        background=BackgroundTask(slot.give),
    )


async def _stream(
    ctx: ApiContext, feed: EventFeed, slot: _Slot, *, follow: bool
) -> AsyncIterator[str]:
    """The events as they come, until the client goes away, the server stops or
    (without ``follow``) the events there were have been sent."""
    try:
        yield f"retry: {RETRY_MS}\nid: {feed.cursor}\n\n"
        if follow:
            async with aclosing(_follow(ctx, feed, slot.streams)) as texts:
                async for text in texts:
                    yield text
            return
        told = feed.cursor
        while True:
            shown = await run_in_threadpool(feed.read)
            if shown:
                yield "".join(block(e) for e in shown)
                told = int(shown[-1]["id"])
            if not feed.full:
                break
        if feed.cursor > told:  # what the filter skipped need not be read again
            yield f"id: {feed.cursor}\n\n"
    finally:
        slot.give()


async def _follow(ctx: ApiContext, feed: EventFeed, streams: Streams) -> AsyncGenerator[str]:
    told = feed.cursor  # the last id the client was given
    quiet_since = time.monotonic()
    while not streams.stopping():
        shown = await _look(ctx, feed, streams)
        if shown is not None:
            if shown:
                yield "".join(block(e) for e in shown)
                told = int(shown[-1]["id"])
                quiet_since = time.monotonic()
            if feed.full:
                continue
        if time.monotonic() - quiet_since >= HEARTBEAT_S:
            moved = f"id: {feed.cursor}\n" if feed.cursor > told else ""
            told = feed.cursor
            yield f": keep-alive\n{moved}\n"
            quiet_since = time.monotonic()
        await anyio.sleep(POLL_S)


async def _look(ctx: ApiContext, feed: EventFeed, streams: Streams) -> list[dict[str, Any]] | None:
    """The next events when there may be new ones (None when there are none). A
    store that cannot answer now (busy, unreachable) is asked again later."""
    try:
        newest = await streams.newest(ctx)
        if feed.full or newest > feed.cursor:
            return await run_in_threadpool(feed.read, newest)
    except Exception as exc:
        if not ctx.store.unavailable(exc):
            raise
        log.warning("the event stream could not read the store now: %s", exc)
    return None
