"""GPU faults: an Owner clears one (what `gpuwarden gpu clear UUID` does locally)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gpuwarden.api.context import ApiContext, action, audit_ok, get_ctx, get_scope, set_target
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import ErrorOut

router = APIRouter(tags=["gpus"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 413, 422, 429)
}
#: NVIDIA's GPU-<uuid> and the simulated GPU's GPU-sim-... ids
_GPU_UUID = re.compile(r"^GPU-[0-9A-Za-z-]{4,80}$")


@router.post("/v1/gpus/{gpu_uuid}/clear", status_code=202, responses=_ERRORS)
@action("gpu.clear")
def clear_gpu(gpu_uuid: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    """Ask the broker that owns GPU ``gpu_uuid`` to clear its fault and resume VRAM
    admission there (after a critical Xid). The broker takes the request on its
    next pass and logs ``gpu_fault_cleared`` (or ``gpu_clear_ignored`` when that
    GPU has no fault). Fix the cause first: `nvidia-smi -q`, the kernel log."""
    set_target(request, gpu_uuid)
    if not _GPU_UUID.fullmatch(gpu_uuid):
        raise HttpError(422, f"{gpu_uuid!r} is not a GPU UUID (GPU-...): see `gpuwarden status`")
    ctx.store.request_gpu_clear(gpu_uuid, now=ctx.clock())
    audit_ok(request, target=gpu_uuid, status=202)
    return {"gpu": gpu_uuid, "requested": True}
