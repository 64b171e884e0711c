"""Errors of the HTTP API: every one is ``{"error": "..."}``, saying what was
wrong and what to do, with the status code that fits. Refusals of mutating calls
are written to the audit log here, in one place."""

from __future__ import annotations

import json
import logging
import math
import typing
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuwarden.api.limits import Send, send_error
from gpuwarden.errors import (
    GpuwardenError,
    JobControlError,
    NotAllowedError,
    StoreUnavailable,
    UnknownJobError,
    UserError,
)
from gpuwarden.store.base import (
    DuplicateJobError,
    DuplicateTokenError,
    IdempotencyConflict,
)

log = logging.getLogger(__name__)


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a string the client sent with a
    lone surrogate in it can be echoed in an error without failing to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode("ascii")


class HttpError(GpuwardenError):
    """An answer other than success: a status, the message, and extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def status_of(exc: UserError) -> int:
    """The HTTP status of a user's mistake raised below the API."""
    if isinstance(exc, UnknownJobError):
        return 404
    if isinstance(exc, NotAllowedError):
        return 403
    if isinstance(exc, DuplicateJobError | DuplicateTokenError | JobControlError):
        return 409
    if isinstance(exc, IdempotencyConflict):
        return 422
    return 422


def unavailable_headers(exc: StoreUnavailable) -> dict[str, str]:
    """The headers of a 503 for a store that cannot be reached now: ``Retry-After``
    (whole seconds, at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}


async def send_unavailable(send: Send, exc: StoreUnavailable, path: str) -> None:
    """Answer a request the store could not be read for (outside the routes: the
    gate's token check) with 503 and ``Retry-After``."""
    log.warning("%s: answered 503, %s", path, exc.detail or exc.message)
    await send_error(send, 503, exc.message, unavailable_headers(exc))


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    return AsciiJSONResponse({"error": message}, status_code=status, headers=headers)


async def audit_refusal(request: Request, status: int, message: str) -> None:
    """Write the audit row of a refused (or failed) mutating call, once."""
    state = request.scope.setdefault("state", {})
    audit = state.get("gw_audit")
    if audit is None or state.get("gw_audited"):
        return
    state["gw_audited"] = True
    outcome = f"error: {message}" if status >= 500 else f"refused: {message}"
    try:
        await run_in_threadpool(audit, outcome, status)
    except Exception:  # the refusal still goes out; the log says the row is missing
        log.exception("could not write the audit row of a refused request")


def _explain_validation(exc: RequestValidationError, request: Request) -> str:
    allowed = _body_fields(request)
    problems: list[str] = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        kind = err.get("type", "")
        where = ".".join(loc) or "request"
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            problems.append(
                f"the body is not valid JSON ({ctx.get('error', 'decode error')} at "
                f"position {loc[1] if len(loc) > 1 else '?'}): send a JSON object"
            )
        elif kind == "extra_forbidden":
            field = loc[-1] if loc else "?"
            known = f" (allowed: {', '.join(allowed)})" if allowed and len(loc) == 2 else ""
            problems.append(f"unknown field {field!r} in {'.'.join(loc[:-1])}{known}")
        elif kind == "missing" and loc == ["body"]:
            problems.append("the request needs a JSON body (Content-Type: application/json)")
        elif kind in ("model_attributes_type", "dict_type") and loc == ["body"]:
            problems.append(
                "the body must be a JSON object, sent with Content-Type: application/json"
            )
        else:
            problems.append(f"{where}: {err.get('msg', 'not valid')}")
    return "; ".join(problems) or "the request is not valid"


def _body_fields(request: Request) -> list[str]:
    endpoint = request.scope.get("endpoint")
    if endpoint is None:
        return []
    try:
        hints = typing.get_type_hints(endpoint)
    except Exception:  # a hint that does not resolve: say less
        return []
    for hint in hints.values():
        if isinstance(hint, type) and issubclass(hint, pydantic.BaseModel):
            return sorted(hint.model_fields)
    return []


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into ``{"error": ...}``."""

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> Any:
        await audit_refusal(request, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> Any:
        status = status_of(exc)
        await audit_refusal(request, status, exc.message)
        return error_response(status, exc.message)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable) -> Any:
        # no audit row: the store that would keep it is the one that is unreachable
        log.warning(
            "%s %s: answered 503, %s", request.method, request.url.path, exc.detail or exc.message
        )
        return error_response(503, exc.message, unavailable_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        message = _explain_validation(exc, request)
        await audit_refusal(request, 422, message)
        return error_response(422, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Any:
        status = exc.status_code
        path = request.scope.get("path", "")
        if status == 404 and any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
            # no route takes a control character (a path parameter stops at a newline)
            status = 422
            message = (
                f"the URL path {path[:100]!r} has a control character (such as NUL or a "
                "newline): file names and ids with one are not taken"
            )
        elif status == 404:
            message = (
                f"no such endpoint: {request.method} {request.url.path} "
                "(the endpoints are listed in /openapi.json)"
            )
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        if status == 400:  # FastAPI's "error parsing the body": bytes that are not UTF-8
            status = 422
            message = (
                "the body could not be read as JSON (it must be UTF-8 text): send a JSON object"
            )
        await audit_refusal(request, status, message)
        return error_response(status, message, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Any:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        message = (
            f"internal error ({type(exc).__name__}); the server's log has the details. "
            "Try again later; if it persists, report it"
        )
        await audit_refusal(request, 500, f"{type(exc).__name__}: {exc}")
        return error_response(500, message)
