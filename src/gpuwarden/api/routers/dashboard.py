"""The dashboard: its page at ``/`` (plain HTML, JavaScript and CSS shipped in the
package, ``api/dashboard/``: nothing from a CDN, no build step) and the JSON it
reads under ``/v1/dashboard/``.

The page needs no token to load; everything it shows comes from routes that do
(a session cookie, ``routers/session.py``). ``overview`` is read on every
refresh; ``history`` is the memory timeline this API process keeps
(``api/history.py``); ``stats`` is computed at most once a minute
(``api/dashdata.py``). A submitter is shown only its own jobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import FileResponse, JSONResponse

from gpuwarden.api import dashdata
from gpuwarden.api.auth import Principal, Scope
from gpuwarden.api.context import (
    ApiContext,
    action,
    get_ctx,
    get_principal,
    get_scope,
    run_while_serving,
)
from gpuwarden.api.history import History, Sampler
from gpuwarden.api.models import ErrorOut

router = APIRouter(tags=["dashboard"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]
Access = Annotated[Scope, Depends(get_scope)]

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorOut} for code in (401, 403, 429)}

#: the page's files, shipped in the package
PAGE_DIR = Path(__file__).resolve().parents[1] / "dashboard"
#: the page loads nothing from anywhere else, runs no inline script, and is framed
#: by no other page (its buttons act)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
NO_STORE = {"Cache-Control": "no-store"}


def _file(name: str, media: str) -> FileResponse:
    return FileResponse(PAGE_DIR / name, media_type=media, headers=PAGE_HEADERS)


@router.get("/", include_in_schema=False)
@action("dashboard.page")
def page() -> FileResponse:
    """The dashboard's page (it signs in and reads the routes below)."""
    return _file("index.html", "text/html; charset=utf-8")


@router.get("/dashboard/app.js", include_in_schema=False)
@action("dashboard.page")
def script() -> FileResponse:
    return _file("app.js", "text/javascript; charset=utf-8")


@router.get("/dashboard/app.css", include_in_schema=False)
@action("dashboard.page")
def style() -> FileResponse:
    return _file("app.css", "text/css; charset=utf-8")


@router.get("/v1/dashboard/overview", responses=_ERRORS)
@action("dashboard.read")
def overview(ctx: Ctx, who: Who, access: Access) -> JSONResponse:
    """Every node's GPUs (ledger holdings by job and warm server, the device's
    reading, foreign memory, managed runtimes, the reserve, degraded and fault
    reasons), warm servers with the grace left, queued jobs with why they wait,
    running jobs with their progress in time, recent failures, and in a cluster
    every enrolled node. A submitter sees only its own jobs."""
    return JSONResponse(dashdata.overview(ctx, who, access), headers=NO_STORE)


@router.get("/v1/dashboard/history", responses=_ERRORS)
@action("dashboard.read")
def history(request: Request) -> JSONResponse:
    """Per GPU, the ledger against the device's reading for the last hour, sampled
    by this API process every 10 s from what the brokers publish (``since``: how
    far back it has data; it starts empty when the API starts)."""
    kept: History = request.app.state.gw_history
    kept.sample_if_due()
    return JSONResponse(kept.to_json(), headers=NO_STORE)


@router.get("/v1/dashboard/stats", responses=_ERRORS)
@action("dashboard.read")
def stats(request: Request, ctx: Ctx, who: Who, access: Access) -> JSONResponse:
    """Queue waits of the last day's attempts (a histogram), each vram type's
    declared footprint against its measured peak, and GPU-hours by owner for the
    last day and week (a submitter: its own and everyone else's together).
    Computed at most once a minute."""
    got: dashdata.Stats = request.app.state.gw_stats
    return JSONResponse(got.to_json(ctx, who, access), headers=NO_STORE)


def install(app: FastAPI) -> None:
    """Keep the timeline and the stats cache on ``app``, and sample the timeline on
    a thread while the app runs (its lifespan)."""
    ctx: ApiContext = app.state.gw
    kept = History(ctx.store, clock=ctx.clock)
    app.state.gw_history = kept
    app.state.gw_stats = dashdata.Stats(clock=ctx.clock)
    sampler = Sampler(kept)
    run_while_serving(app, sampler.start, sampler.stop)
