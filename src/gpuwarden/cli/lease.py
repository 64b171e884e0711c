"""``gpuwarden lease``: hold room on one GPU for an app that is not a job
(SPEC.md, "VRAM leases").

    gpuwarden lease --vram 12G [--gpu UUID] [--for 30m] [--ttl 60s] [-- CMD ARGS...]
    gpuwarden lease end ID
    gpuwarden lease list

It queues a job of the built-in ``lease`` type and waits for its grant, saying
why it waits (``explain``'s words). With a command it runs the command as this
user, from this process, with ``CUDA_VISIBLE_DEVICES`` set to the granted GPU;
the command's memory there is the lease's (its PID is registered), and the
lease ends when it exits (the exit status is the command's). Without one it
prints the GPU and the lease id and holds the lease until ``--for`` passes or
``gpuwarden lease end ID``. Either way it renews the lease while it holds it.

Three ways to the node, one :class:`_Way` each: ``--url`` (the HTTP API; a
command only when the URL is this host's), the broker's local socket when one
listens (any user ``[commands]`` allows; the broker writes the lease's files),
else the store and the state directory themselves (root, the state's owner).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol
from urllib.parse import urlsplit

from gpuwarden.api import localsock
from gpuwarden.api.leasedesk import LeaseDesk
from gpuwarden.app import make_probe
from gpuwarden.cli.common import (
    Progress,
    add_remote_options,
    config_of,
    err,
    existing_store,
    out,
    printable,
    progress_text,
    remote,
    wait_here,
)
from gpuwarden.client import Client
from gpuwarden.config import Config
from gpuwarden.core.lease import DEFAULT_TTL_S, ENDED_BY_HOLDER, check_ttl
from gpuwarden.core.model import format_bytes
from gpuwarden.core.states import JobState
from gpuwarden.core.units import parse_bytes, parse_duration
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.registry import Registry

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
    sp.add_argument("--gpu", help="only on this GPU (its UUID, as `gpuwarden status` lists it)")
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
    add_remote_options(sp)
    sp.set_defaults(func=cmd_lease)


PARSERS = {"lease": _add_parser}


#: what a lease is said to be: ``GET /v1/leases/{id}``'s fields (LeaseDesk.info)
Info = dict[str, Any]


class _GaveUp(Exception):
    """Ctrl-C before the grant: the lease was given up (cancelled)."""


def cmd_lease(args: argparse.Namespace) -> int:
    words = list(args.words)
    if args.vram is None:
        if words[:1] == ["end"] and len(words) == 2:
            return _end(args, words[1])
        if words == ["list"]:
            return _list(args)
        raise UserError(
            "lease: give --vram (gpuwarden lease --vram 12G [--gpu UUID] [--for 30m] "
            "[-- CMD...]), or `lease end ID`, or `lease list`"
        )
    try:
        vram = parse_bytes(args.vram, option="--vram", example="12G")
        ttl = check_ttl(parse_duration(args.ttl, option="--ttl", example="60s"))
        hold_for = None if args.hold_for is None else parse_duration(args.hold_for, option="--for")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if words and getattr(args, "url", None) and not _is_this_host(str(args.url)):
        raise UserError(
            f"lease --url {args.url} -- CMD: the command would run here, on another host "
            "than the node whose GPU the lease holds; run `gpuwarden lease` on the node, or "
            "hold the lease without a command (the app on the node registers its pids: "
            "POST /v1/leases/ID/pids)"
        )
    with _way(args) as way:
        try:
            info = way.ask(args, vram, ttl)
        except _GaveUp as gave:
            err.print(f"lease {gave}: given up before its grant (cancelled)", markup=False)
            return 130
        if not info.get("granted"):
            why = info.get("reason") or info.get("waiting") or f"it is {info.get('state')}"
            err.print(f"lease {info['id']}: not granted: {printable(str(why))}", markup=False)
            if info.get("state") in ("queued", "running"):
                with contextlib.suppress(GpuwardenError, OSError):
                    way.end(info["id"], f"{ENDED_BY_HOLDER}: its --wait-timeout passed")
            return 1
        holding = _Holding(way, info, ttl, lambda: _gpu_env(args, str(info["gpu"])))
        if words:
            return holding.run(words)
        return holding.hold(hold_for)


def _is_this_host(url: str) -> bool:
    """Whether ``url`` names this host (a loopback address, or this host's name)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _user() -> str:
    try:
        import getpass  # noqa: PLC0415 - only a lease asks who holds it

        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def _gpu_env(args: argparse.Namespace, gpu: str) -> dict[str, str]:
    """The command's environment: this one, the probe's variables for ``gpu`` (a
    simulated GPU's, where the config names one), ``CUDA_VISIBLE_DEVICES``."""
    env: dict[str, str] = {}
    with contextlib.suppress(GpuwardenError, OSError):
        probe = make_probe(config_of(args), mock_gpu=bool(args.mock_gpu))
        try:
            env = dict(probe.job_env(gpu))
        finally:
            probe.close()
    return {**os.environ, **env, "CUDA_VISIBLE_DEVICES": gpu}


# -- the ways to the node ------------------------------------------------------------


class _Way(Protocol):
    def ask(self, args: argparse.Namespace, vram: int, ttl: float) -> Info: ...
    def info(self, lease_id: str) -> Info | None: ...
    def renew(self, lease_id: str) -> None: ...
    def end(self, lease_id: str, reason: str) -> None: ...
    def pids(self, lease_id: str, pids: list[int]) -> None: ...
    def listed(self) -> list[Info]: ...


@contextlib.contextmanager
def _way(args: argparse.Namespace) -> Iterator[_Way]:
    """``--url``: the API; else the broker's local socket when one listens; else
    the store itself."""
    client = remote(args)
    if client is not None:
        with client:
            yield _Http(client)
        return
    config = config_of(args)
    path = localsock.socket_path(config)
    if _Socket.listening(path):
        yield _Socket(path)
        return
    here = _Here(args, config)
    try:
        yield here
    finally:
        here.desk.store.close()


class _Here:
    """The store and the state directory, in this process (no broker listens)."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.config = config
        store = existing_store(args, config)
        self.registry = Registry.load(config.module_paths, config.launch_rules)
        self.desk = LeaseDesk(store, self.registry, config)

    def ask(self, args: argparse.Namespace, vram: int, ttl: float) -> Info:
        store = self.desk.store
        job = self.desk.ask(
            vram, ttl_s=ttl, gpu=args.gpu, priority=args.priority, owner=None, holder=_user()
        )
        out.print(f"lease {job.id}: {format_bytes(vram)} asked for", markup=False)
        try:
            job = wait_here(
                store,
                self.registry,
                self.config,
                job.id,
                args.wait_timeout,
                until=lambda j: j.state is not JobState.QUEUED,
                first="waiting for its grant",
            )
        except KeyboardInterrupt:
            store.request_cancel(job.id, now=time.time())
            raise _GaveUp(job.id) from None
        info = self.desk.info(job)
        info["granted"] = job.state is JobState.RUNNING  # its files follow (_laid_out)
        return info

    def info(self, lease_id: str) -> Info | None:
        try:
            return self.desk.info(self.desk.lease(lease_id))
        except UserError:
            return None

    def renew(self, lease_id: str) -> None:
        self.desk.renew(self.desk.lease(lease_id))

    def end(self, lease_id: str, reason: str) -> None:
        self.desk.end(self.desk.lease(lease_id), reason)

    def pids(self, lease_id: str, pids: list[int]) -> None:
        self.desk.register_pids(self.desk.lease(lease_id), pids)

    def listed(self) -> list[Info]:
        return [self.desk.info(j) for j in self.desk.listed()]


class _Socket:
    """The broker's local socket: the broker learns who asks from the kernel."""

    def __init__(self, path: Any) -> None:
        self.path = path

    @staticmethod
    def listening(path: Any) -> bool:
        return localsock.listening(path)

    def request(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The answers to ``body``, one message at a time; an error message raises."""
        yield from localsock.ask(self.path, body)
        raise UserError(f"the broker at {self.path} stopped answering")

    def one(self, body: dict[str, Any]) -> dict[str, Any]:
        return next(iter(self.request(body)))

    def ask(self, args: argparse.Namespace, vram: int, ttl: float) -> Info:
        body = {"op": "lease", "vram_bytes": vram, "ttl_s": ttl, "gpu": args.gpu}
        body["priority"] = args.priority
        lease_id = ""
        with Progress("lease: asked for") as progress:
            try:
                for m in self.request(body):
                    if "lease" in m:
                        lease_id = m["lease"]["id"]
                        out.print(f"lease {lease_id}: {format_bytes(vram)} asked for", markup=False)
                        progress.update(f"lease {lease_id}: waiting for its grant")
                    elif "waiting" in m:
                        progress.update(progress_text(lease_id, "queued", str(m["waiting"])))
                    elif "granted" in m or "end" in m:
                        return dict(m.get("granted") or m["end"])
            except KeyboardInterrupt:
                if lease_id:  # the broker cancels it when we hang up; say so, too
                    with contextlib.suppress(GpuwardenError, OSError):
                        self.end(lease_id, f"{ENDED_BY_HOLDER} (interrupted)")
                raise _GaveUp(lease_id) from None
        raise UserError(f"the broker at {self.path} stopped answering")

    def info(self, lease_id: str) -> Info | None:
        try:
            return dict(self.one({"op": "lease-show", "id": lease_id})["lease"])
        except UserError:
            return None

    def renew(self, lease_id: str) -> None:
        self.one({"op": "lease-renew", "id": lease_id})

    def end(self, lease_id: str, reason: str) -> None:
        self.one({"op": "lease-end", "id": lease_id, "reason": reason})

    def pids(self, lease_id: str, pids: list[int]) -> None:
        self.one({"op": "lease-pids", "id": lease_id, "pids": pids})

    def listed(self) -> list[Info]:
        return list(self.one({"op": "lease-list"})["leases"])


class _Http:
    """The HTTP API (``--url``): the node's ``serve --api``."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def ask(self, args: argparse.Namespace, vram: int, ttl: float) -> Info:
        c = self.client
        info = c.lease(vram, gpu=args.gpu, ttl_s=ttl, priority=args.priority, holder=_user())
        lease_id = str(info["id"])
        out.print(f"lease {lease_id}: {format_bytes(vram)} asked for", markup=False)
        deadline = time.monotonic() + args.wait_timeout
        try:
            with Progress(f"lease {lease_id}: waiting for its grant") as progress:
                while info["state"] in ("queued", "running") and not info["granted"]:
                    if time.monotonic() > deadline:
                        break
                    note = str(info.get("waiting") or "")
                    progress.update(progress_text(lease_id, str(info["state"]), note))
                    info = c.lease_wait(lease_id, min(10.0, args.wait_timeout))
        except KeyboardInterrupt:
            with contextlib.suppress(GpuwardenError):
                c.end_lease(lease_id)
            raise _GaveUp(lease_id) from None
        return info

    def info(self, lease_id: str) -> Info | None:
        try:
            return self.client.get_lease(lease_id)
        except UserError:
            return None

    def renew(self, lease_id: str) -> None:
        self.client.renew_lease(lease_id)

    def end(self, lease_id: str, reason: str) -> None:
        self.client.end_lease(lease_id, reason=reason)

    def pids(self, lease_id: str, pids: list[int]) -> None:
        self.client.lease_pids(lease_id, pids)

    def listed(self) -> list[Info]:
        return self.client.leases()


# -- holding a granted lease ---------------------------------------------------------


class _Holding:
    """A granted lease this process holds: renewed every third of its ttl."""

    def __init__(
        self, way: _Way, info: Info, ttl: float, env: Callable[[], dict[str, str]]
    ) -> None:
        self.way, self.id, self.ttl, self.env = way, str(info["id"]), ttl, env
        self.gpu = str(info["gpu"])
        self.vram = int(info.get("vram_bytes") or 0)
        self.next_renew = 0.0

    def _laid_out(self) -> bool:
        deadline = time.monotonic() + LAYOUT_WAIT_S
        while time.monotonic() < deadline:
            info = self.way.info(self.id)
            if info is not None and info.get("until") is not None:
                return True
            if not self._still_held(info):
                return False
            time.sleep(0.05)
        return False

    def _still_held(self, info: Info | None = None) -> bool:
        info = info if info is not None else self.way.info(self.id)
        if info is not None and info.get("state") == "running":
            return True
        why = info.get("reason") if info is not None else "it is gone"
        err.print(f"lease {self.id}: ended: {printable(str(why or ''))}", markup=False)
        return False

    def _renew(self) -> None:
        now = time.monotonic()
        if now >= self.next_renew:
            with contextlib.suppress(GpuwardenError, OSError):  # its end is seen next
                self.way.renew(self.id)
            self.next_renew = now + self.ttl / 3

    def _end(self, reason: str) -> None:
        with contextlib.suppress(GpuwardenError, OSError):
            self.way.end(self.id, reason)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            info = self.way.info(self.id)
            if info is None or info.get("state") not in ("queued", "running"):
                break
            time.sleep(0.1)
        out.print(f"lease {self.id}: ended ({reason})", markup=False)

    def _announce(self) -> None:
        out.print(
            f"lease {self.id}: granted on {self.gpu} ({format_bytes(self.vram)}); it ends "
            f"{self.ttl:g} s after its last renewal",
            markup=False,
        )

    def run(self, command: list[str]) -> int:
        """Run ``command`` with the lease; its end ends the lease."""
        if not self._laid_out():
            return 1
        self._announce()
        try:
            proc = subprocess.Popen(command, env=self.env())
        except OSError as exc:
            self._end(f"{ENDED_BY_HOLDER}: its command could not start")
            raise UserError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        try:
            self.way.pids(self.id, [proc.pid])
        except (GpuwardenError, OSError) as exc:
            err.print(f"lease {self.id}: its command's pid not registered: {exc}", markup=False)
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
            f"lease {self.id}: held on {self.gpu} {how}, renewed every "
            f"{self.ttl / 3:g} s; end it with `gpuwarden lease end {self.id}` or Ctrl-C"
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


# -- end and list ----------------------------------------------------------------------


def _end(args: argparse.Namespace, lease_id: str) -> int:
    with _way(args) as way:
        info = way.info(lease_id)
        if info is None:
            raise UserError(f"no lease {lease_id!r} of yours here (`gpuwarden lease list`)")
        if info.get("state") not in ("queued", "running"):
            why = printable(str(info.get("reason") or ""))
            out.print(f"lease {lease_id} has ended already: {why}", markup=False)
            return 0
        way.end(lease_id, ENDED_BY_HOLDER)
        out.print(f"lease {lease_id}: ending", markup=False)
        return 0


def _list(args: argparse.Namespace) -> int:
    with _way(args) as way:
        rows = way.listed()
    for info in rows:
        until = info.get("until")
        vram = format_bytes(int(info.get("vram_bytes") or 0))
        out.print(
            f"{info['id']}  {info['state']:8}  {vram:>9}  {info.get('gpu') or '-'}  "
            f"{info.get('holder') or ''}"
            + (f"  until {time.strftime('%H:%M:%S', time.localtime(until))}" if until else ""),
            markup=False,
        )
    if not rows:
        out.print("no leases", markup=False)
    return 0
