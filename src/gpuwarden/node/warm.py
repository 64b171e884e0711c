"""The warm servers of one node (launch mode ``serve``), driven from the broker loop.

:class:`WarmServers` is the loop's collaborator for serve types: it starts a
server for a type (or hands a job to the one that is idle), takes in what the
servers' threads post (a PID, loaded, gone), evicts and stops them. Its methods
run on the loop's thread, except the server's own thread (``_serve_loop``: one
per server, it loads it and then serves each job the loop hands it through a
:class:`Handoff`; :meth:`WarmServers.serve_next` on a thread of the job's own when
that thread has ended), which drives a :class:`WarmProcess` and only posts
messages (the job's :class:`LaunchResult`, :class:`ServerNote` and
:class:`ExchangeNote`) back to the loop's mailbox.
Which server exists, and in what state, is :mod:`gpuwarden.node.warmpool`'s.

A loaded server outlives its broker (:meth:`WarmServers.leave_idle` at a routine
stop; a killed broker leaves it too): it keeps a record
(:mod:`gpuwarden.node.warmrecord`) and waits for the next broker on its socket
path, which is stable for a node and state directory (:meth:`WarmServers.socket_dir`);
the next broker takes it over (:meth:`WarmServers.adopt`, asked by
:func:`gpuwarden.node.warmkeep.adopt_left` before anything is planned).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import queue
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.core import policy
from gpuwarden.core.ledger import HoldState
from gpuwarden.core.model import Job, JobType
from gpuwarden.core.queueindex import QueueIndex
from gpuwarden.core.states import JobState
from gpuwarden.launch import supervisor
from gpuwarden.launch.base import INSIDE, LaunchResult
from gpuwarden.launch.sandbox import output_limit_reason
from gpuwarden.launch.warmproc import (
    JobReport,
    LoadReport,
    ServeError,
    WarmProcess,
    placement_check,
)
from gpuwarden.node import attemptfs, warmrecord
from gpuwarden.node.attemptfs import ExchangeError, ExchangeSlot
from gpuwarden.node.attempts import Launching
from gpuwarden.node.measured import Footprints
from gpuwarden.node.queue import ClassKey
from gpuwarden.node.running import Emit, ExchangeNote, Mailbox, RunningAttempt, ServerNote
from gpuwarden.node.settings import NodeSettings
from gpuwarden.node.status import WarmStatus
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warmpool import ServerState, WarmPool, WarmServer
from gpuwarden.node.warmrecord import ServerRecord
from gpuwarden.server.worker import WAIT_ENV
from gpuwarden.store.base import Store

#: the broker's log: its lines keep one name, whichever of its modules writes them
log = logging.getLogger("gpuwarden.node.loop")

#: how long a server whose broker went away waits for the next one (seconds);
#: the broker's own ``GPUWARDEN_SERVE_WAIT_S`` sets another
SERVE_WAIT_S = 300.0
#: the least time an adopted server is given to come back (it may be finishing
#: the job it ran when its broker went away: up to its type's timeout)
COME_BACK_S = 30.0
#: the most
COME_BACK_MAX_S = 3600.0


def serve_wait_s() -> float:
    """How long a left server waits for a new broker: ``GPUWARDEN_SERVE_WAIT_S``
    of the broker's environment when it is a number >= 0, else :data:`SERVE_WAIT_S`."""
    try:
        wait = float(os.environ.get(WAIT_ENV, SERVE_WAIT_S))
    except ValueError:
        return SERVE_WAIT_S
    return wait if math.isfinite(wait) and wait >= 0 else SERVE_WAIT_S


class Handoff:
    """The jobs the loop hands to one server's thread, in order (``None``: the
    thread ends). Closed by that thread as it ends: a job handed after that is
    refused, and the loop drives it on a thread of its own instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[RunningAttempt | None] = queue.SimpleQueue()
        self._closed = False
        #: the server's thread
        self.thread: threading.Thread | None = None

    def put(self, run: RunningAttempt | None) -> bool:
        """Hand ``run`` over; False when the thread has ended (nothing was handed)."""
        with self._lock:
            if self._closed:
                return False
            self._jobs.put(run)
            return True

    def get(self) -> RunningAttempt | None:
        """The server's thread: the next job (blocks until there is one)."""
        return self._jobs.get()

    def close(self) -> list[RunningAttempt]:
        """The server's thread, as it ends: refuse what comes later, and return the
        jobs handed meanwhile."""
        with self._lock:
            self._closed = True
        left: list[RunningAttempt] = []
        while True:
            try:
                run = self._jobs.get_nowait()
            except queue.Empty:
                return left
            if run is not None:
                left.append(run)


class SlotRemover:
    """Removes served jobs' exchange slots on a thread of its own (started with the
    first), so that neither the job's result nor the server's next job waits for
    the removal; ``failed(server, error)`` is called on that thread for a slot that
    cannot be removed."""

    def __init__(self, failed: Callable[[WarmServer, ExchangeError], None]) -> None:
        self._failed = failed
        self._slots: queue.Queue[tuple[WarmServer, ExchangeSlot]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def remove(self, server: WarmServer, slot: ExchangeSlot) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="exchange-slot-remover", daemon=True
                )
                self._thread.start()
        self._slots.put((server, slot))

    def drain(self) -> None:
        """Wait until every slot handed over so far has been removed (or failed)."""
        if self._thread is not None:
            self._slots.join()

    def _run(self) -> None:
        while True:
            server, slot = self._slots.get()
            try:
                slot.close()
            except ExchangeError as exc:
                self._failed(server, exc)
            except Exception:  # never ends the thread: later slots still go
                log.exception("removing %s failed", slot.path)
            finally:
                self._slots.task_done()


class WarmServers:
    """The warm servers of one node: at most one per job type."""

    def __init__(
        self,
        *,
        settings: NodeSettings,
        probe_kind: str,
        vram: VramBook,
        footprints: Footprints,
        launching: Launching,
        mailbox: Mailbox,
        emit: Emit,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        #: on a real GPU a worker must say how much of its model is on the device. The
        #: simulated GPU has no device for a real model: a worker that reports no
        #: figure there (it runs on the CPU by design) is not checked
        self.strict = probe_kind != "sim"
        self.vram = vram
        self.footprints = footprints
        self.launching = launching
        self.mailbox = mailbox
        self.emit = emit
        self.clock = clock
        self.pool = WarmPool()
        #: made on the first server's start (:meth:`socket_dir`)
        self._socket_dir: Path | None = None
        #: the sockets' folder is the node's stable one: servers may outlive the broker
        self.stable_sockets = False
        #: per server (its ledger holder), how jobs are handed to its thread
        self._handoffs: dict[str, Handoff] = {}
        self._remover = SlotRemover(self._slot_not_removed)

    # -- what the loop and status see --------------------------------------------

    def __iter__(self) -> Iterator[WarmServer]:
        return iter(self.pool)

    def __len__(self) -> int:
        return len(self.pool)

    def has(self, type_name: str) -> bool:
        """Whether ``type_name`` has a server here (in any state)."""
        return type_name in self.pool.by_type

    def views(self) -> tuple[policy.WarmView, ...]:
        return self.pool.views()

    def statuses(self, now: float) -> tuple[WarmStatus, ...]:
        return tuple(s.status(now) for s in self.pool)

    def evictable(self) -> set[str]:
        """The ledger holders of idle servers an eviction could stop for a new job
        (``keep_warm`` ones yield only to higher priority: not counted)."""
        return {s.holder for s in self.pool if s.state is ServerState.IDLE and not s.type.keep_warm}

    # -- starting --------------------------------------------------------------------

    def ready(self, jobtype: JobType, decision: policy.Start) -> bool:
        """Whether the plan's decision still holds: a warm start needs the type's
        server idle; a cold one needs no server (one per type: an old one may still
        be stopping). It may have changed since the plan: the next pass decides again."""
        server = self.pool.get(jobtype.name)
        if decision.warm:
            return server is not None and server.state is ServerState.IDLE
        return server is None

    def idle(self) -> bool:
        """Whether any server is idle (the fast path has something to hand to)."""
        return any(s.state is ServerState.IDLE for s in self.pool)

    def fast_starts(
        self,
        index: QueueIndex[ClassKey],
        store: Store,
        types: Mapping[str, JobType],
        *,
        paused: str,
        use: Mapping[str, float] | None = None,
    ) -> list[tuple[Job, JobType, policy.Start]]:
        """The queued jobs to hand to idle warm servers now, without a planning pass
        (the warm fast path): for each idle server, the first queued job of its type
        in the loop's queue index (read in full here). That is the job
        :func:`gpuwarden.core.policy.plan_pass` would hand it, since a job whose
        server is warm goes first among equal priority and takes no memory; the
        plan decides instead when a queued job has a higher priority (its memory
        may come from evicting this idle server), when VRAM admission is paused
        (``paused``: the probe failed) or the server's GPU is degraded. A job the
        index holds that is no longer queued (a client cancelled it) is taken out.
        ``use``: each owner's use (fair share: among equal priority, least first)."""
        starts: list[tuple[Job, JobType, policy.Start]] = []
        classes = index.classes()
        if paused or not classes:
            return starts
        top = max(key[1] for key in classes)
        degraded = self.vram.degraded()
        for server in self.pool:
            if server.state is not ServerState.IDLE or server.gpu in degraded:
                continue
            # the type's first job in queue order: highest priority, the owner who
            # used least, then arrival
            use = use or {}
            heads = [
                (key[1], use.get(key[-1], 0.0), head)
                for key in classes
                if key[0] == server.type.name and (head := index.head(key)) is not None
            ]
            if not heads:
                continue
            priority, _, (_, job_id) = min(heads, key=lambda h: (-h[0], h[1], h[2][0]))
            jobtype = types.get(server.type.name)
            if priority < top or jobtype is None:
                continue
            job = store.get_job(job_id)
            if job is None or job.state is not JobState.QUEUED or job.cancel_requested:
                index.remove(job_id)  # gone from the queue since the index looked
                continue
            starts.append((job, jobtype, policy.Start(job.id, server.gpu, warm=True)))
        return starts

    def start(self, run: RunningAttempt, decision: policy.Start, gpu: str, now: float) -> None:
        """Hand the started attempt to its type's warm server, loading one first if
        there is none (:meth:`ready` said the decision holds)."""
        job, attempt, jobtype = run.job, run.attempt, run.jobtype
        server = self.pool.get(jobtype.name)
        fresh: WarmServer | None = None
        try:
            # the server never sees this folder: its job's files pass through the
            # server's exchange folder, and the outputs are moved here afterwards
            self.launching.make_attempt_dir(run, now)
            safefs.make_dir(run.attempt_dir / "out")
            if server is None or not decision.warm:
                server = fresh = self._new_server(jobtype, gpu, job.priority, now)
                server.priority = job.priority
                run.server = server
                # one thread per server: it loads it, serves this job, then each job
                # handed to it (no thread started per job)
                handoff = self._handoffs[server.holder] = Handoff()
                run.thread = handoff.thread = threading.Thread(
                    target=self._serve_loop,
                    args=(server, run, handoff),
                    name=f"serve-{server.holder}",
                    daemon=True,
                )
                run.thread.start()
                return
            server.state = ServerState.BUSY
            server.priority = job.priority
            run.server = server
            given = self._handoffs.get(server.holder)
            if given is not None and given.put(run):
                run.thread = given.thread
                return
            # its thread has ended (the server is going away): a thread of the job's
            # own drives it, and the job fails as the server's does
            run.thread = threading.Thread(
                target=self.serve_next,
                args=(server, run),
                name=f"serve-{job.id}-{attempt.number}",
                daemon=True,
            )
            run.thread.start()
        except Exception as exc:  # the attempt started in the store: it must still end
            log.exception("could not start serving %s", job.id)
            run.thread = None
            if fresh is not None:  # nothing ran: its memory was never used
                self.pool.remove(fresh)
                self._handoffs.pop(fresh.holder, None)
                self.vram.end(fresh.holder, now)
            elif run.server is not None:
                run.server.state = ServerState.IDLE
                run.server = None
            self.mailbox.post(
                LaunchResult(
                    job_id=job.id,
                    attempt=attempt.number,
                    exit_code=None,
                    started_at=now,
                    ended_at=self.clock(),
                    launch_error=f"could not prepare the attempt: {exc}",
                )
            )

    def socket_dir(self) -> Path:
        """Where this node's servers' sockets live: short, since a unix socket's
        path is limited to 107 bytes (a state directory's may be longer), and the
        same for every run of this node and state directory, so that a server a
        broker left finds the next one there: ``<tmp>/gpuwarden-<hash>``, made
        with mode 0700. When that name is anything but a folder of this user's that
        no one else may write to (someone else made it first), a fresh folder with
        a random name (``mkdtemp``) is used instead, and no server is left running."""
        if self._socket_dir is None:
            digest = hashlib.sha256(self.launching.instance.encode()).hexdigest()[:16]
            stable = Path(tempfile.gettempdir()) / f"gpuwarden-{digest}"
            with contextlib.suppress(FileExistsError):
                stable.mkdir(mode=0o700)
            st = os.lstat(stable)
            if (
                stat.S_ISDIR(st.st_mode)
                and st.st_uid == os.geteuid()
                and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
            ):
                self._socket_dir, self.stable_sockets = stable, True
            else:
                log.warning("%s is not this broker's own: warm servers die with it", stable)
                prefix = f"gpuwarden-{self.launching.instance[-10:]}-"
                self._socket_dir = Path(tempfile.mkdtemp(prefix=prefix))
        return self._socket_dir

    def close(self) -> None:
        """Remove the served jobs' slots still to be removed, and the sockets'
        folder if it is empty (its servers are gone)."""
        self._remover.drain()
        if self._socket_dir is not None:
            with contextlib.suppress(OSError):
                self._socket_dir.rmdir()

    def _new_server(self, jobtype: JobType, gpu: str, priority: int, now: float) -> WarmServer:
        epoch = self.pool.next_epoch()
        warm_dir = self.settings.state_dir / "warm"
        attemptfs.own_dir(warm_dir)
        log_dir = warm_dir / f"{jobtype.name}-{epoch}"
        safefs.make_dir(log_dir)  # fresh: an epoch is never reused
        # the folder every job of the server passes through (its mount, in a sandbox)
        safefs.make_dir(log_dir / "exchange", mode=attemptfs.EXCHANGE_MODE)
        socket_path = self.socket_dir() / f"{epoch}.sock"
        launcher, request = self.launching.server_request(jobtype, gpu, epoch, log_dir, socket_path)
        if not request.mounts and self.stable_sockets:
            # it may outlive this broker: it waits this long for the next one
            env = {**request.env, WAIT_ENV: repr(serve_wait_s())}
            request = dataclasses.replace(request, env=env)
        worker = WarmProcess(
            launcher, request, socket_path, epoch, stop_wait_s=self.settings.stop_grace_s
        )
        footprint = self.footprints.of(jobtype)
        server = WarmServer(
            type=jobtype,
            gpu=gpu,
            epoch=epoch,
            worker=worker,
            footprint=footprint,
            idle_grace_s=(
                jobtype.idle_grace_s
                if jobtype.idle_grace_s is not None
                else self.settings.idle_grace_s
            ),
            started_at=now,
            priority=priority,
        )
        self.pool.add(server)
        self.vram.start(
            server.holder,
            gpu,
            type_name=jobtype.name,
            job_id=None,
            nbytes=footprint,
            coresident=jobtype.coresident,
            now=now,
            state=HoldState.WARM,
        )
        self.emit("warm_server_starting", type=jobtype.name, gpu=gpu, epoch=epoch)
        return server

    # -- across a restart of the broker ------------------------------------------------

    def _keep(self, server: WarmServer, report: LoadReport) -> None:
        """A server just loaded: write its record for the next broker, if it may
        outlive this one (unsandboxed, with a wait, its socket in the node's stable
        folder); a server whose record cannot be written dies with its broker."""
        request = server.worker.request
        if WAIT_ENV not in request.env or server.pid is None:
            return
        ticks = supervisor.start_ticks(server.pid)
        if ticks is None:
            return
        record = ServerRecord(
            type=server.type.name,
            epoch=server.epoch,
            gpu=server.gpu,
            marker=request.marker,
            pid=server.pid,
            start_ticks=ticks,
            boot_id=supervisor.boot_id(),
            socket=str(server.worker.socket_path),
            footprint_bytes=server.footprint,
            load_s=max(report.load_s, 0.0),
            device_bytes=report.device_bytes,
            jobs_served=server.jobs_served,
        )
        try:
            warmrecord.write(self.settings.state_dir, record)
        except (OSError, safefs.UnsafePathError) as exc:
            log.warning("warm server %s: no record for the next broker: %s", server.holder, exc)
            return
        server.kept = True

    def leave_idle(self) -> list[WarmServer]:
        """A routine stop of the broker: let go of every idle server that has a
        record (:meth:`_keep`), leaving it running with its model loaded: its
        connection is closed without ``stop``, and it waits for the next broker
        (``GPUWARDEN_SERVE_WAIT_S``). They leave the pool; the others (busy,
        loading, without a record) are stopped as before. Returns those left."""
        left: list[WarmServer] = []
        for server in self.pool:
            if server.state is not ServerState.IDLE or not server.kept:
                continue
            server.worker.leave("left running for the next broker")
            self.pool.remove(server)
            handoff = self._handoffs.pop(server.holder, None)
            if handoff is not None:
                handoff.put(None)  # its thread ends; nothing is stopped
            self.emit(
                "warm_server_left",
                type=server.type.name,
                gpu=server.gpu,
                epoch=server.epoch,
                pid=server.pid,
                jobs_served=server.jobs_served,
            )
            left.append(server)
        return left

    def adopt(self, record: ServerRecord, jobtype: JobType, now: float) -> WarmServer:
        """Take over the server an earlier broker left (``record``, verified by the
        caller). It joins the pool as ``loading`` (its type's jobs wait; it is
        never evicted meanwhile) with its ledger holding restored, and its own
        thread waits for it to come back (:meth:`_adopted_loop`): then it is idle
        with its model still loaded; one that does not come back is stopped.
        Raises ValueError when its type has a server already."""
        log_dir = self.settings.state_dir / "warm" / f"{jobtype.name}-{record.epoch}"
        socket_path = self.socket_dir() / f"{record.epoch}.sock"
        launcher, request = self.launching.server_request(
            jobtype, record.gpu, record.epoch, log_dir, socket_path
        )
        worker = WarmProcess(
            launcher, request, socket_path, record.epoch, stop_wait_s=self.settings.stop_grace_s
        )
        grace = jobtype.idle_grace_s
        server = WarmServer(
            type=jobtype,
            gpu=record.gpu,
            epoch=record.epoch,
            worker=worker,
            footprint=self.footprints.of(jobtype),
            idle_grace_s=grace if grace is not None else self.settings.idle_grace_s,
            started_at=now,
            load_s=record.load_s,
            pid=record.pid,
            jobs_served=record.jobs_served,
            kept=True,
        )
        self.pool.add(server)
        self.pool.taken(record.epoch)
        self.vram.start(
            server.holder,
            server.gpu,
            type_name=jobtype.name,
            job_id=None,
            nbytes=server.footprint,
            coresident=jobtype.coresident,
            now=now,
            state=HoldState.WARM,
        )
        self.vram.set_pid(server.holder, record.pid)
        handoff = self._handoffs[server.holder] = Handoff()
        wait = min(max(COME_BACK_S, jobtype.timeout_s + COME_BACK_S), COME_BACK_MAX_S)
        handoff.thread = threading.Thread(
            target=self._adopted_loop,
            args=(server, handoff, wait),
            name=f"serve-{server.holder}",
            daemon=True,
        )
        self.emit(
            "warm_server_adopting", type=jobtype.name, gpu=server.gpu, epoch=record.epoch,
            pid=record.pid,
        )  # fmt: skip
        handoff.thread.start()
        return server

    def _adopted_loop(self, server: WarmServer, handoff: Handoff, wait_s: float) -> None:
        """An adopted server's thread: wait up to ``wait_s`` for it to come back,
        then serve the jobs handed to it as any server's thread does."""
        try:
            report = server.worker.attach(server.pid or 0, wait_s)
        except Exception as exc:
            why = exc.message if isinstance(exc, ServeError) else f"internal error: {exc!r}"
            if not isinstance(exc, ServeError):
                log.exception("taking over %s failed", server.holder)
                with contextlib.suppress(Exception):
                    server.worker.stop(why)
            self._note(server, "gone", reason=f"it did not come back: {why}")
            for left in handoff.close():
                self._drive(server, left, load=False)  # each fails as the server is gone
            return
        self._note(server, "adopted", report=report)
        self._serve_loop(server, None, handoff)

    def _adopted(self, server: WarmServer, report: LoadReport, now: float) -> None:
        """The loop: an adopted server came back, its model loaded: idle from now."""
        if server.state is ServerState.LOADING:
            server.state = ServerState.IDLE
            server.idle_since = now
        self.emit(
            "warm_server_adopted",
            type=server.type.name,
            gpu=server.gpu,
            epoch=server.epoch,
            pid=server.pid,
            load_s=round(report.load_s, 3),
            jobs_served=server.jobs_served,
        )

    # -- the worker threads ------------------------------------------------------------

    def load_and_serve(self, server: WarmServer, run: RunningAttempt) -> None:
        """Worker thread: start the server's process, wait for its model, serve the job."""
        self._drive(server, run, load=True)

    def _serve_loop(self, server: WarmServer, run: RunningAttempt | None, handoff: Handoff) -> None:
        """The server's thread: load it and serve ``run``, then each job handed to
        it in turn, until it is stopped or gone (or handed ``None``: stopped while
        idle). Jobs handed to it after that are served (and fail) here too, and
        the handoff is closed so that no later one waits for this thread."""
        next_run: RunningAttempt | None = run
        load = run is not None  # None: an adopted server, loaded already
        try:
            if next_run is None:
                next_run = handoff.get()
            while next_run is not None:
                self._drive(server, next_run, load=load)
                load = False
                if not server.worker.alive():
                    break
                next_run = handoff.get()
        finally:
            for left in handoff.close():
                self._drive(server, left, load=False)  # each fails as the server is gone

    def serve_next(self, server: WarmServer, run: RunningAttempt) -> None:
        """Worker thread: hand one job to a loaded server."""
        self._drive(server, run, load=False)

    def _drive(self, server: WarmServer, run: RunningAttempt, *, load: bool) -> None:
        """Whatever happens here, exactly one result is posted for the job; a server
        that cannot go on is stopped (confirmed gone) and its end posted too."""
        started = self.clock()
        stage = "could not load" if load else "failed"
        try:
            if load:
                report = self._load(server)
                self._note(server, "loaded", report=report)
                stage = "failed"
            self._serve_one(server, run, started)
        except ServeError as exc:
            if exc.kind == "output_limit":
                # the job wrote past [sandbox] output_mib: its own failure, not the
                # server's; the server was stopped all the same
                self.mailbox.post(
                    self._served_result(run, started=started, limit_exceeded=exc.message)
                )
                self._note(server, "gone", reason=exc.message)
                return
            self._lost(server, run, started, f"it {stage}: {exc}; its processes are confirmed gone")
        except ExchangeError as exc:
            why = f"its exchange folder could not be used safely: {exc.message}"
            try:
                server.worker.stop(why)
            except Exception:
                log.exception("stopping %s failed", server.holder)
            self._lost(server, run, started, f"{why}; it was stopped")
        except Exception as exc:  # a bug or an OS error must still end the attempt
            log.exception("serving %s on %s failed", run.job.id, server.holder)
            try:
                server.worker.stop(f"internal error: {exc!r}")
            except Exception:
                log.exception("stopping %s failed", server.holder)
            self._lost(server, run, started, f"internal error while serving: {exc!r}")

    def _lost(self, server: WarmServer, run: RunningAttempt, started: float, why: str) -> None:
        self.mailbox.post(
            self._served_result(run, started=started, worker_error=why, stopped=run.stop.is_set())
        )
        self._note(server, "gone", reason=why)

    def _load(self, server: WarmServer) -> LoadReport:
        jobtype = server.type
        strict = self.strict
        expected = jobtype.expected_device_bytes
        report = server.worker.start(
            jobtype.load_timeout_s,
            on_pid=lambda pid: self._note(server, "pid", pid=pid),
            expected_device_bytes=expected if strict else None,
        )
        why = None if strict or report.device_bytes is None else placement_check(report, expected)
        if why is not None:
            server.worker.stop(why)
            raise ServeError(why, kind="placement")
        return report

    def _serve_one(self, server: WarmServer, run: RunningAttempt, started: float) -> None:
        """Serve one job through its exchange slot and post its result; the slot is
        removed after that, on the remover's thread: off the path from the server's
        answer to the result, and from there to the server's next job."""
        input_dir, params = self.launching.params(run)
        request = server.worker.request
        sandboxed = bool(request.mounts)
        slot = ExchangeSlot(
            Path(request.attempt_dir) / "exchange",
            f"{run.job.id}-{run.attempt.number}",
            owner=self.launching.sandbox_owner(server.type) if sandboxed else None,
        )
        over: list[str] = []
        try:
            report = self._serve_through_exchange(server, run, slot, input_dir, params, over=over)
            self._after_served(
                server, run, started, report, limit_exceeded=over[0] if over else None
            )
        except BaseException:
            try:
                slot.close()
            except ExchangeError:
                log.exception("removing %s failed", slot.path)  # the first error stands
            raise
        self._remover.remove(server, slot)  # the server's thread goes on at once

    def _slot_not_removed(self, server: WarmServer, exc: ExchangeError) -> None:
        """The remover's thread: a served job's slot could not be removed. The job's
        outputs were moved out before its result was posted: that result stands. The
        server cannot be used safely any more: stopped (a job handed to it meanwhile
        fails as its infrastructure's failure)."""
        why = f"its exchange folder could not be used safely: {exc.message}"
        log.warning("warm server %s: %s", server.holder, why)
        try:
            server.worker.stop(why)
        finally:
            self._note(server, "gone", reason=why)

    def _output_over_limit(self, server: WarmServer, out: Path) -> str | None:
        """``output past N MiB`` when a sandboxed job's outputs in its slot hold more
        than ``[sandbox] output_mib`` (the server's watch sees the exchange folder
        only once a second: this is the check at the job's end)."""
        sandbox = self.launching.sandbox_for(server.type)
        limit = sandbox.limits.output_bytes if sandbox is not None else 0
        if limit <= 0:
            return None
        listing = safefs.walk(out)
        if listing.total_bytes <= limit and listing.truncated is None:
            return None
        return output_limit_reason(limit)

    def _serve_through_exchange(
        self,
        server: WarmServer,
        run: RunningAttempt,
        slot: ExchangeSlot,
        input_dir: Path,
        params: dict[str, Any],
        *,
        over: list[str],
    ) -> JobReport:
        """Every job reaches its warm server through the server's exchange folder
        (sandboxed or not: a server outlives its jobs, so it never gets a job's own
        folders). The job's slot ``<job>-<attempt>`` is made fresh there, whatever
        the server left under that name removed unfollowed; the job's inputs are
        copied in and its outputs moved to the attempt's ``out/`` by descriptor
        (:class:`gpuwarden.node.attemptfs.ExchangeSlot`); the caller removes the
        slot. A sandboxed job whose outputs are past ``[sandbox] output_mib`` when
        it ends gets the reason in ``over``."""
        sandboxed = bool(server.worker.request.mounts)
        seen = Path(INSIDE / "output" / slot.name) if sandboxed else slot.path
        try:
            slot.open(input_dir)
            staged = dict(params)
            for spec in run.jobtype.params:
                if spec.type.value == "input" and spec.name in staged:
                    rel = Path(str(staged[spec.name])).relative_to(input_dir)
                    staged[spec.name] = str(seen / "in" / rel)
            report = server.worker.run_job(
                run.job.id,
                run.attempt.number,
                staged,
                seen / "in",
                seen / "out",
                seen / "scratch",
                run.jobtype.timeout_s,
            )
            if sandboxed and (why := self._output_over_limit(server, slot.path / "out")):
                over.append(why)
            return report
        finally:
            try:
                slot.collect(run.attempt_dir / "out")
            except Exception:  # never hides why the job itself ended
                log.exception("collecting the outputs of %s from %s failed", run.holder, slot.path)
                slot.refused.append(
                    {"path": ".", "kind": "output folder", "why": "its outputs could not be moved"}
                )
            self.mailbox.post(
                ExchangeNote(
                    run.job.id,
                    run.attempt.number,
                    server.type.name,
                    server.epoch,
                    cleared=slot.cleared,
                    refused=tuple(slot.refused),
                )
            )

    def _after_served(
        self,
        server: WarmServer,
        run: RunningAttempt,
        started: float,
        report: JobReport,
        *,
        limit_exceeded: str | None = None,
    ) -> None:
        if report.message:
            attemptfs.write_new_file(
                run.attempt_dir / "message.json", json.dumps({"message": report.message}).encode()
            )
        for stale in report.stale_dropped:
            self._note(server, "stale", reason=json.dumps(stale))
        self.mailbox.post(
            self._served_result(
                run,
                started=started,
                exit_code=0 if report.ok else 1,
                stderr=report.error or "",
                limit_exceeded=limit_exceeded,
            )
        )

    def _served_result(
        self,
        run: RunningAttempt,
        *,
        started: float | None = None,
        exit_code: int | None = None,
        stderr: str = "",
        worker_error: str | None = None,
        stopped: bool = False,
        limit_exceeded: str | None = None,
    ) -> LaunchResult:
        now = self.clock()
        return LaunchResult(
            job_id=run.job.id,
            attempt=run.attempt.number,
            exit_code=exit_code,
            started_at=started or now,
            ended_at=now,
            pid=run.server.pid if run.server else None,
            stderr=stderr,
            worker_error=worker_error,
            stopped=stopped,
            limit_exceeded=limit_exceeded,
        )

    def _note(
        self,
        server: WarmServer,
        what: str,
        *,
        pid: int | None = None,
        report: LoadReport | None = None,
        reason: str = "",
    ) -> None:
        """Worker thread: post what became of ``server`` to the loop."""
        note = ServerNote(
            server.type.name, server.epoch, what, pid=pid, report=report, reason=reason
        )
        self.mailbox.post(note)

    # -- what the threads posted, eviction, stopping ------------------------------------

    def on_note(self, note: ServerNote, now: float) -> bool:
        """Take in what a server's thread posted; whether the node's status changed."""
        server = self.pool.get(note.type, note.epoch)
        if note.what == "stale":
            self.emit(
                "stale_report",
                type=note.type,
                epoch=note.epoch,
                action="dropped",
                report=note.reason,
            )
            return False
        if server is None:
            self.emit(
                "stale_report", type=note.type, epoch=note.epoch, action="dropped", report=note.what
            )
            return False
        if note.what == "pid" and note.pid is not None:
            server.pid = note.pid
            self.vram.set_pid(server.holder, note.pid)
        elif note.what == "loaded" and note.report is not None:
            server.load_s = note.report.load_s
            if server.state is ServerState.LOADING:
                server.state = ServerState.BUSY  # its first job runs now
            self._keep(server, note.report)
            self.emit(
                "warm_server_loaded",
                type=note.type,
                gpu=server.gpu,
                epoch=note.epoch,
                load_s=round(note.report.load_s, 3),
                device_bytes=note.report.device_bytes,
            )
        elif note.what == "adopted" and note.report is not None:
            self._adopted(server, note.report, now)
        elif note.what == "gone":
            if server.kept:
                warmrecord.remove(self.settings.state_dir, f"{server.epoch}.json")
            self.pool.remove(server)
            self._handoffs.pop(server.holder, None)
            measured = self.vram.end(server.holder, now)
            if measured is not None and measured.alone:
                self.footprints.measure(
                    server.type,
                    measured.peak_bytes,
                    override=None,
                    source=f"warm:{server.epoch}",
                    gpus=self.vram.views(),
                    now=now,
                )
            self.emit(
                "warm_server_stopped",
                type=note.type,
                gpu=server.gpu,
                epoch=note.epoch,
                reason=server.stop_reason or note.reason,
                jobs_served=server.jobs_served,
            )
        return True

    def evict(self, decision: policy.Evict) -> bool:
        """Stop an idle warm server; its busyness is checked again right here.
        Whether it was stopped."""
        server = self.pool.get(decision.type)
        if server is None or server.holder != decision.holder:
            return False
        if server.state is not ServerState.IDLE:
            self.emit(
                "eviction_skipped",
                type=server.type.name,
                epoch=server.epoch,
                reason=f"it is {server.state.value} now",
            )
            return False
        self.stop(server, f"evicted: {decision.reason}")
        return True

    def stop_idle_on(self, gpu: str, reason: str) -> None:
        """Stop the idle servers on ``gpu`` (a busy one stops with its job)."""
        for server in self.pool:
            if server.gpu == gpu and server.state is ServerState.IDLE:
                self.stop(server, reason)

    def stop_all(self, reason: str) -> None:
        """Stop every server not stopping already, each confirmed gone (shutdown)."""
        for server in self.pool:
            if server.state is not ServerState.STOPPING:
                self.stop(server, reason, wait=True)

    def stop(self, server: WarmServer, reason: str, *, wait: bool = False) -> None:
        """Stop ``server`` on a thread of its own; its end is posted (``gone``)."""
        server.state = ServerState.STOPPING
        server.stop_reason = reason
        self.emit("warm_server_stopping", type=server.type.name, epoch=server.epoch, reason=reason)

        def stop() -> None:
            server.worker.stop(reason)
            self._note(server, "gone", reason=reason)

        thread = threading.Thread(target=stop, name=f"stop-{server.holder}", daemon=True)
        thread.start()
        handoff = self._handoffs.get(server.holder)
        if handoff is not None:
            handoff.put(None)  # an idle server's thread waits for its next job: it ends
        if wait:
            thread.join()
