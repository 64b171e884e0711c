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

A sandboxed service is adopted too: under bubblewrap its main process is the
PID the store recorded (bubblewrap's, whose tree holds the sandbox's network
namespace), under podman or docker the main process of the attempt's container,
found by its name and its labels
(:meth:`gpuwarden.launch.sandbox.SandboxLauncher.adoptable_pid`); it must carry
the attempt's marker all the same. Its end removes its container or its cgroups
(:meth:`~gpuwarden.launch.sandbox.SandboxLauncher.release_adopted`). Its output
folder's size is no longer watched (only the run that started it watched it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
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
        sandbox = self.launching.sandbox_for(jobtype)
        if sandbox is None and not isinstance(self.launcher, HostLauncher):
            return None
        found = [a for a in self.store.attempts(job.id) if a.number == job.attempts]
        if not found or found[0].pid is None or found[0].ended_at is not None:
            return None
        attempt, recorded = found[0], found[0].pid
        pid: int | None = recorded
        cleanup: Callable[[], None] | None = None
        if sandbox is not None:
            pid = sandbox.adoptable_pid(self.instance, job.id, attempt.number, recorded)
            cleanup = functools.partial(
                sandbox.release_adopted, self.instance, job.id, attempt.number
            )
        if pid is None:
            return None
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
        run.thread = watch_adopted(request, pid, run.stop, self.mailbox.post, cleanup)
        self.emit("service_adopted", job=job.id, attempt=attempt.number, pid=pid)
        return marker
