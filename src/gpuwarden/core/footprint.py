"""Footprints: how much VRAM a job of a type is admitted with, and when that rises.

A type declares its footprint; a job may declare its own. What admission uses is
the larger of that declaration and the type's measured footprint, which only
ever rises:

- a job that had its GPU to itself and used more than its footprint raises the
  type's measured footprint to its peak (:func:`raised`);
- a job that ran out of memory (CUDA out-of-memory) with its GPU to itself asked
  for too little: the next jobs of its type are admitted with half as much again
  as it reached (:func:`after_oom`), raised the same way.

A raised footprint is rounded up to the node's measuring step and never set
above what the largest GPU offers (its total less the reserve): a peak that only
fit by eating into the reserve must not lock the type out of the node for good.

Pure: no I/O, no clock. The node's broker applies these (``node/measured.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpuwarden.core.policy import GpuView

#: after a CUDA out-of-memory, the next jobs of the type get this much of what it reached
OOM_FACTOR = 1.5


def effective(declared: int, override: int | None, measured: int) -> int:
    """The footprint a job is admitted with: its own declaration (``override``) or
    its type's (``declared``), raised to the type's measured footprint (never
    lowered by it)."""
    return max(override or declared, measured)


def after_oom(admitted: int, peak: int) -> int:
    """What a job that ran out of memory alone on its GPU shows its type needs:
    half as much again as the more of what it was admitted with and its peak."""
    return int(max(admitted, peak) * OOM_FACTOR)


def round_up(nbytes: int, step: int) -> int:
    """``nbytes`` rounded up to a multiple of ``step``."""
    return math.ceil(nbytes / step) * step


def raised(
    peak: int, *, admitted: int, measured: int, step: int, gpus: Iterable[GpuView]
) -> int | None:
    """The type's new measured footprint after a job of it reached ``peak`` (with
    its GPU to itself), or None when nothing rises. ``admitted``: what the job was
    admitted with; ``measured``: the type's measured footprint now; ``step``: the
    rounding; ``gpus``: the node's GPUs (the ceiling is the largest one's room)."""
    if peak <= admitted:
        return None
    ceiling = max((g.total_bytes - g.reserve_bytes for g in gpus), default=peak)
    new = min(round_up(peak, step), ceiling)
    return new if new > measured else None
