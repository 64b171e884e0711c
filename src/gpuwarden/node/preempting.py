"""The node's side of preemption at a safe point (the rule: :mod:`gpuwarden.core.preempt`).

:class:`Preemptions` gives the plan its victims (the running attempts of
preemptible types), carries out a :class:`~gpuwarden.core.preempt.Preempt`
(the type's checkpoint signal to the attempt's process group, an event), and
stops, through the normal stop path, an attempt that has not exited when its
grace ends (stop reason ``"preempt"``). How the attempt's end is judged is
:func:`gpuwarden.core.classify.classify` (``checkpointed`` or ``preempted``).

Everything here runs on the loop's thread.
"""

from __future__ import annotations

import os
import signal

from gpuwarden.core.ledger import parts_of
from gpuwarden.core.preempt import Preempt, Victim
from gpuwarden.launch import reaper
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit, RunningAttempt


def signal_group(pid: int, name: str) -> bool:
    """Send the signal ``name`` to the process group that ``pid`` leads (an
    attempt's main process starts its own session). False when ``pid`` is gone
    or leads no group (it is not sent to anything else then)."""
    found = reaper.stat(pid)
    if found is None or found[2] != pid:
        return False
    try:
        os.killpg(pid, signal.Signals[name])
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Preemptions:
    """Preemptions on this node: asked, signalled, and ended after their grace."""

    def __init__(self, *, attempts: AttemptRunner, emit: Emit) -> None:
        self.attempts = attempts
        self.emit = emit

    def victims(self) -> tuple[Victim, ...]:
        """The running attempts the plan may ask to checkpoint (and those asked): a
        multi-GPU attempt once per GPU, under the name of its holding there."""
        return tuple(
            Victim(
                job_id=run.job.id,
                holder=part,
                gpu_uuid=gpu,
                priority=run.job.priority,
                since=run.attempt.started_at,
                min_run_s=run.jobtype.min_run_s,
                signal=run.jobtype.checkpoint_signal,
                grace_s=run.jobtype.checkpoint_grace_s,
                preempting_for=run.preempting_for,
            )
            for run in self.attempts
            if run.jobtype.preemptible
            and run.pid is not None  # its process runs: the signal has somewhere to go
            and (run.stop_reason is None or run.preempting_for is not None)
            for part, gpu in zip(
                parts_of(run.holder, len(run.attempt.gpus)), run.attempt.gpus, strict=True
            )
        )

    def ask(self, decision: Preempt, now: float) -> bool:
        """Send the victim its checkpoint signal, once; False when it is no longer
        running here as the plan saw it."""
        run = self.attempts.by_job.get(decision.job_id)
        if (
            run is None
            or run.pid is None
            or run.preempting_for is not None
            or run.stop_reason is not None
        ):
            return False
        run.preempting_for = decision.for_job
        run.preempt_deadline = now + decision.grace_s
        sent = signal_group(run.pid, decision.signal)
        self.emit(
            "preemption_requested",
            job=run.job.id,
            attempt=run.attempt.number,
            for_job=decision.for_job,
            signal=decision.signal,
            gpu=decision.gpu_uuid,
            grace_s=decision.grace_s,
            sent=sent,
            reason=decision.reason,
        )
        if not sent:  # its process is gone already: its end is on its way
            run.preempt_deadline = now
        return True

    def overdue(self, now: float) -> None:
        """Stop (the normal stop path) each asked attempt whose grace has ended."""
        for run in self.attempts:
            if _overdue(run, now):
                run.stop_reason = "preempt"
                run.stop.set()
                self.emit(
                    "preemption_grace_ended",
                    job=run.job.id,
                    attempt=run.attempt.number,
                    for_job=run.preempting_for,
                )


def _overdue(run: RunningAttempt, now: float) -> bool:
    return (
        run.preempting_for is not None and run.stop_reason is None and now >= run.preempt_deadline
    )
