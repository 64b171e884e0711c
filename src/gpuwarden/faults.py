"""Named fault points: places in the broker where a test can make it die.

``GPUWARDEN_FAULT=NAME`` (or ``NAME@N``: the N-th time it is reached, default
1) makes the broker process SIGKILL itself when it reaches :func:`point` NAME.
It is read once, at import. Nothing happens without the variable: a point costs
one dictionary lookup. Tests use it to prove that a crash at any of these
moments loses no accepted job and records no result twice.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "GPUWARDEN_FAULT"

#: every point the broker has, in the order a bundle meets them
POINTS = (
    "after_claim",  # the bundle is in processing/, nothing recorded
    "after_bundle_commit",  # its jobs and the bundle row are committed
    "after_start_attempt",  # queued -> running committed, no process yet
    "after_launch",  # the job's process runs
    "after_finish_attempt",  # its result is committed, the bundle not written
    "after_result_write",  # the result bundle is in outbox/, not recorded
    "after_bundle_finish",  # recorded, the input still in processing/
)


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, nth = value.partition("@")
    if name not in POINTS or not (nth or "1").isdigit():
        # a test hook must never break the real command line: say so and do nothing
        sys.stderr.write(
            f"gpuwarden: ignoring {ENV}={value!r}: use NAME or NAME@N, NAME one of "
            f"{', '.join(POINTS)}\n"
        )
        return None
    return name, int(nth or 1)


_ARMED = _parse(os.environ.get(ENV))
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """Die here (SIGKILL, no cleanup) if this point is armed and its turn has come."""
    if _ARMED is None or _ARMED[0] != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= _ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)
