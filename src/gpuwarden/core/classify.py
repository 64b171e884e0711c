"""Failure classification: what an attempt's end means for its job. Pure.

See DESIGN.md, "Failure classification". Infrastructure failures are retried up
to the type's ``max_retries``; the job's own failure and a timeout never are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpuwarden.core.states import JobState


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    JOB_FAILED = "job_failed"  # non-zero exit: the job's own failure
    MISSING_OUTPUT = "missing_output"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"  # the broker stopped while the job ran
    LAUNCH_ERROR = "launch_error"  # infrastructure: could not start
    INTERRUPTED = "interrupted"  # infrastructure: the broker died while the job ran
    WORKER_FAILED = "worker_failed"  # infrastructure: its warm server died or hung


INFRASTRUCTURE = frozenset({Outcome.LAUNCH_ERROR, Outcome.INTERRUPTED, Outcome.WORKER_FAILED})


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """What is known when an attempt has ended and its processes are gone."""

    exit_code: int | None
    timed_out: bool = False
    stopped: bool = False
    cancel_requested: bool = False
    shutting_down: bool = False
    launch_error: str | None = None
    worker_error: str | None = None
    interrupted: bool = False
    missing_outputs: tuple[str, ...] = ()
    timeout_s: float = 0.0
    stderr_tail: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    target: JobState
    reason: str


def classify(facts: AttemptFacts, *, attempt: int, max_retries: int) -> Verdict:
    """Map an ended attempt to the job's next state and a reason a person can read."""
    outcome, reason = _outcome(facts)
    if outcome in INFRASTRUCTURE:
        if attempt <= max_retries:
            return Verdict(
                outcome, JobState.QUEUED, f"{reason}; retrying ({attempt}/{max_retries})"
            )
        return Verdict(
            outcome,
            JobState.FAILED,
            f"{reason}; gave up after {attempt} attempt{'s' if attempt != 1 else ''}",
        )
    target = {
        Outcome.SUCCEEDED: JobState.DONE,
        Outcome.CANCELLED: JobState.CANCELLED,
    }.get(outcome, JobState.FAILED)
    return Verdict(outcome, target, reason)


def _outcome(f: AttemptFacts) -> tuple[Outcome, str]:
    if f.launch_error is not None:
        return Outcome.LAUNCH_ERROR, f"launch error: {f.launch_error}"
    if f.interrupted:
        return Outcome.INTERRUPTED, "the broker stopped unexpectedly while the job ran"
    if f.worker_error is not None and not f.stopped:
        return Outcome.WORKER_FAILED, f"its warm server failed: {f.worker_error}"
    if f.stopped and f.cancel_requested:
        return Outcome.CANCELLED, "cancelled while running; its processes were stopped"
    if f.stopped:
        return (
            Outcome.SHUTDOWN,
            "the broker shut down while the job ran; it was stopped after the grace period",
        )
    if f.timed_out:
        return (
            Outcome.TIMED_OUT,
            f"timed out after {f.timeout_s:g} s; its processes were stopped and confirmed gone",
        )
    if f.exit_code != 0:
        tail = f": {f.stderr_tail}" if f.stderr_tail else ""
        return Outcome.JOB_FAILED, f"the job exited with code {f.exit_code}{tail}"
    if f.missing_outputs:
        return (
            Outcome.MISSING_OUTPUT,
            "the job exited 0 but did not write the output(s) asked for: "
            + ", ".join(f.missing_outputs),
        )
    return Outcome.SUCCEEDED, "done"
