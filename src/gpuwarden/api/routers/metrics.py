"""``GET /metrics``: the Prometheus text exposition (:mod:`gpuwarden.api.metrics`).

Its action is ``metrics.read`` (owner and operator tokens: a scrape config's
bearer token); with ``[api] metrics_public = true`` it answers without a token,
the way Prometheus scrapes by default (the gate treats it as public then). It is
mounted wherever the API is: ``serve --api`` and the coordinator, which also
gives each enrolled node as its agent last reported it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gpuwarden.api.context import ApiContext, action, get_ctx
from gpuwarden.api.metrics import CONTENT_TYPE, scrape
from gpuwarden.api.routers.nodes import is_coordinator

router = APIRouter(tags=["metrics"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]

#: the action of ``GET /metrics``
METRICS_ACTION = "metrics.read"


@router.get("/metrics", include_in_schema=False, response_class=Response)
@action(METRICS_ACTION)
def metrics(request: Request, ctx: Ctx) -> Response:
    """Every gpuwarden series, from what the nodes published (no store-wide scan)."""
    body = scrape(ctx.store, ctx.registry, clock=ctx.clock, coordinator=is_coordinator(request))
    return Response(content=body, media_type=CONTENT_TYPE)
