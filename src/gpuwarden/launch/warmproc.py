"""The broker side of one serve worker (launch mode ``serve``).

A :class:`WarmProcess` is one warm model server: a host process started with its
GPU and a unix socket, which loads its model once and then takes jobs one at a
time over the socket (the protocol is in :mod:`gpuwarden.server.protocol`).

The process is run by the host launcher on a daemon thread, exactly like an
attempt (with an infinite timeout), so stopping it reuses the launcher's tree
kill: setting the stop event stops every process of the worker and returns only
once each is confirmed gone.

Every failure of the worker is a :class:`ServeError`, raised only after the
worker has been stopped and confirmed gone (its ``launch_result`` says whether
anything survived SIGKILL). All but ``output_limit`` are not the job's fault,
so they are *infrastructure* failures — the job is retried up to its type's
``max_retries``, then quarantined — and ``kind`` says which:

==================  ============================================================
``start``           the socket could not be made or the process not started
``load_failed``     the module's ``load`` raised (the worker sent ``load_failed``)
``load_timeout``    no ``hello`` and ``ready`` within the load timeout
``placement``       the placement check refused the load (model partly on the CPU)
``protocol``        garbage on the socket, a wrong epoch before ``ready``, or a
                    malformed message
``crashed``         the worker closed the connection or its process ended
``timeout``         no result within the job's timeout (the worker hung)
``stopped``         :meth:`WarmProcess.stop` was called (cancel, eviction,
                    shutdown) while ``start`` or ``run_job`` waited
``output_limit``    the sandbox stopped the worker: its exchange folder (its
                    output mount) held more than ``[sandbox] output_mib``
==================  ============================================================

``output_limit`` is the exception: writing past the output limit is what the
job asked the server to do, so it is the job's own failure (``infrastructure``
is False) and the reason starts with the sandbox's ``output past N MiB``.

Load failures are infrastructure failures: the load is the job type's, not
the job's, and it may fail for reasons outside the module (memory not yet freed
by a previous holder, a driver fall-back); ``max_retries`` and quarantine bound
the cost of a load that always fails. A failure *inside* ``handle`` is not a
``ServeError``: it comes back as a :class:`JobReport` with ``ok`` false, the
job's own failure, and the worker goes on serving.

One file because it is one object: :class:`WarmProcess` owns one process, one
socket and the locks between them, and its start, jobs and stop are the states
of that one worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from gpuwarden.errors import GpuwardenError
from gpuwarden.launch.base import Launcher, LaunchRequest, LaunchResult
from gpuwarden.launch.host import Ended, watch_adopted
from gpuwarden.launch.reaper import carries
from gpuwarden.server.protocol import (
    Channel,
    PeerClosed,
    ProtocolError,
    field,
    optional_field,
)
from gpuwarden.server.worker import EPOCH_ENV, SCRATCH_ENV, SOCKET_ENV

__all__ = [
    "PLACEMENT_MIN_FRACTION",
    "STOP_WAIT_S",
    "JobReport",
    "LoadReport",
    "ServeError",
    "ServeFailure",
    "WarmProcess",
    "placement_check",
]

log = logging.getLogger(__name__)

#: how long :meth:`WarmProcess.stop` waits for an idle worker to exit after ``stop``
#: before the launcher stops its process tree
STOP_WAIT_S = 2.0
#: longest single wait while waiting for the worker, so that a ``stop`` from another
#: thread and the end of the process are noticed promptly
POLL_S = 0.05
#: how long sending one message may take (the worker is not reading: it is stuck)
SEND_TIMEOUT_S = 10.0
#: the least fraction of the declared model size that must be in GPU memory
PLACEMENT_MIN_FRACTION = Fraction(99, 100)
_PLACEMENT_NUM = PLACEMENT_MIN_FRACTION.numerator
_PLACEMENT_DENOM = PLACEMENT_MIN_FRACTION.denominator
_PLACEMENT_MAX_REFUSED = math.ceil(100 * PLACEMENT_MIN_FRACTION) - 1
#: the longest path a unix socket can have on Linux (bytes, without the NUL)
MAX_SOCKET_PATH = 107

ServeFailure = Literal[
    "start",
    "load_failed",
    "load_timeout",
    "placement",
    "protocol",
    "crashed",
    "timeout",
    "stopped",
    "output_limit",
]


class ServeError(GpuwardenError):
    """A serve worker failed; it has been stopped."""

    def __init__(
        self,
        message: str,
        *,
        kind: ServeFailure,
        infrastructure: bool = True,
        launch_result: LaunchResult | None = None,
        stale_dropped: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        #: which failure (see the module docstring)
        self.kind: ServeFailure = kind
        #: not the job's own failure: retried up to ``max_retries``
        self.infrastructure = infrastructure
        #: the stopped worker's result (exit code, survivors), when it was started
        self.launch_result = launch_result
        #: messages dropped while waiting (stale epoch or attempt), for the log
        self.stale_dropped: list[dict[str, Any]] = list(stale_dropped or [])


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a worker reported when its model was loaded."""

    #: seconds the module's ``load`` took, as measured by the worker
    load_s: float
    #: bytes of the model in GPU memory, or None when the module does not say
    device_bytes: int | None
    #: the worker's main process (the one the launcher started)
    pid: int


@dataclass(frozen=True, slots=True)
class JobReport:
    """The end of one job on a worker."""

    #: True when ``handle`` returned; False when it raised (the job's own failure)
    ok: bool
    #: what ``handle`` returned
    message: str | None
    #: ``"<ExceptionType>: <message>"`` when ``ok`` is False
    error: str | None
    #: messages dropped while waiting (stale epoch or attempt), for the caller to log
    stale_dropped: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _ready_numbers(msg: Mapping[str, Any]) -> tuple[float, int | None]:
    """The load time and device bytes of a ``ready`` message, checked."""
    load_s = field(msg, "load_s", float)
    device_bytes = optional_field(msg, "device_bytes", int)
    if load_s < 0 or (device_bytes is not None and device_bytes < 0):
        raise ProtocolError("the 'ready' message has a negative load_s or device_bytes")
    return load_s, device_bytes


def placement_check(report: LoadReport, expected_bytes: int | None) -> str | None:
    """Return why a load must be refused, or None if it may serve.

    With ``expected_bytes`` set (> 0), at least :data:`PLACEMENT_MIN_FRACTION` of
    it must be in GPU memory; a worker that does not report ``device_bytes``
    fails too. Less means part of the model silently fell back to the CPU.
    """
    if expected_bytes is None or expected_bytes <= 0:
        return None
    want = _size(expected_bytes, expected_bytes)
    if report.device_bytes is None:
        return (
            f"the worker did not report how much of the model is in GPU memory "
            f"({want} expected there)"
        )
    if report.device_bytes * _PLACEMENT_DENOM >= _PLACEMENT_NUM * expected_bytes:
        return None
    # never shows a refused load as 99 % or more
    percent = min(round(100 * report.device_bytes / expected_bytes), _PLACEMENT_MAX_REFUSED)
    return (
        f"only {percent}% of the model ({_size(report.device_bytes, expected_bytes)} of "
        f"{want}) is in GPU memory: it fell back to the CPU"
    )


def _size(nbytes: int, scale: int) -> str:
    """``nbytes`` in the binary unit that suits ``scale``, one decimal."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if scale >= factor:
            return f"{nbytes / factor:.1f} {unit}"
    return f"{nbytes} B"


class _Failure(GpuwardenError):
    """Why waiting for the worker ended; turned into a ServeError after the stop."""

    def __init__(self, kind: ServeFailure, reason: str, *, with_exit: bool = False) -> None:
        super().__init__(reason)
        self.kind: ServeFailure = kind
        self.reason = reason
        #: add the worker's exit status and stderr tail to the reason
        self.with_exit = with_exit


class WarmProcess:
    """One serve worker process and the connection to it.

    ``req`` is a host launch request for the worker process: its argv, cwd,
    environment (with ``CUDA_VISIBLE_DEVICES``), ``attempt_dir`` (for
    ``stdout.log`` and ``stderr.log``) and ``timeout_s = math.inf`` (the process
    lives until stopped). The worker adds ``GPUWARDEN_SERVE_SOCKET`` and
    ``GPUWARDEN_SERVE_EPOCH``, and ``GPUWARDEN_SCRATCH_DIR`` (``<attempt_dir>/
    scratch``, the load's scratch folder) unless the request sets it.

    One caller at a time (the broker's loop); only :meth:`stop`, :meth:`alive`
    and the properties may be called from another thread, also while
    :meth:`start` or :meth:`run_job` waits — which then raises a ``stopped``
    :class:`ServeError` once the worker is gone.
    """

    def __init__(
        self,
        launcher: Launcher,
        req: LaunchRequest,
        socket_path: Path,
        epoch: int,
        *,
        stop_wait_s: float = STOP_WAIT_S,
    ) -> None:
        env = dict(req.env)
        env[SOCKET_ENV] = str(socket_path)
        env[EPOCH_ENV] = str(epoch)
        env.setdefault(SCRATCH_ENV, str(Path(req.attempt_dir) / "scratch"))
        self._req = dataclasses.replace(req, env=env)
        self._launcher = launcher
        self._socket_path = Path(socket_path)
        self._epoch = epoch
        self._stop_wait_s = stop_wait_s

        #: what runs or watches the process: the launcher's thread, or (attach) the
        #: reaper's watch of an adopted one
        self._thread: threading.Thread | Ended | None = None
        self._launch_result: LaunchResult | None = None
        self._pid: int | None = None
        self._pid_known = threading.Event()
        self._listener: socket.socket | None = None
        self._channel: Channel | None = None
        self._ready_seen = False
        #: the worker said load_failed: it exits by itself
        self._exiting = False
        self._loaded = False
        self._busy = False
        #: set for the launcher: stop the whole process tree
        self._kill = threading.Event()
        #: set when stop() begins: waits in other threads give up
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        #: held around each receive and around closing the channel
        self._io_lock = threading.Lock()
        self._stop_result: LaunchResult | None = None
        self._stop_reason: str | None = None
        #: set by :meth:`attach`: only a process carrying this marker may connect
        self._peer_marker: str | None = None

    # -- properties -----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def pid(self) -> int | None:
        """The worker's main process id, once it has started."""
        return self._pid

    @property
    def request(self) -> LaunchRequest:
        """The launch request the process runs with (the added variables included)."""
        return self._req

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def busy(self) -> bool:
        """True while :meth:`run_job` waits for a result."""
        return self._busy

    @property
    def stop_reason(self) -> str | None:
        """The reason given to the first :meth:`stop`, once it was called."""
        return self._stop_reason

    @property
    def launch_result(self) -> LaunchResult | None:
        """The process's result, once :meth:`stop` has returned."""
        return self._stop_result

    def alive(self) -> bool:
        """True from :meth:`start` until the worker is stopped or its process ends."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping.is_set()

    def stderr_tail(self, limit: int = 2000) -> str:
        """The last ``limit`` characters of the worker's ``stderr.log`` (invalid
        UTF-8 as U+FFFD), stripped; "" when there is none."""
        return _tail(Path(self._req.attempt_dir) / "stderr.log", limit)

    # -- start ----------------------------------------------------------------

    def start(
        self,
        load_timeout_s: float,
        on_pid: Callable[[int], None] | None = None,
        expected_device_bytes: int | None = None,
    ) -> LoadReport:
        """Start the worker and wait until its model is loaded; blocks.

        Listens on the socket, starts the process (``on_pid`` gets its pid as
        soon as it runs), accepts its connection and waits for ``hello`` and
        then ``ready`` or ``load_failed``, all within ``load_timeout_s``. Then
        applies :func:`placement_check` with ``expected_device_bytes``.

        On any failure the worker is stopped (confirmed gone) and a
        :class:`ServeError` is raised. Called once.
        """
        if self._thread is not None or self._stop_result is not None:
            raise RuntimeError("WarmProcess.start() may be called once")
        deadline = time.monotonic() + load_timeout_s if load_timeout_s < math.inf else None
        try:
            self._listener = self._listen()
        except OSError as exc:
            reason = f"cannot listen on the serve socket {self._socket_path}: {exc}"
            raise ServeError(reason, kind="start", launch_result=self.stop(reason)) from exc

        self._thread = threading.Thread(
            target=self._run_process,
            args=(on_pid,),
            name=f"serve-worker-{self._epoch}",
            daemon=True,
        )
        self._thread.start()
        with self._failing():
            self._accept(deadline, load_timeout_s)
            hello = self._receive(deadline, lambda: self._load_timeout("say hello", load_timeout_s))
            self._expect_own(hello, "hello")
            hello_pid = field(hello, "pid", int)
            msg = self._receive(deadline, lambda: self._load_timeout("load", load_timeout_s))
            self._expect_own(msg, "ready", "load_failed")
            if msg["type"] == "load_failed":
                self._exiting = True
                raise _Failure(
                    "load_failed", f"the model failed to load: {field(msg, 'error', str)}"
                )
            self._ready_seen = True
            load_s, device_bytes = _ready_numbers(msg)
            # the launcher reports the pid right after the start: at once, in practice
            self._pid_known.wait(1.0)
            report = LoadReport(load_s, device_bytes, self._pid or hello_pid)
            refused = placement_check(report, expected_device_bytes)
            if refused is not None:
                raise _Failure("placement", refused)
        self._loaded = True
        log.info(
            "serve worker epoch %d (pid %d) loaded in %.2f s, %s bytes on the device",
            self._epoch,
            report.pid,
            report.load_s,
            report.device_bytes,
        )
        return report

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """A start or a take-over: any failure stops the worker and is raised as a
        :class:`ServeError` (protocol error, the worker gone, or what it said)."""
        try:
            yield
        except ProtocolError as exc:
            raise self._fail(_Failure("protocol", f"protocol error: {exc.message}")) from None
        except PeerClosed:
            raise self._fail(
                _Failure("crashed", "the serve worker closed the connection", with_exit=True)
            ) from None
        except _Failure as failure:
            raise self._fail(failure) from None

    # -- a worker an earlier broker left ------------------------------------------

    def attach(self, pid: int, wait_s: float) -> LoadReport:
        """Take over a loaded worker an earlier broker of this node started and left
        running; blocks. ``pid`` is its supervisor (the caller verified it by its
        start time, boot id and marker: never a bare pid), watched from now on by
        the reaper. Listens on the worker's socket path again and waits up to
        ``wait_s`` for it to connect (only a process carrying the worker's marker
        is accepted) and say ``hello`` and ``ready`` with ``"resumed": true``:
        nothing is loaded again. On any failure the worker is stopped (every
        process with its marker, confirmed gone) and a :class:`ServeError` is
        raised. Called once, instead of :meth:`start`."""
        if self._thread is not None or self._stop_result is not None:
            raise RuntimeError("WarmProcess.attach() may be called once, instead of start()")
        self._pid = pid
        self._pid_known.set()
        self._peer_marker = self._req.marker
        self._thread = watch_adopted(self._req, pid, self._kill, self._adopted_end)
        deadline = time.monotonic() + wait_s
        try:
            self._listener = self._listen()
        except OSError as exc:
            reason = f"cannot listen on the serve socket {self._socket_path}: {exc}"
            raise ServeError(reason, kind="start", launch_result=self.stop(reason)) from exc
        with self._failing():
            self._accept(deadline, wait_s)
            hello = self._receive(deadline, lambda: self._load_timeout("come back", wait_s))
            self._expect_own(hello, "hello")
            msg = self._receive(deadline, lambda: self._load_timeout("say ready", wait_s))
            self._expect_own(msg, "ready")
            if msg.get("resumed") is not True:
                raise ProtocolError("the worker loaded its model again instead of resuming")
            self._ready_seen = True
            load_s, device_bytes = _ready_numbers(msg)
        self._loaded = True
        log.info("serve worker epoch %d (supervisor pid %d) taken over", self._epoch, pid)
        return LoadReport(load_s, device_bytes, pid)

    def _adopted_end(self, result: LaunchResult) -> None:
        self._launch_result = result

    def leave(self, reason: str) -> None:
        """Let go of the worker and leave its processes running (a routine stop of
        the broker): the connection is closed without ``stop``, so a worker
        started with a wait (``GPUWARDEN_SERVE_WAIT_S``) keeps its model and
        waits for the next broker. Waits in other threads give up; nothing is
        killed. The object is not used again."""
        with self._stop_lock:
            if self._stop_result is not None:
                return
            self._stop_reason = reason
            self._stopping.set()
            with self._io_lock:
                if self._channel is not None:
                    self._channel.close()
                self._close_listener()

    def _peer_ok(self, conn: socket.socket) -> bool:
        """Whether the process that connected may (:meth:`attach`: it carries the
        worker's marker, as the kernel names it; any other is turned away)."""
        if self._peer_marker is None:
            return True
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return False
        peer = struct.unpack("3i", raw)[0]
        if peer > 0 and carries(peer, self._peer_marker):
            return True
        log.warning(
            "serve worker epoch %d: turned away a connection from pid %d", self._epoch, peer
        )
        return False

    def _listen(self) -> socket.socket:
        path = self._socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OSError(f"the path is longer than {MAX_SOCKET_PATH} bytes")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # the folder may be in /tmp: someone else could have made it first
        st = os.lstat(path.parent)
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise OSError(
                f"the socket's folder {path.parent} is not this broker's own (a folder of "
                f"uid {os.geteuid()} that no one else may write to): remove it"
            )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket of an earlier worker
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            path.chmod(stat.S_IRUSR | stat.S_IWUSR)
            listener.listen(1)
            listener.setblocking(False)
        except OSError:
            listener.close()
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return listener

    def _run_process(self, on_pid: Callable[[int], None] | None) -> None:
        """The launcher thread: run the worker process until it ends or is stopped."""

        def on_start(pid: int) -> None:
            self._pid = pid
            self._pid_known.set()
            if on_pid is not None:
                # an exception here would escape the launcher before its cleanup
                try:
                    on_pid(pid)
                except Exception:
                    log.exception("serve worker epoch %d: on_pid failed", self._epoch)

        now = time.time()
        try:
            self._launch_result = self._launcher.run(self._req, self._kill, on_start)
        except Exception as exc:  # the launcher promises not to raise; be safe
            log.exception("serve worker epoch %d: the launcher raised", self._epoch)
            self._launch_result = LaunchResult(
                job_id=self._req.job_id,
                attempt=self._req.attempt,
                exit_code=None,
                started_at=now,
                ended_at=time.time(),
                pid=self._pid,
                launch_error=f"the launcher failed: {exc}",
            )

    def _accept(self, deadline: float | None, load_timeout_s: float) -> None:
        """Accept the worker's one connection, then close the listener and remove
        the socket file."""
        while True:
            self._check_running("before it connected")
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise self._load_timeout("connect", load_timeout_s)
            with self._io_lock:  # stop() closes the listener under this lock
                listener = self._listener
                if listener is None:
                    raise _Failure("stopped", f"the serve worker was stopped: {self._stop_reason}")
                poller = select.poll()
                poller.register(listener, select.POLLIN)
                if not poller.poll(math.ceil(wait * 1000)):
                    continue
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                if not self._peer_ok(conn):
                    conn.close()
                    continue
                self._close_listener()
                self._channel = Channel(conn)
                return

    def _load_timeout(self, what: str, load_timeout_s: float) -> _Failure:
        return _Failure(
            "load_timeout", f"the serve worker did not {what} within {load_timeout_s:g} s"
        )

    def _expect_own(self, msg: Mapping[str, Any], *types: str) -> None:
        if msg["epoch"] != self._epoch:
            raise ProtocolError(
                f"a {msg['type']!r} message of epoch {msg['epoch']} from the worker of "
                f"epoch {self._epoch}"
            )
        if msg["type"] not in types:
            raise ProtocolError(
                f"expected {' or '.join(map(repr, types))}, got a {msg['type']!r} message"
            )

    # -- jobs -----------------------------------------------------------------

    def run_job(  # noqa: PLR0917 - the signature the broker codes against
        self,
        job_id: str,
        attempt: int,
        params: Mapping[str, Any],
        input_dir: Path,
        output_dir: Path,
        scratch_dir: Path,
        timeout_s: float,
    ) -> JobReport:
        """Run one job on the worker and return its report; blocks.

        Sends ``job`` and waits up to ``timeout_s`` (``math.inf``: no limit) for
        the ``result`` whose epoch, job and attempt match. Any other message is
        dropped and listed in ``stale_dropped``. On a timeout, garbage, end of
        file, the process ending, or :meth:`stop` from another thread, the
        worker is stopped (confirmed gone) and a :class:`ServeError` raised.
        """
        if not self._loaded:
            raise RuntimeError("WarmProcess.run_job() before a successful start()")
        stale: list[dict[str, Any]] = []
        self._busy = True
        try:
            self._send_job(
                {
                    "type": "job",
                    "epoch": self._epoch,
                    "job": job_id,
                    "attempt": attempt,
                    "params": dict(params),
                    "input_dir": str(input_dir),
                    "output_dir": str(output_dir),
                    "scratch_dir": str(scratch_dir),
                }
            )
            return self._await_result(job_id, attempt, timeout_s, stale)
        except ProtocolError as exc:
            raise self._fail(
                _Failure("protocol", f"protocol error: {exc.message}"), stale
            ) from None
        except PeerClosed:
            raise self._fail(
                _Failure(
                    "crashed",
                    f"the serve worker closed the connection during job {job_id}",
                    with_exit=True,
                ),
                stale,
            ) from None
        except _Failure as failure:
            raise self._fail(failure, stale) from None
        finally:
            self._busy = False

    def _send_job(self, job: dict[str, Any]) -> None:
        """Send the ``job`` message; a worker that does not take it in
        :data:`SEND_TIMEOUT_S` is stuck."""
        if self._stopping.is_set():
            raise _Failure("stopped", f"the serve worker was stopped: {self._stop_reason}")
        channel = self._channel
        assert channel is not None
        try:
            channel.send(job, timeout_s=SEND_TIMEOUT_S)
        except TimeoutError:
            raise _Failure(
                "timeout", f"the serve worker did not take a job within {SEND_TIMEOUT_S:g} s"
            ) from None

    def _await_result(
        self, job_id: str, attempt: int, timeout_s: float, stale: list[dict[str, Any]]
    ) -> JobReport:
        """Wait up to ``timeout_s`` for the job's ``result``; any other message is
        dropped into ``stale``."""
        deadline = time.monotonic() + timeout_s if timeout_s < math.inf else None

        def late() -> _Failure:
            return _Failure(
                "timeout",
                f"job {job_id} attempt {attempt} got no result within {timeout_s:g} s "
                f"(the serve worker hung)",
            )

        while True:
            msg = self._receive(deadline, late)
            if (
                msg["type"] == "result"
                and msg["epoch"] == self._epoch
                and msg.get("job") == job_id
                and msg.get("attempt") == attempt
                and not isinstance(msg.get("attempt"), bool)
            ):
                ok = field(msg, "ok", bool)
                message = optional_field(msg, "message", str)
                error = optional_field(msg, "error", str)
                if not ok and error is None:
                    error = "the worker reported a failure without an error"
                return JobReport(ok, message, None if ok else error, stale)
            log.debug("serve worker epoch %d: dropped %r", self._epoch, msg)
            stale.append(msg)

    # -- waiting --------------------------------------------------------------

    def _check_running(self, when: str) -> None:
        """Raise a _Failure if stop() began or the worker's process ended."""
        if self._stopping.is_set():
            raise _Failure("stopped", f"the serve worker was stopped: {self._stop_reason}")
        thread = self._thread
        if thread is not None and not thread.is_alive():
            result = self._launch_result
            if result is not None and result.launch_error is not None:
                raise _Failure("start", result.launch_error)
            raise _Failure("crashed", f"the serve worker's process ended {when}", with_exit=True)

    def _receive(
        self, deadline: float | None, on_timeout: Callable[[], _Failure]
    ) -> dict[str, Any]:
        """The next message, in short waits that notice stop() and the end of the
        process; raise ``on_timeout()`` when ``deadline`` passes."""
        while True:
            if self._stopping.is_set():
                raise _Failure("stopped", f"the serve worker was stopped: {self._stop_reason}")
            ended = self._thread is not None and not self._thread.is_alive()
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise on_timeout()
            with self._io_lock:
                channel = self._channel
                if channel is None or channel.closed:
                    raise _Failure("stopped", f"the serve worker was stopped: {self._stop_reason}")
                try:
                    # once the process is gone, only what it sent before remains
                    return channel.recv(0 if ended else wait)
                except TimeoutError:
                    pass
            if ended:
                self._check_running("before it answered")

    # -- stop -----------------------------------------------------------------

    def _fail(self, failure: _Failure, stale: list[dict[str, Any]] | None = None) -> ServeError:
        """Stop the worker and return the ServeError for ``failure``."""
        if self._stopping.is_set():
            # stop() from another thread came first; what followed (end of file,
            # the process gone) is its consequence
            failure = _Failure("stopped", "stopped")
        result = self.stop(failure.reason)
        if result.limit_exceeded is not None:
            # the sandbox stopped it for what it wrote: whatever the channel saw
            # next (end of file, a dead process) follows from that
            return ServeError(
                f"{result.limit_exceeded}: the sandbox stopped the serve worker",
                kind="output_limit",
                infrastructure=False,
                launch_result=result,
                stale_dropped=stale,
            )
        reason = failure.reason
        if failure.kind == "stopped":
            reason = f"the serve worker was stopped: {self._stop_reason}"
        elif failure.with_exit:
            reason = f"{reason} ({_describe_end(result)})"
            tail = self.stderr_tail(1000)
            if tail:
                reason = f"{reason}; stderr ends with:\n{tail}"
        return ServeError(reason, kind=failure.kind, launch_result=result, stale_dropped=stale)

    def stop(self, reason: str) -> LaunchResult:
        """Stop the worker and return its process's result; blocks until every
        process of it is confirmed gone (a process that outlives SIGKILL is in
        the result's ``survivors`` and logged as an error).

        A loaded, idle worker gets ``stop`` and up to ``stop_wait_s`` to exit by
        itself; then (or at once, for a worker that is loading or busy) the
        launcher stops its whole process tree: SIGTERM, SIGKILL after the
        request's ``kill_grace_s``, until each process is confirmed gone.

        Idempotent and thread-safe: a second call, also from another thread,
        waits for the first and returns the same result.
        """
        with self._stop_lock:
            if self._stop_result is not None:
                return self._stop_result
            self._stop_reason = reason
            self._stopping.set()
            log.info("serve worker epoch %d: stopping: %s", self._epoch, reason)
            thread = self._thread
            channel = self._channel
            # only a loaded, idle worker reads `stop`; any other is stopped at once
            idle = channel is not None and self._ready_seen and not self._busy
            if thread is not None and thread.is_alive() and channel is not None and idle:
                try:
                    channel.send({"type": "stop", "epoch": self._epoch}, timeout_s=POLL_S)
                except (PeerClosed, ProtocolError, TimeoutError):
                    pass
                else:
                    thread.join(self._stop_wait_s)
            elif thread is not None and self._exiting:
                thread.join(self._stop_wait_s)
            self._kill.set()
            if thread is not None:
                thread.join()
            with self._io_lock:  # never while another thread receives or accepts
                if self._channel is not None:
                    self._channel.close()
                self._close_listener()
            result = self._launch_result
            if result is None:  # never started
                now = time.time()
                result = LaunchResult(
                    job_id=self._req.job_id,
                    attempt=self._req.attempt,
                    exit_code=None,
                    started_at=now,
                    ended_at=now,
                    stopped=True,
                )
            if result.survivors:
                log.error(
                    "serve worker epoch %d: processes %s survived SIGKILL; not confirmed gone",
                    self._epoch,
                    list(result.survivors),
                )
            self._stop_result = result
            return result

    def _close_listener(self) -> None:
        """Close the listening socket and remove its file; hold ``_io_lock``."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
            with contextlib.suppress(OSError):
                self._socket_path.unlink()


def _describe_end(result: LaunchResult) -> str:
    if result.launch_error is not None:
        return result.launch_error
    if result.exit_code is None:
        return "exit status unknown"
    if result.exit_code < 0:
        return f"killed by signal {-result.exit_code}"
    return f"exit status {result.exit_code}"


def _tail(path: Path, limit: int) -> str:
    """The last ``limit`` characters of the file at ``path``, stripped."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - 4 * limit))
            data = f.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text[len(text) - limit :].strip() if limit > 0 else ""
