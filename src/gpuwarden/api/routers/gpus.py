"""GPU faults: an Owner clears one (what `gpuwarden gpu clear UUID` does locally)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gpuwarden.api.auth import Principal
from gpuwarden.api.context import (
    ApiContext,
    action,
    audit_ok,
    get_ctx,
    get_principal,
    get_scope,
    set_target,
)
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import ErrorOut, GpuClearIn

router = APIRouter(tags=["gpus"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 413, 422, 429)
}
#: NVIDIA's GPU-<uuid> and the simulated GPU's GPU-sim-... ids
_GPU_UUID = re.compile(r"^GPU-[0-9A-Za-z-]{4,80}$")


@router.post("/v1/gpus/{gpu_uuid}/clear", status_code=202, responses=_ERRORS)
@action("gpu.clear")
def clear_gpu(
    gpu_uuid: str, body: GpuClearIn, request: Request, ctx: Ctx, who: Who
) -> dict[str, Any]:
    """Ask the broker that owns GPU ``gpu_uuid`` to clear its latched fault and resume
    VRAM admission there (after a critical Xid), saying what was done about it
    (``reason``). The broker takes the request on its next pass, closes the latch
    with this token and the reason, and logs ``gpu_fault_cleared`` (or
    ``gpu_clear_ignored`` when that GPU has no fault). Fix the cause first:
    `nvidia-smi -q`, the kernel log."""
    set_target(request, gpu_uuid)
    if not _GPU_UUID.fullmatch(gpu_uuid):
        raise HttpError(422, f"{gpu_uuid!r} is not a GPU UUID (GPU-...): see `gpuwarden status`")
    reason = " ".join(body.reason.split())
    by = f"token:{who.token_id} ({who.name})"
    ctx.store.request_gpu_clear(gpu_uuid, now=ctx.clock(), by=by, reason=reason)
    audit_ok(request, {"reason": reason}, target=gpu_uuid, status=202)
    return {"gpu": gpu_uuid, "requested": True, "by": by, "reason": reason}
