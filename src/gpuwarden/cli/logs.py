"""``gpuwarden logs``: what an attempt of a job wrote on stdout or stderr, read from
its attempt folder (through :mod:`gpuwarden.node.joblogs`, never following a link)
or through the API; ``--follow`` goes on until the attempt has ended.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.cli.common import (
    TERMINAL_STATES,
    Commands,
    Progress,
    add_remote_options,
    config_of,
    err,
    existing_store,
    local_or_http,
    printable,
    progress_text,
    wait_here,
    wait_note,
)
from gpuwarden.client import Client
from gpuwarden.cluster import logcopy
from gpuwarden.config import Config
from gpuwarden.core.model import MIB, Attempt
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.node import joblogs
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store


def _add_logs(sub: Commands) -> None:
    sp = sub.add_parser(
        "logs",
        help="a job's output streams: what it wrote on stdout (or stderr)",
        description="Print what an attempt of the job wrote on stdout (with --stderr: on "
        "stderr), from its attempt folder, or with --url through the API. Default: the "
        "latest attempt. --follow prints what it writes until the attempt ends (a job "
        "that has not started yet is waited for).",
        allow_abbrev=False,
    )
    sp.add_argument("job")
    sp.add_argument("--attempt", type=int, metavar="N", help="this attempt (default: the latest)")
    sp.add_argument("-f", "--follow", action="store_true", help="go on until the attempt has ended")
    sp.add_argument("--stderr", action="store_true", help="the stderr stream instead of stdout")
    sp.add_argument(
        "--stream",
        choices=joblogs.STREAMS,
        help="the stream: stdout (default), stderr, or build: the output of the image "
        "build of a job from a pinned commit (build.log)",
    )
    add_remote_options(sp)
    sp.set_defaults(func=cmd_logs)


#: the commands of this module, each with what adds its parser
PARSERS = {"logs": _add_logs}


class StreamOut:
    """Writes a job's bytes to stdout: as they are when piped; on a terminal as
    text (invalid UTF-8 shown as U+FFFD) with control characters escaped
    (:func:`printable`), so what a job wrote cannot drive the terminal."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> None:
        if self.tty:
            sys.stdout.write(printable(self._decoder.decode(data)))
            sys.stdout.flush()
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        if self.tty:
            sys.stdout.write(printable(self._decoder.decode(b"", final=True)))
        sys.stdout.flush()


def cmd_logs(args: argparse.Namespace) -> int:
    if args.attempt is not None and args.attempt < 1:
        raise UserError(f"--attempt {args.attempt}: attempts are numbered from 1")
    if args.stderr and args.stream not in {None, "stderr"}:
        raise UserError(f"--stderr and --stream {args.stream} do not go together: choose one")
    stream = args.stream or ("stderr" if args.stderr else "stdout")
    try:
        return local_or_http(
            args,
            lambda a: _logs_here(a, stream),
            lambda a, client: _logs_http(a, client, stream),
        )
    except BrokenPipeError:  # `gpuwarden logs JOB | head`: the reader has had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _not_started(job_id: str, state: str, terminal: bool) -> str:
    """As the API says it (``api.routers.logs.not_started``)."""
    if terminal:
        return f"job {job_id} ended ({state}) without starting: it has no output"
    return (
        f"job {job_id} is {state} and has not started: no output yet "
        f"(`gpuwarden logs --follow {job_id}` waits for it; `gpuwarden explain {job_id}` "
        "says why it waits)"
    )


def _pick(job_id: str, numbers: list[int], wanted: int | None) -> int:
    if wanted is None:
        return numbers[-1]
    if wanted not in numbers:
        have = ", ".join(map(str, numbers))
        raise UserError(f"job {job_id} has no attempt {wanted} (its attempts: {have})")
    return wanted


def _logs_here(args: argparse.Namespace, stream: str) -> int:
    config = config_of(args)
    store = existing_store(args, config, writes=False)
    try:
        job = store.get_job(args.job)
        if job is None:
            raise UserError(f"no job with id {args.job!r} (see `gpuwarden jobs`)")
        try:
            registry: Registry | None = Registry.load(config.module_paths, config.launch_rules)
        except GpuwardenError:  # the streams are there whatever the modules say now
            registry = None
        if job.attempts == 0 and not job.state.terminal and args.follow and registry is not None:
            job = wait_here(
                store,
                registry,
                config,
                job.id,
                math.inf,
                until=lambda j: j.attempts > 0 or j.state.terminal,
                first="waiting for it to start",
            )
        attempts = store.attempts(job.id)
        if not attempts:
            raise UserError(_not_started(job.id, job.state.value, job.state.terminal))
        number = _pick(job.id, [a.number for a in attempts], args.attempt)
        attempt = next(a for a in attempts if a.number == number)
        jobs_dir = config.state_dir / "jobs"
        where = joblogs.locate(
            jobs_dir, attempt, stream, node=config.node_name, registry=registry, job_type=job.type
        )
        sink = StreamOut()
        if _from_copy(config, store, attempt, stream, where=where, sink=sink, follow=args.follow):
            return 0
        fd = where.fd
        if fd is None and where.later and args.follow:
            fd = _wait_for_file(store, jobs_dir, attempt, stream)
        if fd is None:
            if where.note:
                err.print(where.note, markup=False, highlight=False)
            sink.write(where.copy)
            sink.close()
            return 1 if where.refused else 0
        _copy_stream(store, attempt, fd, sink, follow=args.follow)
        if args.follow:
            after = store.get_job(job.id)
            if after is not None:
                _after_follow(after.id, attempt.number, after.attempts, after.state.value,
                              after.state.terminal)  # fmt: skip
    finally:
        store.close()
    return 0


def _copy_stream(store: Store, attempt: Attempt, fd: int, sink: StreamOut, *, follow: bool) -> None:
    """The stream file open at ``fd`` to ``sink`` (with ``follow``: until the
    attempt has ended); closes ``fd`` and ``sink``."""
    try:
        if follow:
            sink.write_all(
                joblogs.follow(
                    fd,
                    lambda: _attempt_ended(store, attempt.job_id, attempt.number),
                    sleep=time.sleep,
                    clock=time.monotonic,
                )
            )
        else:
            sink.write_all(joblogs.read_all(fd))
    finally:
        os.close(fd)
    sink.close()


def _from_copy(
    config: Config,
    store: Store,
    attempt: Attempt,
    stream: str,
    *,
    where: joblogs.Located,
    sink: StreamOut,
    follow: bool,
) -> bool:
    """On a coordinator: the stream of an attempt that runs (or ran) on a node, as
    that node sent it while it ran; False when there is no such copy."""
    path = logcopy.log_path(config.state_dir / "logs", attempt.job_id, attempt.number, stream)
    if where.fd is not None or where.refused or attempt.node == config.node_name:
        return False
    if not (logcopy.kept(path) or (follow and attempt.ended_at is None)):
        return False
    bound = int(config.api.max_log_mib * MIB)

    def ended() -> bool:
        return not follow or _attempt_ended(store, attempt.job_id, attempt.number)

    sink.write_all(logcopy.follow(path, ended, bound=bound))
    sink.close()
    if follow:
        after = store.get_job(attempt.job_id)
        if after is not None:
            _after_follow(after.id, attempt.number, after.attempts, after.state.value,
                          after.state.terminal)  # fmt: skip
    return True


def _attempt_ended(store: Store, job_id: str, number: int) -> bool:
    job = store.get_job(job_id)
    if job is None or job.state.terminal:
        return True
    attempt = next((a for a in store.attempts(job_id) if a.number == number), None)
    return attempt is None or attempt.ended_at is not None


def _wait_for_file(store: Store, jobs_dir: Path, attempt: Attempt, stream: str) -> int | None:
    """The stream file of a running attempt once the launcher has made it; None if
    the attempt ended first."""
    while True:
        try:
            fd = joblogs.reopen(jobs_dir, attempt, stream)
        except safefs.UnsafePathError as exc:
            raise GpuwardenError(f"{joblogs.file_name(stream)} of attempt {attempt.number} "
                                 f"{exc.why}: it is not read") from None  # fmt: skip
        if fd is not None:
            return fd
        if _attempt_ended(store, attempt.job_id, attempt.number):
            return None
        time.sleep(joblogs.ENDED_EVERY_S)


def _after_follow(job_id: str, number: int, attempts: int, state: str, terminal: bool) -> None:
    """After --follow: say so when the job goes on with another attempt."""
    if not terminal and attempts > number:
        err.print(
            f"attempt {number} ended; job {job_id} runs again as attempt {attempts}: "
            f"`gpuwarden logs --follow {job_id}` follows it",
            markup=False,
        )
    elif not terminal:
        err.print(
            f"attempt {number} ended; job {job_id} is {state} for another attempt: "
            f"`gpuwarden logs --follow {job_id}` follows it",
            markup=False,
        )


def _logs_http(args: argparse.Namespace, client: Client, stream: str) -> int:
    job = client.get(args.job)
    if not job.get("attempts_detail") and args.follow and job["state"] not in TERMINAL_STATES:
        with Progress(f"job {job['id']}: waiting for it to start") as progress:

            def started(j: dict[str, Any]) -> None:
                progress.update(progress_text(j["id"], j["state"], wait_note(j.get("explain", []))))

            job = client.wait_started(job["id"], progress=started)
    numbers = [int(a["number"]) for a in job.get("attempts_detail", [])]
    if not numbers:
        raise UserError(_not_started(job["id"], job["state"], job["state"] in TERMINAL_STATES))
    number = _pick(job["id"], numbers, args.attempt)
    sink = StreamOut()
    with client.logs(job["id"], stream, attempt=number, follow=args.follow) as got:
        if got.note:
            err.print(got.note, markup=False, highlight=False)
        sink.write_all(got.chunks)
    sink.close()
    if args.follow:
        after = client.get(job["id"])
        _after_follow(after["id"], number, int(after.get("attempts", 0)), after["state"],
                      after["state"] in TERMINAL_STATES)  # fmt: skip
    return 1 if got.refused else 0
