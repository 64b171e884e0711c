"""The GPU lock file's rule (``gpu_lock``): which lock a job's attempt holds. Pure.

A tool outside the queue (``gpuwarden gpu lock UUID -- CMD``, a notebook that
takes the same ``flock``) shares the GPUs with the broker through one lock file
per GPU. While an attempt runs, it holds on each of its GPUs:

- ``exclusive`` (``LOCK_EX``): it has the GPU to itself (its type does not share
  its GPU, or it runs on several GPUs);
- ``shared`` (``LOCK_SH``): its type shares its GPU with others (co-resident);
  several shared holders coexist, and an outside ``LOCK_EX`` waits for them all;
- nothing: a runtime type's job (the managed runtime's model, no GPU of its own),
  or a job without a GPU (``cpu`` lane).

A GPU whose lock a process outside the queue holds, or waits for, takes no new
job (``core/policy.py``: ``GpuView.locked``); jobs running there go on.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["LockMode", "lock_mode"]


class LockMode(StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"


def lock_mode(*, gpus: int, coresident: bool, runtime: bool) -> LockMode | None:
    """The lock an attempt on ``gpus`` GPUs holds on each of them (None: none)."""
    if runtime or gpus < 1:
        return None
    if coresident and gpus == 1:
        return LockMode.SHARED
    return LockMode.EXCLUSIVE
