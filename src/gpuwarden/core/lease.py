"""VRAM leases: room on one GPU held for an app that is not a job (SPEC.md,
"VRAM leases"). Pure: the built-in job type a lease is, its ttl, and the words
of its ends.

A lease is a job of the built-in type :data:`LEASE_TYPE` (lane ``vram``, its own
``vram_bytes``), so admission, wait reasons, eviction of idle warm servers,
runtime release, priority, fair share and restart survival are the queue's.
Its attempt is a holder process that uses no GPU, under the attempt's
supervisor; the supervisor's lease file carries the lease's deadline (written
at the grant and at each renewal), and a supervisor past it stops the holder:
the lease ends expired. Ending it on purpose writes the reason, then a deadline
already passed.
"""

from __future__ import annotations

import math
from typing import Any

from gpuwarden.core.model import JobType, Lane, LaunchMode, ParamSpec, ParamType

__all__ = [
    "DEFAULT_TTL_S",
    "ENDED_BY_HOLDER",
    "LEASE_MODULE",
    "LEASE_TYPE",
    "MAX_TTL_S",
    "check_ttl",
    "expired_reason",
    "is_lease",
    "lease_job_type",
    "ttl_of",
]

#: the type every lease is a job of; no module folder holds it
LEASE_TYPE = "lease"
#: the module it is listed under (a name no module folder can have)
LEASE_MODULE = "gpuwarden-lease"
#: how long a lease lives without a renewal, unless its holder says
DEFAULT_TTL_S = 60.0
MIN_TTL_S = 5.0
MAX_TTL_S = 24 * 3600.0
#: a lease holds its GPU for at most this long, renewed or not (the type's timeout)
MAX_LEASE_S = 7 * 24 * 3600.0
#: the reason of a lease its holder ended (``lease end``, ``DELETE``, its command exited)
ENDED_BY_HOLDER = "ended by its holder"

#: the holder process: it waits, using no GPU, until its supervisor stops it
_HOLDER = ("{python}", "-I", "-S", "-c", "import signal\nwhile True: signal.pause()")


def lease_job_type() -> JobType:
    """The built-in type of a lease's job. ``coresident``: a lease holds a flat
    amount, so jobs that share their GPU may run beside it (a job that needs a
    GPU to itself waits for it)."""
    return JobType(
        name=LEASE_TYPE,
        module=LEASE_MODULE,
        module_dir="/",
        lane=Lane.VRAM,
        launch=LaunchMode.HOST,
        command=_HOLDER,
        coresident=True,
        timeout_s=MAX_LEASE_S,
        max_retries=0,
        params=(
            ParamSpec(
                "ttl_s",
                ParamType.NUMBER,
                default=DEFAULT_TTL_S,
                description="seconds the lease lives without a renewal",
            ),
            ParamSpec("holder", ParamType.STRING, default="", description="who holds it"),
        ),
        description="a VRAM lease: room on one GPU for an app that is not a job",
    )


def is_lease(type_name: str) -> bool:
    return type_name == LEASE_TYPE


def check_ttl(value: object) -> float:
    """A lease's ttl in seconds, from :data:`MIN_TTL_S` to :data:`MAX_TTL_S`.
    Raise :class:`ValueError` saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"ttl_s must be a number of seconds, got {value!r:.60}")
    if not MIN_TTL_S <= value <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be from {MIN_TTL_S:g} to {MAX_TTL_S:g} s, got {value:g}")
    return float(value)


def ttl_of(params: dict[str, Any]) -> float:
    """A lease job's ttl (its ``ttl_s`` parameter), the default when unreadable."""
    try:
        return check_ttl(params.get("ttl_s", DEFAULT_TTL_S))
    except ValueError:
        return DEFAULT_TTL_S


def expired_reason(ttl_s: float) -> str:
    """Why a lease whose holder stopped renewing it ended."""
    return f"lease expired: not renewed within its ttl of {ttl_s:g} s"
