"""The helper a module's serve worker is written with (launch mode ``serve``).

A module author writes two functions, ``load`` and ``handle``, and hands them to
:func:`serve`::

    from gpuwarden.server.worker import JobContext, LoadContext, serve

    def load(ctx: LoadContext) -> Model:
        return Model.from_pretrained("weights/", device="cuda")  # once per worker

    def handle(model: Model, job: JobContext) -> str | None:
        text = model.generate(job.params["prompt"])
        (job.output_dir / "out.txt").write_text(text)
        return "generated 1 text"  # the job's message

    if __name__ == "__main__":
        serve(load, handle, device_bytes=lambda m: m.cuda_bytes())

:func:`serve` connects to the broker (``GPUWARDEN_SERVE_SOCKET``), says
``hello``, calls ``load`` once and reports ``ready`` (with the seconds the load
took and, if ``device_bytes`` is given, how many bytes of the model are in GPU
memory) or ``load_failed``. Then it runs one job at a time: each ``job``
message becomes one ``handle`` call, and its return value (a string, or
``None``) the job's message. An exception in ``handle`` is the job's own
failure: it is reported (``ok`` false, ``"<ExceptionType>: <message>"``), its
traceback printed to stderr, and the worker goes on with the next job. The
worker exits with status 0 on ``stop`` or when the broker closes the
connection, and with status 1 when the load fails or the broker sends garbage.

A broker that goes away without ``stop`` (it was stopped routinely, or killed)
leaves a worker started with ``GPUWARDEN_SERVE_WAIT_S`` above 0 running: it
keeps its model and connects to the same socket path again, once every
:data:`RECONNECT_POLL_S`, until a new broker listens there (then it says
``hello`` and ``ready`` again, ``"resumed": true``, without loading anything)
or that many seconds pass (then it exits with status 0, so nothing is left
behind). A job's result it could not send is dropped: the new broker has
already ended that attempt as interrupted and runs the job again.

``SystemExit`` and ``KeyboardInterrupt`` raised in ``load`` or ``handle`` are not
caught: the worker exits and the broker retries the job as an infrastructure
failure. The protocol is documented in :mod:`gpuwarden.server.protocol`.

This module imports nothing of gpuwarden beyond :mod:`gpuwarden.server.protocol`
and :mod:`gpuwarden.errors`, so a worker starts fast.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from gpuwarden.server.protocol import Channel, PeerClosed, ProtocolError, field

__all__ = [
    "EPOCH_ENV",
    "MAX_TEXT",
    "SCRATCH_ENV",
    "SOCKET_ENV",
    "WAIT_ENV",
    "JobContext",
    "LoadContext",
    "run_worker",
    "serve",
]

#: the path of the broker's socket
SOCKET_ENV = "GPUWARDEN_SERVE_SOCKET"
#: the worker's epoch (a decimal integer)
EPOCH_ENV = "GPUWARDEN_SERVE_EPOCH"
#: how long a worker whose broker went away (no ``stop``) waits for a new one, in
#: seconds; unset or 0: it exits at once
WAIT_ENV = "GPUWARDEN_SERVE_WAIT_S"
#: how often a waiting worker tries the socket again
RECONNECT_POLL_S = 0.1
#: the longest wait a worker takes from :data:`WAIT_ENV` (a day)
MAX_WAIT_S = 86400.0
#: the worker's own scratch folder (for the load); a temporary folder when unset
SCRATCH_ENV = "GPUWARDEN_SCRATCH_DIR"

#: the longest message or error a result carries, in characters
MAX_TEXT = 16384

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What ``load`` is given."""

    #: ``CUDA_VISIBLE_DEVICES``: the UUID of the worker's GPU ("" when none)
    gpu: str
    #: a folder the load may write to; kept for the worker's life, not returned
    scratch_dir: Path
    #: the worker's epoch (for log lines)
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class JobContext:
    """What ``handle`` is given for one job."""

    job_id: str
    #: the attempt number, from 1
    attempt: int
    #: the job's parameters (defaults filled in, each ``input`` an absolute path)
    params: dict[str, Any]
    #: the job's input files (read-only by convention)
    input_dir: Path
    #: where the job writes its outputs; empty at the start
    output_dir: Path
    #: the attempt's scratch folder; empty at the start, not returned
    scratch_dir: Path


def serve(
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    *,
    device_bytes: Callable[[M], int | None] | None = None,
) -> NoReturn:
    """Run this process as a serve worker: load once, then handle jobs one at a
    time until the broker says ``stop`` or goes away. Never returns: exits with
    status 0 after ``stop`` or end of file, 1 when the load fails or the broker
    sends garbage, and 2 when the environment does not name a socket and epoch
    (the process was not started by gpuwarden)."""
    raise SystemExit(run_worker(load, handle, device_bytes=device_bytes, env=os.environ))


def run_worker(
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    *,
    device_bytes: Callable[[M], int | None] | None = None,
    env: Mapping[str, str],
) -> int:
    """:func:`serve`, returning the exit status instead of exiting."""
    path = env.get(SOCKET_ENV, "")
    epoch_text = env.get(EPOCH_ENV, "")
    if not path:
        _note(f"{SOCKET_ENV} is not set: a serve worker is started by gpuwarden")
        return 2
    try:
        epoch = int(epoch_text)
    except ValueError:
        _note(f"{EPOCH_ENV} is not an integer: {epoch_text!r}")
        return 2

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        _note(f"cannot connect to the broker at {path}: {exc}")
        return 1
    link = _Link(Channel(sock), path, _wait_s(env))
    try:
        return _run(link, epoch, env, load=load, handle=handle, device_bytes=device_bytes)
    except PeerClosed:
        _note("the broker closed the connection")
        return 0
    except ProtocolError as exc:
        _note(f"protocol error: {exc.message}")
        return 1
    finally:
        link.channel.close()
        sys.stdout.flush()
        sys.stderr.flush()


def _wait_s(env: Mapping[str, str]) -> float:
    """:data:`WAIT_ENV` as seconds (0 when unset or not a number >= 0)."""
    try:
        wait = float(env.get(WAIT_ENV, "0") or "0")
    except ValueError:
        return 0.0
    return min(wait, MAX_WAIT_S) if wait > 0 else 0.0


class _Link:
    """The connection to the broker, which a worker with a wait (:data:`WAIT_ENV`)
    makes again after its broker went away."""

    def __init__(self, channel: Channel, path: str, wait_s: float) -> None:
        self.channel = channel
        self.path = path
        self.wait_s = wait_s

    def reconnect(self) -> bool:
        """The broker is gone: connect to the same path again, until a new broker
        listens there (True) or :attr:`wait_s` passes (False)."""
        self.channel.close()
        if self.wait_s <= 0:
            return False
        _note(f"the broker went away; waiting up to {self.wait_s:g} s for a new one")
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                time.sleep(RECONNECT_POLL_S)
                continue
            self.channel = Channel(sock)
            _note("connected to a new broker")
            return True
        _note(f"no new broker within {self.wait_s:g} s: exiting")
        return False


def _run(
    link: _Link,
    epoch: int,
    env: Mapping[str, str],
    *,
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    device_bytes: Callable[[M], int | None] | None,
) -> int:
    link.channel.send({"type": "hello", "epoch": epoch, "pid": os.getpid()})

    own_scratch = not env.get(SCRATCH_ENV)
    scratch = env.get(SCRATCH_ENV) or tempfile.mkdtemp(prefix="gpuwarden-serve-")
    try:
        return _serve_with(
            link, epoch, env, Path(scratch), load=load, handle=handle, device_bytes=device_bytes
        )
    finally:
        if own_scratch:  # a folder of its own making: nothing else removes it
            shutil.rmtree(scratch, ignore_errors=True)


def _serve_with(
    link: _Link,
    epoch: int,
    env: Mapping[str, str],
    scratch: Path,
    *,
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    device_bytes: Callable[[M], int | None] | None,
) -> int:
    """Load the model, then take jobs until told to stop (or the broker is gone
    and no new one comes)."""
    ctx = LoadContext(gpu=env.get("CUDA_VISIBLE_DEVICES", ""), scratch_dir=scratch, epoch=epoch)
    start = time.monotonic()
    try:
        model = load(ctx)
        load_s = time.monotonic() - start
        nbytes = None if device_bytes is None else device_bytes(model)
        if nbytes is not None and (
            not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0
        ):
            raise TypeError(f"device_bytes returned {nbytes!r}, not an integer >= 0 or None")
    except Exception as exc:
        traceback.print_exc()
        link.channel.send({"type": "load_failed", "epoch": epoch, "error": _describe(exc)})
        return 1
    ready = {"type": "ready", "epoch": epoch, "load_s": load_s, "device_bytes": nbytes}
    link.channel.send(ready)
    _flush()
    while True:
        try:
            return _jobs(link.channel, epoch, model, handle)
        except PeerClosed:
            if not link.reconnect():
                return 0
        # a new broker: the same worker, its model still loaded
        try:
            link.channel.send(
                {"type": "hello", "epoch": epoch, "pid": os.getpid(), "resumed": True}
            )
            link.channel.send({**ready, "resumed": True})
        except PeerClosed:
            continue  # gone again: wait again (the loop's next recv says so)


def _jobs(
    channel: Channel, epoch: int, model: M, handle: Callable[[M, JobContext], str | None]
) -> int:
    """Run the jobs the broker sends, one at a time, until ``stop`` (0)."""
    while True:
        msg = channel.recv(None)
        if msg["epoch"] != epoch:
            _note(f"ignored a {msg['type']!r} message of epoch {msg['epoch']} (mine is {epoch})")
            continue
        if msg["type"] == "stop":
            return 0
        if msg["type"] != "job":
            _note(f"ignored a message of unknown type {msg['type']!r}")
            continue
        job = JobContext(
            job_id=field(msg, "job", str),
            attempt=field(msg, "attempt", int),
            params=dict(field(msg, "params", dict)),
            input_dir=Path(field(msg, "input_dir", str)),
            output_dir=Path(field(msg, "output_dir", str)),
            scratch_dir=Path(field(msg, "scratch_dir", str)),
        )
        result: dict[str, Any] = {
            "type": "result",
            "epoch": epoch,
            "job": job.job_id,
            "attempt": job.attempt,
        }
        try:
            message = handle(model, job)
        except Exception as exc:
            traceback.print_exc()
            result.update(ok=False, message=None, error=_describe(exc))
        else:
            text = None if message is None else _text(str(message))
            result.update(ok=True, message=text, error=None)
        _flush()
        channel.send(result)


def _describe(exc: BaseException) -> str:
    """``"<ExceptionType>: <message>"``, or the type alone when the message is empty."""
    text = str(exc)
    return _text(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _text(text: str) -> str:
    """``text`` made safe to send: characters that are not valid UTF-8 (lone
    surrogates) become U+FFFD, and past :data:`MAX_TEXT` characters it is cut."""
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    if len(text) > MAX_TEXT:
        text = f"{text[:MAX_TEXT]} [... {len(text) - MAX_TEXT} characters cut]"
    return text


def _note(text: str) -> None:
    print(f"[gpuwarden serve worker] {text}", file=sys.stderr, flush=True)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
