"""What the node learned from its own attempts: each type's measured footprint
(raised by the rule of :mod:`gpuwarden.core.footprint`, never lowered, kept in
the store), its latest run times (what backfilling plans with, with a job's own
``est_s`` until there is one: :mod:`gpuwarden.core.profile`), and the RAM peak
of each attempt's process tree (:class:`RamPeaks`, kept per attempt and per type).
:func:`type_profiles` puts them together per type for ``types`` and the API.

Owned by the broker loop: attempts and warm servers feed it as they end.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gpuwarden.core import footprint, profile
from gpuwarden.core.command import profile_key
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import Job, JobType
from gpuwarden.core.policy import GpuView
from gpuwarden.launch import reaper
from gpuwarden.launch.base import Launcher
from gpuwarden.launch.sandbox import SandboxLauncher
from gpuwarden.store.base import Store

log = logging.getLogger("gpuwarden.footprint")

#: a type's run-time estimate looks at this many of its latest runs
RUN_TIME_WINDOW = profile.RUN_TIME_WINDOW


def sized_by_job(jobtype: JobType, job: Job) -> bool:
    """Whether the job's footprint is its own, not its type's: it declared one
    (``vram_gib``, a command job's ``--vram``), or set a parameter that sizes its
    VRAM (``sizes_vram``) to anything but its default. Its measurement then moves
    no footprint of its type (issue 31: ``burn.llm --gib 40`` raised the type's
    footprint for everyone)."""
    if job.vram_bytes is not None:
        return True
    return any(
        p.sizes_vram and p.name in job.params and job.params[p.name] != p.default
        for p in jobtype.params
    )


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
        return footprint.effective(
            jobtype.vram_bytes, override, self.measured.get(profile_key(jobtype.name), 0)
        )

    def measure(
        self,
        jobtype: JobType,
        peak: int,
        *,
        override: int | None,
        source: str,
        gpus: Iterable[GpuView],
        now: float,
        own: bool = False,
    ) -> None:
        """A job (``source``) of ``jobtype`` reached ``peak`` with its GPU to itself:
        raise the type's stored footprint to it if it beat what the job was
        admitted with (``override``: the job's own declaration). Not for a job
        whose footprint is its own (``own``, :func:`sized_by_job`): what it took
        says nothing of the type's other jobs."""
        if own:
            log.info(
                "job %s of %s peaked at %d bytes; its footprint is its own: the type's "
                "stays as it is",
                source, jobtype.name, peak,
            )  # fmt: skip
            return
        new = footprint.raised(
            peak,
            admitted=self.of(jobtype, override),
            measured=self.measured.get(profile_key(jobtype.name), 0),
            step=self.step_bytes,
            gpus=gpus,
        )
        if new is not None and self.store.raise_footprint(
            profile_key(jobtype.name), new, now=now, job_id=source
        ):
            self.measured[profile_key(jobtype.name)] = new

    def out_of_memory(
        self,
        jobtype: JobType,
        peak: int,
        *,
        override: int | None,
        source: str,
        gpus: Iterable[GpuView],
        now: float,
        own: bool = False,
    ) -> None:
        """A job ran out of memory with its GPU to itself: what it asked for is
        wrong; the next jobs of its type are admitted with half as much again as
        it reached (unless its footprint was its own, ``own``)."""
        need = footprint.after_oom(self.of(jobtype, override), peak)
        self.measure(jobtype, need, override=None, source=source, gpus=gpus, now=now, own=own)


class RunTimes:
    """Per type, the run times of its latest succeeded attempts (newest last)."""

    def __init__(self, recent: Iterable[tuple[str, float]]) -> None:
        """``recent``: (type, seconds) of the latest runs, newest first (as the
        store lists them)."""
        self._times: dict[str, deque[float]] = {}
        for type_name, seconds in reversed(list(recent)):
            self.note(type_name, seconds)

    def note(self, type_name: str, seconds: float) -> None:
        # a command job's run times are kept under its name, whatever its options
        self._times.setdefault(profile_key(type_name), deque(maxlen=RUN_TIME_WINDOW)).append(
            seconds
        )

    def estimate(self, type_name: str) -> float | None:
        """The longest of the type's latest runs: what backfilling plans with."""
        return profile.estimate(self.times(type_name))

    def times(self, type_name: str) -> list[float]:
        """The type's latest run times, oldest first."""
        return list(self._times.get(profile_key(type_name), ()))

    def expected_s(self, type_name: str, est_s: float | None) -> float | None:
        """How long a job of the type that declared ``est_s`` is expected to run:
        the type's measured estimate once it has one, else ``est_s`` as the planner
        rounds it (:func:`gpuwarden.core.profile.expected_s`)."""
        return profile.expected_s(self.estimate(type_name), profile.est_class(est_s))

    def holding_s(self, type_name: str, est_s: float | None) -> float | None:
        """How long a started job is expected to hold its GPU: as :meth:`expected_s`,
        but with ``est_s`` as declared, not rounded up (a holder expected to end
        later than its own word would let a backfill run into the held-back job)."""
        return profile.expected_s(self.estimate(type_name), est_s)


#: the RAM of running attempts is sampled at most this often (on the loop's ticks)
RAM_SAMPLE_S = 0.2
#: and at most this many attempts at a time, in turn: a node running hundreds of
#: attempts samples each less often rather than make its loop's tick long
RAM_SAMPLES_PER_TICK = 32
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def tree_rss(root: int) -> int:
    """The resident memory of ``root`` and its live descendants now, in bytes (the
    sum of their RSS: pages they share count once per process); 0 once it is gone."""
    total = 0
    for pid in (root, *reaper.tree_pids(root)):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_bytes().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total


def tree_shows_ram(launcher: Launcher) -> bool:
    """Whether an attempt's memory is in its main process's tree with this
    launcher: host processes and bubblewrap sandboxes, yes; podman's and docker's
    containers run under their daemon or monitor, not under the command started."""
    return not isinstance(launcher, SandboxLauncher) or launcher.runtime is Runtime.BUBBLEWRAP


class RamPeaks:
    """Per running attempt (by its holder name), the most RAM its process tree was
    seen to use: sampled on the loop's ticks, at most every ``every_s``, at most
    ``per_tick`` attempts at a time, in turn (a peak between two samples is
    missed; an attempt that ends before its first sample has no measurement)."""

    def __init__(
        self,
        *,
        every_s: float = RAM_SAMPLE_S,
        per_tick: int = RAM_SAMPLES_PER_TICK,
        read: Callable[[int], int] = tree_rss,
    ) -> None:
        self.every_s = every_s
        self.per_tick = per_tick
        self._read = read
        self._roots: dict[str, int] = {}
        self._turn: deque[str] = deque()  # whose sample is next, in turn
        self._peaks: dict[str, int] = {}
        #: what each tree used at its last sample (RAM admission's promised part)
        self._now: dict[str, int] = {}
        self._due = float("-inf")

    def __len__(self) -> int:
        return len(self._roots)

    def watch(self, holder: str, pid: int) -> None:
        """The attempt's main process runs as ``pid``: sample its tree from now on."""
        if holder not in self._roots:
            self._turn.append(holder)
        self._roots[holder] = pid
        self.sample_one(holder)

    def sample(self, now: float) -> None:
        """Sample the next ``per_tick`` watched attempts, if the last samples are
        ``every_s`` old."""
        if not self._roots or now < self._due:
            return
        self._due = now + self.every_s
        for _ in range(min(self.per_tick, len(self._turn))):
            holder = self._turn[0]
            self._turn.rotate(-1)
            self.sample_one(holder)

    def sample_one(self, holder: str) -> None:
        pid = self._roots.get(holder)
        if pid is not None:
            used = self._read(pid)
            self._now[holder] = used
            if used > self._peaks.get(holder, 0):
                self._peaks[holder] = used

    def peak(self, holder: str) -> int | None:
        """The attempt's peak so far (None: never seen to use any)."""
        return self._peaks.get(holder)

    def current(self, holder: str) -> int:
        """What the attempt's tree used at its last sample (0: not sampled yet)."""
        return self._now.get(holder, 0)

    def end(self, holder: str) -> None:
        """The attempt is over: stop watching it."""
        if self._roots.pop(holder, None) is not None:
            self._turn.remove(holder)
        self._peaks.pop(holder, None)
        self._now.pop(holder, None)


def type_profiles(store: Store, types: Iterable[JobType]) -> dict[str, dict[str, Any]]:
    """Per type, its measured profile as ``types --json`` and ``GET /v1/types`` show
    it: declared and measured VRAM, the RAM peak, the wall times of its latest
    succeeded runs (median, p90, longest: the estimate backfilling plans with)."""
    vram = store.footprints()
    ram = store.type_profiles()
    times = RunTimes(store.recent_run_times())
    return {t.name: _profile(t, vram, ram, times) for t in types}


def _profile(
    t: JobType, vram: Mapping[str, Any], ram: Mapping[str, Any], times: RunTimes
) -> dict[str, Any]:
    measured = vram.get(t.name)
    peak = ram.get(t.name)
    wall = profile.wall_times(times.times(t.name))
    return {
        "vram_declared_bytes": t.vram_bytes,
        "vram_measured_bytes": measured.bytes if measured is not None else None,
        "ram_peak_bytes": peak.ram_peak_bytes if peak is not None else None,
        "wall": wall.to_json() if wall is not None else None,
    }
