"""The warm-server half of the broker loop (launch mode ``serve``).

:class:`WarmServing` is mixed into :class:`gpuwarden.node.loop.Broker`: these
methods run on the loop thread, except ``_load_and_serve`` and ``_serve``, which
run on a worker thread per job, drive a :class:`WarmProcess`, and only post
messages (:class:`RunningAttempt` results and :class:`ServerNote`) back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden import safefs
from gpuwarden.config import Config
from gpuwarden.core import policy
from gpuwarden.core.ledger import HoldState
from gpuwarden.core.model import MIB, Job, JobType
from gpuwarden.errors import TransitionError
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.launch.base import INSIDE, Launcher, LaunchRequest, LaunchResult, Mount
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.sandbox import SandboxLauncher, mounts_for, output_limit_reason
from gpuwarden.launch.warmproc import (
    JobReport,
    LoadReport,
    ServeError,
    WarmProcess,
    placement_check,
)
from gpuwarden.node import attemptfs
from gpuwarden.node.attemptfs import ExchangeError, ExchangeSlot
from gpuwarden.node.running import ExchangeNote, RunningAttempt, ServerNote, Started
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warmpool import ServerState, WarmPool, WarmServer
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store

log = logging.getLogger("gpuwarden.node.loop")


class WarmServing:
    """Warm servers of one node, driven from the broker loop."""

    # provided by the Broker this is mixed into
    config: Config
    store: Store
    probe: GpuProbe
    registry: Registry
    vram: VramBook
    warm: WarmPool
    node: str
    instance: str
    _running: dict[str, RunningAttempt]
    _waits: dict[str, str]
    _status_dirty: bool
    _completions: queue.Queue[LaunchResult | Started | ServerNote | ExchangeNote]
    _wake: threading.Event
    _jobs_dir: Path
    #: made on the first server's start (:meth:`socket_dir`)
    _socket_dir: Path | None

    if TYPE_CHECKING:

        def _emit(self, kind: str, **detail: Any) -> None: ...

        def footprint(self, jobtype: JobType, override: int | None = None) -> int: ...

        def _params(self, run: RunningAttempt) -> tuple[Path, dict[str, Any]]: ...

        def _base_env(self, gpu: str | None) -> dict[str, str]: ...

        def sandbox_for(self, jobtype: JobType) -> SandboxLauncher | None: ...

        def sandbox_owner(self, jobtype: JobType) -> tuple[int, int] | None: ...

        def _make_attempt_dir(self, run: RunningAttempt, now: float) -> None: ...

        def gpu_access(self, gpu: str | None) -> tuple[str | None, tuple[Mount, ...]]: ...

        def _raise_footprint(
            self, jobtype: JobType, peak: int, override: int | None, source: str, now: float
        ) -> None: ...

    def _start_served(
        self, job: Job, jobtype: JobType, decision: policy.Start, gpu: str, now: float
    ) -> None:
        """Hand the job to its type's warm server, loading one first if there is none."""
        server = self.warm.get(jobtype.name)
        if decision.warm and (server is None or server.state is not ServerState.IDLE):
            return  # it changed since the plan: the next pass decides again
        if not decision.warm and server is not None:
            return  # one server per type: the old one is still there (stopping)
        try:
            job, attempt = self.store.start_attempt(job.id, node=self.node, gpu_uuid=gpu, now=now)
        except TransitionError:
            return
        attempt_dir = self._jobs_dir / job.id / f"attempt-{attempt.number}"
        run = RunningAttempt(job=job, attempt=attempt, jobtype=jobtype, attempt_dir=attempt_dir)
        self._running[job.id] = run
        self._waits.pop(job.id, None)
        self._status_dirty = True
        fresh: WarmServer | None = None
        try:
            # the server never sees this folder: its job's files pass through the
            # server's exchange folder, and the outputs are moved here afterwards
            self._make_attempt_dir(run, now)
            safefs.make_dir(attempt_dir / "out")
            if server is None or not decision.warm:
                server = fresh = self._new_server(jobtype, gpu, job.priority, now)
                target = self._load_and_serve
            else:
                server.state = ServerState.BUSY
                target = self._serve
            server.priority = job.priority
            run.server = server
            run.thread = threading.Thread(
                target=target,
                args=(server, run),
                name=f"serve-{job.id}-{attempt.number}",
                daemon=True,
            )
            run.thread.start()
        except Exception as exc:  # the attempt started in the store: it must still end
            log.exception("could not start serving %s", job.id)
            run.thread = None
            if fresh is not None:  # nothing ran: its memory was never used
                self.warm.remove(fresh)
                self.vram.end(fresh.holder, now)
            elif run.server is not None:
                run.server.state = ServerState.IDLE
                run.server = None
            self._post(
                LaunchResult(
                    job_id=job.id,
                    attempt=attempt.number,
                    exit_code=None,
                    started_at=now,
                    ended_at=time.time(),
                    launch_error=f"could not prepare the attempt: {exc}",
                )
            )

    def socket_dir(self) -> Path:
        """Where this broker's servers' sockets live: short, since a unix socket's
        path is limited to 107 bytes (a state directory's may be longer). Made
        fresh, once, with a random name (``mkdtemp``: mode 0700, created
        atomically), so nothing another user planted in /tmp is ever used."""
        if self._socket_dir is None:
            self._socket_dir = Path(tempfile.mkdtemp(prefix=f"gpuwarden-{self.instance[-10:]}-"))
        return self._socket_dir

    def _new_server(self, jobtype: JobType, gpu: str, priority: int, now: float) -> WarmServer:
        epoch = self.warm.next_epoch()
        warm_dir = self.config.state_dir / "warm"
        attemptfs.own_dir(warm_dir)
        log_dir = warm_dir / f"{jobtype.name}-{epoch}"
        safefs.make_dir(log_dir)  # fresh: an epoch is never reused
        # the folder every job of the server passes through (its mount, in a sandbox)
        safefs.make_dir(log_dir / "exchange", mode=attemptfs.EXCHANGE_MODE)
        sandbox = self.sandbox_for(jobtype)
        env = self._base_env(gpu)
        env["GPUWARDEN_JOB_TYPE"] = jobtype.name
        weights = self.config.sandbox.weights_dir
        if weights is not None:
            env["GPUWARDEN_WEIGHTS_DIR"] = str(weights)
        request = LaunchRequest(
            job_id=f"warm-{jobtype.name}",
            attempt=epoch,
            argv=self.registry.argv(jobtype, sandbox.python if sandbox else None),
            cwd=jobtype.module_dir,
            env=env,
            attempt_dir=str(log_dir),
            timeout_s=math.inf,
            clip_chars=self.config.broker.clip_chars,
            kill_grace_s=self.config.broker.kill_grace_s,
            instance=self.instance,
        )
        socket_path = self.socket_dir() / f"{epoch}.sock"
        launcher: Launcher = HostLauncher()
        if sandbox is not None:
            launcher = sandbox
            request = self._sandboxed_server_request(request, gpu, socket_path, jobtype)
        worker = WarmProcess(
            launcher,
            request,
            socket_path,
            epoch,
            stop_wait_s=self.config.warm.stop_grace_s,
        )
        footprint = self.footprint(jobtype)
        server = WarmServer(
            type=jobtype,
            gpu=gpu,
            epoch=epoch,
            worker=worker,
            footprint=footprint,
            idle_grace_s=(
                jobtype.idle_grace_s
                if jobtype.idle_grace_s is not None
                else self.config.warm.idle_grace_s
            ),
            started_at=now,
            priority=priority,
        )
        self.warm.add(server)
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
        self._emit("warm_server_starting", type=jobtype.name, gpu=gpu, epoch=epoch)
        return server

    def _sandboxed_server_request(
        self, request: LaunchRequest, gpu: str, socket_path: Path, jobtype: JobType
    ) -> LaunchRequest:
        """A warm server in a sandbox sees its module, its scratch, its socket and
        its exchange folder, through which each job's files pass (mounts cannot
        change while it runs, so the jobs' own folders are never mounted)."""
        log_dir = Path(request.attempt_dir)
        exchange = log_dir / "exchange"
        # its load scratch (a bind mount when [sandbox] scratch_mib = 0), the
        # sandbox's user's like an attempt's
        safefs.make_dir(log_dir / "scratch", owner=self.sandbox_owner(jobtype))
        weights = self.config.sandbox.weights_dir
        gpu_uuid, gpu_mounts = self.gpu_access(gpu)
        mounts = mounts_for(
            module_dir=jobtype.module_dir,
            input_dir=None,
            output_dir=str(exchange),
            scratch_dir=str(log_dir / "scratch"),
            report_dir=None,
            params_file=None,
            weights_dir=str(weights) if weights is not None else None,
            scratch_bytes=int(self.config.sandbox.scratch_mib * MIB),
            extra=(Mount(str(socket_path), str(INSIDE / "serve.sock"), writable=True), *gpu_mounts),
        )
        return dataclasses.replace(
            request, mounts=mounts, gpu_uuid=gpu_uuid, memory_bytes=jobtype.ram_bytes
        )

    def _load_and_serve(self, server: WarmServer, run: RunningAttempt) -> None:
        """Worker thread: start the server's process, wait for its model, serve the job."""
        self._drive(server, run, load=True)

    def _serve(self, server: WarmServer, run: RunningAttempt) -> None:
        """Worker thread: hand one job to a loaded server."""
        self._drive(server, run, load=False)

    def _drive(self, server: WarmServer, run: RunningAttempt, *, load: bool) -> None:
        """Whatever happens here, exactly one result is posted for the job; a server
        that cannot go on is stopped (confirmed gone) and its end posted too."""
        started = time.time()
        stage = "could not load" if load else "failed"
        try:
            if load:
                report = self._load(server)
                self._post(ServerNote(server.type.name, server.epoch, "loaded", report=report))
                stage = "failed"
            self._serve_one(server, run, started)
        except ServeError as exc:
            if exc.kind == "output_limit":
                # the job wrote past [sandbox] output_mib: its own failure, not the
                # server's; the server was stopped all the same
                self._post(self._served_result(run, started=started, limit_exceeded=exc.message))
                self._post(ServerNote(server.type.name, server.epoch, "gone", reason=exc.message))
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
        self._post(
            self._served_result(run, started=started, worker_error=why, stopped=run.stop.is_set())
        )
        self._post(ServerNote(server.type.name, server.epoch, "gone", reason=why))

    def _load(self, server: WarmServer) -> LoadReport:
        jobtype = server.type
        # On a real GPU a worker must say how much of its model is on the device. The
        # simulated GPU has no device for a real model: a worker that reports no
        # figure there (it runs on the CPU by design) is not checked.
        strict = self.probe.kind != "sim"
        expected = jobtype.expected_device_bytes
        report = server.worker.start(
            jobtype.load_timeout_s,
            on_pid=lambda pid: self._post(ServerNote(jobtype.name, server.epoch, "pid", pid=pid)),
            expected_device_bytes=expected if strict else None,
        )
        why = None if strict or report.device_bytes is None else placement_check(report, expected)
        if why is not None:
            server.worker.stop(why)
            raise ServeError(why, kind="placement")
        return report

    def _serve_one(self, server: WarmServer, run: RunningAttempt, started: float) -> None:
        input_dir, params = self._params(run)
        over: list[str] = []
        report = self._serve_through_exchange(server, run, input_dir, params, over=over)
        self._after_served(server, run, started, report, limit_exceeded=over[0] if over else None)

    def _output_over_limit(self, server: WarmServer, out: Path) -> str | None:
        """``output past N MiB`` when a sandboxed job's outputs in its slot hold more
        than ``[sandbox] output_mib`` (the server's watch sees the exchange folder
        only once a second: this is the check at the job's end)."""
        sandbox = self.sandbox_for(server.type)
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
        (:class:`gpuwarden.node.attemptfs.ExchangeSlot`). A sandboxed job whose outputs
        are past ``[sandbox] output_mib`` when it ends gets the reason in ``over``."""
        request = server.worker.request
        sandboxed = bool(request.mounts)
        slot = ExchangeSlot(
            Path(request.attempt_dir) / "exchange",
            f"{run.job.id}-{run.attempt.number}",
            owner=self.sandbox_owner(server.type) if sandboxed else None,
        )
        seen = Path(INSIDE / "output" / slot.name) if sandboxed else slot.path
        failing = True
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
            failing = False
            return report
        finally:
            try:
                slot.collect(run.attempt_dir / "out")
            except Exception:  # never hides why the job itself ended
                log.exception("collecting the outputs of %s from %s failed", run.holder, slot.path)
                slot.refused.append(
                    {"path": ".", "kind": "output folder", "why": "its outputs could not be moved"}
                )
            self._post(
                ExchangeNote(
                    run.job.id,
                    run.attempt.number,
                    server.type.name,
                    server.epoch,
                    cleared=slot.cleared,
                    refused=tuple(slot.refused),
                )
            )
            try:
                slot.close()
            except ExchangeError:
                if not failing:
                    raise
                log.exception("removing %s failed", slot.path)  # the first error stands

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
            self._post(
                ServerNote(server.type.name, server.epoch, "stale", reason=json.dumps(stale))
            )
        self._post(
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
        now = time.time()
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

    def _post(self, item: LaunchResult | Started | ServerNote | ExchangeNote) -> None:
        self._completions.put(item)
        self._wake.set()

    def _on_server_note(self, note: ServerNote, now: float) -> None:
        server = self.warm.get(note.type, note.epoch)
        if note.what == "stale":
            self._emit(
                "stale_report",
                type=note.type,
                epoch=note.epoch,
                action="dropped",
                report=note.reason,
            )
            return
        if server is None:
            self._emit(
                "stale_report", type=note.type, epoch=note.epoch, action="dropped", report=note.what
            )
            return
        if note.what == "pid" and note.pid is not None:
            server.pid = note.pid
            self.vram.set_pid(server.holder, note.pid)
        elif note.what == "loaded" and note.report is not None:
            server.load_s = note.report.load_s
            if server.state is ServerState.LOADING:
                server.state = ServerState.BUSY  # its first job runs now
            self._emit(
                "warm_server_loaded",
                type=note.type,
                gpu=server.gpu,
                epoch=note.epoch,
                load_s=round(note.report.load_s, 3),
                device_bytes=note.report.device_bytes,
            )
        elif note.what == "gone":
            self.warm.remove(server)
            measured = self.vram.end(server.holder, now)
            if measured is not None and measured.alone:
                self._raise_footprint(
                    server.type, measured.peak_bytes, None, f"warm:{server.epoch}", now
                )
            self._emit(
                "warm_server_stopped",
                type=note.type,
                gpu=server.gpu,
                epoch=note.epoch,
                reason=server.stop_reason or note.reason,
                jobs_served=server.jobs_served,
            )
        self._status_dirty = True

    def _evict(self, decision: policy.Evict) -> None:
        """Stop an idle warm server; its busyness is checked again right here."""
        server = self.warm.get(decision.type)
        if server is None or server.holder != decision.holder:
            return
        if server.state is not ServerState.IDLE:
            self._emit(
                "eviction_skipped",
                type=server.type.name,
                epoch=server.epoch,
                reason=f"it is {server.state.value} now",
            )
            return
        self._stop_server(server, f"evicted: {decision.reason}")

    def _stop_server(self, server: WarmServer, reason: str, *, wait: bool = False) -> None:
        server.state = ServerState.STOPPING
        server.stop_reason = reason
        self._emit("warm_server_stopping", type=server.type.name, epoch=server.epoch, reason=reason)

        def stop() -> None:
            server.worker.stop(reason)
            self._post(ServerNote(server.type.name, server.epoch, "gone", reason=reason))

        thread = threading.Thread(target=stop, name=f"stop-{server.holder}", daemon=True)
        thread.start()
        if wait:
            thread.join()
