"""What the node learned from its own attempts: each type's measured footprint
(raised by the rule of :mod:`gpuwarden.core.footprint`, never lowered, kept in
the store) and its latest run times (what backfilling plans with).

Owned by the broker loop: attempts and warm servers feed it as they end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from gpuwarden.core import footprint, profile
from gpuwarden.core.model import JobType
from gpuwarden.core.policy import GpuView
from gpuwarden.store.base import Store

#: a type's run-time estimate looks at this many of its latest runs
RUN_TIME_WINDOW = profile.RUN_TIME_WINDOW


class Footprints:
    """Per type, the footprint admission uses: declared, raised by measurement."""

    def __init__(self, store: Store, *, step_bytes: int) -> None:
        self.store = store
        self.step_bytes = step_bytes
        #: per type, its measured footprint (as the store keeps it)
        self.measured = {t: f.bytes for t, f in store.footprints().items()}

    def of(self, jobtype: JobType, override: int | None = None) -> int:
        """The footprint a job is admitted with: its own or its type's declaration,
        raised to the type's measured peak (never lowered by it)."""
        return footprint.effective(jobtype.vram_bytes, override, self.measured.get(jobtype.name, 0))

    def measure(
        self,
        jobtype: JobType,
        peak: int,
        *,
        override: int | None,
        source: str,
        gpus: Iterable[GpuView],
        now: float,
    ) -> None:
        """A job (``source``) of ``jobtype`` reached ``peak`` with its GPU to itself:
        raise the type's stored footprint to it if it beat what the job was
        admitted with (``override``: the job's own declaration)."""
        new = footprint.raised(
            peak,
            admitted=self.of(jobtype, override),
            measured=self.measured.get(jobtype.name, 0),
            step=self.step_bytes,
            gpus=gpus,
        )
        if new is not None and self.store.raise_footprint(
            jobtype.name, new, now=now, job_id=source
        ):
            self.measured[jobtype.name] = new

    def out_of_memory(
        self,
        jobtype: JobType,
        peak: int,
        *,
        override: int | None,
        source: str,
        gpus: Iterable[GpuView],
        now: float,
    ) -> None:
        """A job ran out of memory with its GPU to itself: what it asked for is
        wrong; the next jobs of its type are admitted with half as much again as
        it reached."""
        need = footprint.after_oom(self.of(jobtype, override), peak)
        self.measure(jobtype, need, override=None, source=source, gpus=gpus, now=now)


class RunTimes:
    """Per type, the run times of its latest succeeded attempts (newest last)."""

    def __init__(self, recent: Iterable[tuple[str, float]]) -> None:
        """``recent``: (type, seconds) of the latest runs, newest first (as the
        store lists them)."""
        self._times: dict[str, deque[float]] = {}
        for type_name, seconds in reversed(list(recent)):
            self.note(type_name, seconds)

    def note(self, type_name: str, seconds: float) -> None:
        self._times.setdefault(type_name, deque(maxlen=RUN_TIME_WINDOW)).append(seconds)

    def estimate(self, type_name: str) -> float | None:
        """The longest of the type's latest runs: what backfilling plans with."""
        return profile.estimate(self.times(type_name))

    def times(self, type_name: str) -> list[float]:
        """The type's latest run times, oldest first."""
        return list(self._times.get(type_name, ()))

    def expected_s(self, type_name: str, est_s: float | None) -> float | None:
        """How long a job of the type that declared ``est_s`` is expected to run:
        the type's measured estimate once it has one, else ``est_s`` as the planner
        rounds it (:func:`gpuwarden.core.profile.expected_s`)."""
        return profile.expected_s(self.estimate(type_name), profile.est_class(est_s))
