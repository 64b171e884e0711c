"""Adoption: a service an earlier run of this broker started, taken back at start.

A broker that restarts (``serve`` or an agent, killed or stopped) while services
it started still run takes each back instead of stopping it
(:class:`Adoption`, asked by :class:`gpuwarden.node.recovery.Recovery` before it
stops what was left): the attempt the store shows running is a service's; its
main process (the PID the store recorded) still runs and carries the attempt's
marker; it answers its health check now. Then it gets a forwarder and a health
thread again (:meth:`gpuwarden.node.services.Services.adopt`), its memory is held
on the ledger again, and the reaper watches its process
(:func:`gpuwarden.launch.host.watch_adopted`): the same attempt goes on, no new
one starts, no second process. Anything else is stopped and ends interrupted,
as before.

Only services that run as host processes (unsandboxed, with the host launcher)
are adopted; a sandboxed one is stopped as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwarden.core.model import Job, LaunchMode
from gpuwarden.launch.base import LaunchRequest, attempt_marker
from gpuwarden.launch.host import HostLauncher, watch_adopted
from gpuwarden.launch.reaper import carries
from gpuwarden.node.attempts import Launching
from gpuwarden.node.measured import Footprints
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit, Mailbox, RunningAttempt
from gpuwarden.node.services import Services
from gpuwarden.node.vram import VramBook
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store


@dataclass
class Adoption:
    """Takes back the running services an earlier run of ``instance`` left."""

    instance: str
    store: Store
    registry: Registry
    launcher: object
    launching: Launching
    attempts: AttemptRunner
    services: Services
    vram: VramBook
    footprints: Footprints
    mailbox: Mailbox
    emit: Emit
    kill_grace_s: float
    clip_chars: int

    def adopt(self, job: Job, now: float) -> str | None:
        """Take back the running attempt of ``job``: its marker when it is this
        broker's again, else None (it is stopped and ends interrupted)."""
        jobtype = self.registry.types.get(job.type)
        if jobtype is None or jobtype.launch is not LaunchMode.SERVICE:
            return None
        if not isinstance(self.launcher, HostLauncher) or self.launching.sandbox_for(jobtype):
            return None
        found = [a for a in self.store.attempts(job.id) if a.number == job.attempts]
        if not found or found[0].pid is None or found[0].ended_at is not None:
            return None
        attempt, pid = found[0], found[0].pid
        marker = attempt_marker(self.instance, job.id, attempt.number)
        if not carries(pid, marker):
            return None
        attempt_dir = self.launching.attempt_dir(job.id, attempt.number)
        run = RunningAttempt(job=job, attempt=attempt, jobtype=jobtype, attempt_dir=attempt_dir)
        run.pid = pid
        why = self.services.adopt(run, pid, now)
        if why is not None:
            self.emit("service_not_adopted", job=job.id, attempt=attempt.number, why=why)
            return None
        if attempt.gpu_uuid is not None:
            self.vram.start(
                run.holder,
                attempt.gpu_uuid,
                type_name=jobtype.name,
                job_id=job.id,
                nbytes=self.footprints.of(jobtype, job.vram_bytes),
                coresident=jobtype.coresident,
                now=now,
            )
            self.vram.set_pid(run.holder, pid)
        self.attempts.by_job[job.id] = run
        request = LaunchRequest(
            job_id=job.id,
            attempt=attempt.number,
            argv=(),
            cwd=str(attempt_dir),
            env={},
            attempt_dir=str(attempt_dir),
            timeout_s=math.inf,
            clip_chars=self.clip_chars,
            kill_grace_s=self.kill_grace_s,
            instance=self.instance,
        )
        run.thread = watch_adopted(request, pid, run.stop, self.mailbox.post)
        self.emit("service_adopted", job=job.id, attempt=attempt.number, pid=pid)
        return marker
