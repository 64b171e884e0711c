"""What a broker does at its start with the attempts an earlier run left.

An earlier run of this node (the same instance: node name and state directory)
may have stopped or died with attempts running. Each is taken back first
(``adopt``: :mod:`gpuwarden.node.adoption`): one whose supervisor still runs
goes on as this broker's (its processes, its container or its cgroups are left
alone); one whose supervisor recorded its end is judged from that record. Every
other process it left (attempts with neither, warm servers) is stopped, found by
its instance marker, never by a bare PID; its containers are removed, and the
attempt ends
interrupted, judged by :func:`gpuwarden.core.classify.classify` (an interruption
spends no retry, up to the type's limit), and the memory it held counts in the
ledger until the probe shows it free (the reclaim gate).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuwarden.core import jobcontrol
from gpuwarden.core.classify import AttemptFacts, classify, interruptions_before
from gpuwarden.core.model import Job, JobType
from gpuwarden.errors import TransitionError
from gpuwarden.launch.base import attempt_marker, attempt_name_of
from gpuwarden.launch.host import find_attempt_processes, find_instance_processes, stop_processes
from gpuwarden.launch.sandbox import SandboxLauncher
from gpuwarden.node.adoption import Taken
from gpuwarden.node.attempts import Launching
from gpuwarden.node.measured import Footprints
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit, OnError
from gpuwarden.node.vram import VramBook
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store


class Recovery:
    """Ends what an earlier run of this broker's instance left running."""

    def __init__(
        self,
        *,
        instance: str,
        kill_grace_s: float,
        store: Store,
        registry: Registry,
        sandbox: SandboxLauncher | None,
        vram: VramBook,
        footprints: Footprints,
        attempts: AttemptRunner,
        launching: Launching,
        emit: Emit,
        on_error: OnError,
        adopt: Callable[[Job, float], Taken | None] | None = None,
        keep: Iterable[str] = (),
    ) -> None:
        self.instance = instance
        self.kill_grace_s = kill_grace_s
        self.store = store
        self.registry = registry
        self.sandbox = sandbox
        self.vram = vram
        self.footprints = footprints
        self.attempts = attempts
        self.launching = launching
        self.emit = emit
        self.on_error = on_error
        #: takes back a running attempt, or None: it is stopped
        self.adopt = adopt
        #: markers of processes taken over already (warm servers: node/warmkeep.py)
        self.keep = tuple(keep)

    def run(self, now: float) -> None:
        """Adopt the running services that still answer; stop every other leftover
        process and container, end each other attempt the store shows running,
        then judge the held jobs again (their dependencies)."""
        running = self.store.running_jobs()
        adopted: dict[str, Taken] = {}
        for job in running:
            if self.adopt is not None and (taken := self.adopt(job, now)) is not None:
                adopted[job.id] = taken
        live = {j: t.marker for j, t in adopted.items() if t.live}
        leftovers = find_instance_processes(self.instance, but=[*live.values(), *self.keep])
        reaped_all, survivors_all = stop_processes(leftovers, self.kill_grace_s)
        if leftovers:
            self.emit("leftovers_stopped", reaped=reaped_all, survivors=survivors_all)
        if self.sandbox is not None:
            keep = [
                attempt_name_of(self.instance, j.id, j.attempts) for j in running if j.id in live
            ]
            removed = self.sandbox.remove_leftovers(self.instance, but=keep)
            if removed:
                self.emit("leftover_containers_removed", containers=removed)
        for job in running:
            if job.id not in adopted:
                self.end_interrupted(job, now)
        settled = self.store.settle_dependencies(now=now)
        if settled:
            self.emit("dependencies_settled", jobs=settled)

    def end_interrupted(self, job: Job, now: float) -> None:
        """End the attempt of ``job`` an earlier run left running: interrupted."""
        marker = attempt_marker(self.instance, job.id, job.attempts)
        reaped, survivors = stop_processes(find_attempt_processes(marker), self.kill_grace_s)
        jobtype = self.registry.types.get(job.type)
        attempts = self.store.attempts(job.id)
        last = attempts[-1] if attempts else None
        if last is not None and last.gpu_uuid is not None and last.pid is not None and jobtype:
            self._reclaim(job, jobtype, f"{job.id}/{last.number}", last.gpu_uuid, last.pid, now)
        verdict = classify(
            AttemptFacts(
                exit_code=None,
                interrupted=True,
                stopped=job.cancel_requested,
                cancel_requested=job.cancel_requested,
            ),
            attempt=jobcontrol.attempt_in_round(job.attempts, job.requeued_after),
            max_retries=jobtype.max_retries if jobtype else 0,
            interruptions=interruptions_before(
                jobcontrol.round_attempts(
                    ((a.number, a.outcome) for a in attempts),
                    job.requeued_after,
                    before=job.attempts,
                )
            ),
            # a type no longer registered could never run again: set it aside
            max_interruptions=self.attempts.max_interruptions(jobtype) if jobtype else 0,
        )
        reason = verdict.reason
        if survivors:
            reason += f"; processes {survivors} survived SIGKILL"
        try:
            self.store.finish_attempt(
                job.id,
                job.attempts,
                target=verdict.target,
                now=now,
                outcome=verdict.outcome.value,
                reason=reason,
                result=self.launching.result_extra(job, None, None, {"message": reason}),
            )
        except TransitionError as exc:
            self.on_error("recover", exc)
            return
        self.emit("attempt_recovered", job=job.id, attempt=job.attempts, reaped=reaped)

    def _reclaim(  # noqa: PLR0917 - the attempt's facts, each named at the call
        self, job: Job, jobtype: JobType, holder: str, gpu: str, pid: int, now: float
    ) -> None:
        """Rebuild the ledger from the store: the memory an interrupted attempt held
        (``holder``, on ``gpu``, its process ``pid``) counts until the probe shows
        its process's share gone (the reclaim gate)."""
        self.vram.start(
            holder,
            gpu,
            type_name=jobtype.name,
            job_id=job.id,
            nbytes=self.footprints.of(jobtype, job.vram_bytes),
            coresident=jobtype.coresident,
            now=now,
        )
        self.vram.set_pid(holder, pid)
        self.vram.end(holder, now)
