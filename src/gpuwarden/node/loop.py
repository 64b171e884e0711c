"""The node broker: the single writer of its node's attempt state.

Each :meth:`Broker.tick` reads top to bottom: take in new bundles, drain what
worker threads posted, pass cancel requests on, plan and start attempts, write
the results of finished bundles, publish status and events. Worker threads only
run launchers and drive warm servers; they never touch the store or the
broker's state, they post to its :class:`Mailbox` and the loop drains it.

The broker holds one collaborator per concern, each given its dependencies when
it is built:

- ``queues`` (:class:`gpuwarden.intake.service.QueueIntake`): the queue roots'
  bundles, their intake, results and recovery;
- ``attempts`` (:class:`gpuwarden.node.runner.AttemptRunner`): host and container
  attempts, from their start to their recorded end;
- ``warm`` (:class:`gpuwarden.node.warm.WarmServers`): the serve types' servers;
- ``gpus`` (:class:`gpuwarden.node.gpus.GpuWatch`): the probe read, a GPU's Xid
  answered; ``vram`` (:class:`gpuwarden.node.vram.VramBook`): the ledger;
- ``footprints`` and ``run_times`` (:mod:`gpuwarden.node.measured`): what the
  node learned from its attempts;
- ``launching`` (:class:`gpuwarden.node.attempts.Launching`): how an attempt is
  laid out and launched here;
- at start, :class:`gpuwarden.node.recovery.Recovery`: what an earlier run left.

What the loop decides itself: what to start (:func:`gpuwarden.core.policy.plan`
on a snapshot) and what it publishes (:class:`gpuwarden.node.status.BrokerStatus`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from hashlib import sha256
from typing import Any

from gpuwarden.core import policy
from gpuwarden.core.gpulock import lock_mode
from gpuwarden.core.model import (
    Event,
    Job,
    JobSpec,
    JobType,
    Lane,
    LaunchMode,
    gpu_count,
    gpu_list,
)
from gpuwarden.core.preempt import Preempt, Victim
from gpuwarden.core.ramadmit import never_admits
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError
from gpuwarden.eventlog import EventLog, NullLog
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import QueueIntake
from gpuwarden.launch.base import Launcher
from gpuwarden.launch.sandbox import SandboxLauncher
from gpuwarden.node.adoption import Adoption
from gpuwarden.node.attempts import Launching
from gpuwarden.node.fairuse import FairUse
from gpuwarden.node.gpulocks import GpuLocks, release
from gpuwarden.node.gpus import GpuWatch
from gpuwarden.node.hostram import effective_need
from gpuwarden.node.jobends import JobEnds
from gpuwarden.node.leases import attribute_lease_pids
from gpuwarden.node.measured import Footprints, RunTimes
from gpuwarden.node.preempting import Preemptions
from gpuwarden.node.queue import ClassKey, QueueBook, SizedKey
from gpuwarden.node.recovery import Recovery
from gpuwarden.node.runner import AttemptRunner, Recorded, cap_refusal
from gpuwarden.node.running import (
    Clock,
    ExchangeNote,
    Mailbox,
    RunningAttempt,
    RuntimeNote,
    ServerNote,
    ServiceNote,
    Started,
)
from gpuwarden.node.runtimes import ManagedRuntimes
from gpuwarden.node.services import Services
from gpuwarden.node.settings import NodeSettings
from gpuwarden.node.stats import NodeStats
from gpuwarden.node.status import (
    BrokerStatus,
    FootprintStatus,
    GpuReport,
    GpuStatus,
    LoopError,
    ProcessUse,
    RunningStatus,
    gpu_reports,
)
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warm import WarmServers
from gpuwarden.node.warmkeep import adopt_left, leave_idle
from gpuwarden.node.warmpool import ServerState
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Store

# ``result_json`` is intake's (gpuwarden.intake.service); named here for the CLI
__all__ = ["Broker", "IntakeFactory"]

log = logging.getLogger("gpuwarden.node.loop")

#: at most this many wait reasons go into the status row
_STATUS_WAITING_MAX = 1000

#: status is written at most this often, even while things change
_MIN_STATUS_GAP_S = 0.25

#: events written to the event log per page (a tick writes one page), and at most
#: how many pages a stop writes before it exits (the store's whole backlog)
_EVENT_PAGE = 1000
_FLUSH_PAGES = 10_000

#: while idle, how often the queue roots' ``inbox/`` folders are looked at (one
#: ``stat`` each: a bundle renamed in changes the folder's mtime), so that a bundle
#: dropped on an idle broker does not wait for the poll interval
_INBOX_LOOK_S = 0.005


class Broker:
    """The broker loop of one node, and what it knows of the node."""

    def __init__(
        self,
        *,
        settings: NodeSettings,
        store: Store,
        probe: GpuProbe,
        registry: Registry,
        launchers: Mapping[LaunchMode, Launcher],
        intake: IntakeFactory,
        roots: list[QueueRoot] | None = None,
        events: EventLog | None = None,
        clock: Clock = time.time,
    ) -> None:
        """``intake`` builds the queue intake given this broker (its ``emit``,
        ``record_error``, ``check_fits``, ``clock`` and ``wake``): the wiring
        (``gpuwarden.app``) knows the configuration intake needs."""
        self.settings = settings
        self.store = store
        self.probe = probe
        self.registry = registry
        #: the node's launch rules, applied at submission (through the registry)
        #: and again at each start: the configuration may have changed meanwhile
        self.rules = settings.rules
        registry.rules = self.rules
        self.launchers = dict(launchers)
        container = self.launchers.get(LaunchMode.CONTAINER)
        #: sandboxed attempts (container types, and serve types' workers)
        self.sandbox = container if isinstance(container, SandboxLauncher) else None
        self.roots = list(roots or [])
        self.events = events or NullLog()
        self._clock = clock
        self.node = settings.name
        self.accepting = True
        #: names this broker's processes: stable across restarts of the same node and
        #: state directory, so recovery finds (only) what an earlier run left
        self.instance = f"{self.node}-{sha256(str(settings.state_dir).encode()).hexdigest()[:10]}"
        self._last_error: LoopError | None = None
        self._last_status = 0.0
        self._status_dirty = True  # something changed since the last status
        #: why each class of the queue waits, as the last pass left it, in queue order
        self._waits: dict[Hashable, policy.ClassWait] = {}
        #: each owner's fair-share use as the last pass read it
        self._use: dict[str, float] = {}
        #: the last event written to the event log: where the log's own cursor says
        #: (``serve --log``), or the store's latest event
        self._event_cursor = self.events.resume(store.last_event_id())
        self._build(intake)
        # said once, as the broker starts and before anything runs: every type that
        # would run unsandboxed here, and why (each such attempt is an event too)
        if summary := self.rules.unsandboxed_summary(registry.types.values()):
            log.warning("%s", summary)

    def _build(self, intake: IntakeFactory) -> None:
        """Build the collaborators, each given what it depends on."""
        self.mailbox = Mailbox()
        #: what the node counts of itself, published in its status (``/metrics``)
        self.stats = NodeStats(since=self._clock())
        #: who in this process waits for a job's end (the API's ``wait``)
        self.ends = JobEnds()
        # a submission or a cancel, from this process or another, wakes the loop
        self.store.on_submit(self.mailbox.wake)
        #: the queued jobs, by class, followed through the store's events
        self.queue = QueueBook(self.store, self.registry, self._clock)
        self.vram = VramBook(self.settings.vram)
        #: the GPU lock files (``gpu_lock``): who outside the queue keeps a GPU
        self.locks = GpuLocks.of(self.settings.gpu_lock, self.settings.gpu_lock_group, self.emit)
        #: the managed runtimes ([[runtimes]]): looked at by a poller thread
        self.runtimes = ManagedRuntimes(
            self.settings.runtimes,
            vram=self.vram,
            mailbox=self.mailbox,
            clock=self._clock,
            emit=self.emit,
        )
        self.footprints = Footprints(self.store, step_bytes=self.settings.vram.step_bytes)
        self.run_times = RunTimes(self.store.recent_run_times())
        #: each owner's decayed VRAM GiB-hours (fair share), loaded once, added to at each end
        self.fair = FairUse(
            self.store, self.settings.fair_share_half_life_s, self.vram, self.footprints
        )
        self.launching = Launching(
            settings=self.settings,
            probe=self.probe,
            registry=self.registry,
            sandbox=self.sandbox,
            instance=self.instance,
            emit=self.emit,
        )
        self.warm = WarmServers(
            settings=self.settings,
            probe_kind=self.probe.kind,
            vram=self.vram,
            footprints=self.footprints,
            launching=self.launching,
            mailbox=self.mailbox,
            emit=self.emit,
            clock=self._clock,
        )
        #: the queue roots' bundles: intake, results, recovery
        self.queues = intake(self)
        self.attempts = AttemptRunner(
            node=self.node,
            store=self.store,
            vram=self.vram,
            launching=self.launching,
            footprints=self.footprints,
            run_times=self.run_times,
            mailbox=self.mailbox,
            emit=self.emit,
            on_error=self.record_error,
            touch=self.queues.touch,
            max_interruptions=self.settings.max_interruptions,
            clock=self._clock,
            stats=self.stats,
            ram_floor_bytes=self.settings.ram_floor_bytes,
        )
        #: the running preemptible jobs asked to yield (``core/preempt.py``'s rule)
        self.preemptions = Preemptions(attempts=self.attempts, emit=self.emit)
        #: the running service jobs: their health threads, forwarders and routes
        services = (self.mailbox, self.emit, self._clock, self.rules.sandboxed)
        self.services = Services(*services, self.settings.service_address)
        self.gpus = GpuWatch(
            probe=self.probe,
            vram=self.vram,
            store=self.store,
            attempts=self.attempts,
            warm=self.warm,
            emit=self.emit,
            node=self.node,
            state_dir=self.settings.state_dir,
        )

    @property
    def clock(self) -> Clock:
        """What the broker and its collaborators take the time from."""
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        """A test may give the broker another clock once it is built: its
        collaborators follow."""
        self._clock = clock
        self.warm.clock = clock
        self.attempts.clock = clock
        self.services.clock = clock
        self.queues.clock = clock

    # -- the loop -----------------------------------------------------------

    def tick(self) -> None:
        """One pass of the loop. A failing step is recorded and the loop goes on.

        The writes of the plan share one commit (group commit), made before any
        of its launches, which follow in the same tick; the ends drained share
        another (:meth:`_drain`)."""
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
                if step == self._schedule:
                    with self.store.batch(), self.attempts.launches_after_commit():
                        step(self.clock())
                else:
                    step(self.clock())
            except Exception as exc:  # the loop must outlive any one step
                self.record_error(step.__name__.strip("_"), exc)

    def wake(self) -> None:
        """Make the loop tick now (a signal arrived, or a test wants it)."""
        self.mailbox.wake()

    def idle(self, seconds: float) -> None:
        """Wait until the next tick is due: ``seconds``, or less if woken (a
        worker's post, a submission, a signal) or if a queue root's ``inbox/``
        changed (looked at every :data:`_INBOX_LOOK_S`)."""
        if not (self.roots and self.accepting) or seconds <= _INBOX_LOOK_S:
            self.mailbox.wait(seconds)
            return
        marks = self._inbox_marks()
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.mailbox.wait(min(_INBOX_LOOK_S, left)) or self._inbox_marks() != marks:
                return

    def _inbox_marks(self) -> list[tuple[int, int] | None]:
        marks: list[tuple[int, int] | None] = []
        for root in self.roots:
            try:
                st = root.inbox.stat()
            except OSError:
                marks.append(None)
            else:
                marks.append((st.st_mtime_ns, st.st_ino))
        return marks

    def run(
        self,
        stop: threading.Event,
        *,
        force: threading.Event | None = None,
        between: Callable[[], None] | None = None,
        started: Mapping[str, Any] | None = None,
    ) -> None:
        """Tick until ``stop`` is set, then shut down gracefully (``force``, set
        before or during the shutdown, cuts the grace). ``between`` runs after each
        tick on the loop's thread (an agent's sync step); it may set ``stop`` (and
        ``force``). ``started`` adds to the detail of the ``broker_started`` event."""
        self.emit("broker_started", pid=os.getpid(), probe=self.probe.kind, **(started or {}))
        self.runtimes.start()
        while not stop.is_set():
            self.tick()
            if between is not None:
                between()
            if not stop.is_set():
                self.idle(self.settings.poll_interval_s)
        forced = force is not None and force.is_set()
        if self.settings.on_stop == "leave" and not forced:
            self.leave()
        else:
            self.shutdown(0.0 if forced else self.settings.shutdown_grace_s, force=force)

    def leave(self) -> None:
        """A routine stop (``[broker] on_stop = "leave"``): stop intake and planning
        and leave every supervised attempt running under its supervisor; the next
        broker of this instance takes them back (:mod:`gpuwarden.node.adoption`).
        An idle warm server is let go with its model loaded, to wait for the next
        broker (:mod:`gpuwarden.node.warmkeep`); jobs on a warm server are not
        supervised: they and their servers are stopped as by :meth:`shutdown`."""
        self.accepting = False
        leave_idle(self.warm)  # idle warm servers wait for the next broker (node/warmkeep.py)
        served = [run for run in self.attempts if run.server is not None]
        left = len(self.attempts) - len(served)
        self.emit("broker_stopping", running=len(self.attempts), leaving=left, grace_s=0.0)
        for run in served:
            run.stop_reason = "shutdown"
            run.stop.set()
            if run.server is not None and run.server.state is not ServerState.STOPPING:
                self.warm.stop(run.server, "the broker is shutting down")
        for run in served:
            if run.thread is not None:
                run.thread.join()
        self._stop_servers()
        self.emit("broker_stopped", left_running=left)
        self._publish(self.clock(), force=True, stopped=True)

    def shutdown(self, grace_s: float, *, force: threading.Event | None = None) -> None:
        """Stop intake, give running attempts ``grace_s`` to finish, then stop them
        and record them failed with that reason. Returns once all are drained."""
        self.accepting = False
        self.emit("broker_stopping", running=len(self.attempts), grace_s=grace_s)
        deadline = self.clock() + grace_s
        for run in self.attempts:  # a service runs until stopped: it is not waited for
            if run.jobtype.launch is LaunchMode.SERVICE:
                run.stop_reason = "shutdown"
                run.stop.set()
        while len(self.attempts) and self.clock() < deadline:
            if force is not None and force.is_set():
                break
            self._drain(self.clock())
            time.sleep(min(0.05, self.settings.poll_interval_s))
        for run in self.attempts:
            run.stop_reason = "shutdown"
            run.stop.set()
            if run.server is not None and run.server.state is not ServerState.STOPPING:
                self.warm.stop(run.server, "the broker is shutting down")
        for run in self.attempts:
            if run.thread is not None:
                run.thread.join()
        self._stop_servers()
        self.emit("broker_stopped")
        self._publish(self.clock(), force=True, stopped=True)

    def _stop_servers(self) -> None:
        """The end of a stop: warm servers, services' forwarders, managed runtimes,
        and the bundles whose jobs ended."""
        self.warm.stop_all("the broker is shutting down")
        # a real wait, whatever the loop's clock says: processes take real time to go
        deadline = time.monotonic() + 60
        while len(self.warm) and time.monotonic() < deadline:
            self._drain(self.clock())
            time.sleep(0.02)
        self._drain(self.clock())
        self.warm.close()  # only if empty: its sockets are gone
        self.services.close()
        self.runtimes.stop()
        self._finish_bundles(self.clock(), force=True)

    # -- recovery -----------------------------------------------------------

    def recover(self) -> None:
        """At start: end the attempts an earlier run left running
        (:mod:`gpuwarden.node.recovery`), and decide what happens to every bundle
        left in ``processing/`` (each logged); put back the GPU faults latched
        before (:meth:`gpuwarden.node.gpus.GpuWatch.restore`)."""
        now = self.clock()
        self.gpus.restore()
        # warm servers an earlier run left, taken over first (node/warmkeep.py)
        warm_kept = adopt_left(
            self.warm, self.registry.types, instance=self.instance, emit=self.emit, now=now
        )
        Recovery(
            instance=self.instance,
            kill_grace_s=self.settings.kill_grace_s,
            store=self.store,
            registry=self.registry,
            sandbox=self.sandbox,
            vram=self.vram,
            footprints=self.footprints,
            attempts=self.attempts,
            launching=self.launching,
            emit=self.emit,
            on_error=self.record_error,
            keep=warm_kept,
            adopt=Adoption(
                instance=self.instance,
                store=self.store,
                registry=self.registry,
                launchers=self.launchers,
                launching=self.launching,
                attempts=self.attempts,
                services=self.services,
                vram=self.vram,
                footprints=self.footprints,
                mailbox=self.mailbox,
                emit=self.emit,
                kill_grace_s=self.settings.kill_grace_s,
                clip_chars=self.settings.clip_chars,
            ).adopt,
        ).run(now)
        self.queues.recover(now)
        self._status_dirty = True

    # -- intake -------------------------------------------------------------

    def _intake(self, now: float) -> None:
        if not self.accepting:
            return
        if self.queues.intake(now):
            self._status_dirty = True
        self._warm_fast(now)

    def _warm_fast(self, now: float) -> None:
        """The warm fast path: a queued job goes to its type's idle warm server now,
        not after a planning pass (``WarmServers.fast_starts`` applies the plan's rules)."""
        if not self.accepting or not self.warm.idle():
            return
        if self.queue.refresh(now):  # what was submitted since the index last looked
            self._status_dirty = True
        if self.attempts.ram_gated(*(key[5] for key in self.queue.classes())):
            return  # host RAM is judged by the planning pass (SPEC section 11, "Host RAM")
        paused = f"the GPU probe failed: {self.gpus.error}" if self.gpus.error else ""
        types = self.registry.types
        for job, jobtype, start in self.warm.fast_starts(
            self.queue.index,
            self.store,
            types,
            paused=paused,
            use=self.fair.table(now, self.attempts),
        ):
            if self._start(job, jobtype, start, now):
                self.queue.index.remove(job.id)

    # -- attempts -----------------------------------------------------------

    def _schedule(self, now: float) -> None:
        """Plan over the queue index's classes and carry out the decisions."""
        if self.queue.refresh(now):
            self._status_dirty = True
        self._use = use = self.fair.table(now, self.attempts)
        lineups = (
            [
                self._lineup(sized, owners, use)
                for sized, owners in self.queue.shelves.groups().items()
            ]
            if self.accepting
            else []
        )
        if len(self.vram.ledger) or any(lu.job.lane is Lane.VRAM for lu in lineups):
            self._observe(now)  # the reclaim gate needs fresh readings while memory is held
        if len(self.runtimes):
            self._observe(now)  # a release asked of a runtime is seen on the device
            if self.runtimes.follow(now):
                self._status_dirty = True
        if not lineups and not len(self.warm):
            if self._waits:
                self._waits = {}
                self._status_dirty = True
            return
        self._look_at_locks()
        # also when only warm servers may expire
        done = policy.plan_pass(lineups, self._snapshot(now, lineups), now)
        for eviction in done.evictions:
            if isinstance(eviction, policy.Evict) and self.warm.evict(eviction):
                self.stats.evicted(eviction.type)
        for ask in done.asks:
            self.runtimes.ask(ask, now)
        for preempt in done.preemptions:
            if self.preemptions.ask(preempt, now):
                self._status_dirty = True
        index = self.queue.index
        for refused in done.refusals:
            index.remove(refused.job_id)
            self.store.transition(refused.job_id, JobState.FAILED, now=now, reason=refused.reason)
        for start in done.starts:
            job = self.store.get_job(start.job_id)
            if job is None or job.state is not JobState.QUEUED:
                index.remove(start.job_id)  # cancelled by a client since the index looked
            elif self._start(job, self.registry.types[job.type], start, now):
                index.remove(start.job_id)
        before = [w.signature() for w in self._waits.values()]
        self._waits = {w.key: w for w in done.waits}
        if [w.signature() for w in done.waits] != before:
            self._status_dirty = True

    def _lineup(
        self,
        sized: SizedKey,
        owners: Mapping[str, Mapping[Any, ClassKey]],
        use: Mapping[str, float],
    ) -> policy.SizedLineup:
        """One lineup as the planner sees it: the queue index's classes of ``sized``
        (the same but for their owners and their jobs' own footprints), with the
        footprint, estimate and warm server the node knows now."""
        type_name, priority, est_s, own_gpus, ram, pin = sized
        jobtype = self.registry.types[type_name]
        vram = jobtype.lane is Lane.VRAM

        def size(own: int | None) -> int:
            return self.footprints.of(jobtype, own) if vram else 0

        stamp = (size(None), size(1))  # what a measurement of the type changes
        shelves = [
            self.queue.shelves.shelf(sized, owner, use.get(owner, 0.0), size, stamp)
            for owner in owners
        ]
        job = policy.QueuedJob(
            id="",
            type=type_name,
            lane=jobtype.lane,
            vram_bytes=0,
            priority=priority,
            seq=0,
            coresident=jobtype.coresident or jobtype.runtime is not None,
            # the type's measured estimate once it has one, else the class's est_s
            expected_s=self.run_times.expected_s(type_name, est_s),
            serve=jobtype.launch is LaunchMode.SERVE,
            warm=self.warm.has(type_name),
            runtime=self._runtime_of(jobtype),
            model=jobtype.model or "",
            gpus=gpu_count(jobtype, own_gpus),
            ram=effective_need(jobtype, ram),
            gpu=pin,
        )

        def size_of(job_id: str) -> int:
            key = self.queue.index.key_of(job_id)
            return 0 if key is None else size(key[2])

        return policy.SizedLineup(
            sized, job, shelves, lambda own: (*sized[:2], own, *sized[2:]), size_of
        )

    def _runtime_of(self, jobtype: JobType) -> str:
        """A runtime type's runtime, by its name here (or the word its type gave,
        which the plan refuses, when no runtime here answers to it)."""
        if jobtype.runtime is None:
            return ""
        return self.runtimes.resolve(jobtype.runtime) or jobtype.runtime

    def _snapshot(self, now: float, lineups: list[policy.SizedLineup]) -> policy.Snapshot:
        # host RAM is read only when some job (or the node's floor) asks for it
        ram = self.attempts.ram_view(
            self.attempts.host_ram.sample(now)
            if self.attempts.ram_gated(*(lu.job.ram for lu in lineups))
            else None
        )
        return policy.Snapshot(
            queued=(),
            gpus=self.locks.mark(self.vram.views()),
            running_cpu=sum(1 for r in self.attempts if r.jobtype.lane is Lane.CPU),
            cpu_slots=self.settings.cpu_slots,
            accepting=self.accepting,
            vram_paused=f"the GPU probe failed: {self.gpus.error}" if self.gpus.error else "",
            warm=self.warm.views(),
            runtimes=self.runtimes.views(self.clock()),
            # the GPUs held back in the last pass: a held-back job keeps its GPU
            held_back=tuple(
                (w.job_id, w.reserved_gpu) for w in self._waits.values() if w.reserved_gpu
            ),
            victims=self.preemptions.victims(),
            ram=ram,
        )

    def _start(self, job: Job, jobtype: JobType, decision: policy.Start, now: float) -> bool:
        """Start the job as decided. False if it is still queued (its warm server is
        not ready for it yet); True once it left the queue (started, or ended)."""
        gpu = decision.gpu_uuid
        refused = self.rules.refusal(jobtype)
        if refused is not None:  # accepted under another configuration
            self.store.transition(
                job.id, JobState.FAILED, now=now, reason=f"refused by the launch rules: {refused}"
            )
            return True
        if self.rules.unsandboxed_warning(jobtype):  # the broker said so when it started
            self.emit("unsandboxed", job=job.id, type=jobtype.name)
        if jobtype.launch is LaunchMode.SERVE and gpu is not None:
            if not self.warm.ready(jobtype, decision):
                return False
            if not isinstance(run := self._begin(job, jobtype, gpu, now), RunningAttempt):
                return run
            self._began(run.job.id)
            self.warm.start(run, decision, gpu, now)
            return True
        service = jobtype.launch is LaunchMode.SERVICE
        # a service runs sandboxed like a container type, with the same launcher
        launcher = self.launchers.get(LaunchMode.CONTAINER if service else jobtype.launch)
        if service and (taken := self.services.taken(job.service_name, job.owner)) is not None:
            self.store.transition(job.id, JobState.FAILED, now=now, reason=f"refused: {taken}")
            return True
        if launcher is None:
            self.store.transition(
                job.id,
                JobState.FAILED,
                now=now,
                reason=f"launch mode {jobtype.launch.value!r} of {jobtype.name} is not "
                f"available on this node (available: "
                f"{', '.join([*(m.value for m in self.launchers), LaunchMode.SERVE.value])})",
            )
            return True
        if (no_cap := cap_refusal(job, launcher)) is not None:
            self.store.transition(job.id, JobState.FAILED, now=now, reason=f"refused: {no_cap}")
            return True
        runtime = self.runtimes.resolve(jobtype.runtime) if jobtype.runtime else None
        if runtime is not None and jobtype.model is not None:
            launcher = self.runtimes.launcher(runtime, jobtype.model, launcher)
        if not isinstance(run := self._begin(job, jobtype, gpu, now), RunningAttempt):
            return run
        run.runtime = runtime
        if service:
            self.services.add(run, now)
        self._began(run.job.id)
        self.attempts.launch(run, launcher, decision, now)
        return True

    def _begin(
        self, job: Job, jobtype: JobType, gpu: str | None, now: float
    ) -> RunningAttempt | bool:
        """Take its GPUs' locks (``gpu_lock``: ``core/gpulock.py``'s mode), then begin
        the attempt; else what :meth:`_start` returns: False (still queued: a lock
        kept by an outsider, whose reason the next pass gives, or its row locked for
        a moment), True (it left the queue: cancelled since the plan)."""
        gpus = gpu_list(gpu)
        mode = lock_mode(
            gpus=len(gpus), coresident=jobtype.coresident, runtime=jobtype.runtime is not None
        )
        locks = self.locks.take(gpus, mode)
        if locks is None:
            self._status_dirty = True
            return False
        run = self.attempts.begin(job, jobtype, gpu, now)
        if run is None:
            release(locks)
            return not self._still_queued(job.id)
        run.locks = locks
        return run

    def _look_at_locks(self) -> None:
        """Who outside the queue keeps a GPU (at most every ``gpulocks.LOOK_S``)."""
        if self.locks.refresh(v.uuid for v in self.vram.views()):
            self._status_dirty = True

    def _still_queued(self, job_id: str) -> bool:
        """After a start the store refused: True when the job is still queued (its
        row was locked by another writer for a moment: tried again next pass),
        False when it left the queue (cancelled by a client since the plan)."""
        job = self.store.get_job(job_id)
        return job is not None and job.state is JobState.QUEUED

    def _began(self, job_id: str) -> None:
        self._status_dirty = True

    def _drain(self, now: float) -> None:
        """Take in everything the worker threads posted. The ends are written in
        one batch and committed together; only then does the node's own state
        follow (servers freed, memory measured, bundles looked at)."""
        recorded: list[Recorded] = []
        failure: Exception | None = None
        self.attempts.ram.sample(now)  # the running attempts' RAM, before any ends here
        with self.store.batch():
            try:
                while (message := self.mailbox.take()) is not None:
                    if isinstance(message, ServerNote):
                        if self.warm.on_note(message, now):
                            self._status_dirty = True
                    elif isinstance(message, ExchangeNote):
                        self.attempts.on_exchange(message)
                    elif isinstance(message, Started):
                        self.attempts.on_started(message)
                        self.services.started(message.job_id, message.attempt, message.pid)
                    elif isinstance(message, ServiceNote):
                        self._status_dirty = True
                        if (why := self.services.on_note(message)) is not None:
                            self._stop_service(message.job_id, "service_unhealthy", why)
                    elif isinstance(message, RuntimeNote):
                        if self.runtimes.on_note(message):
                            self._status_dirty = True
                    elif (run := self.attempts.pop(message)) is not None:
                        self._status_dirty = True
                        self.services.end(run.job.id)
                        self.fair.charge(run, now)
                        recorded.append(self.attempts.record(run, message, now))
            except Exception as exc:  # what came before it is still committed
                failure = exc
            try:
                self.store.commit()
            except Exception:
                self.fair.dropped()
                for r in recorded:  # not written after all: drained again next tick
                    self.attempts.unrecord(r)
                raise
            self.fair.committed()
            for r in recorded:
                self.attempts.follow(r, now)
                self.ends.ended(r.run.job.id)  # committed: a waiting request may look
        self._warm_fast(now)  # a server this freed takes its type's next job now
        if failure is not None:
            raise failure

    def _stop_service(self, job_id: str, reason: str, why: str) -> None:
        """Stop a running service: for its health (``service_unhealthy``, ``why``
        the reason) or at a person's request (``service_stop``, ``why`` who asked)."""
        run = self.attempts.by_job.get(job_id)
        if run is None or run.stop_reason is not None:
            return
        run.stop_reason, run.fault = reason, why
        run.stop.set()
        self._status_dirty = True
        self.emit("service_stopping", job=job_id, attempt=run.attempt.number, why=why)

    def _pass_cancels(self, now: float) -> None:
        if not len(self.attempts):
            return
        self.preemptions.overdue(now)  # an asked job past its checkpoint grace is stopped
        for job_id, why in self.services.overdue_all(now):
            self._stop_service(job_id, "service_unhealthy", why)
        for job in self.store.running_jobs():
            run = self.attempts.by_job.get(job.id)
            if run is not None and job.stop_requested_by is not None:
                self._stop_service(job.id, "service_stop", job.stop_requested_by)
            # a cancel overrides a preemption's stop (the job is cancelled, not re-queued)
            if run is not None and job.cancel_requested and run.stop_reason in (None, "preempt"):
                run.stop_reason = "cancel"
                run.stop.set()
                if run.server is not None and run.server.state is not ServerState.STOPPING:
                    self.warm.stop(run.server, f"its job {job.id} was cancelled")
                self.emit("cancel_passed_on", job=job.id, attempt=run.attempt.number)

    # -- the GPUs -----------------------------------------------------------

    def _observe(self, now: float) -> None:
        """Read the probe (once per tick at most) and let the VRAM book take it in."""
        attribute_lease_pids(self.attempts, self.vram)  # their memory is the lease's
        if self.gpus.observe(now):
            self._status_dirty = True

    def _operator_requests(self, now: float) -> None:
        """Carry out what operators asked through the store (``gpuwarden gpu clear``)."""
        if self.gpus.operator_requests(now):
            self._status_dirty = True

    def check_fits(self, specs: list[JobSpec]) -> None:
        """Refuse, at submission, a job whose footprint exceeds every GPU here, that
        asks for more RAM than this host has, or for a RAM cap this node cannot
        enforce."""
        self._observe(self.clock())
        views = self.vram.views()
        ram = self.attempts.ram_view(None)
        for spec in specs:
            jobtype = self.registry.get(spec.type)
            if (why := never_admits(ram, effective_need(jobtype, spec.ram))) is not None:
                raise ValidationError(f"job {spec.id} ({spec.type}) {why}")
            launcher = self.launchers.get(jobtype.launch)
            if spec.ram.cap_bytes and launcher is not None and not launcher.memory_caps().enforced:
                raise ValidationError(
                    f"job {spec.id} ({spec.type}): ram_gib asks for a RAM cap, but this node "
                    f"cannot enforce one: {launcher.memory_caps().how}"
                )
            if jobtype.lane is not Lane.VRAM:
                continue
            why = policy.never_fits(
                self.footprints.of(jobtype, spec.vram_bytes), views, gpu_count(jobtype, spec.gpus)
            )
            if why is not None:
                raise ValidationError(f"job {spec.id} ({spec.type}) {why}")

    def victims(self) -> list[tuple[Victim, int]]:
        """This node's running attempts of preemptible types (the plan's victims),
        each with the bytes it holds in the ledger: what a coordinator needs to
        choose them for preemption across hosts. On the loop's thread."""
        out = []
        for v in self.preemptions.victims():
            holding = self.vram.ledger.get(v.holder)
            out.append((v, holding.bytes if holding is not None else 0))
        return out

    def preempt(self, decision: Preempt) -> bool:
        """Ask a running attempt to checkpoint on a coordinator's word (preemption
        across hosts; the agent's sync calls it on the loop's thread): the same
        signal, grace and event as the node's own plan. False when it is not running
        here as asked, or was asked already."""
        asked = self.preemptions.ask(decision, self.clock())
        if asked:
            self._status_dirty = True
            self.wake()
        return asked

    def room(self, pending: Iterable[Job]) -> list[GpuReport]:
        """Per GPU, the room a new job could take here now, as placement across
        nodes needs it (:func:`gpuwarden.node.status.gpu_reports`); ``pending``: jobs
        queued here that will take room when they start."""
        waiting = 0
        for job in pending:
            jobtype = self.registry.types.get(job.type)
            if (
                job.state is JobState.QUEUED
                and jobtype is not None
                and jobtype.lane is Lane.VRAM
                and not self.warm.has(jobtype.name)
            ):
                waiting += self.footprints.of(jobtype, job.vram_bytes)
        return gpu_reports(
            self.locks.mark(self.vram.views()),
            used={r.uuid: r.used_bytes for r in self.gpus.readings},
            evictable=self.warm.evictable(),
            waiting=waiting,
            sensors={r.uuid: r.sensors for r in self.gpus.readings if r.sensors is not None},
        )

    # -- results ------------------------------------------------------------

    def _finish_bundles(self, now: float, *, force: bool = False) -> None:
        """Write the result of each bundle whose jobs have all ended."""
        self.queues.finish_bundles(now, force=force)

    # -- status and events --------------------------------------------------

    def flush_events(self) -> None:
        """Write every event the store has after the event log's cursor, page after
        page: a stop's last events reach the log before the process exits, however
        many came at once (a tick writes one page)."""
        self._write_events(pages=_FLUSH_PAGES)

    def _write_events(self, pages: int = 1) -> None:
        for _ in range(pages):
            batch = self.store.events(after_id=self._event_cursor, limit=_EVENT_PAGE)
            if not batch:
                return
            self.events.write_events(batch)  # the log's cursor moves past them too
            self._event_cursor = batch[-1].id or self._event_cursor
            if len(batch) < _EVENT_PAGE:
                return

    def _publish(self, now: float, *, force: bool = False, stopped: bool = False) -> None:
        self._write_events(pages=_FLUSH_PAGES if stopped else 1)
        since = now - self._last_status
        due = since >= self.settings.status_interval_s
        if not (force or due or (self._status_dirty and since >= _MIN_STATUS_GAP_S)):
            return
        self._status_dirty = False
        self._last_status = now
        self._observe(now)
        self._look_at_locks()
        self.store.put_node_status(
            NodeStatus(
                node=self.node,
                pid=os.getpid(),
                updated_at=now,
                payload=self.status(stopped).to_json(),
            )
        )

    def status(self, stopped: bool = False) -> BrokerStatus:
        """What ``gpuwarden status`` shows of this node. ``gpus`` holds the probe's
        readings with the VRAM book's view of each: reserve, foreign memory,
        holdings (the ledger) and whether admission there is paused."""
        views = {v.uuid: v for v in self.locks.mark(self.vram.views())}
        return BrokerStatus(
            stopped=stopped,
            accepting=self.accepting,
            probe=self.probe.kind,
            probe_error=self.gpus.error,
            gpus=tuple(
                GpuStatus(
                    uuid=g.uuid,
                    name=g.name,
                    total_bytes=g.total_bytes,
                    used_bytes=g.used_bytes,
                    processes=tuple(ProcessUse(p.pid, p.used_bytes) for p in g.processes),
                    view=views.get(g.uuid),
                    sensors=g.sensors,
                )
                for g in self.gpus.readings
            ),
            degraded=self.vram.degraded(),
            faults=self.gpus.fault_status(),
            footprints={
                t.name: FootprintStatus(
                    declared_bytes=t.vram_bytes,
                    measured_bytes=self.footprints.measured.get(t.name, 0),
                    effective_bytes=self.footprints.of(t),
                )
                for t in sorted(self.registry.types.values(), key=lambda t: t.name)
                if t.lane is Lane.VRAM
            },
            queues={str(r.path): r.depth() for r in self.roots},
            running=tuple(
                RunningStatus(
                    job=r.job.id,
                    type=r.job.type,
                    attempt=r.attempt.number,
                    gpu=r.attempt.gpu_uuid,
                    started_at=r.attempt.started_at,
                    preempting_for=r.preempting_for,
                )
                for r in self.attempts
            ),
            warm=self.warm.statuses(self.clock()),
            runtimes=tuple(self.runtimes.statuses(self.clock())),
            warm_views=self.warm.views(),
            waiting=self._waiting(),
            last_error=self._last_error,
            queued_indexed=len(self.queue),
            stats=self.stats.snapshot(queued=self.queue.by_type(), faults=self.vram.faults),
            ram=self.attempts.ram_view(self.attempts.host_ram.sample(self.clock())),
            services=tuple(self.services.statuses()),
        )

    def _waiting(self) -> dict[str, str]:
        """Why the first queued jobs wait (at most ``_STATUS_WAITING_MAX``), class by
        class in queue order: the reasons are written here, not in every pass."""
        return {
            job_id: self._waits[key].wait(job_id).reason
            for key, job_id in self.queue.first(self._waits, _STATUS_WAITING_MAX, self._use)
        }

    def emit(self, kind: str, **detail: Any) -> None:
        """Add an event to the store (``job`` names the job it is about)."""
        job = detail.pop("job", None)
        self.store.add_event(Event(ts=self.clock(), kind=kind, job_id=job, detail=detail))
        self.stats.on_event(kind, detail)

    def record_error(self, where: str, exc: Exception) -> None:
        """A step failed: log it, keep it for the status, and say it as an event."""
        log.exception("broker step %s failed", where)
        self._last_error = LoopError(ts=self.clock(), where=where, message=f"{exc}")
        try:
            self.emit("loop_error", where=where, message=str(exc))
        except Exception:  # the store itself may be what failed
            self.events.write(
                {"ts": self.clock(), "event": "loop_error", "where": where, "message": str(exc)}
            )

    # -- helpers for run-once and tests ---------------------------------------

    @property
    def running(self) -> int:
        return len(self.attempts)

    def runs(self, jobtype: JobType) -> bool:
        """Whether jobs of ``jobtype`` run here: its launch rules allow it and, for
        a runtime type, this node has its runtime."""
        if self.rules.refusal(jobtype) is not None:
            return False
        return jobtype.runtime is None or self.runtimes.resolve(jobtype.runtime) is not None

    def runtime_warm_types(self) -> list[str]:
        """The runtime types whose model their runtime here says it has loaded: a
        job of one starts here without loading anything (placement's warm rule)."""
        loaded = {v.name: v.models for v in self.runtimes.views(self.clock())}
        out = []
        for t in self.registry.types.values():
            name = self.runtimes.resolve(t.runtime) if t.runtime else None
            if name is not None and t.model in loaded.get(name, ()):
                out.append(t.name)
        return sorted(out)

    def service_routes(self) -> dict[str, ServiceRoute]:
        """How the in-process API reaches each running service, by its name: a
        thread-safe snapshot (the route credentials are in it: never publish it)."""
        return {r.name: r for r in self.services.routes()}

    def wait_reason(self, job_id: str) -> str | None:
        """Why a queued job waits, as the last pass saw it (None: it was not judged)."""
        key = self.queue.index.key_of(job_id)
        if key is None:
            return None
        # its class as the pass judged it, else its lineup's (a bigger size not looked at)
        waited = self._waits.get(key[:-1]) or self._waits.get((*key[:2], *key[3:-1]))
        return None if waited is None else waited.wait(job_id).reason


#: builds a broker's queue intake, given the broker (see :class:`Broker`)
IntakeFactory = Callable[[Broker], QueueIntake]
