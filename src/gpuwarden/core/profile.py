"""A job type's measured profile, and the run-time estimate backfilling plans with. Pure.

Each type keeps what its own runs showed: its peak VRAM (the measured footprint,
:mod:`gpuwarden.core.footprint`), its peak RAM (the most its attempts' process
trees were seen to use) and its wall times (its latest succeeded attempts). The
planner plans backfill with a run-time estimate per job (:func:`expected_s`):

- the longer of the type's estimate, the longest of its latest succeeded runs
  (:func:`estimate`), and the job's own ``est_s``, as its submitter declared it
  (rounded up a little by :func:`est_class`, so that jobs declaring nearly the
  same time share a class of the queue index); either alone when only it is known;
- else none: the job never starts on a held-back GPU by being expected to end
  first.

No I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: a type's run-time estimate and its summary look at this many of its latest runs
RUN_TIME_WINDOW = 20
#: the most a job may declare as ``est_s``: one year (anything above is a typo)
MAX_EST_S = 366 * 86400.0
#: ``est_s`` is planned with rounded up to a step of 2 ** (1 / this) (about 19 %)
_STEPS_PER_OCTAVE = 4


def check_est_s(value: Any) -> float:
    """A declared ``est_s`` as a float; ValueError saying why it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"est_s must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"est_s must be a positive number of seconds, got {value!r}")
    if seconds > MAX_EST_S:
        raise ValueError(f"est_s must be at most {MAX_EST_S:g} s (a year), got {value!r}")
    return seconds


def est_class(est_s: float | None) -> float | None:
    """``est_s`` as the planner plans with it: rounded up to the next power of
    2 ** (1/4) seconds (at least 1 s; at most 19 % more than declared, never less).
    Jobs of a type whose declared times round alike are one class of the queue
    index; a submitter who declares a different time for every job makes at most
    a few dozen classes per type, not one per job."""
    if est_s is None:
        return None
    if est_s <= 1.0:
        return 1.0
    step = math.ceil(_STEPS_PER_OCTAVE * math.log2(est_s) - 1e-9)
    rounded: float = 2.0 ** (step / _STEPS_PER_OCTAVE)
    return rounded if rounded >= est_s else 2.0 ** ((step + 1) / _STEPS_PER_OCTAVE)


def estimate(times: Sequence[float]) -> float | None:
    """A type's run-time estimate from its latest succeeded runs: the longest (a
    backfilled job that runs past it could delay the held-back job)."""
    return max(times) if times else None


def expected_s(measured: float | None, declared: float | None) -> float | None:
    """How long a job is expected to run: the longer of its type's measured
    estimate and what the job declared (``est_s``, as :func:`est_class` rounds
    it), either alone when the other is not known, else None. A job that says it
    runs longer than its type has so far is believed (its parameters may make it
    longer: a backfill planned on the type's history would run into the job it
    must not delay); one that says less is not (it would be backfilled on a word
    its type's runs do not bear out)."""
    if measured is None or declared is None:
        return measured if declared is None else declared
    return max(measured, declared)


def percentile(times: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of non-empty ``times``."""
    ordered = sorted(times)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class WallTimes:
    """What a type's latest succeeded runs took."""

    runs: int
    median_s: float
    p90_s: float
    #: the longest: the run-time estimate backfilling plans with
    longest_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "median_s": self.median_s,
            "p90_s": self.p90_s,
            "longest_s": self.longest_s,
        }


def wall_times(times: Sequence[float]) -> WallTimes | None:
    """Median, p90 and longest of a type's latest runs; None without any."""
    if not times:
        return None
    return WallTimes(
        runs=len(times),
        median_s=percentile(times, 50),
        p90_s=percentile(times, 90),
        longest_s=max(times),
    )
