"""Adoption: attempts an earlier run of this broker started, taken back at start.

Every attempt runs under a supervisor of its own (:mod:`gpuwarden.launch.supervisor`),
so a broker that stops or dies leaves its attempts running. A starting broker
(:class:`Adoption`, asked by :class:`gpuwarden.node.recovery.Recovery` for each
attempt the store shows running, before anything is planned):

- takes back an attempt whose supervisor still runs (the process named in its
  ``started.json``, with the same start time, boot id and marker: never a bare
  PID): its memory is held on the ledger again and the reaper watches the
  supervisor (:func:`gpuwarden.launch.host.watch_adopted`); its end is read from
  the supervisor's exit record and judged as if this broker had started it
  (``attempt_adopted``);
- judges an attempt whose supervisor has gone but left its exit record from
  that record, as if it had seen it end (``attempt_end_recovered``): done is
  done, a checkpoint (exit 6 after the checkpoint signal) is honoured;
- leaves every other attempt to be stopped and ended interrupted (the store's
  running attempt with neither a live supervisor nor a record).

A service is taken back the same way, and only if it also answers its health
check now: then it gets a forwarder and a health thread again
(:meth:`gpuwarden.node.services.Services.adopt`). Its main process is the PID the
store recorded (its supervisor's, checked as above), or under podman or docker
the main process of the attempt's container, found by its name and its labels
(:meth:`gpuwarden.launch.sandbox.SandboxLauncher.adoptable_pid`), which carries
the attempt's marker. A sandboxed attempt's end removes its container or its
cgroups (:meth:`~gpuwarden.launch.sandbox.SandboxLauncher.release_adopted`); its
output folder's size is no longer watched (only the run that started it did).
Warm servers' jobs are not taken back here (a warm server is not an attempt's
supervisor).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwarden.core.model import Job, LaunchMode
from gpuwarden.launch.base import LaunchRequest, attempt_marker
from gpuwarden.launch.host import (
    HostLauncher,
    LiveSupervisor,
    live_supervisor,
    recorded_end,
    recorded_result,
    watch_adopted,
)
from gpuwarden.launch.reaper import carries
from gpuwarden.launch.sandbox import SandboxLauncher
from gpuwarden.node.attempts import Launching
from gpuwarden.node.measured import Footprints
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit, Mailbox, RunningAttempt
from gpuwarden.node.services import Services
from gpuwarden.node.vram import VramBook
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store


@dataclass(frozen=True, slots=True)
class Taken:
    """An attempt :class:`Adoption` took back: its marker, and whether its
    processes run on (``live``; else its end was read from its record)."""

    marker: str
    live: bool


@dataclass
class Adoption:
    """Takes back the running attempts an earlier run of ``instance`` left."""

    instance: str
    store: Store
    registry: Registry
    #: the node's launchers by launch mode: an attempt is taken back only where the
    #: launcher of its mode (a service's: the container one) starts supervised ones
    launchers: Mapping[LaunchMode, object]
    launching: Launching
    attempts: AttemptRunner
    services: Services
    vram: VramBook
    footprints: Footprints
    mailbox: Mailbox
    emit: Emit
    kill_grace_s: float
    clip_chars: int

    def adopt(self, job: Job, now: float) -> Taken | None:
        """Take back the running attempt of ``job`` (see the module's docstring);
        None when it is not this broker's to take (it is stopped and ends
        interrupted)."""
        jobtype = self.registry.types.get(job.type)
        if jobtype is None or jobtype.launch is LaunchMode.SERVE:
            return None  # a warm server's job: its server is not an attempt's supervisor
        sandbox = self.launching.sandbox_for(jobtype)
        mode = LaunchMode.CONTAINER if jobtype.launch is LaunchMode.SERVICE else jobtype.launch
        if sandbox is None and not isinstance(self.launchers.get(mode), HostLauncher):
            return None
        found = [a for a in self.store.attempts(job.id) if a.number == job.attempts]
        if not found or found[0].ended_at is not None:
            return None
        # the store may not have its pid yet (the broker died right after the
        # launch): its supervisor's own records say whether it ran
        attempt = found[0]
        attempt_dir = self.launching.attempt_dir(job.id, attempt.number)
        marker = attempt_marker(self.instance, job.id, attempt.number)
        run = RunningAttempt(job=job, attempt=attempt, jobtype=jobtype, attempt_dir=attempt_dir)
        live = live_supervisor(str(attempt_dir), marker)
        if jobtype.launch is LaunchMode.SERVICE:
            return self._service(run, sandbox, live, now)
        cleanup = self._cleanup(sandbox, job.id, attempt.number)
        if live is not None:
            if attempt.pid is None:
                self.store.set_attempt_pid(job.id, attempt.number, live.pid)
            self._hold(run, live.pid, now)
            run.thread = watch_adopted(
                self._request(run), live.pid, run.stop, self.mailbox.post, cleanup
            )
            self.emit("attempt_adopted", job=job.id, attempt=attempt.number, pid=live.pid)
            return Taken(marker, live=True)
        record = recorded_end(str(attempt_dir))
        if record is None:
            return None
        self._hold(run, attempt.pid, now)
        self.mailbox.post(recorded_result(self._request(run), attempt.pid, record))
        if cleanup is not None:
            cleanup()
        self.emit(
            "attempt_end_recovered", job=job.id, attempt=attempt.number, exit_code=record.exit_code
        )
        return Taken(marker, live=False)

    def _cleanup(
        self, sandbox: SandboxLauncher | None, job_id: str, number: int
    ) -> Callable[[], None] | None:
        if sandbox is None:
            return None
        return functools.partial(sandbox.release_adopted, self.instance, job_id, number)

    def _service(
        self,
        run: RunningAttempt,
        sandbox: SandboxLauncher | None,
        live: LiveSupervisor | None,
        now: float,
    ) -> Taken | None:
        """A service: taken back only if it still runs and answers its health check."""
        job, attempt = run.job, run.attempt
        recorded = attempt.pid if attempt.pid is not None else live.pid if live else None
        if recorded is None:
            return None
        pid: int | None = recorded
        if sandbox is not None and sandbox.runtime.needs_image:
            pid = sandbox.adoptable_pid(self.instance, job.id, attempt.number, recorded)
        marker = attempt_marker(self.instance, job.id, attempt.number)
        own = live is not None and live.pid == pid
        if pid is None or not (own or carries(pid, marker)):
            return None
        run.pid = pid
        why = self.services.adopt(run, pid, now)
        if why is not None:
            self.emit("service_not_adopted", job=job.id, attempt=attempt.number, why=why)
            return None
        self._hold(run, pid, now)
        cleanup = self._cleanup(sandbox, job.id, attempt.number)
        run.thread = watch_adopted(self._request(run), pid, run.stop, self.mailbox.post, cleanup)
        self.emit("service_adopted", job=job.id, attempt=attempt.number, pid=pid)
        return Taken(marker, live=True)

    def _hold(self, run: RunningAttempt, pid: int | None, now: float) -> None:
        """Hold the attempt's memory on the ledger again, and make it this broker's."""
        run.pid = pid
        gpu = run.attempt.gpu_uuid
        if gpu is not None and pid is not None:  # no pid: it ended before one was stored
            self.vram.start(
                run.holder,
                gpu,
                type_name=run.jobtype.name,
                job_id=run.job.id,
                nbytes=self.footprints.of(run.jobtype, run.job.vram_bytes),
                coresident=run.jobtype.coresident,
                now=now,
            )
            self.vram.set_pid(run.holder, pid)
        self.attempts.by_job[run.job.id] = run

    def _request(self, run: RunningAttempt) -> LaunchRequest:
        return LaunchRequest(
            job_id=run.job.id,
            attempt=run.attempt.number,
            argv=(),
            cwd=str(run.attempt_dir),
            env={},
            attempt_dir=str(run.attempt_dir),
            timeout_s=math.inf,
            clip_chars=self.clip_chars,
            kill_grace_s=self.kill_grace_s,
            instance=self.instance,
        )
