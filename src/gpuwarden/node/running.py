"""What the broker loop keeps per running attempt, and what worker threads post
to it. Worker threads only ever create these messages and post them to the
loop's :class:`Mailbox`; the loop reads them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.core.model import Attempt, Job, JobType
from gpuwarden.core.runtime import Capabilities, Reading
from gpuwarden.launch.base import Joinable, LaunchResult
from gpuwarden.launch.reaper import StopSignal
from gpuwarden.launch.warmproc import LoadReport
from gpuwarden.node.warmpool import WarmServer

#: how the broker's collaborators write an event (``emit(kind, **detail)``)
Emit = Callable[..., None]
#: how they record a failed step (``on_error(where, exc)``) without stopping the loop
OnError = Callable[[str, Exception], None]
#: where they take the time from (the broker's clock)
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Started:
    """Posted by a worker thread as soon as the attempt's main process runs."""

    job_id: str
    attempt: int
    pid: int


@dataclass(frozen=True, slots=True)
class ServerNote:
    """Posted by a warm server's thread: it got a PID, loaded, or is gone."""

    type: str
    epoch: int
    what: str  # "pid", "loaded" or "gone"
    pid: int | None = None
    report: LoadReport | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ExchangeNote:
    """Posted by a warm server's job thread before the job's result: what its
    exchange slot showed (section 12 of SPEC.md, "Exchange folder")."""

    job_id: str
    attempt: int
    type: str
    epoch: int
    #: what the server had left under the slot's name ("symlink", ...), or None
    cleared: str | None = None
    #: entries that could not be used, as ``{"path", "kind", "why"}``
    refused: tuple[dict[str, str], ...] = ()


@dataclass
class RunningAttempt:
    """An attempt this broker started and has not drained yet (loop-owned)."""

    job: Job
    attempt: Attempt
    jobtype: JobType
    attempt_dir: Path
    #: set to stop the attempt; it tells the reaper at once
    stop: threading.Event = field(default_factory=StopSignal)
    #: what ends with the attempt: its worker thread, or the reaper's handle
    thread: Joinable | None = None
    #: "cancel", "shutdown", "preempt", "service_stop" or "service_unhealthy"
    stop_reason: str | None = None
    server: WarmServer | None = None  # the warm server it runs on (serve types)
    #: why its GPU stopped it ("gpu_fault" or "app_error" stop reasons), why its
    #: health did ("service_unhealthy"), or who stopped it ("service_stop")
    fault: str | None = None
    #: what its warm server's exchange slot refused (an :class:`ExchangeNote`)
    exchange_refused: list[dict[str, str]] = field(default_factory=list)
    #: a runtime type's job: the managed runtime it uses (its name here)
    runtime: str | None = None
    #: its processes are in its main process's tree: their RAM is measured
    ram_measured: bool = False
    #: its main process (from its ``Started`` note), None until it runs
    pid: int | None = None
    #: asked to checkpoint (preempted) for this job, and until when it may take
    preempting_for: str | None = None
    preempt_deadline: float = 0.0
    #: the previous attempt's output folder, carried into this one's (it resumes
    #: after a checkpoint or a preemption: ``GPUWARDEN_RESUME=1``), or None
    resume_from: Path | None = None
    #: its GPUs' lock files (``gpu_lock``), their ``flock`` held until its end is drained
    locks: list[int] = field(default_factory=list)

    @property
    def holder(self) -> str:
        """The attempt's name in the VRAM ledger."""
        return f"{self.job.id}/{self.attempt.number}"


#: what a worker thread posts to the loop
@dataclass(frozen=True, slots=True)
class RuntimeNote:
    """Posted by the managed runtimes' poller (:mod:`gpuwarden.node.runtimes`): what
    one look at a runtime found: its process tree, and its reading or the error."""

    name: str
    at: float
    pids: frozenset[int]
    reading: Reading | None = None
    capabilities: Capabilities | None = None
    error: str = ""
    #: a release was made (the calls), refused ("not asked: ...") or "failed"
    released: str = ""


@dataclass(frozen=True, slots=True)
class ServiceNote:
    """A service's health check, from its health thread: passed or not, and what
    a failed one said."""

    job_id: str
    attempt: int
    ok: bool
    error: str
    at: float


Message = LaunchResult | Started | ServerNote | ExchangeNote | RuntimeNote | ServiceNote


class Mailbox:
    """Where worker threads post to the loop, and what wakes it: a posted message
    wakes the loop at once (it need not wait for its next tick)."""

    def __init__(self) -> None:
        self._messages: queue.Queue[Message] = queue.Queue()
        self._wake = threading.Event()

    def post(self, message: Message) -> None:
        """Hand ``message`` to the loop and wake it."""
        self._messages.put(message)
        self._wake.set()

    def put(self, message: Message) -> None:
        """Hand ``message`` to the loop for its next pass, without waking it (a
        process's PID; a report the loop hands back to itself to try again)."""
        self._messages.put(message)

    def take(self) -> Message | None:
        """The next message, or None when there is none."""
        try:
            return self._messages.get_nowait()
        except queue.Empty:
            return None

    def wake(self) -> None:
        self._wake.set()

    def wait(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if woken (the wake is used up); True if woken."""
        woken = self._wake.wait(seconds)
        self._wake.clear()
        return woken
