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
    "JobContext",
    "LoadContext",
    "run_worker",
    "serve",
]

#: the path of the broker's socket
SOCKET_ENV = "GPUWARDEN_SERVE_SOCKET"
#: the worker's epoch (a decimal integer)
EPOCH_ENV = "GPUWARDEN_SERVE_EPOCH"
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
    channel = Channel(sock)
    try:
        return _run(channel, epoch, env, load=load, handle=handle, device_bytes=device_bytes)
    except PeerClosed:
        _note("the broker closed the connection")
        return 0
    except ProtocolError as exc:
        _note(f"protocol error: {exc.message}")
        return 1
    finally:
        channel.close()
        sys.stdout.flush()
        sys.stderr.flush()


def _run(
    channel: Channel,
    epoch: int,
    env: Mapping[str, str],
    *,
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    device_bytes: Callable[[M], int | None] | None,
) -> int:
    channel.send({"type": "hello", "epoch": epoch, "pid": os.getpid()})

    own_scratch = not env.get(SCRATCH_ENV)
    scratch = env.get(SCRATCH_ENV) or tempfile.mkdtemp(prefix="gpuwarden-serve-")
    try:
        return _serve_with(
            channel, epoch, env, Path(scratch), load=load, handle=handle, device_bytes=device_bytes
        )
    finally:
        if own_scratch:  # a folder of its own making: nothing else removes it
            shutil.rmtree(scratch, ignore_errors=True)


def _serve_with(
    channel: Channel,
    epoch: int,
    env: Mapping[str, str],
    scratch: Path,
    *,
    load: Callable[[LoadContext], M],
    handle: Callable[[M, JobContext], str | None],
    device_bytes: Callable[[M], int | None] | None,
) -> int:
    """Load the model, then take jobs until told to stop."""
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
        channel.send({"type": "load_failed", "epoch": epoch, "error": _describe(exc)})
        return 1
    channel.send({"type": "ready", "epoch": epoch, "load_s": load_s, "device_bytes": nbytes})
    _flush()

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
