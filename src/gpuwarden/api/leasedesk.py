"""What every way in does with a VRAM lease (SPEC.md, "VRAM leases"): ask for one,
renew it, end it, name its PIDs, read it. The HTTP routes (``api/routers/leases.py``),
the node's local socket (``api/localsock.py``) and ``gpuwarden lease`` on the
store itself all go through :class:`LeaseDesk`, so their rules and words are one.

Who may touch which lease is the caller's to check (a token's scope, a local
user's uid): the desk takes the lease's ``owner`` as given. No web stack here.

A lease is granted once its job runs and its attempt folder holds the deadline
(``supervisor/lease``); the desk writes that folder's files (:mod:`gpuwarden.node.leases`),
so it runs on the node's host, as the broker's user.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.config import Config
from gpuwarden.core.lease import ENDED_BY_HOLDER, LEASE_TYPE, check_ttl, is_lease, ttl_of
from gpuwarden.core.model import Job, JobSpec, format_bytes
from gpuwarden.core.policy import never_fits
from gpuwarden.core.states import JobState
from gpuwarden.errors import JobControlError, UnknownJobError, ValidationError
from gpuwarden.intake.jobs import new_job_id, prepare
from gpuwarden.node import explain, leases
from gpuwarden.node.status import BrokerStatus
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission

__all__ = ["LeaseDesk", "LeaseTally", "pid_owner", "tally"]

#: the most PIDs one request may name
MAX_PIDS_PER_REQUEST = 64


def pid_owner(pid: int) -> int | None:
    """The real uid of process ``pid`` on this host (None: no such process)."""
    try:
        with Path(f"/proc/{int(pid)}/status").open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(slots=True)
class LeaseTally:
    """The leases as ``status`` and the dashboard sum them up: how many are granted
    and waiting, and what the granted ones hold on each GPU (bytes, by UUID)."""

    granted: int = 0
    waiting: int = 0
    held_bytes: dict[str, int] = field(default_factory=dict)


def tally(infos: Iterable[Mapping[str, Any]]) -> LeaseTally:
    """Sum up leases as :meth:`LeaseDesk.info` (``GET /v1/leases``) gives them."""
    out = LeaseTally()
    for x in infos:
        if not x.get("granted"):
            out.waiting += 1
            continue
        out.granted += 1
        gpu = str(x.get("gpu") or "-")
        size = x.get("vram_bytes")
        out.held_bytes[gpu] = out.held_bytes.get(gpu, 0) + (size if isinstance(size, int) else 0)
    return out


class LeaseDesk:
    """Leases over one store, on the node's host."""

    def __init__(self, store: Store, registry: Registry, config: Config) -> None:
        self.store = store
        self.registry = registry
        self.state_dir: Path = config.state_dir

    # -- asking ------------------------------------------------------------------

    def gpus(self, now: float) -> BrokerStatus | None:
        """The running broker's last published status (None: none runs)."""
        status = explain.latest_status(self.store, now)
        return None if status is None else BrokerStatus.from_json(status.payload)

    def check_room(self, vram: int, gpu: str | None, now: float) -> None:
        """Refuse a lease no GPU of the running broker can ever hold, or one pinned
        to a GPU it does not have (naming the GPUs it has). No broker: no check."""
        status = self.gpus(now)
        if status is None:
            return
        views = status.gpu_views()
        if gpu is not None:
            have = [g.uuid for g in views]
            pinned = [g for g in views if g.uuid == gpu]
            if not pinned:
                listed = ", ".join(have) or "none"
                raise ValidationError(
                    f"--gpu {gpu}: this node has no such GPU (its GPUs: {listed})"
                )
            views = tuple(pinned)
        if (why := never_fits(vram, views)) is not None:
            raise ValidationError(f"a lease of {format_bytes(vram)} {why}")

    def ask(
        self,
        vram: object,
        *,
        ttl_s: object,
        gpu: object = None,
        priority: int = 0,
        owner: str | None,
        holder: str,
        job_id: str | None = None,
    ) -> Job:
        """Queue a lease of ``vram`` bytes (pinned to ``gpu`` when given); the job."""
        if isinstance(vram, bool) or not isinstance(vram, int) or vram <= 0:
            raise ValidationError(
                f"vram_bytes must be a whole number of bytes above 0, got {vram!r}"
            )
        try:
            ttl = check_ttl(ttl_s)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if gpu is not None and (not isinstance(gpu, str) or not gpu):
            raise ValidationError(f"gpu must be a GPU's UUID, got {gpu!r}")
        now = time.time()
        self.check_room(vram, gpu, now)
        spec = prepare(
            self.registry,
            JobSpec(
                id=job_id or new_job_id(LEASE_TYPE),
                type=LEASE_TYPE,
                params={"ttl_s": ttl, "holder": holder[:200]},
                vram_bytes=vram,
                priority=priority,
                constraints={"gpu": gpu} if gpu else {},
            ),
            owner=owner,
        )
        [job] = self.store.submit([spec], now=now, origin=Submission(owner=owner))
        return job

    # -- reading -----------------------------------------------------------------

    def lease(self, lease_id: object) -> Job:
        """The lease ``lease_id``; :class:`UnknownJobError` when there is none."""
        job = self.store.get_job(lease_id) if isinstance(lease_id, str) else None
        if job is None or not is_lease(job.type):
            raise UnknownJobError(f"no lease {str(lease_id)[:140]!r} (GET /v1/leases lists them)")
        return job

    def info(self, job: Job) -> dict[str, Any]:
        """The lease as ``GET /v1/leases/{id}`` says it: state, GPU, until, ..."""
        attempts = self.store.attempts(job.id)
        out = leases.lease_json(job, attempts[-1] if attempts else None, self.state_dir)
        out["pinned_gpu"] = job.constraints.get("gpu")
        out["granted"] = job.state is JobState.RUNNING and out["until"] is not None
        return out

    def listed(self, owner: str | None = None, *, every_owner: bool = True) -> list[Job]:
        """The queued and granted leases (``owner``'s only unless ``every_owner``)."""
        jobs = self.store.live_jobs_of_type(LEASE_TYPE)
        return jobs if every_owner else [j for j in jobs if j.owner == owner]

    def attempt_dir(self, job: Job) -> Path | None:
        """A granted lease's attempt folder (None: not granted, or not laid out yet)."""
        if job.state is not JobState.RUNNING:
            return None
        attempts = self.store.attempts(job.id)
        if not attempts:
            return None
        folder = leases.attempt_dir_of(self.state_dir, job.id, attempts[-1].number)
        return folder if leases.deadline(folder) is not None else None

    # -- holding -----------------------------------------------------------------

    def _held(self, job: Job, doing: str) -> Path:
        folder = self.attempt_dir(job)
        if folder is None:
            if job.state.terminal:
                raise JobControlError(
                    f"lease {job.id} has ended ({job.state.value}: {job.reason or ''}); "
                    f"nothing to {doing}"
                )
            raise JobControlError(
                f"lease {job.id} is not granted yet ({job.state.value}): {doing} it once "
                "it is (GET /v1/leases/{id} says when)"
            )
        return folder

    def renew(self, job: Job, ttl_s: object = None) -> float:
        """Move a granted lease's deadline to now + its ttl (or ``ttl_s``); the deadline."""
        ttl = ttl_of(job.params)
        if ttl_s is not None:
            try:
                ttl = check_ttl(ttl_s)
            except ValueError as exc:
                raise ValidationError(str(exc)) from None
        until = leases.renew(self._held(job, "renew"), ttl, time.time())
        if until is None:
            raise JobControlError(f"lease {job.id} is being ended; nothing to renew")
        return until

    def end(self, job: Job, reason: str = ENDED_BY_HOLDER) -> Job:
        """End a lease: a granted one's supervisor stops its holder (within a
        second); one not granted yet is cancelled. An ended one is left as it is."""
        if job.state.terminal:
            return job
        folder = self.attempt_dir(job)
        if folder is None or not leases.end(folder, reason):
            return self.store.request_cancel(job.id, now=time.time())
        return job

    def register_pids(self, job: Job, pids: object, *, uid: int | None = None) -> list[int]:
        """Name ``pids`` (processes of this host) as the lease's: their memory on
        its GPU is the lease's. ``uid``: each must be that user's (a local user's
        own); None: any process (a token's; SPEC.md says why)."""
        wanted = _pid_list(pids)
        for pid in wanted:
            owner = pid_owner(pid)
            if owner is None:
                raise ValidationError(f"pid {pid}: no such process on this host")
            if uid is not None and uid not in (0, owner):
                raise ValidationError(f"pid {pid} is not a process of yours (uid {uid})")
        try:
            return leases.register_pids(self._held(job, "register pids for"), wanted)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


def _pid_list(pids: object) -> list[int]:
    if not isinstance(pids, list | tuple) or not pids:
        raise ValidationError("pids must be a non-empty list of process ids")
    if len(pids) > MAX_PIDS_PER_REQUEST:
        raise ValidationError(f"at most {MAX_PIDS_PER_REQUEST} pids in one request")
    out = []
    for p in pids:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 1 << 22:
            raise ValidationError(f"pid {p!r} is not a process id")
        out.append(p)
    return out
