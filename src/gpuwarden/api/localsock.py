"""The node's local socket (SPEC.md, "Command jobs"): how a user of this host runs
a command job, as themselves.

``gpuwarden serve`` listens on a Unix socket (``[commands] socket``, default
``<state_dir>/gpuwarden.sock``, mode 0666). The broker learns who is at the
other end from the kernel (``SO_PEERCRED``), never from what the client says,
and refuses users that ``[commands]`` does not allow, saying which rule refused
them. A connection carries one request, one JSON object on a line, and is
answered with JSON lines:

* ``{"op": "submit", "argv": [...], "cwd": "/abs", "env": {...}, ...}``: the jobs
  it made (``{"ids": [...]}``), or ``{"error": "..."}``;
* ``{"op": "follow", "id": ID}``: while it waits, ``{"waiting": "why"}``; while it
  runs, its output as ``{"stdout": BASE64}`` / ``{"stderr": BASE64}``; at its end
  ``{"end": {"state", "exit_code", "reason"}}``;
* ``{"op": "cancel", "id": ID}``: ``{"state": ...}``;
* VRAM leases (SPEC.md, "VRAM leases"; the rules are :class:`~gpuwarden.api.leasedesk.LeaseDesk`'s):
  ``{"op": "lease", "vram_bytes", "ttl_s", "gpu", "priority"}``: ``{"lease": INFO}``
  (queued), ``{"waiting": "why"}`` while it waits, then ``{"granted": INFO}`` or,
  when it ended ungranted, ``{"end": INFO}``; a client that hangs up before the
  grant has the lease cancelled. ``{"op": "lease-renew", "id"}``: ``{"until": T}``;
  ``{"op": "lease-end", "id", "reason"}``: ``{"state": ...}``;
  ``{"op": "lease-pids", "id", "pids": [...]}`` (the user's own processes):
  ``{"pids": [...]}``; ``{"op": "lease-show", "id"}``: ``{"lease": INFO}``;
  ``{"op": "lease-list"}``: ``{"leases": [INFO, ...]}``.

A user may follow and cancel only their own command jobs (root: any), and
renew, end, name PIDs of and see only their own leases (root: any); asking for
a lease is gated by ``[commands]`` like a command. What a
session does is :class:`LocalSession`, which ``gpuwarden run`` also uses in
process when no broker listens and it may write the store itself.
"""

from __future__ import annotations

import base64
import contextlib
import grp
import json
import logging
import os
import pwd
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.api.leasedesk import LeaseDesk
from gpuwarden.cluster import report
from gpuwarden.config import Config
from gpuwarden.core import command
from gpuwarden.core.command import CommandOptions, CommandSpec, LocalUser
from gpuwarden.core.lease import DEFAULT_TTL_S, ENDED_BY_HOLDER
from gpuwarden.core.model import Job, JobSpec, gpu_count
from gpuwarden.core.policy import never_fits
from gpuwarden.core.ramadmit import RamNeed
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError, UserError, ValidationError
from gpuwarden.intake.jobs import new_job_id, prepare
from gpuwarden.node import explain, joblogs
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission

log = logging.getLogger(__name__)

#: the socket's file name in the state directory
SOCKET_NAME = "gpuwarden.sock"
#: the longest request line
MAX_REQUEST = 4 << 20
#: how often a follower asks again why a job waits, and polls its state
NOTE_EVERY_S = 1.0
POLL_S = 0.1
#: the most connections served at once, and how long one may be idle
MAX_CONNECTIONS = 64
IDLE_S = 30.0
#: the most jobs one ``--array`` makes
MAX_ARRAY = 10_000

Send = Callable[[dict[str, Any]], None]
#: the lease ops answered with one message (``lease`` itself follows the grant)
LEASE_OPS = ("lease-renew", "lease-end", "lease-pids", "lease-show", "lease-list")


def socket_path(config: Config) -> Path:
    """Where the node's local socket is."""
    return config.commands.socket or config.state_dir / SOCKET_NAME


@contextlib.contextmanager
def addressable(path: Path) -> Iterator[str]:
    """An address for ``path`` that fits a Unix socket's 108 bytes: the path
    itself, or the same file reached through a descriptor of its folder."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def connect(path: Path) -> socket.socket:
    """A connection to the local socket at ``path`` (the client's side)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with addressable(path) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


def listening(path: Path) -> bool:
    """True when a broker answers at ``path``."""
    try:
        with connect(path):
            return True
    except OSError:
        return False


def ask(path: Path, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The answers to one request, one message at a time (the client's side); an
    error message raises :class:`UserError` with its words."""
    with connect(path) as sock, sock.makefile("rb") as answers:
        sock.sendall(json.dumps(body).encode() + b"\n")
        for line in answers:
            message = json.loads(line)
            if "error" in message:
                raise UserError(str(message["error"]))
            yield message


def local_user(uid: int, gid: int) -> LocalUser:
    """The user the kernel named, with their names from the user database (a uid
    with no entry keeps its number as its name, and only its primary group)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return LocalUser(uid, gid, str(uid))
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, gid))))
    names = []
    for g in groups:
        with contextlib.suppress(KeyError):
            names.append(grp.getgrgid(g).gr_name)
    return LocalUser(uid, gid, entry.pw_name, groups, tuple(names))


def peer_user(conn: socket.socket) -> LocalUser:
    """Who is at the other end of ``conn``: ``SO_PEERCRED``, the kernel's word."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", raw)
    return local_user(uid, gid)


def owner_of(user: LocalUser) -> str | None:
    """A local user's jobs' ``owner`` (fair share is per owner): ``user:NAME``;
    root's are the host's own (None), as the local CLI's always were."""
    return None if user.uid == 0 else f"user:{user.name}"


# -- what a session does -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Gate:
    """``[commands]``: who may run host commands here."""

    users: tuple[str, ...]
    groups: tuple[str, ...]
    state_owner: int

    @classmethod
    def of(cls, config: Config) -> Gate:
        owner = config.state_dir.stat().st_uid if config.state_dir.exists() else os.getuid()
        return cls(tuple(config.commands.users), tuple(config.commands.groups), owner)

    def check(self, user: LocalUser) -> None:
        why = command.user_refusal(
            user, users=self.users, groups=self.groups, state_owner=self.state_owner
        )
        if why is not None:
            raise UserError(why)


class LocalSession:
    """Submit, follow and cancel command jobs for a local user, over one store."""

    def __init__(self, store: Store, registry: Registry, config: Config) -> None:
        self.store = store
        self.registry = registry
        self.config = config
        self.gate = Gate.of(config)
        self.jobs_dir = config.state_dir / "jobs"

    # -- submit --------------------------------------------------------------------

    def submit(self, body: Mapping[str, Any], user: LocalUser) -> list[str]:
        """The command jobs ``body`` asks for, run as ``user``, stored; their ids."""
        self.gate.check(user)
        specs = [prepare(self.registry, s, owner=None) for s in command_specs(body, user)]
        self._refuse_if_it_never_fits(specs[0])
        self.store.submit(specs, now=time.time(), origin=Submission(owner=owner_of(user)))
        return [s.id for s in specs]

    def _refuse_if_it_never_fits(self, spec: JobSpec) -> None:
        """Against the GPUs the running broker last reported (when one runs)."""
        status = explain.latest_status(self.store, time.time())
        if status is None:
            return
        view = explain.view_from_status(status, self.config.broker.cpu_slots)
        jobtype = self.registry.get(spec.type)
        if (why := explain.never_admitted(view.ram, jobtype, spec.ram)) is not None:
            raise ValidationError(f"job {spec.id} ({spec.type}) {why}")
        need = explain.effective_footprint(jobtype, spec.vram_bytes, self.store)
        if (why := never_fits(need, view.gpus, gpu_count(jobtype, spec.gpus))) is not None:
            raise ValidationError(f"job {spec.id} ({spec.type}) {why}")

    # -- follow and cancel -----------------------------------------------------------

    def own_job(self, job_id: object, user: LocalUser) -> Job:
        """The job ``job_id`` if ``user`` may follow and cancel it."""
        if not isinstance(job_id, str):
            raise ValidationError("give the job's id")
        job = self.store.get_job(job_id)
        mine = job is not None and (
            user.uid == 0 or (job.command is not None and job.command.uid == user.uid)
        )
        if job is None or not mine:
            # the same words for a job of another's as for none: ids are not told
            raise UserError(f"no command job {job_id} of user {user.name} here")
        return job

    def cancel(self, job_id: object, user: LocalUser) -> Job:
        job = self.own_job(job_id, user)
        if job.state.terminal:
            return job
        return self.store.request_cancel(job.id, now=time.time())

    def follow(self, job_id: object, user: LocalUser, send: Send) -> None:
        """Say why the job waits while it waits, send its output while it runs
        (every attempt's, in order), and its end."""
        job = self.own_job(job_id, user)
        follower = _Follower(self, job.id, send)
        follower.run()

    # -- VRAM leases ---------------------------------------------------------------

    def desk(self) -> LeaseDesk:
        return LeaseDesk(self.store, self.registry, self.config)

    def own_lease(self, lease_id: object, user: LocalUser) -> Job:
        """The lease ``lease_id`` if it is ``user``'s (root: any)."""
        job = None
        with contextlib.suppress(GpuwardenError):
            job = self.desk().lease(lease_id)
        if job is None or (user.uid != 0 and job.owner != owner_of(user)):
            raise UserError(f"no lease {str(lease_id)[:140]} of user {user.name} here")
        return job

    def lease(self, body: Mapping[str, Any], user: LocalUser, send: Send) -> None:
        """Ask for a lease as ``user`` and follow it to its grant (or its end)."""
        self.gate.check(user)
        priority = _int(body.get("priority", 0), "--priority")
        if priority > 0 and user.uid != 0:
            raise ValidationError(
                f"--priority {priority}: a local user other than root may only lower a "
                "lease's priority (0 or less)"
            )
        desk = self.desk()
        job = desk.ask(
            body.get("vram_bytes"),
            ttl_s=body.get("ttl_s", DEFAULT_TTL_S),
            gpu=body.get("gpu"),
            priority=priority,
            owner=owner_of(user),
            holder=user.name,
        )
        try:
            send({"lease": desk.info(job)})
            self._until_granted(desk, job, send)
        except OSError:  # the client hung up before the grant: nobody holds it
            desk.end(self.store.get_job(job.id) or job, f"{ENDED_BY_HOLDER} (it hung up)")
            raise

    def _until_granted(self, desk: LeaseDesk, job: Job, send: Send) -> None:
        note, next_note = "", 0.0
        while True:
            now = self.store.get_job(job.id)
            if now is None or now.state.terminal:
                send({"end": desk.info(now or job)})
                return
            if desk.attempt_dir(now) is not None:
                send({"granted": desk.info(now)})
                return
            if now.state is JobState.QUEUED and time.monotonic() >= next_note:
                lines = report.explain(
                    now, self.store, self.registry, self.config.broker.cpu_slots, time.time()
                )
                keep = "; ".join(
                    ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen by"))
                )
                if keep != note:
                    note = keep
                    send({"waiting": note})
                next_note = time.monotonic() + NOTE_EVERY_S
            time.sleep(POLL_S)

    def lease_op(self, op: str, body: Mapping[str, Any], user: LocalUser) -> dict[str, Any]:
        """``lease-renew``, ``lease-end``, ``lease-pids``, ``lease-show``, ``lease-list``."""
        desk = self.desk()
        if op == "lease-list":
            every = user.uid == 0
            return {
                "leases": [desk.info(j) for j in desk.listed(owner_of(user), every_owner=every)]
            }
        job = self.own_lease(body.get("id"), user)
        if op == "lease-renew":
            return {"until": desk.renew(job)}
        if op == "lease-end":
            why = str(body.get("reason") or ENDED_BY_HOLDER)[:300]
            why = why if why.startswith(ENDED_BY_HOLDER) else f"{ENDED_BY_HOLDER}: {why}"
            return {"state": desk.end(job, why).state.value}
        if op == "lease-pids":
            return {"pids": desk.register_pids(job, body.get("pids"), uid=user.uid)}
        return {"lease": desk.info(job)}


class _Follower:
    """One ``follow``: the job's state polled, its current attempt's streams read."""

    def __init__(self, session: LocalSession, job_id: str, send: Send) -> None:
        self.session = session
        self.job_id = job_id
        self.send = send
        self.note = ""
        self.next_note = 0.0
        self.number = 0  # the attempt whose streams are open
        self.fds: dict[str, int] = {}

    def run(self) -> None:
        try:
            while True:
                job = self.session.store.get_job(self.job_id)
                if job is None:
                    raise UserError(f"job {self.job_id} is no longer in the store")
                if job.state is JobState.QUEUED:
                    self._waiting(job)
                self._stream(job)
                if job.state.terminal:
                    self._stream(job, last=True)
                    self.send({"end": end_of(job)})
                    return
                time.sleep(POLL_S)
        finally:
            self._close()

    def _waiting(self, job: Job) -> None:
        if time.monotonic() < self.next_note:
            return
        s = self.session
        lines = report.explain(job, s.store, s.registry, s.config.broker.cpu_slots, time.time())
        keep = [ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen by"))]
        note = "; ".join(keep)
        if note != self.note:
            self.note = note
            self.send({"waiting": note})
        self.next_note = time.monotonic() + NOTE_EVERY_S

    def _stream(self, job: Job, *, last: bool = False) -> None:
        """What the current attempt wrote since the last look; a newer attempt's
        streams once the one open has been read to its end."""
        if job.attempts > self.number and not self.fds:
            self.number = job.attempts
            self.note = ""
        for name in ("stdout", "stderr"):
            if name not in self.fds and self.number:
                fd = self._open(job, name)
                if fd is not None:
                    self.fds[name] = fd
            fd = self.fds.get(name, -1)
            while fd >= 0 and (chunk := joblogs.read_some(fd)):
                self.send({name: base64.b64encode(chunk).decode()})
        if self.fds and (last or job.attempts > self.number):
            self._close()  # read to the end: the next look opens the next attempt's

    def _open(self, job: Job, name: str) -> int | None:
        rel = f"{job.id}/attempt-{self.number}/{joblogs.file_name(name)}"
        try:
            return safefs.open_file(rel, under=self.session.jobs_dir)
        except (FileNotFoundError, safefs.UnsafePathError):
            return None

    def _close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def end_of(job: Job) -> dict[str, Any]:
    return {"state": job.state.value, "exit_code": job.exit_code, "reason": job.reason}


# -- the jobs of a request ---------------------------------------------------------


def command_specs(body: Mapping[str, Any], user: LocalUser) -> list[JobSpec]:
    """The jobs of a submit request (one, or one per ``--array`` index), each
    running as ``user``; :class:`ValidationError` saying what is wrong."""
    argv, env, cwd = _checked(body)
    name = body.get("name") or command.default_name(argv)
    try:
        options = CommandOptions(
            share=bool(body.get("share", False)),
            preempt=_preempt(body.get("preempt")),
            timeout_s=body.get("timeout_s"),
        )
        type_name = command.type_name(str(name), options)
        command.parse_type(type_name)  # the timeout's range
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    priority = _int(body.get("priority", 0), "--priority")
    if priority > 0 and user.uid != 0:
        raise ValidationError(
            f"--priority {priority}: a local user other than root may only lower a job's "
            "priority (0 or less); ask the node's operator to raise it"
        )
    base = body.get("id") or new_job_id(str(name))
    cmd = CommandSpec(argv, cwd, env, user.uid, user.gid, user.groups)
    common: dict[str, Any] = {
        "type": type_name,
        "priority": priority,
        "vram_bytes": body.get("vram_bytes"),
        "est_s": body.get("est_s"),
        "gpus": body.get("gpus"),
        "ram": RamNeed(int(body.get("ram_bytes") or 0), 0, 0),
        "constraints": dict(body.get("constraints") or {}),
    }
    after = tuple(str(a) for a in body.get("after") or ())
    array = body.get("array")
    if array is None:
        return [JobSpec(id=str(base), command=cmd, after=after, **common)]
    indices, limit = _array(array)
    ids = [f"{base}_{i}" for i in indices]
    specs = []
    for n, (job_id, index) in enumerate(zip(ids, indices, strict=True)):
        # at most ``limit`` at once: each waits for the one ``limit`` places before it
        chain = (f"afterany:{ids[n - limit]}",) if limit and n >= limit else ()
        each = CommandSpec(argv, cwd, env, user.uid, user.gid, user.groups, index)
        specs.append(JobSpec(id=job_id, command=each, after=after + chain, **common))
    return specs


def _checked(body: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, str], str]:
    try:
        return command.check_command(
            body.get("argv"), body.get("env"), body.get("cwd"), sandboxed=False
        )
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def _preempt(value: object) -> str | None:
    if value is None:
        return None
    if value not in command.SIGNALS:
        raise ValidationError(
            f"--preemptible={value}: the signal is one of {', '.join(command.SIGNALS)}"
        )
    return str(value)


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(f"{what} must be a whole number, got {value!r}")
    return value


def _array(array: object) -> tuple[list[int], int]:
    if not isinstance(array, Mapping):
        raise ValidationError("--array: give it as 0-99 or 0-99%4")
    indices = array.get("indices")
    limit = array.get("limit") or 0
    if (
        not isinstance(indices, list)
        or not indices
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)
    ):
        raise ValidationError("--array: the indices are whole numbers from 0")
    if len(indices) > MAX_ARRAY or len(set(indices)) != len(indices):
        raise ValidationError(f"--array: at most {MAX_ARRAY} distinct indices")
    return indices, _int(limit, "--array's %N")


# -- the server --------------------------------------------------------------------


class _Handler(socketserver.StreamRequestHandler):
    server: LocalServer
    #: a client that sends no request, or stops reading what it is sent, for this
    #: long is dropped (its thread is not held)
    timeout = IDLE_S

    def handle(self) -> None:
        send = self._sender()
        if not self.server.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                self.rfile.readline(MAX_REQUEST + 1)  # read first: the client hears why
                send({"error": f"the broker is busy: {MAX_CONNECTIONS} connections are open"})
            return
        try:
            self._handle(send)
        finally:
            self.server.slots.release()

    def _handle(self, send: Send) -> None:
        try:
            user = peer_user(self.connection)
            line = self.rfile.readline(MAX_REQUEST + 1)
            if len(line) > MAX_REQUEST:
                raise ValidationError(f"the request is over {MAX_REQUEST} bytes")
            try:
                body = json.loads(line)
            except ValueError:
                raise ValidationError("the request is not one JSON object on a line") from None
            if not isinstance(body, dict):
                raise ValidationError("the request is not a JSON object")
            self._answer(body, user, send)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return
        except GpuwardenError as exc:
            with contextlib.suppress(OSError):
                send({"error": exc.message})
        except Exception as exc:  # one request's failure is said, the server goes on
            log.exception("local socket request failed")
            with contextlib.suppress(OSError):
                send({"error": f"the broker failed on this request: {exc}"})

    def _sender(self) -> Send:
        def send(message: dict[str, Any]) -> None:
            self.wfile.write(json.dumps(message).encode() + b"\n")
            self.wfile.flush()

        return send

    def _answer(self, body: dict[str, Any], user: LocalUser, send: Send) -> None:
        session = self.server.session
        op = body.get("op")
        if op == "submit":
            send({"ids": session.submit(body, user)})
        elif op == "follow":
            session.follow(body.get("id"), user, send)
        elif op == "cancel":
            send({"state": session.cancel(body.get("id"), user).state.value})
        elif op == "lease":
            session.lease(body, user, send)
        elif op in LEASE_OPS:
            send(session.lease_op(str(op), body, user))
        else:
            raise ValidationError(
                f"unknown op {op!r}: submit, follow, cancel, lease or {', '.join(LEASE_OPS)}"
            )


class LocalServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The local socket, served on threads of its own (one per connection)."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, path: Path, session: LocalSession) -> None:
        self.path = path
        self.session = session
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()  # a socket left by a broker that died
        with addressable(path) as address:
            super().__init__(address, _Handler, bind_and_activate=True)
        path.chmod(0o666)  # who may use it is [commands]'s to say, per peer
        self.thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="gpuwarden-local"
        )

    def start(self) -> LocalServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
