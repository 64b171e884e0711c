"""``gpuwarden lease``: hold room on one GPU for an app that is not a job
(SPEC.md, "VRAM leases").

    gpuwarden lease --vram 12G [--for 30m] [--ttl 60s] [-- CMD ARGS...]
    gpuwarden lease end ID
    gpuwarden lease list

It queues a job of the built-in ``lease`` type and waits for its grant, saying
why it waits (``explain``'s words). With a command it runs the command as this
user, from this process, with ``CUDA_VISIBLE_DEVICES`` set to the granted GPU;
the command's memory there is the lease's (its PID is registered), and the
lease ends when it exits (the exit status is the command's). Without one it
prints the GPU and the lease id and holds the lease until ``--for`` passes or
``gpuwarden lease end ID``. Either way it renews the lease while it holds it.
Local to the host (the state directory), like ``submit`` without ``--url``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from collections.abc import Callable

from gpuwarden.app import make_probe
from gpuwarden.cli.common import (
    Progress,
    config_of,
    err,
    existing_store,
    out,
    printable,
    wait_here,
)
from gpuwarden.config import Config
from gpuwarden.core.lease import DEFAULT_TTL_S, ENDED_BY_HOLDER, LEASE_TYPE, check_ttl
from gpuwarden.core.model import Job, JobSpec, format_bytes
from gpuwarden.core.states import JobState
from gpuwarden.core.units import parse_bytes, parse_duration
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import new_job_id, prepare
from gpuwarden.node import leases
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission

__all__ = ["PARSERS", "cmd_lease"]

#: how long after its grant the lease's attempt may take to be laid out
LAYOUT_WAIT_S = 30.0


def _add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser(
        "lease",
        help="hold room on one GPU for an app that is not a job",
        description=(
            "Hold VRAM on one GPU. `lease --vram 12G [--for 30m] [-- CMD...]` waits for "
            "its grant; `lease end ID` ends one; `lease list` lists them."
        ),
    )
    sp.add_argument("words", nargs="*", help="end ID | list | -- CMD ARGS...")
    sp.add_argument("--vram", help="how much: 12G (GiB) or 512M (MiB)")
    sp.add_argument("--for", dest="hold_for", help="hold it this long (30m, 2h, 90s)")
    sp.add_argument(
        "--ttl",
        default=f"{DEFAULT_TTL_S:g}s",
        help="it ends this long after its last renewal (default 60s)",
    )
    sp.add_argument("--priority", type=int, default=0)
    sp.add_argument(
        "--wait-timeout",
        type=float,
        default=24 * 3600.0,
        help="seconds to wait for the grant (default: a day)",
    )
    sp.set_defaults(func=cmd_lease)


PARSERS = {"lease": _add_parser}


def cmd_lease(args: argparse.Namespace) -> int:
    words = list(args.words)
    if args.vram is None:
        if words[:1] == ["end"] and len(words) == 2:
            return _end_here(args, words[1])
        if words == ["list"]:
            return _list_here(args)
        raise UserError(
            "lease: give --vram (gpuwarden lease --vram 12G [--for 30m] [-- CMD...]), "
            "or `lease end ID`, or `lease list`"
        )
    try:
        vram = parse_bytes(args.vram, option="--vram", example="12G")
        ttl = check_ttl(parse_duration(args.ttl, option="--ttl", example="60s"))
        hold_for = None if args.hold_for is None else parse_duration(args.hold_for, option="--for")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return _lease_here(args, vram, ttl, hold_for, words)


def _lease_here(
    args: argparse.Namespace, vram: int, ttl: float, hold_for: float | None, command: list[str]
) -> int:
    config = config_of(args)
    store = existing_store(args, config)
    try:
        registry = Registry.load(config.module_paths, config.launch_rules)
        user = _user()
        spec = prepare(
            registry,
            JobSpec(
                id=new_job_id(LEASE_TYPE),
                type=LEASE_TYPE,
                params={"ttl_s": ttl, "holder": user},
                vram_bytes=vram,
                priority=args.priority,
            ),
        )
        store.submit([spec], now=time.time(), origin=Submission())
        out.print(f"lease {spec.id}: {format_bytes(vram)} asked for", markup=False)
        try:
            job = wait_here(
                store,
                registry,
                config,
                spec.id,
                args.wait_timeout,
                until=lambda j: j.state is not JobState.QUEUED,
                first="waiting for its grant",
            )
        except KeyboardInterrupt:
            store.request_cancel(spec.id, now=time.time())
            err.print(f"lease {spec.id}: given up before its grant (cancelled)", markup=False)
            return 130
        held = _granted(store, job)
        if held is None:
            return 1
        holding = _Holding(store, config, job, held, ttl, mock_gpu=bool(args.mock_gpu))
        if command:
            return holding.run(command)
        return holding.hold(hold_for)
    finally:
        store.close()


def _granted(store: Store, job: Job) -> str | None:
    """The granted lease's GPU; None (said why) when it was not granted."""
    if job.state is not JobState.RUNNING:
        why = job.reason or f"it is {job.state.value}"
        err.print(f"lease {job.id}: not granted: {printable(why)}", markup=False)
        if job.state is JobState.QUEUED:
            store.request_cancel(job.id, now=time.time())
        return None
    attempts = store.attempts(job.id)
    return str(attempts[-1].gpu_uuid) if attempts else None


def _user() -> str:
    try:
        import getpass  # noqa: PLC0415 - only a lease asks who holds it

        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


class _Holding:
    """A granted lease this process holds: renewed every third of its ttl."""

    def __init__(
        self, store: Store, config: Config, job: Job, gpu: str, ttl: float, *, mock_gpu: bool
    ) -> None:
        self.store, self.config, self.job, self.ttl = store, config, job, ttl
        self.gpu, self.mock_gpu = gpu, mock_gpu
        number = store.attempts(job.id)[-1].number
        self.dir = leases.attempt_dir_of(config.state_dir, job.id, number)
        self.next_renew = 0.0

    def _laid_out(self) -> bool:
        deadline = time.monotonic() + LAYOUT_WAIT_S
        while time.monotonic() < deadline:
            if leases.deadline(self.dir) is not None:
                return True
            if not self._still_held():
                return False
            time.sleep(0.05)
        return False

    def _still_held(self) -> bool:
        job = self.store.get_job(self.job.id)
        if job is not None and job.state is JobState.RUNNING:
            return True
        why = job.reason if job is not None else "it is gone from the store"
        err.print(f"lease {self.job.id}: ended: {printable(why)}", markup=False)
        return False

    def _renew(self) -> None:
        now = time.monotonic()
        if now >= self.next_renew:
            leases.renew(self.dir, self.ttl, time.time())
            self.next_renew = now + self.ttl / 3

    def _end(self, reason: str) -> None:
        if not leases.end(self.dir, reason):
            self.store.request_cancel(self.job.id, now=time.time())
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            job = self.store.get_job(self.job.id)
            if job is None or job.state.terminal:
                break
            time.sleep(0.1)
        out.print(f"lease {self.job.id}: ended ({reason})", markup=False)

    def _announce(self) -> None:
        out.print(
            f"lease {self.job.id}: granted on {self.gpu} "
            f"({format_bytes(self.job.vram_bytes or 0)}); it ends "
            f"{self.ttl:g} s after its last renewal",
            markup=False,
        )

    def _gpu_env(self) -> dict[str, str]:
        probe = make_probe(self.config, mock_gpu=self.mock_gpu)
        try:
            env = probe.job_env(self.gpu)
        finally:
            probe.close()
        return {**os.environ, **env, "CUDA_VISIBLE_DEVICES": self.gpu}

    def run(self, command: list[str]) -> int:
        """Run ``command`` with the lease; its end ends the lease."""
        if not self._laid_out():
            return 1
        self._announce()
        try:
            proc = subprocess.Popen(command, env=self._gpu_env())
        except OSError as exc:
            self._end(f"{ENDED_BY_HOLDER}: its command could not start")
            raise UserError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        leases.register_pids(self.dir, [proc.pid])
        try:
            code = self._while(proc.poll)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            code = _reap(proc)
        if code is None:  # the lease ended under it: its room is gone
            proc.terminate()
            code = _reap(proc)
            return code if code else 1
        self._end(f"{ENDED_BY_HOLDER}: its command exited with {code}")
        return code if code >= 0 else 128 - code

    def hold(self, hold_for: float | None) -> int:
        """Hold the lease until ``hold_for`` passes or it is ended elsewhere."""
        if not self._laid_out():
            return 1
        self._announce()
        until = None if hold_for is None else time.monotonic() + hold_for
        how = f"for {hold_for:g} s" if hold_for else "until it is ended"
        with Progress(
            f"lease {self.job.id}: held on {self.gpu} {how}, renewed every "
            f"{self.ttl / 3:g} s; end it with `gpuwarden lease end {self.job.id}` or Ctrl-C"
        ):
            try:
                done = self._while(lambda: 0 if until and time.monotonic() >= until else None)
            except KeyboardInterrupt:
                self._end(f"{ENDED_BY_HOLDER} (interrupted)")
                return 130
        if done is None:
            return 1
        self._end(f"{ENDED_BY_HOLDER}: its --for of {hold_for:g} s passed")
        return 0

    def _while(self, finished: Callable[[], int | None]) -> int | None:
        """Renew until ``finished()`` says a code; None when the lease ended first."""
        checked = 0.0
        while (code := finished()) is None:
            self._renew()
            if time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if not self._still_held():
                    return None
            time.sleep(0.1)
        return code


def _reap(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _end_here(args: argparse.Namespace, lease_id: str) -> int:
    config = config_of(args)
    store = existing_store(args, config)
    try:
        job = store.get_job(lease_id)
        if job is None or job.type != LEASE_TYPE:
            raise UserError(f"no lease {lease_id!r} in {config.state_dir}")
        if job.state.terminal:
            out.print(f"lease {job.id} has ended already: {printable(job.reason)}", markup=False)
            return 0
        attempts = store.attempts(job.id)
        if not (
            job.state is JobState.RUNNING
            and attempts
            and leases.end(
                leases.attempt_dir_of(config.state_dir, job.id, attempts[-1].number),
                ENDED_BY_HOLDER,
            )
        ):
            store.request_cancel(job.id, now=time.time())
        out.print(f"lease {job.id}: ending", markup=False)
        return 0
    finally:
        store.close()


def _list_here(args: argparse.Namespace) -> int:
    config = config_of(args)
    store = existing_store(args, config)
    try:
        live = frozenset({JobState.QUEUED, JobState.RUNNING})
        rows = [j for j in store.list_jobs(states=live, limit=1000) if j.type == LEASE_TYPE]
        for job in rows:
            attempts = store.attempts(job.id)
            info = leases.lease_json(job, attempts[-1] if attempts else None, config.state_dir)
            until = info["until"]
            out.print(
                f"{job.id}  {job.state.value:8}  {format_bytes(job.vram_bytes or 0):>9}  "
                f"{info['gpu'] or '-'}  {info['holder']}"
                + (f"  until {time.strftime('%H:%M:%S', time.localtime(until))}" if until else ""),
                markup=False,
            )
        if not rows:
            out.print("no leases", markup=False)
        return 0
    finally:
        store.close()
