"""Failure classification: what an attempt's end means for its job. Pure.

See DESIGN.md, "Failure classification". Infrastructure failures are retried up
to the type's ``max_retries``, then the job is quarantined with its attempt
history; the job's own failure and a timeout are never retried. An attempt the
broker's own end interrupted spends no retry: it counts against a limit of its
own (``max_interruptions``), which still sets aside a job that takes the broker
down every time it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gpuwarden.core.preempt import CHECKPOINT_EXIT
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
    GPU_FAULT = "gpu_fault"  # infrastructure: its GPU reported a hardware fault (Xid)
    KILLED = "killed"  # infrastructure: SIGKILL from outside (the kernel's OOM killer?)
    CUDA_OOM_SHARED = "cuda_oom_shared"  # infrastructure: CUDA OOM beside another job
    CUDA_OOM = "cuda_oom"  # CUDA OOM with the GPU to itself: its footprint is wrong
    #: the broker failed while it completed the attempt (a bug): the job fails
    INTERNAL_ERROR = "internal_error"
    #: asked to yield (preemption), it saved its state and exited 6: re-queued,
    #: no retry spent, resumed with ``GPUWARDEN_RESUME=1``
    CHECKPOINTED = "checkpointed"
    #: asked to yield, it did not exit within its grace: stopped and re-queued,
    #: counted against its interruptions (``max_interruptions``), no retry spent
    PREEMPTED = "preempted"
    #: the kernel killed it (OOM kill in its memory cgroup) for passing its own
    #: RAM cap (``ram_gib``): the job's own failure, deterministic, not retried
    RAM_CAP_EXCEEDED = "ram_cap_exceeded"
    #: a service did not become healthy, or stayed unhealthy, past its
    #: ``health_grace_s``: stopped, retried, then quarantined (infrastructure)
    SERVICE_UNHEALTHY = "service_unhealthy"
    #: it failed (exited non-zero, or without its outputs) while the node's own
    #: disk (its state and attempt folders) was full: the host's fault, retried
    HOST_FAULT = "host_fault"
    #: a VRAM lease whose holder stopped renewing it: its supervisor ended it at
    #: its deadline (SPEC.md, "VRAM leases"); final, not retried
    LEASE_EXPIRED = "lease_expired"


INFRASTRUCTURE = frozenset(
    {
        Outcome.LAUNCH_ERROR,
        Outcome.INTERRUPTED,
        Outcome.WORKER_FAILED,
        Outcome.GPU_FAULT,
        Outcome.KILLED,
        Outcome.CUDA_OOM_SHARED,
        Outcome.SERVICE_UNHEALTHY,
        Outcome.HOST_FAULT,
    }
)

#: how many times a job may be interrupted by the broker's own end (a crash, a
#: SIGKILL) before it is quarantined: interruptions do not spend ``max_retries``
DEFAULT_MAX_INTERRUPTIONS = 5

#: what a process's stderr says when CUDA (or the simulated GPU) ran out of memory
CUDA_OOM_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "CUDA_ERROR_OUT_OF_MEMORY")


def is_cuda_oom(stderr: str) -> bool:
    return any(m in stderr for m in CUDA_OOM_MARKERS)


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
    #: why it was interrupted, when not by the broker's own end (its supervisor
    #: died; its lease ran out and its supervisor stopped it), or None
    interrupted_why: str | None = None
    missing_outputs: tuple[str, ...] = ()
    timeout_s: float = 0.0
    stderr_tail: str = ""
    #: its stderr says CUDA ran out of memory
    cuda_oom: bool = False
    #: nothing else held memory on its GPU while it ran (an OOM is then its own)
    gpu_alone: bool = False
    #: it was stopped because its GPU reported a fault (the reason), or None
    gpu_fault: str | None = None
    #: it was stopped because its GPU reported an application error for it, or None
    app_error: str | None = None
    #: the container runtime, or the attempt's memory cgroup, recorded an OOM
    #: kill (None: no runtime and no cap, or unknown)
    oom_killed: bool | None = None
    #: the job's RAM cap that was in place, enforced by the kernel (0: none)
    ram_cap_bytes: int = 0
    #: the sandbox stopped it for passing one of its limits, and which
    #: (``"output past 16384 MiB"``), or None: the job's own failure
    limit_exceeded: str | None = None
    #: it was asked to checkpoint (preempted) for this job, or None
    preempted_for: str | None = None
    #: the signal it was sent then
    checkpoint_signal: str = ""
    #: a service stopped for its health (the reason), or None
    service_unhealthy: str | None = None
    #: a service stopped by ``gpuwarden stop``: who asked, or None
    stopped_by: str | None = None
    #: the node's own disk (its state and attempt folders) was full when the
    #: attempt ended, as the node measured it (``statvfs``), said for a person; None
    #: when it was not. A failure then is the host's, not the job's
    host_disk_full: str | None = None
    #: a VRAM lease's end (its supervisor stopped its holder at the lease's
    #: deadline): why, in words, and whether it expired (else its holder ended it)
    lease_end: str | None = None
    lease_expired: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    target: JobState
    reason: str


def classify(
    facts: AttemptFacts,
    *,
    attempt: int,
    max_retries: int,
    interruptions: int = 0,
    max_interruptions: int = DEFAULT_MAX_INTERRUPTIONS,
    checkpoints: int = 0,
) -> Verdict:
    """Map an ended attempt to the job's next state and a reason a person can read.

    ``interruptions`` is how many of the job's earlier attempts ended
    ``interrupted`` (:func:`interruptions_before`). They spend no retry: the
    infrastructure failure of attempt ``N`` is failure ``N - interruptions``
    against ``max_retries``. An interruption itself is re-queued while the job's
    interruptions, this one included, are at most ``max_interruptions``, and
    quarantined past that: a job that takes the broker down every time it runs
    must not do so for ever. ``checkpoints`` is how many ended ``checkpointed``
    (:func:`checkpoints_before`): they spend neither.
    """
    outcome, reason = _outcome(facts)
    if outcome is Outcome.CHECKPOINTED:
        return Verdict(outcome, JobState.QUEUED, f"{reason}; re-queued without spending a retry")
    if outcome in (Outcome.INTERRUPTED, Outcome.PREEMPTED):
        count = interruptions + 1
        if count <= max_interruptions:
            return Verdict(
                outcome,
                JobState.QUEUED,
                f"{reason}; re-queued without spending a retry "
                f"(interruption {count}/{max_interruptions})",
            )
        if outcome is Outcome.PREEMPTED:
            why = (
                f"{count} of its attempts were interrupted (max_interruptions = "
                f"{max_interruptions}), the last by ignoring its checkpoint signal"
            )
        else:
            why = (
                f"the broker stopped unexpectedly during {count} of its attempts "
                f"(max_interruptions = {max_interruptions}), so the job may be what takes "
                "the broker down"
            )
        return Verdict(
            outcome,
            JobState.QUARANTINED,
            f"{reason}; quarantined: {why} (each attempt's reason: `gpuwarden show JOB`)",
        )
    if outcome in INFRASTRUCTURE:
        target, why = retry_or_quarantine(
            reason,
            attempt=attempt,
            max_retries=max_retries,
            interruptions=interruptions + checkpoints,
        )
        return Verdict(outcome, target, why)
    target = {
        Outcome.SUCCEEDED: JobState.DONE,
        Outcome.CANCELLED: JobState.CANCELLED,
    }.get(outcome, JobState.FAILED)
    return Verdict(outcome, target, reason)


def retry_or_quarantine(
    reason: str,
    *,
    attempt: int,
    max_retries: int,
    interruptions: int = 0,
    where: str = "",
) -> tuple[JobState, str]:
    """The job's next state after an infrastructure failure of attempt ``attempt``,
    and the reason with what was decided added: queued again while its failures
    (attempts less ``interruptions``) are at most ``max_retries``, quarantined past
    that. The broker (through :func:`classify`) and the cluster's coordinator (an
    expired lease, a node's retry) decide with this one rule; ``where`` says over
    what the attempts were counted (the coordinator's " on all nodes")."""
    failures = attempt - interruptions
    if failures <= max_retries:
        return JobState.QUEUED, f"{reason}; retrying ({failures}/{max_retries})"
    return (
        JobState.QUARANTINED,
        f"{reason}; quarantined after {attempt} attempt{'s' if attempt != 1 else ''}{where} "
        "(each attempt's reason: `gpuwarden show JOB`)",
    )


#: outcomes that count against a job's ``max_interruptions`` (and spend no retry)
INTERRUPTIONS = frozenset({Outcome.INTERRUPTED.value, Outcome.PREEMPTED.value})


def interruptions_before(outcomes: Iterable[str | None]) -> int:
    """How many of a job's earlier attempts (their stored outcomes) were interrupted:
    by the broker's own end, or stopped after ignoring a checkpoint signal."""
    return sum(1 for o in outcomes if o in INTERRUPTIONS)


def checkpoints_before(outcomes: Iterable[str | None]) -> int:
    """How many of a job's earlier attempts ended checkpointed (they spend nothing)."""
    return sum(1 for o in outcomes if o == Outcome.CHECKPOINTED.value)


def internal_error(what: str) -> Verdict:
    """The verdict when completing an attempt failed inside the broker: the job
    fails (it is not re-run: the same bug would meet it again) and says why."""
    return Verdict(
        Outcome.INTERNAL_ERROR,
        JobState.FAILED,
        f"internal error while the broker completed the attempt: {what} "
        "(a gpuwarden bug: the broker's log has the traceback)",
    )


def _preempted(f: AttemptFacts, for_job: str) -> tuple[Outcome, str]:
    if f.exit_code != CHECKPOINT_EXIT:
        return (
            Outcome.PREEMPTED,
            f"preempted for job {for_job}: it did not exit within its checkpoint grace after "
            f"{f.checkpoint_signal}, so it was stopped",
        )
    return (
        Outcome.CHECKPOINTED,
        f"checkpointed on {f.checkpoint_signal} (exit {CHECKPOINT_EXIT}), yielding to job "
        f"{for_job}; it resumes with GPUWARDEN_RESUME=1",
    )


def _ram_cap_reason(cap_bytes: int, exit_code: int | None) -> str:
    cap = f"{cap_bytes / 2**30:.2f} GiB"
    fix = "raise ram_gib or use less memory"
    if exit_code in (-9, 137):
        return (
            f"killed for memory: it passed its RAM cap of {cap} (ram_gib) and the kernel "
            f"stopped it (OOM kill in its memory cgroup); {fix}"
        )
    return (
        f"killed for memory: it passed its RAM cap of {cap} (ram_gib) and the kernel killed "
        f"a process of it (OOM kill in its memory cgroup; it then exited with code "
        f"{exit_code}); {fix}"
    )


def _failed(f: AttemptFacts) -> tuple[Outcome, str]:
    """The outcome of an attempt that exited non-zero (not stopped, not timed out)."""
    tail = f": {f.stderr_tail}" if f.stderr_tail else ""
    if f.ram_cap_bytes > 0 and f.oom_killed:
        return Outcome.RAM_CAP_EXCEEDED, _ram_cap_reason(f.ram_cap_bytes, f.exit_code)
    if f.host_disk_full is not None:
        return (
            Outcome.HOST_FAULT,
            f"the job exited with code {f.exit_code} while {f.host_disk_full}: "
            f"the host's fault, not the job's{tail}",
        )
    if f.cuda_oom and f.gpu_alone:
        return (
            Outcome.CUDA_OOM,
            "CUDA out of memory with the GPU to itself: its footprint is too small "
            f"(raised for the next jobs){tail}",
        )
    if f.cuda_oom:
        return Outcome.CUDA_OOM_SHARED, f"CUDA out of memory beside another job{tail}"
    if f.exit_code in (-9, 137):
        if f.oom_killed:
            return (
                Outcome.KILLED,
                "killed for memory: the container runtime recorded an OOM kill "
                "(exit 137; raise the type's ram_gib or [sandbox] memory_gib)",
            )
        if f.oom_killed is False:
            return (
                Outcome.KILLED,
                "killed by SIGKILL from outside gpuwarden (exit 137; the container "
                "runtime recorded no OOM kill)",
            )
        return (
            Outcome.KILLED,
            "killed by SIGKILL from outside gpuwarden (the kernel's out-of-memory "
            "killer, or someone else)",
        )
    return Outcome.JOB_FAILED, f"the job exited with code {f.exit_code}{tail}"


def _outcome(f: AttemptFacts) -> tuple[Outcome, str]:
    if f.launch_error is not None:
        return Outcome.LAUNCH_ERROR, f"launch error: {f.launch_error}"
    if f.lease_end is not None:
        return (Outcome.LEASE_EXPIRED if f.lease_expired else Outcome.SUCCEEDED), f.lease_end
    if f.interrupted:
        return (
            Outcome.INTERRUPTED,
            f.interrupted_why or "the broker stopped unexpectedly while the job ran",
        )
    if f.gpu_fault is not None:
        return Outcome.GPU_FAULT, f"its GPU reported a fault ({f.gpu_fault}); it was stopped"
    if f.app_error is not None:
        return Outcome.JOB_FAILED, f"its GPU reported an error in the job: {f.app_error}"
    if f.limit_exceeded is not None:
        return (
            Outcome.JOB_FAILED,
            f"{f.limit_exceeded}: the sandbox stopped the job (a limit of [sandbox]; not retried)",
        )
    if f.worker_error is not None and not f.stopped:
        return Outcome.WORKER_FAILED, f"its warm server failed: {f.worker_error}"
    if f.stopped and f.cancel_requested:
        return Outcome.CANCELLED, "cancelled while running; its processes were stopped"
    if f.stopped and f.stopped_by is not None:
        return Outcome.SUCCEEDED, f"stopped by {f.stopped_by}"
    if f.service_unhealthy is not None:
        return Outcome.SERVICE_UNHEALTHY, f.service_unhealthy
    if f.preempted_for is not None and (
        f.exit_code == CHECKPOINT_EXIT or (f.stopped and not f.shutting_down)
    ):
        return _preempted(f, f.preempted_for)
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
        return _failed(f)
    if f.missing_outputs and f.host_disk_full is not None:
        return (
            Outcome.HOST_FAULT,
            f"the job did not write the output(s) asked for ({', '.join(f.missing_outputs)}) "
            f"while {f.host_disk_full}: the host's fault, not the job's",
        )
    if f.missing_outputs:
        return (
            Outcome.MISSING_OUTPUT,
            "the job exited 0 but did not write the output(s) asked for: "
            + ", ".join(f.missing_outputs),
        )
    return Outcome.SUCCEEDED, "done"


#: Xids that mean the GPU itself is sick: VRAM admission on it stops until an
#: operator clears it (NVIDIA's Xid catalogue: 48 double-bit ECC, 63/64 page
#: retirement or row remapping, 74 NVLink, 79 fallen off the bus, 92 high
#: single-bit ECC rate, 94/95 contained/uncontained ECC, 119 GSP timeout)
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119})
#: Xids caused by what a program did on the GPU: they fail the job, not the GPU
#: (13 graphics engine exception, 31 MMU fault, 43 reset channel, 45 preemptive
#: cleanup, 68 video processor exception, 109 context switch timeout)
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def xid_kind(code: int) -> str:
    """``"critical"``, ``"application"`` or ``"other"`` (logged only)."""
    if code in CRITICAL_XIDS:
        return "critical"
    if code in APPLICATION_XIDS:
        return "application"
    return "other"
