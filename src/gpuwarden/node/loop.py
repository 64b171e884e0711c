"""The node broker: the single writer of its node's attempt state.

Each :meth:`Broker.tick` reads top to bottom: take in new bundles, drain the
completions that worker threads posted, pass cancel requests on, plan and start
attempts, write the results of finished bundles, publish status and events.
Worker threads only run launchers; they never touch the store or the broker's
state, they post a :class:`LaunchResult` that the loop drains.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from hashlib import sha256
from pathlib import Path
from typing import Any

from gpuwarden import faults, safefs
from gpuwarden.config import Config
from gpuwarden.core import policy
from gpuwarden.core.classify import (
    INFRASTRUCTURE,
    AttemptFacts,
    Outcome,
    Verdict,
    classify,
    internal_error,
    interruptions_before,
    is_cuda_oom,
    xid_kind,
)
from gpuwarden.core.model import MIB, Attempt, Event, Job, JobSpec, JobType, Lane, LaunchMode
from gpuwarden.core.states import JobState
from gpuwarden.errors import (
    GpuProbeError,
    GpuwardenError,
    TransitionError,
    ValidationError,
)
from gpuwarden.eventlog import EventLog, NullLog
from gpuwarden.gpu.base import GpuProbe, GpuReading
from gpuwarden.gpu.sim import SimProbe
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import QueueIntake, result_json
from gpuwarden.launch.base import (
    Launcher,
    LaunchRequest,
    LaunchResult,
    Mount,
    attempt_marker,
    inside_path,
)
from gpuwarden.launch.host import (
    find_attempt_processes,
    find_instance_processes,
    stop_processes,
)
from gpuwarden.launch.sandbox import SandboxLauncher, mounts_for
from gpuwarden.node import attemptfs
from gpuwarden.node.running import ExchangeNote, RunningAttempt, ServerNote, Started
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warm import WarmServing
from gpuwarden.node.warmpool import ServerState, WarmPool
from gpuwarden.registry import Registry
from gpuwarden.store.base import (
    NodeStatus,
    Store,
)

__all__ = ["RUN_TIME_WINDOW", "Broker", "result_json"]

log = logging.getLogger("gpuwarden.node.loop")

#: operator requests (gpu clear) are looked for this often
_REQUESTS_EVERY_S = 0.5

#: a type's run-time estimate looks at this many of its latest runs
RUN_TIME_WINDOW = 20

#: at most this many wait reasons go into the status row
_STATUS_WAITING_MAX = 1000

#: status is written at most this often, even while things change
_MIN_STATUS_GAP_S = 0.25

#: the broker's environment variables that pass on to a job
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "VIRTUAL_ENV")


class Broker(WarmServing):
    def __init__(
        self,
        *,
        config: Config,
        store: Store,
        probe: GpuProbe,
        registry: Registry,
        launchers: Mapping[LaunchMode, Launcher],
        roots: list[QueueRoot] | None = None,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.probe = probe
        self.registry = registry
        #: the node's launch rules, applied at submission (through the registry)
        #: and again at each start: the configuration may have changed meanwhile
        self.rules = config.launch_rules
        registry.rules = self.rules
        self.launchers = dict(launchers)
        container = self.launchers.get(LaunchMode.CONTAINER)
        #: sandboxed attempts (container types, and serve types' workers)
        self.sandbox = container if isinstance(container, SandboxLauncher) else None
        self.roots = list(roots or [])
        self.events = events or NullLog()
        self.clock = clock
        self.node = config.node_name
        self.accepting = True
        self._running: dict[str, RunningAttempt] = {}
        self._completions: queue.Queue[LaunchResult | Started | ServerNote | ExchangeNote] = (
            queue.Queue()
        )
        self.warm = WarmPool()
        #: set by a worker thread when it posts a completion, so the loop wakes at once
        self._wake = threading.Event()
        self._last_error: dict[str, Any] | None = None
        self._last_status = 0.0
        self._status_dirty = True  # something changed since the last status
        self._last_requests_check = 0.0
        self._readings: list[GpuReading] = []
        self._probe_error = ""
        self._observed_at = -1.0
        self.vram = VramBook(config.vram)
        self._footprints = {t: f.bytes for t, f in store.footprints().items()}
        #: per type, the run times of its latest succeeded attempts (newest last)
        self._run_times: dict[str, deque[float]] = {}
        for type_name, seconds in reversed(store.recent_run_times()):
            self._run_times.setdefault(type_name, deque(maxlen=RUN_TIME_WINDOW)).append(seconds)
        self._waits: dict[str, str] = {}
        self._socket_dir: Path | None = None
        #: the last event written to the event log: where the log's own cursor says
        #: (``serve --log``), or the store's latest event
        self._event_cursor = self.events.resume(store.last_event_id())
        self._jobs_dir = config.state_dir / "jobs"
        #: names this broker's processes: stable across restarts of the same node and
        #: state directory, so recovery finds (only) what an earlier run left
        self.instance = f"{self.node}-{sha256(str(config.state_dir).encode()).hexdigest()[:10]}"
        #: the queue roots' bundles: intake, results, recovery
        self.queues = QueueIntake(
            store=store,
            registry=registry,
            config=config,
            roots=self.roots,
            emit=self._emit,
            on_error=self._record_error,
            check=self.check_fits,
            clock=clock,
            wake=self.wake,  # a finished extraction is taken at once, not next tick
        )
        # said once, as the broker starts and before anything runs: every type that
        # would run unsandboxed here, and why (each such attempt is an event too)
        if summary := self.rules.unsandboxed_summary(registry.types.values()):
            log.warning("%s", summary)

    # -- the loop -----------------------------------------------------------

    def tick(self) -> None:
        """One pass of the loop. A failing step is recorded and the loop goes on."""
        for step in (
            self._operator_requests,
            self._intake,
            self._drain,
            self._pass_cancels,
            self._schedule,
            self._finish_bundles,
            self._publish,
        ):
            try:
                step(self.clock())
            except Exception as exc:  # the loop must outlive any one step
                self._record_error(step.__name__.strip("_"), exc)

    def wake(self) -> None:
        """Make the loop tick now (a signal arrived, or a test wants it)."""
        self._wake.set()

    def idle(self, seconds: float) -> None:
        """Wait until the next tick is due: ``seconds``, or less if woken."""
        self._wake.wait(seconds)
        self._wake.clear()

    def run(self, stop: threading.Event, *, force: threading.Event | None = None) -> None:
        """Tick until ``stop`` is set, then shut down gracefully (``force`` cuts the grace)."""
        self._emit("broker_started", pid=os.getpid(), probe=self.probe.kind)
        while not stop.is_set():
            self.tick()
            self._wake.wait(self.config.broker.poll_interval_s)
            self._wake.clear()
        self.shutdown(self.config.broker.shutdown_grace_s, force=force)

    def shutdown(self, grace_s: float, *, force: threading.Event | None = None) -> None:
        """Stop intake, give running attempts ``grace_s`` to finish, then stop them
        and record them failed with that reason. Returns once all are drained."""
        self.accepting = False
        self._emit("broker_stopping", running=len(self._running), grace_s=grace_s)
        deadline = self.clock() + grace_s
        while self._running and self.clock() < deadline:
            if force is not None and force.is_set():
                break
            self._drain(self.clock())
            time.sleep(min(0.05, self.config.broker.poll_interval_s))
        for run in self._running.values():
            run.stop_reason = "shutdown"
            run.stop.set()
            if run.server is not None and run.server.state is not ServerState.STOPPING:
                self._stop_server(run.server, "the broker is shutting down")
        for run in list(self._running.values()):
            if run.thread is not None:
                run.thread.join()
        for server in self.warm:
            if server.state is not ServerState.STOPPING:
                self._stop_server(server, "the broker is shutting down", wait=True)
        deadline = time.monotonic() + 60
        while len(self.warm) and time.monotonic() < deadline:
            self._drain(self.clock())
            time.sleep(0.02)
        self._drain(self.clock())
        if self._socket_dir is not None:
            with contextlib.suppress(OSError):  # only if empty: its sockets are gone
                self._socket_dir.rmdir()
        self._finish_bundles(self.clock(), force=True)
        self._emit("broker_stopped")
        self._publish(self.clock(), force=True, stopped=True)

    # -- recovery -----------------------------------------------------------

    def recover(self) -> None:
        """At start: end the attempts an earlier run left running, and decide what
        happens to every bundle left in ``processing/`` (each logged)."""
        now = self.clock()
        # every process an earlier run of this instance left (attempts, warm
        # servers) is stopped, found by its marker, never by a bare PID
        leftovers = find_instance_processes(self.instance)
        reaped_all, survivors_all = stop_processes(leftovers, self.config.broker.kill_grace_s)
        if leftovers:
            self._emit("leftovers_stopped", reaped=reaped_all, survivors=survivors_all)
        if self.sandbox is not None:
            removed = self.sandbox.remove_leftovers(self.instance)
            if removed:
                self._emit("leftover_containers_removed", containers=removed)
        for job in self.store.running_jobs():
            marker = attempt_marker(self.instance, job.id, job.attempts)
            reaped, survivors = stop_processes(
                find_attempt_processes(marker), self.config.broker.kill_grace_s
            )
            jobtype = self.registry.types.get(job.type)
            attempts = self.store.attempts(job.id)
            self._reclaim_interrupted(job, jobtype, attempts, now)
            verdict = classify(
                AttemptFacts(
                    exit_code=None,
                    interrupted=True,
                    stopped=job.cancel_requested,
                    cancel_requested=job.cancel_requested,
                ),
                attempt=job.attempts,
                max_retries=jobtype.max_retries if jobtype else 0,
                interruptions=interruptions_before(
                    a.outcome for a in attempts if a.number < job.attempts
                ),
                # a type no longer registered could never run again: set it aside
                max_interruptions=self.max_interruptions(jobtype) if jobtype else 0,
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
                    result=self._result_extra(job, None, None, {"message": reason}),
                )
            except TransitionError as exc:
                self._record_error("recover", exc)
                continue
            self._emit("attempt_recovered", job=job.id, attempt=job.attempts, reaped=reaped)
        self.queues.recover(now)
        self._status_dirty = True

    def _reclaim_interrupted(
        self, job: Job, jobtype: JobType | None, attempts: list[Attempt], now: float
    ) -> None:
        """Rebuild the ledger from the store: the memory an interrupted attempt held
        counts until the probe shows its process's share gone (the reclaim gate)."""
        last = attempts[-1] if attempts else None
        if last is None or last.gpu_uuid is None or last.pid is None or jobtype is None:
            return
        holder = f"{job.id}/{last.number}"
        self.vram.start(
            holder,
            last.gpu_uuid,
            type_name=jobtype.name,
            job_id=job.id,
            nbytes=self.footprint(jobtype, job.vram_bytes),
            coresident=jobtype.coresident,
            now=now,
        )
        self.vram.set_pid(holder, last.pid)
        self.vram.end(holder, now)

    # -- intake -------------------------------------------------------------

    def _intake(self, now: float) -> None:
        if not self.accepting:
            return
        if self.queues.intake(now):
            self._status_dirty = True

    # -- attempts -----------------------------------------------------------

    def _schedule(self, now: float) -> None:
        queued = self.store.queued_jobs() if self.accepting else []
        types: dict[str, JobType] = {}
        entries: list[policy.QueuedJob] = []
        for job in queued:
            if job.cancel_requested:  # asked while it ran; it must never run again
                self.store.transition(
                    job.id, JobState.CANCELLED, now=now, reason="cancelled before it ran again"
                )
                continue
            jobtype = self.registry.types.get(job.type)
            if jobtype is None:
                self.store.transition(
                    job.id,
                    JobState.FAILED,
                    now=now,
                    reason=f"job type {job.type} is not known to this broker (module removed?)",
                )
                continue
            types[job.id] = jobtype
            entries.append(self._queued_entry(job, jobtype))
        if len(self.vram.ledger) or any(e.lane is Lane.VRAM for e in entries):
            self._observe(now)  # the reclaim gate needs fresh readings while memory is held
        if not entries and not len(self.warm):
            if self._waits:
                self._waits.clear()
                self._status_dirty = True
            return
        snapshot = self._snapshot(tuple(entries))  # also when only warm servers may expire
        jobs = {j.id: j for j in queued}
        before = self._waits
        self._waits = {}
        for decision in policy.plan(snapshot, now):
            if isinstance(decision, policy.Wait):
                self._waits[decision.job_id] = decision.reason
            elif isinstance(decision, policy.Refuse):
                self.store.transition(
                    decision.job_id, JobState.FAILED, now=now, reason=decision.reason
                )
            elif isinstance(decision, policy.Evict):
                self._evict(decision)
            else:
                self._start(jobs[decision.job_id], types[decision.job_id], decision, now)
        if self._waits != before:
            self._status_dirty = True

    def max_interruptions(self, jobtype: JobType) -> int:
        """How often a job of ``jobtype`` may be interrupted by this broker's own
        end before it is quarantined: the type's own limit, else the broker's."""
        if jobtype.max_interruptions is not None:
            return jobtype.max_interruptions
        return self.config.broker.max_interruptions

    def footprint(self, jobtype: JobType, override: int | None = None) -> int:
        """The footprint a job is admitted with: its own or its type's declaration,
        raised to the type's measured peak (never lowered by it)."""
        return max(override or jobtype.vram_bytes, self._footprints.get(jobtype.name, 0))

    def run_time_estimate(self, type_name: str) -> float | None:
        """The longest of the type's latest runs: what backfilling plans with."""
        times = self._run_times.get(type_name)
        return max(times) if times else None

    def _queued_entry(self, job: Job, jobtype: JobType) -> policy.QueuedJob:
        vram = jobtype.lane is Lane.VRAM
        return policy.QueuedJob(
            id=job.id,
            type=job.type,
            lane=jobtype.lane,
            vram_bytes=self.footprint(jobtype, job.vram_bytes) if vram else 0,
            priority=job.priority,
            seq=job.seq,
            coresident=jobtype.coresident,
            expected_s=self.run_time_estimate(jobtype.name),
            serve=jobtype.launch is LaunchMode.SERVE,
            warm=jobtype.name in self.warm.by_type,
        )

    def _snapshot(self, queued: tuple[policy.QueuedJob, ...]) -> policy.Snapshot:
        return policy.Snapshot(
            queued=queued,
            gpus=self.vram.views(),
            running_cpu=sum(1 for r in self._running.values() if r.jobtype.lane is Lane.CPU),
            cpu_slots=self.config.broker.cpu_slots,
            accepting=self.accepting,
            vram_paused=f"the GPU probe failed: {self._probe_error}" if self._probe_error else "",
            warm=self.warm.views(),
        )

    def _observe(self, now: float) -> None:
        """Read the probe (once per tick at most) and let the VRAM book take it in."""
        if self._observed_at == now:
            return
        self._observed_at = now
        try:
            self._readings = self.probe.read()
        except GpuProbeError as exc:
            if not self._probe_error:
                self._emit("probe_failed", reason=exc.message)
            self._probe_error = exc.message  # admission fails closed
            return
        if self._probe_error:
            self._emit("probe_recovered")
        self._probe_error = ""
        for event in self.vram.observe(self._readings, now):
            kind = event.pop("event")
            if kind == "gpu_xid":
                self._on_xid(event["gpu"], int(event["xid"]))
                continue
            self._emit(kind, **event)
            self._status_dirty = True

    def _on_xid(self, gpu: str, code: int) -> None:
        """A GPU reported an Xid. A critical one stops VRAM admission there until an
        operator clears it, and its jobs go back to the queue as infrastructure
        failures; an application one fails the jobs running there; others are logged."""
        kind = xid_kind(code)
        self._emit("gpu_xid", gpu=gpu, xid=code, severity=kind)
        if kind == "other":
            return
        if kind == "critical":
            reason = (
                f"Xid {code}: check `nvidia-smi -q` and the kernel log (dmesg) on this host; "
                f"once fixed, `gpuwarden gpu clear {gpu}` (or a broker restart) resumes it"
            )
            self.vram.fault(gpu, reason)
            self._emit("gpu_fault", gpu=gpu, xid=code, reason=reason)
            for server in self.warm:
                if server.gpu == gpu and server.state is ServerState.IDLE:
                    self._stop_server(server, f"its GPU reported Xid {code}")
        for run in self._running.values():
            if run.attempt.gpu_uuid != gpu or run.stop_reason is not None:
                continue
            run.stop_reason = "gpu_fault" if kind == "critical" else "app_error"
            run.fault = f"Xid {code}"
            run.stop.set()
            if run.server is not None and run.server.state is not ServerState.STOPPING:
                self._stop_server(run.server, f"its GPU reported Xid {code}")
        self._status_dirty = True

    def _operator_requests(self, now: float) -> None:
        """Carry out what operators asked through the store (``gpuwarden gpu clear``)."""
        if now - self._last_requests_check < _REQUESTS_EVERY_S:
            return
        self._last_requests_check = now
        for gpu in self.store.take_gpu_clears(now=now):
            if self.vram.clear_fault(gpu):
                self._emit("gpu_fault_cleared", gpu=gpu)
                self._status_dirty = True
            else:
                self._emit("gpu_clear_ignored", gpu=gpu, reason="no fault on that GPU here")

    def check_fits(self, specs: list[JobSpec]) -> None:
        """Refuse, at submission, a job whose footprint exceeds every GPU here."""
        self._observe(self.clock())
        views = self.vram.views()
        for spec in specs:
            jobtype = self.registry.get(spec.type)
            if jobtype.lane is not Lane.VRAM:
                continue
            why = policy.never_fits(self.footprint(jobtype, spec.vram_bytes), views)
            if why is not None:
                raise ValidationError(f"job {spec.id} ({spec.type}) {why}")

    def _start(self, job: Job, jobtype: JobType, decision: policy.Start, now: float) -> None:
        gpu = decision.gpu_uuid
        refused = self.rules.refusal(jobtype)
        if refused is not None:  # accepted under another configuration
            self.store.transition(
                job.id, JobState.FAILED, now=now, reason=f"refused by the launch rules: {refused}"
            )
            return
        if self.rules.unsandboxed_warning(jobtype):  # the broker said so when it started
            self._emit("unsandboxed", job=job.id, type=jobtype.name)
        if jobtype.launch is LaunchMode.SERVE and gpu is not None:
            self._start_served(job, jobtype, decision, gpu, now)
            return
        launcher = self.launchers.get(jobtype.launch)
        if launcher is None:
            self.store.transition(
                job.id,
                JobState.FAILED,
                now=now,
                reason=f"launch mode {jobtype.launch.value!r} of {jobtype.name} is not "
                f"available on this node (available: "
                f"{', '.join([*(m.value for m in self.launchers), LaunchMode.SERVE.value])})",
            )
            return
        try:
            job, attempt = self.store.start_attempt(job.id, node=self.node, gpu_uuid=gpu, now=now)
        except TransitionError:
            return  # cancelled by a client between the snapshot and now
        faults.point("after_start_attempt")
        attempt_dir = self._jobs_dir / job.id / f"attempt-{attempt.number}"
        run = RunningAttempt(job=job, attempt=attempt, jobtype=jobtype, attempt_dir=attempt_dir)
        # from here on the attempt is this broker's: whatever fails below, it ends
        # through a completion (so it is never left running, and a cancel reaches it)
        self._running[job.id] = run
        self._waits.pop(job.id, None)
        self._status_dirty = True
        try:
            if gpu is not None:
                self.vram.start(
                    run.holder,
                    gpu,
                    type_name=jobtype.name,
                    job_id=job.id,
                    nbytes=self.footprint(jobtype, job.vram_bytes),
                    coresident=jobtype.coresident,
                    now=now,
                    expected_s=self.run_time_estimate(jobtype.name),
                    backfill_for=decision.backfill_for,
                )
            request = self._request(run, gpu, now)
            run.thread = threading.Thread(
                target=self._work,
                args=(launcher, request, run.stop),
                name=f"attempt-{job.id}-{attempt.number}",
                daemon=True,
            )
            run.thread.start()
        except Exception as exc:
            if not isinstance(exc, OSError | GpuwardenError):
                log.exception("could not prepare attempt %s", run.holder)
            run.thread = None
            self._post(
                LaunchResult(
                    job_id=job.id,
                    attempt=attempt.number,
                    exit_code=None,
                    started_at=now,
                    ended_at=self.clock(),
                    launch_error=f"could not prepare the attempt: {exc}",
                )
            )
            return
        faults.point("after_launch")

    def _make_attempt_dir(self, run: RunningAttempt, now: float) -> None:
        """Create the attempt's folder fresh; one already there is moved aside
        (never reused) and that is logged."""
        made = attemptfs.new_attempt_dir(self._jobs_dir, run.job.id, run.attempt.number, now=now)
        if made.moved_aside is not None:
            log.warning(
                "attempt folder %s was already there (the store lost commits?): moved to %s",
                made.path,
                made.moved_aside,
            )
            self._emit(
                "attempt_dir_moved_aside",
                job=run.job.id,
                attempt=run.attempt.number,
                moved_to=str(made.moved_aside),
            )

    def sandbox_owner(self, jobtype: JobType) -> tuple[int, int] | None:
        """Who owns the folders a sandboxed attempt (or warm server) writes: the
        sandbox's user and group when the broker runs as root (every runtime runs
        the job as that host user); None otherwise (nothing is chowned)."""
        sandbox = self.sandbox_for(jobtype)
        return None if sandbox is None else sandbox.job_owner

    def _params(self, run: RunningAttempt) -> tuple[Path, dict[str, Any]]:
        """The job's input directory, and its parameters with inputs made absolute."""
        job = run.job
        input_dir = Path(job.input_dir) if job.input_dir else run.attempt_dir / "inputs"
        params = dict(job.params)
        for spec in run.jobtype.params:
            if spec.type.value == "input" and spec.name in params:
                params[spec.name] = str(input_dir / params[spec.name])
        return input_dir, params

    def _base_env(self, gpu: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in _PASS_ENV}
        env.update(self.probe.job_env(gpu))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def sandbox_for(self, jobtype: JobType) -> SandboxLauncher | None:
        """The sandbox attempts of ``jobtype`` run in, or None (a host process)."""
        return self.sandbox if self.rules.sandboxed(jobtype) else None

    def gpu_access(self, gpu: str | None) -> tuple[str | None, tuple[Mount, ...]]:
        """What a sandbox needs to reach ``gpu``: the real device's UUID, or for
        the simulated GPU the folder that holds its state (and nothing else)."""
        if gpu is None:
            return None, ()
        if isinstance(self.probe, SimProbe):
            folder = str(self.probe.path.parent)
            return None, (Mount(folder, folder, writable=True),)
        return gpu, ()

    def _request(self, run: RunningAttempt, gpu: str | None, now: float) -> LaunchRequest:
        """Lay out the attempt's folder (fresh, mode 0700; what a sandboxed job
        writes belongs to the sandbox's user) and build its launch request."""
        job, jobtype = run.job, run.jobtype
        sandbox = self.sandbox_for(jobtype)
        owner = self.sandbox_owner(jobtype)
        out_dir = run.attempt_dir / "out"
        scratch = run.attempt_dir / "scratch"
        report = run.attempt_dir / "report"
        self._make_attempt_dir(run, now)
        subs = [out_dir, scratch, *([report] if sandbox else [])]
        if not job.input_dir:
            subs.append(run.attempt_dir / "inputs")
        for d in subs:
            safefs.make_dir(d, owner=owner)
        input_dir, params = self._params(run)
        params_path = run.attempt_dir / "params.json"
        weights = self.config.sandbox.weights_dir
        mounts: tuple[Mount, ...] = ()
        gpu_uuid: str | None = None
        if sandbox is not None:
            gpu_uuid, gpu_mounts = self.gpu_access(gpu)
            mounts = mounts_for(
                module_dir=jobtype.module_dir,
                input_dir=str(input_dir),
                output_dir=str(out_dir),
                scratch_dir=str(scratch),
                report_dir=str(report),
                params_file=str(params_path),
                weights_dir=str(weights) if weights is not None else None,
                scratch_bytes=int(self.config.sandbox.scratch_mib * MIB),
                extra=gpu_mounts,
            )
            # the job reads its input parameters as paths it can open: where the
            # sandbox sees them
            params = {
                k: inside_path(mounts, v) if _is_input(jobtype, k) else v for k, v in params.items()
            }
        # readable by the sandbox's user through its mount (the folder is 0700)
        attemptfs.write_new_file(params_path, json.dumps(params, indent=2).encode(), mode=0o644)
        env = self._base_env(gpu)
        env.update(
            {
                "GPUWARDEN_JOB_ID": job.id,
                "GPUWARDEN_JOB_TYPE": job.type,
                "GPUWARDEN_ATTEMPT_NUMBER": str(run.attempt.number),
                "GPUWARDEN_PARAMS": str(params_path),
                "GPUWARDEN_INPUT_DIR": str(input_dir),
                "GPUWARDEN_OUTPUT_DIR": str(out_dir),
                "GPUWARDEN_SCRATCH_DIR": str(scratch),
                "GPUWARDEN_RESULT": str((report if sandbox else run.attempt_dir) / "message.json"),
            }
        )
        if weights is not None:
            env["GPUWARDEN_WEIGHTS_DIR"] = str(weights)
        return LaunchRequest(
            job_id=job.id,
            attempt=run.attempt.number,
            argv=self.registry.argv(jobtype, sandbox.python if sandbox else None),
            cwd=jobtype.module_dir,
            env=env,
            attempt_dir=str(run.attempt_dir),
            timeout_s=jobtype.timeout_s,
            clip_chars=self.config.broker.clip_chars,
            kill_grace_s=self.config.broker.kill_grace_s,
            instance=self.instance,
            mounts=mounts,
            gpu_uuid=gpu_uuid,
            memory_bytes=jobtype.ram_bytes if sandbox is not None else 0,
        )

    def _work(self, launcher: Launcher, request: LaunchRequest, stop: threading.Event) -> None:
        """Worker thread: run the attempt, post the result. Touches nothing else."""

        def started(pid: int) -> None:
            self._completions.put(Started(request.job_id, request.attempt, pid))

        try:
            result = launcher.run(request, stop, started)
        except Exception as exc:  # a launcher bug must still end the attempt
            result = LaunchResult(
                job_id=request.job_id,
                attempt=request.attempt,
                exit_code=None,
                started_at=time.time(),
                ended_at=time.time(),
                launch_error=f"the launcher failed: {exc!r}",
            )
        self._completions.put(result)
        self._wake.set()

    def _drain(self, now: float) -> None:
        while True:
            try:
                result = self._completions.get_nowait()
            except queue.Empty:
                return
            if isinstance(result, ServerNote):
                self._on_server_note(result, now)
                continue
            run = self._running.get(result.job_id)
            if isinstance(result, ExchangeNote):
                self._on_exchange_note(run, result)
                continue
            if isinstance(result, Started):
                if run is not None and run.attempt.number == result.attempt:
                    self.vram.set_pid(run.holder, result.pid)
                    self.store.set_attempt_pid(run.job.id, run.attempt.number, result.pid)
                continue
            if run is None or run.attempt.number != result.attempt:
                self._emit(
                    "stale_report", job=result.job_id, attempt=result.attempt, action="dropped"
                )
                continue
            del self._running[result.job_id]
            self._status_dirty = True
            self._complete(run, result, now)

    def _on_exchange_note(self, run: RunningAttempt | None, note: ExchangeNote) -> None:
        if run is not None and run.attempt.number == note.attempt:
            run.exchange_refused = list(note.refused)
        if note.cleared is not None:
            self._emit(
                "exchange_slot_cleared",
                job=note.job_id,
                attempt=note.attempt,
                type=note.type,
                epoch=note.epoch,
                found=note.cleared,
            )

    def _complete(self, run: RunningAttempt, result: LaunchResult, now: float) -> None:
        """Record the attempt's end, then let the node's own state follow.

        Whatever goes wrong while judging the attempt (an output folder no walk can
        list, a bug), the attempt still ends: ``internal_error``, the job failed
        with the error named. Only a store that is unavailable for now (locked,
        unreachable) keeps it for the next tick.
        """
        holder = run.server.holder if run.server is not None else run.holder
        try:
            verdict, reason, extra = self._judge(run, result, holder)
        except Exception as exc:
            log.exception("judging attempt %s failed", run.holder)
            verdict = internal_error(repr(exc))
            reason = verdict.reason
            extra = {"message": reason, "outcome": verdict.outcome.value}
        self._record_end(run, result, verdict, reason=reason, extra=extra, now=now)
        faults.point("after_finish_attempt")
        # the record is written: now the node's own state follows, each step on its
        # own, so that one failing (a bug) does not leave a server busy or memory held
        steps: list[tuple[str, Callable[[], None]]] = [
            ("freeing its warm server", lambda: self._free_server(run, result, now)),
            ("raising its footprint", lambda: self._after_cuda_oom(run, verdict, holder, now)),
            ("measuring its memory", lambda: self._measure(run, now)),
            ("noting its run time", lambda: self._note_run_time(run, result, verdict)),
            ("touching its bundle", lambda: self._touch_bundle(run)),
        ]
        for where, step in steps:
            try:
                step()
            except Exception as exc:
                self._record_error(f"completing {run.holder}: {where}", exc)

    def _judge(
        self, run: RunningAttempt, result: LaunchResult, holder: str
    ) -> tuple[Verdict, str, dict[str, Any]]:
        """Classify the ended attempt; its reason, and its result (outputs, message)."""
        listing = attemptfs.list_outputs(run.attempt_dir)
        stderr_tail = next(
            (ln.strip() for ln in reversed(result.stderr.splitlines()) if ln.strip()), ""
        )[:300]
        facts = AttemptFacts(
            exit_code=result.exit_code,
            worker_error=result.worker_error,
            cuda_oom=run.attempt.gpu_uuid is not None and is_cuda_oom(result.stderr),
            gpu_alone=self.vram.alone(holder),
            gpu_fault=run.fault if run.stop_reason == "gpu_fault" else None,
            app_error=run.fault if run.stop_reason == "app_error" else None,
            timed_out=result.timed_out,
            stopped=result.stopped,
            cancel_requested=run.stop_reason == "cancel",
            shutting_down=run.stop_reason == "shutdown",
            launch_error=result.launch_error,
            oom_killed=result.oom_killed,
            limit_exceeded=result.limit_exceeded,
            missing_outputs=attemptfs.missing_outputs(run.job.outputs, listing),
            timeout_s=run.jobtype.timeout_s,
            stderr_tail=stderr_tail,
        )
        number, max_retries = run.attempt.number, run.jobtype.max_retries
        verdict = classify(facts, attempt=number, max_retries=max_retries)
        if verdict.outcome in INFRASTRUCTURE and number > 1:
            # earlier interruptions by the broker's own end spend no retry (rare:
            # the store is asked only for a retried infrastructure failure)
            earlier = [a.outcome for a in self.store.attempts(run.job.id) if a.number < number]
            verdict = classify(
                facts,
                attempt=number,
                max_retries=max_retries,
                interruptions=interruptions_before(earlier),
                max_interruptions=self.max_interruptions(run.jobtype),
            )
        reason = verdict.reason
        if result.survivors:
            reason += f"; processes {list(result.survivors)} survived SIGKILL (check the host)"
        message = attemptfs.read_message(run.attempt_dir)
        extra = self._result_extra(
            run.job,
            run,
            result,
            {"message": message.text or reason, "outcome": verdict.outcome.value},
            listing=listing,
        )
        if message.notes:
            extra["message_file"] = "; ".join(message.notes)
        return verdict, reason, extra

    def _record_end(
        self,
        run: RunningAttempt,
        result: LaunchResult,
        verdict: Verdict,
        *,
        reason: str,
        extra: dict[str, Any],
        now: float,
    ) -> None:
        """Write the attempt's end. One the store refuses as not this attempt's to
        end (a stale report) is logged; the node's own state follows either way."""
        try:
            self.store.finish_attempt(
                run.job.id,
                run.attempt.number,
                target=verdict.target,
                now=now,
                outcome=verdict.outcome.value,
                reason=reason,
                exit_code=result.exit_code,
                stdout=result.stdout,
                stderr=result.stderr,
                result=extra,
            )
        except TransitionError as exc:
            self._emit("stale_report", job=run.job.id, attempt=run.attempt.number, why=exc.message)
        except Exception as exc:
            if not self.store.unavailable(exc):
                self._record_internal_end(run, result, exc, now)
                return
            # the store cannot take it now (locked, unreachable): keep the attempt
            # and its report, and try again on the next tick; nothing local changed
            self._running[run.job.id] = run
            self._completions.put(result)
            raise

    def _record_internal_end(
        self, run: RunningAttempt, result: LaunchResult, exc: Exception, now: float
    ) -> None:
        """The store refused the attempt's end as it was given (a bug): end it with
        the least a record needs, saying why."""
        log.error("the store refused the end of %s: %r", run.holder, exc)
        verdict = internal_error(f"the store refused the attempt's result: {exc!r}")
        try:
            self.store.finish_attempt(
                run.job.id,
                run.attempt.number,
                target=verdict.target,
                now=now,
                outcome=verdict.outcome.value,
                reason=verdict.reason,
                exit_code=result.exit_code,
                result={"message": verdict.reason, "outcome": verdict.outcome.value},
            )
        except TransitionError as again:
            self._emit(
                "stale_report", job=run.job.id, attempt=run.attempt.number, why=again.message
            )
        except Exception:
            self._running[run.job.id] = run  # tried again on the next tick
            self._completions.put(result)
            raise

    def _free_server(self, run: RunningAttempt, result: LaunchResult, now: float) -> None:
        server = run.server
        if (
            server is not None
            and result.worker_error is None
            and server.state is not ServerState.STOPPING
        ):
            server.state = ServerState.IDLE
            server.idle_since = now
            server.jobs_served += 1

    def _after_cuda_oom(
        self, run: RunningAttempt, verdict: Verdict, holder: str, now: float
    ) -> None:
        if verdict.outcome is Outcome.CUDA_OOM:
            # it ran out with the GPU to itself: what it asked for is wrong; the next
            # jobs of its type are admitted with half as much again as it reached
            need = max(self.footprint(run.jobtype, run.job.vram_bytes), self.vram.peak(holder))
            self._raise_footprint(run.jobtype, int(need * 1.5), None, run.job.id, now)

    def _note_run_time(self, run: RunningAttempt, result: LaunchResult, verdict: Verdict) -> None:
        if verdict.outcome is Outcome.SUCCEEDED:
            self._run_times.setdefault(run.jobtype.name, deque(maxlen=RUN_TIME_WINDOW)).append(
                result.ended_at - result.started_at
            )

    def _touch_bundle(self, run: RunningAttempt) -> None:
        if run.job.bundle and run.job.queue_root:
            self.queues.touch(run.job.queue_root, run.job.bundle)

    def _measure(self, run: RunningAttempt, now: float) -> None:
        """End the attempt's VRAM holding (it now waits for the reclaim gate) and,
        if the job had its GPU to itself and used more than its footprint, raise the
        type's stored footprint so the next jobs are admitted against it."""
        if run.attempt.gpu_uuid is None:
            return
        m = self.vram.end(run.holder, now)
        if m is not None and m.alone:
            self._raise_footprint(run.jobtype, m.peak_bytes, run.job.vram_bytes, run.job.id, now)

    def _raise_footprint(
        self, jobtype: JobType, peak: int, override: int | None, source: str, now: float
    ) -> None:
        """Raise the type's stored footprint to a measured peak that beat it. Never
        above what the largest GPU here offers: a peak that only fit by eating into
        the reserve must not lock the type out of this node for good."""
        if peak <= self.footprint(jobtype, override):
            return
        views = self.vram.views()
        ceiling = max((v.total_bytes - v.reserve_bytes for v in views), default=peak)
        raised = min(self.vram.round_up(peak), ceiling)
        if raised <= self._footprints.get(jobtype.name, 0):
            return
        if self.store.raise_footprint(jobtype.name, raised, now=now, job_id=source):
            self._footprints[jobtype.name] = raised

    def _result_extra(
        self,
        job: Job,
        run: RunningAttempt | None,
        result: LaunchResult | None,
        fields: dict[str, Any],
        *,
        listing: safefs.Listing | None = None,
    ) -> dict[str, Any]:
        """What a job's result.json holds beyond the job row itself. ``outputs``
        are the regular files of the attempt's ``out/``; ``refused`` names every
        entry that is not one (a link, a FIFO, a device, a folder too deep), why,
        and what its warm server's exchange folder refused."""
        jobtype = self.registry.types.get(job.type)
        extra: dict[str, Any] = dict(fields)
        if jobtype is not None:
            extra["module_fingerprint"] = self.registry.module_of(jobtype).fingerprint
        if run is not None and result is not None:
            extra["output_dir"] = str(run.attempt_dir / "out")
            if listing is None:
                listing = attemptfs.list_outputs(run.attempt_dir)
            extra["outputs"] = sorted(e.path for e in listing.files)
            extra["refused"] = [*listing.refused_json(), *run.exchange_refused]
            if listing.truncated:
                extra["outputs_truncated"] = listing.truncated
            extra["gpu"] = run.attempt.gpu_uuid
            if result.oom_killed is not None:
                extra["oom_killed"] = result.oom_killed
            sandbox = self.sandbox_for(run.jobtype)
            extra["sandbox"] = sandbox.runtime.value if sandbox is not None else "none"
            extra["started_at"] = result.started_at
            extra["ended_at"] = result.ended_at
        return extra

    def _pass_cancels(self, now: float) -> None:
        if not self._running:
            return
        for job in self.store.running_jobs():
            run = self._running.get(job.id)
            if run is not None and job.cancel_requested and run.stop_reason is None:
                run.stop_reason = "cancel"
                run.stop.set()
                if run.server is not None and run.server.state is not ServerState.STOPPING:
                    self._stop_server(run.server, f"its job {job.id} was cancelled")
                self._emit("cancel_passed_on", job=job.id, attempt=run.attempt.number)

    # -- results ------------------------------------------------------------

    def _finish_bundles(self, now: float, *, force: bool = False) -> None:
        """Write the result of each bundle whose jobs have all ended."""
        self.queues.finish_bundles(now, force=force)

    # -- status and events --------------------------------------------------

    def _publish(self, now: float, *, force: bool = False, stopped: bool = False) -> None:
        batch = self.store.events(after_id=self._event_cursor)
        if batch:
            self.events.write_events(batch)  # the log's cursor moves past them too
            self._event_cursor = batch[-1].id or self._event_cursor
        since = now - self._last_status
        due = since >= self.config.broker.status_interval_s
        if not (force or due or (self._status_dirty and since >= _MIN_STATUS_GAP_S)):
            return
        self._status_dirty = False
        self._last_status = now
        self._observe(now)
        self.store.put_node_status(
            NodeStatus(
                node=self.node, pid=os.getpid(), updated_at=now, payload=self.status(stopped)
            )
        )

    def status(self, stopped: bool = False) -> dict[str, Any]:
        """What ``gpuwarden status`` shows of this node. ``gpus`` holds the probe's
        readings with the VRAM book's view of each: reserve, foreign memory,
        holdings (the ledger) and whether admission there is paused."""
        views = {v.uuid: v for v in self.vram.views()}
        gpus = []
        for g in self._readings:
            view = views.get(g.uuid)
            gpus.append(
                {
                    "uuid": g.uuid,
                    "name": g.name,
                    "total_bytes": g.total_bytes,
                    "used_bytes": g.used_bytes,
                    "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in g.processes],
                    **(view.to_json() if view else {}),
                    "free_bytes": view.free_bytes if view else 0,
                }
            )
        return {
            "stopped": stopped,
            "accepting": self.accepting,
            "probe": self.probe.kind,
            "probe_error": self._probe_error,
            "gpus": gpus,
            "degraded": self.vram.degraded(),
            "footprints": self._footprint_table(),
            "queues": {str(r.path): r.depth() for r in self.roots},
            "running": [
                {
                    "job": r.job.id,
                    "type": r.job.type,
                    "attempt": r.attempt.number,
                    "gpu": r.attempt.gpu_uuid,
                    "started_at": r.attempt.started_at,
                }
                for r in self._running.values()
            ],
            "warm": [s.status(self.clock()) for s in self.warm],
            "warm_views": [v.to_json() for v in self.warm.views()],
            "waiting": dict(list(self._waits.items())[:_STATUS_WAITING_MAX]),
            "last_error": self._last_error,
        }

    def _footprint_table(self) -> dict[str, dict[str, int]]:
        """Per vram-lane type: declared, measured (0 if never) and what admission uses."""
        return {
            t.name: {
                "declared_bytes": t.vram_bytes,
                "measured_bytes": self._footprints.get(t.name, 0),
                "effective_bytes": self.footprint(t),
            }
            for t in sorted(self.registry.types.values(), key=lambda t: t.name)
            if t.lane is Lane.VRAM
        }

    def _emit(self, kind: str, **detail: Any) -> None:
        job = detail.pop("job", None)
        self.store.add_event(Event(ts=self.clock(), kind=kind, job_id=job, detail=detail))

    def _record_error(self, where: str, exc: Exception) -> None:
        log.exception("broker step %s failed", where)
        self._last_error = {"ts": self.clock(), "where": where, "message": f"{exc}"}
        try:
            self._emit("loop_error", where=where, message=str(exc))
        except Exception:  # the store itself may be what failed
            self.events.write(
                {"ts": self.clock(), "event": "loop_error", "where": where, "message": str(exc)}
            )

    # -- helpers for run-once and tests ---------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    def wait_reason(self, job_id: str) -> str | None:
        return self._waits.get(job_id)


def _is_input(jobtype: JobType, name: str) -> bool:
    spec = jobtype.param(name)
    return spec is not None and spec.type.value == "input"
