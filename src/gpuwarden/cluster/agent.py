"""``gpuwarden agent``: one GPU host of several, working for a coordinator.

The agent is the same broker loop as ``gpuwarden serve``, on a store of its own
(SQLite in its state directory), plus a sync step after each tick that mirrors
the coordinator's leases into that local store:

* heartbeat: the host's report (GPU room by its own ledger, warm types, how many
  jobs it holds, labels, the job types it can run) and the ids of the jobs it
  holds; the answer renews their leases, says whether the node is active or
  draining, and which held jobs to stop (a client cancelled it; its lease went).
* claim, while it has room: the leased jobs are submitted to the local store
  with the same ids (another id only if that one is taken locally already), and
  the local broker admits and runs them as it would its own; a job's input
  files are fetched from the coordinator first (``GET
  /v1/node/jobs/{id}/inputs/{name}``) into ``<state_dir>/inputs/<local id>/``.
* reports: the local store's events after a cursor become ``start`` and
  ``finish`` reports (state, outcome, reason, exit code, result, output), each
  naming its lease; a report the coordinator refuses is dropped, and a job
  whose start is refused is stopped here.
* the lease watchdog: when the last heartbeat that got an answer is older than
  ``lease_s`` less a margin, every held job is stopped here (reason "lost its
  lease") and is never reported: by then the coordinator may have given it to
  another node.

Before the finish of a ``done`` or ``failed`` attempt, its output files go up
(``PUT /v1/node/jobs/{id}/outputs/{path}``); the coordinator keeps them and the
result (what ``result.json`` holds) points at its copy. The agent keeps its own
copy in the state directory's ``jobs/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import httpx

from gpuwarden import __version__, safefs
from gpuwarden.app import open_node
from gpuwarden.cluster.nodeview import heartbeat_every_s
from gpuwarden.config import Config
from gpuwarden.core.model import Event, JobSpec, Lane
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.eventlog import EventLog
from gpuwarden.intake.jobs import JOB_ID, safe_relpath
from gpuwarden.node.loop import Broker
from gpuwarden.node.warmpool import ServerState
from gpuwarden.store.base import DIRECT, DuplicateJobError, Store, Submission

log = logging.getLogger("gpuwarden.agent")

#: the credential file's name in the state directory (mode 600)
CREDENTIAL_FILE = "node-credential"

#: exit status of an agent whose credential the coordinator refused
EXIT_REVOKED = 3

#: outcomes of a local attempt ended because this agent stopped
_SHUTDOWN_OUTCOMES = frozenset({"shutdown"})

#: where fetched inputs are written before they are renamed into place, beside the
#: jobs' input folders
PARTS = ".parts"

_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Fd:
    """An open descriptor, for ``contextlib.closing``."""

    fd: int

    def close(self) -> None:
        os.close(self.fd)


# -- talking to the coordinator ---------------------------------------------------


class CoordinatorError(GpuwardenError):
    """The coordinator did not answer, or answered with a server error."""


class Refused(GpuwardenError):
    """The coordinator refused a request (4xx other than 401)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class CredentialRefused(GpuwardenError):
    """401: the node's credential is refused (revoked, or enrolled again elsewhere)."""


class Coordinator:
    """The node endpoints of a coordinator, with one node token."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def set_timeout(self, seconds: float) -> None:
        self._http.timeout = httpx.Timeout(seconds)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise CoordinatorError(f"cannot reach the coordinator at {self.url}: {exc}") from None
        return _answer(response)

    def heartbeat(self, report: dict[str, Any], jobs: list[str]) -> dict[str, Any]:
        return self.post("/v1/node/heartbeat", {"report": report, "jobs": jobs})

    def claim(self, report: dict[str, Any], want: int, jobs: list[str]) -> dict[str, Any]:
        return self.post("/v1/node/claim", {"report": report, "want": want, "jobs": jobs})

    def start(self, job_id: str, lease_id: str, gpu: str | None) -> dict[str, Any]:
        return self.post(f"/v1/node/jobs/{job_id}/start", {"lease_id": lease_id, "gpu": gpu})

    def finish(self, job_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.post(f"/v1/node/jobs/{job_id}/finish", body)

    def upload(self, job_id: str, lease_id: str, rel: str, root: Path) -> dict[str, Any]:
        """Send the output file ``root/rel`` (streamed) to the coordinator. The file
        is a job's: it is opened by descriptor below ``root``, never through a link,
        never a FIFO or a device (:class:`gpuwarden.safefs.UnsafePathError`), and at
        most the size it had when it was opened is sent."""
        fd = safefs.open_file(rel, under=root)
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size

            def body() -> Iterator[bytes]:
                left = size
                while left > 0:
                    chunk = f.read(min(1 << 20, left))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk

            try:
                response = self._http.put(
                    f"/v1/node/jobs/{job_id}/outputs/{quote(rel)}",
                    params={"lease_id": lease_id},
                    content=body(),
                    headers={
                        "content-type": "application/octet-stream",
                        "content-length": str(size),
                    },
                )
            except httpx.HTTPError as exc:
                raise CoordinatorError(
                    f"cannot reach the coordinator at {self.url}: {exc}"
                ) from None
        return _answer(response)

    def fetch(self, job_id: str, lease_id: str, name: str, *, parts: Path, into: int) -> None:
        """Fetch input ``name`` of a leased job (streamed to a fresh file in the
        folder ``parts``, then renamed into the open folder ``into`` under the last
        part of ``name``)."""
        path = f"/v1/node/jobs/{job_id}/inputs/{quote(name)}"
        tmp = f"{secrets.token_hex(8)}.part"
        with safefs.opened_dir(parts) as parts_fd:
            try:
                with self._http.stream("GET", path, params={"lease_id": lease_id}) as response:
                    if response.status_code >= 400:
                        response.read()
                        _answer(response)
                    out = os.open(tmp, _O_NEW, 0o600, dir_fd=parts_fd)
                    try:
                        for chunk in response.iter_bytes():
                            view = memoryview(chunk)
                            while view:
                                view = view[os.write(out, view) :]
                    finally:
                        os.close(out)
                os.rename(tmp, name.rpartition("/")[2], src_dir_fd=parts_fd, dst_dir_fd=into)
            except httpx.HTTPError as exc:
                raise CoordinatorError(
                    f"cannot reach the coordinator at {self.url}: {exc}"
                ) from None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parts_fd)


def _answer(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {"value": data}
    if response.status_code < 400:
        return data
    message = str(data.get("error") or response.text[:500] or response.reason_phrase)
    if response.status_code == 401:
        raise CredentialRefused(message)
    if response.status_code == 429 or response.status_code >= 500:
        raise CoordinatorError(f"the coordinator answered {response.status_code}: {message}")
    raise Refused(message, response.status_code)


def enroll(
    url: str,
    enroll_token: str,
    capabilities: dict[str, Any],
    *,
    transport: httpx.BaseTransport | None = None,
) -> dict[str, Any]:
    """Exchange an enrolment token for the node's credential."""
    client = Coordinator(url, enroll_token, timeout=30.0, transport=transport)
    try:
        return client.post("/v1/nodes/enroll", {"capabilities": capabilities})
    except CredentialRefused as exc:
        raise UserError(
            f"the coordinator refused the enrolment token: {exc.message} (ask its owner for "
            "a new one: `gpuwarden node invite NAME`)"
        ) from None
    except (Refused, CoordinatorError) as exc:
        raise UserError(f"enrolment failed: {exc.message}") from None
    finally:
        client.close()


@dataclass(frozen=True, slots=True)
class Credential:
    coordinator: str
    node: str
    token: str
    token_id: str = ""
    lease_s: float = 90.0
    #: the id of the enrolment token this credential was got with: that token is
    #: used up, so an agent started again with it keeps this credential
    enrolled_with: str = ""

    def save(self, path: Path) -> None:
        """Write it, readable by its owner only (mode 600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a crash; made fresh below, never through a link
        fd = os.open(tmp, _O_NEW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Credential:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UserError(
                f"no node credential at {path}: enrol first with `gpuwarden agent "
                "--coordinator URL --enroll-file FILE` (`gpuwarden node invite NAME` makes the "
                "token to put in FILE; or --enroll - to read it from standard input)"
            ) from None
        if mode & 0o077:
            raise UserError(
                f"node credential {path} can be read by others (mode {mode & 0o777:o}): "
                f"run `chmod 600 {path}`"
            )
        try:
            data = json.loads(path.read_text())
            return cls(
                coordinator=str(data["coordinator"]),
                node=str(data["node"]),
                token=str(data["token"]),
                token_id=str(data.get("token_id", "")),
                lease_s=float(data.get("lease_s", 90.0)),
                enrolled_with=str(data.get("enrolled_with", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"node credential {path} cannot be read: {exc}") from None


def capabilities(broker: Broker, config: Config, labels: dict[str, str]) -> dict[str, Any]:
    """What the host has, sent once at enrolment (the heartbeat sends live room)."""
    try:
        readings = broker.probe.read()
    except GpuwardenError:
        readings = []
    return {
        "host": socket.gethostname(),
        "gpuwarden": __version__,
        "probe": broker.probe.kind,
        "gpus": [
            {
                "uuid": r.uuid,
                "name": r.name,
                "total_bytes": r.total_bytes,
                "driver": r.driver,
                "cuda": r.extra.get("cuda", ""),
            }
            for r in readings
        ],
        "driver": next((r.driver for r in readings if r.driver), ""),
        "cuda": next((r.extra.get("cuda", "") for r in readings if r.extra.get("cuda")), ""),
        "container_runtime": config.container_runtime.value,
        "launch_rules": broker.rules.to_json(),
        "labels": labels,
        "types": sorted(broker.registry.types),
    }


# -- the mirror -------------------------------------------------------------------


@dataclass
class Held:
    """A job leased to this node, as it stands here."""

    job_id: str  # the coordinator's id
    local_id: str  # its id in the local store (the same unless that was taken)
    lease_id: str
    #: the lease is gone or about to go: stop it here, never report it
    lost: bool = False
    #: the coordinator knows it started (a start report got an answer)
    started: bool = False
    #: it ended here and its end was reported (or needs no report)
    ended: bool = False


@dataclass
class _Report:
    kind: str  # "start" | "finish"
    held: Held
    body: dict[str, Any] = field(default_factory=dict)
    #: outputs sent to the coordinator already (a finish is retried after them)
    uploaded: set[str] = field(default_factory=set)
    #: outputs not sent, and why: ``[{"path", "why"}]``, in the finish's result
    not_uploaded: list[dict[str, str]] = field(default_factory=list)


class Agent:
    """The sync step: run :meth:`sync` after each broker tick, in the loop's thread."""

    def __init__(
        self,
        broker: Broker,
        coordinator: Coordinator,
        *,
        node: str,
        lease_s: float,
        max_jobs: int,
        labels: dict[str, str],
        claim_every_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.store: Store = broker.store
        self.coordinator = coordinator
        self.node = node
        self.max_jobs = max_jobs
        self.labels = dict(labels)
        self.claim_every_s = claim_every_s
        self.monotonic = monotonic
        self.state = "active"
        self.held: dict[str, Held] = {}
        self._by_local: dict[str, str] = {}
        self._outbox: deque[_Report] = deque()
        self._cursor = self.store.last_event_id()
        self._last_ok = monotonic()
        self._last_beat = -1e9
        self._last_claim = -1e9
        self._claim_now = True
        self._warned_at = -1e9
        self.stopping = False
        self.set_lease(lease_s)

    # -- timing -------------------------------------------------------------

    def set_lease(self, lease_s: float) -> None:
        self.lease_s = lease_s
        #: stop held jobs when the last answered heartbeat is this old
        self.stop_after_s = lease_s - min(20.0, lease_s / 3)
        self.heartbeat_every_s = heartbeat_every_s(lease_s)
        self.coordinator.set_timeout(max(0.5, min(10.0, lease_s / 4)))

    # -- the step -------------------------------------------------------------

    def sync(self) -> None:
        """One pass: watchdog, heartbeat, reports, claim. Raises
        :class:`CredentialRefused` when the coordinator refuses this node."""
        self._watchdog()
        now = self.monotonic()
        if now - self._last_beat >= self.heartbeat_every_s:
            self._heartbeat()
        self._collect()
        self._send()
        self._forget_ended()
        if self._may_claim():
            self._claim()

    def holding(self) -> list[str]:
        """The ids the coordinator should keep leased to this node."""
        return [h.job_id for h in self.held.values() if not h.lost]

    def _busy(self) -> int:
        return len([h for h in self.held.values() if not h.ended])

    def _watchdog(self) -> None:
        """No answered heartbeat for too long: the leases may be gone; stop it all."""
        silent = self.monotonic() - self._last_ok
        if silent <= self.stop_after_s:
            return
        for h in self.held.values():
            if not h.lost and not h.ended:
                self._lose(h, f"lost its lease: no answer from the coordinator for {silent:.0f} s")

    def _lose(self, h: Held, reason: str) -> None:
        """Stop the job here and never report it."""
        h.lost = True
        self._outbox = deque(r for r in self._outbox if r.held is not h)
        job = self.store.get_job(h.local_id)
        now = self.broker.clock()
        self.store.add_event(
            Event(ts=now, kind="lease_lost", job_id=h.local_id, detail={"reason": reason})
        )
        if job is not None and not job.state.terminal:
            with contextlib.suppress(UserError):
                self.store.request_cancel(h.local_id, now=now)
        log.warning("job %s: %s; stopped here", h.job_id, reason)

    # -- heartbeat and claims -----------------------------------------------------

    def report(self) -> dict[str, Any]:
        """This node now, as placement and ``gpuwarden status`` need it: per GPU its
        room (``free_bytes``, what its ledger lets a new job take), what the probe
        shows used and what the ledger holds; the job types it runs, its modules'
        types and its launch rules; warm servers, running jobs, labels."""
        b = self.broker
        st = b.status()
        by_uuid = {str(g.get("uuid")): g for g in st.get("gpus", [])}
        idle_warm = {
            s.holder for s in b.warm if s.state is ServerState.IDLE and not s.type.keep_warm
        }
        gpus: list[dict[str, Any]] = []
        for v in b.vram.views():
            usable = max(0, v.total_bytes - v.reserve_bytes)
            evictable = sum(h.bytes for h in v.holdings if h.holder in idle_warm)
            free = 0 if v.degraded else min(usable, v.free_bytes + evictable)
            seen = by_uuid.get(v.uuid, {})
            gpus.append(
                {
                    "uuid": v.uuid,
                    "name": v.name,
                    "total_bytes": v.total_bytes,
                    "free_bytes": free,
                    "usable_bytes": usable,
                    "used_bytes": int(seen.get("used_bytes", 0)),
                    "ledger_bytes": v.held_bytes,
                    "foreign_bytes": v.foreign_bytes,
                    "reserve_bytes": v.reserve_bytes,
                    "degraded": v.degraded,
                }
            )
        # what is leased here but not started yet will take room too
        waiting = 0
        for h in self.held.values():
            if h.lost or h.ended:
                continue
            job = self.store.get_job(h.local_id)
            jobtype = b.registry.types.get(job.type) if job is not None else None
            if (
                job is not None
                and job.state is JobState.QUEUED
                and jobtype is not None
                and jobtype.lane is Lane.VRAM
                and jobtype.name not in b.warm.by_type
            ):
                waiting += b.footprint(jobtype, job.vram_bytes)
        for g in sorted(gpus, key=lambda g: -int(g["free_bytes"])):
            take = min(waiting, int(g["free_bytes"]))
            g["free_bytes"] = int(g["free_bytes"]) - take
            waiting -= take
        runs_here = sorted(t.name for t in b.registry.types.values() if b.rules.refusal(t) is None)
        running = [
            {
                "job": self._by_local[str(r["job"])],
                "type": r.get("type"),
                "gpu": r.get("gpu"),
                "started_at": r.get("started_at"),
            }
            for r in st.get("running", [])
            if str(r.get("job")) in self._by_local
        ]
        return {
            "gpus": gpus,
            "warm": sorted(s.type.name for s in b.warm if s.state is not ServerState.STOPPING),
            "warm_servers": [
                {
                    "type": w.get("type"),
                    "gpu": w.get("gpu"),
                    "state": w.get("state"),
                    "jobs_served": w.get("jobs_served"),
                }
                for w in st.get("warm", [])
            ],
            "running": running,
            "busy": self._busy(),
            "max_jobs": self.max_jobs,
            "labels": self.labels,
            "types": runs_here,
            "modules": sorted(b.registry.types),
            "launch_rules": b.rules.to_json(),
            "probe": b.probe.kind,
            "probe_error": str(st.get("probe_error") or ""),
            "heartbeat_every_s": self.heartbeat_every_s,
            "accepting": self.state == "active" and b.accepting and not self.stopping,
        }

    def _heartbeat(self) -> None:
        sent = self.monotonic()
        self._last_beat = sent
        try:
            answer = self.coordinator.heartbeat(self.report(), self.holding())
        except CoordinatorError as exc:
            self._warn(f"heartbeat failed: {exc.message}")
            return
        except Refused as exc:
            self._warn(f"heartbeat refused: {exc.message}")
            return
        self._last_ok = sent
        self._take_state(str(answer.get("state", "active")))
        lease_s = float(answer.get("lease_s", self.lease_s))
        if lease_s != self.lease_s:
            self.set_lease(lease_s)
        for cancel in answer.get("cancels", []):
            h = self.held.get(str(cancel.get("id")))
            if h is None or h.lost:
                continue
            reason = str(cancel.get("reason", "cancelled by the coordinator"))
            if cancel.get("lost"):
                self._lose(h, reason)
            else:
                job = self.store.get_job(h.local_id)
                if job is not None and not job.state.terminal:
                    with contextlib.suppress(UserError):
                        self.store.request_cancel(h.local_id, now=self.broker.clock())
                        log.info("job %s: %s; stopping it", h.job_id, reason)

    def _take_state(self, state: str) -> None:
        if state == "revoked":
            raise CredentialRefused(f"node {self.node} was revoked by the coordinator")
        if state != self.state:
            log.warning("node %s is now %s", self.node, state)
            self.state = state

    def _may_claim(self) -> bool:
        if self.stopping or self.state != "active" or not self.broker.accepting:
            return False
        if self._busy() >= self.max_jobs:
            return False
        if self.monotonic() - self._last_ok > self.stop_after_s / 2:
            return False  # not while the coordinator does not answer
        return self._claim_now or self.monotonic() - self._last_claim >= self.claim_every_s

    def _claim(self) -> None:
        self._last_claim = self.monotonic()
        self._claim_now = False
        want = self.max_jobs - self._busy()
        try:
            answer = self.coordinator.claim(self.report(), want, self.holding())
        except (CoordinatorError, Refused) as exc:
            self._warn(f"claim failed: {exc.message}")
            return
        self._take_state(str(answer.get("state", "active")))
        for job in answer.get("jobs", []):
            self._take(job)

    def _take(self, payload: dict[str, Any]) -> None:
        """Put a leased job into the local queue."""
        job_id = str(payload["id"])
        local_id = job_id
        n = 1
        while self.store.get_job(local_id) is not None:
            n += 1
            local_id = f"{job_id}.{n}"
            if not JOB_ID.fullmatch(local_id):
                local_id = f"{job_id[:100]}.{n}"
        inputs = tuple(str(x) for x in payload.get("inputs") or ())
        spec = JobSpec(
            id=local_id,
            type=str(payload["type"]),
            params=dict(payload.get("params") or {}),
            inputs=inputs,
            outputs=tuple(payload.get("outputs") or ()),
            priority=int(payload.get("priority") or 0),
            vram_bytes=payload.get("vram_bytes"),
        )
        origin = DIRECT
        if inputs:
            folder = self._fetch_inputs(job_id, str(payload["lease_id"]), local_id, inputs)
            if folder is None:  # its lease lapses; it goes elsewhere
                return
            origin = Submission(input_dir=str(folder))
        try:
            self.store.submit([spec], now=self.broker.clock(), origin=origin)
        except (DuplicateJobError, UserError) as exc:  # its lease lapses; it goes elsewhere
            log.error("leased job %s could not be queued here: %s", job_id, exc)
            return
        h = Held(job_id=job_id, local_id=local_id, lease_id=str(payload["lease_id"]))
        self.held[job_id] = h
        self._by_local[local_id] = job_id
        self.broker.wake()

    def _fetch_inputs(
        self, job_id: str, lease_id: str, local_id: str, inputs: tuple[str, ...]
    ) -> Path | None:
        """Fetch a leased job's input files from the coordinator into a fresh folder
        of this node's own (``<state_dir>/inputs/LOCAL_ID``, its sub-folders made by
        descriptor, no link followed); None when that fails."""
        top = self.broker.config.state_dir / "inputs"
        folder = top / local_id
        parts = top / PARTS  # beside the job folders: a local id never starts with '.'
        try:
            top.mkdir(parents=True, exist_ok=True)
            parts.mkdir(mode=0o700, exist_ok=True)
            safefs.remove_tree(folder)  # a leftover of an earlier run: not this job's
            safefs.make_dir(folder)
            for name in inputs:
                rel = safe_relpath(name, "input")
                rel.encode("utf-8")  # UnicodeEncodeError: a name that is not UTF-8
                with contextlib.closing(
                    _Fd(safefs.make_dirs(rel.rpartition("/")[0], under=folder))
                ) as into:
                    self.coordinator.fetch(job_id, lease_id, rel, parts=parts, into=into.fd)
        except (CoordinatorError, Refused, UserError, OSError, UnicodeError) as exc:
            message = getattr(exc, "message", str(exc))
            log.error("leased job %s: its input files could not be fetched: %s", job_id, message)
            try:
                safefs.remove_tree(folder)
            except OSError as gone:
                log.error("leased job %s: %s could not be removed: %s", job_id, folder, gone)
            return None
        return folder

    # -- reports ----------------------------------------------------------------

    def _collect(self) -> None:
        """Turn new local events of held jobs into reports, in order."""
        while True:
            events = self.store.events(after_id=self._cursor, limit=1000)
            if not events:
                return
            for ev in events:
                self._cursor = ev.id or self._cursor
                if ev.kind != "transition" or ev.job_id not in self._by_local:
                    continue
                h = self.held.get(self._by_local[ev.job_id])
                if h is None or h.lost:
                    continue
                self._on_transition(h, ev)

    def _on_transition(self, h: Held, ev: Event) -> None:
        to, frm = ev.to_state, ev.from_state
        if to == JobState.RUNNING.value:
            self._outbox.append(_Report("start", h, {"gpu": ev.detail.get("gpu")}))
            return
        if frm == JobState.RUNNING.value:
            self._outbox.append(_Report("finish", h, self._finish_body(h, ev)))
            if to != JobState.QUEUED.value:
                h.ended = True
            self._claim_now = True
            return
        if frm == JobState.QUEUED.value and to == JobState.FAILED.value:
            # refused here before it ran (its type is gone, the launch rules say no)
            self._outbox.append(_Report("start", h, {"gpu": None}))
            body = {
                "state": to,
                "outcome": "launch_error",
                "reason": str(ev.detail.get("reason", "")),
                "result": {"message": str(ev.detail.get("reason", ""))},
            }
            self._outbox.append(_Report("finish", h, body))
            h.ended = True
            self._claim_now = True
        elif to in (JobState.CANCELLED.value, JobState.FAILED.value):
            h.ended = True  # cancelled here on the coordinator's word: nothing to say
            self._claim_now = True

    def _finish_body(self, h: Held, ev: Event) -> dict[str, Any]:
        number = ev.detail.get("attempt")
        attempt = next((a for a in self.store.attempts(h.local_id) if a.number == number), None)
        job = self.store.get_job(h.local_id)
        outcome = str(ev.detail.get("outcome") or (attempt.outcome if attempt else "") or "")
        state = str(ev.to_state)
        reason = attempt.reason if attempt is not None else str(ev.detail.get("reason", ""))
        body: dict[str, Any] = {
            "state": state,
            "outcome": outcome,
            "reason": reason,
            "exit_code": attempt.exit_code if attempt is not None else None,
            "result": dict(job.result) if job is not None else {},
            "stdout": attempt.stdout if attempt is not None else "",
            "stderr": attempt.stderr if attempt is not None else "",
        }
        if outcome in _SHUTDOWN_OUTCOMES:
            # this agent stopped: not the job's failure; it runs again elsewhere
            body.update(
                state=JobState.QUEUED.value,
                outcome="interrupted",
                reason=f"its node {self.node} shut down while it ran",
                release=True,
            )
        return body

    def _send(self) -> None:
        while self._outbox:
            if self.monotonic() - self._last_ok > self.stop_after_s:
                self._watchdog()  # too late to report anything held
                return
            r = self._outbox.popleft()
            try:
                if r.kind == "start":
                    self.coordinator.start(r.held.job_id, r.held.lease_id, r.body.get("gpu"))
                    r.held.started = True
                    continue
                self._upload_outputs(r)
                body = dict(r.body)
                body["lease_id"] = r.held.lease_id
                answer = self.coordinator.finish(r.held.job_id, body)
            except CoordinatorError as exc:
                self._outbox.appendleft(r)
                self._warn(f"report failed, will retry: {exc.message}")
                return
            except Refused as exc:
                log.warning("job %s: %s report refused: %s", r.held.job_id, r.kind, exc.message)
                if r.kind == "start":
                    self._lose(r.held, f"its start was refused: {exc.message}")
                    continue
                r.held.ended = True
                local = self.store.get_job(r.held.local_id)
                if local is not None and not local.state.terminal:
                    # a retry here the coordinator does not know of: it must not run
                    self._lose(r.held, f"its report was refused: {exc.message}")
                continue
            if not answer.get("lease_kept", False) and not r.held.ended:
                # the coordinator ended it (quarantined past its retries, cancelled)
                r.held.ended = True
                self._lose(r.held, f"the coordinator ended it ({answer.get('state')})")

    def _upload_outputs(self, r: _Report) -> None:
        """Before a job's end (done or failed) is reported, send its attempt's
        output files up: the coordinator keeps them (SPEC.md, section 16)."""
        if r.body.get("state") not in (JobState.DONE.value, JobState.FAILED.value):
            return
        result = r.body.get("result") or {}
        out_dir = result.get("output_dir")
        if not out_dir:
            return
        root = Path(str(out_dir))
        listed = [str(x) for x in result.get("outputs") or ()]
        for rel in listed:
            if rel in r.uploaded:
                continue
            why = self._upload_one(r, rel, root)
            if why is not None:
                shown = rel.encode("utf-8", "backslashreplace").decode("utf-8")
                log.warning("job %s: output %s not uploaded: %s", r.held.job_id, shown, why)
                r.not_uploaded.append({"path": shown, "why": why})
            r.uploaded.add(rel)
        if r.not_uploaded:
            # the result says what did not go up; a name that is not UTF-8 cannot be
            # in it (the coordinator takes only valid text)
            kept = [rel for rel in listed if _is_utf8(rel)]
            r.body["result"] = {
                **result,
                "outputs": kept,
                "outputs_not_uploaded": list(r.not_uploaded),
            }

    def _upload_one(self, r: _Report, rel: str, root: Path) -> str | None:
        """Send one output; why it was not sent, or None. Raises :class:`Refused`
        (409: the lease is gone, and so is the report) and :class:`CoordinatorError`
        (no answer: the report is tried again)."""
        if not _is_utf8(rel):
            return "its name is not valid UTF-8"
        try:
            self.coordinator.upload(r.held.job_id, r.held.lease_id, rel, root)
        except Refused as exc:
            if exc.status == 409:
                raise
            # too large, or a path the coordinator refuses: the rest still goes
            return f"the coordinator refused it ({exc.status}): {exc.message}"
        except safefs.UnsafePathError as exc:
            # a link, a FIFO, a device the job put there: never read
            return f"it {exc.why}"
        except FileNotFoundError:
            return "it is gone"
        except OSError as exc:
            return f"it cannot be read: {exc.strerror or exc}"
        return None

    def _forget_ended(self) -> None:
        for job_id, h in list(self.held.items()):
            if any(r.held is h for r in self._outbox):
                continue
            local = self.store.get_job(h.local_id) if (h.ended or h.lost) else None
            if h.ended or (h.lost and (local is None or local.state.terminal)):
                del self.held[job_id]
                self._by_local.pop(h.local_id, None)

    def _warn(self, message: str) -> None:
        if self.monotonic() - self._warned_at >= 10:
            self._warned_at = self.monotonic()
            log.warning("%s", message)

    # -- stopping -------------------------------------------------------------------

    def drop_everything(self, reason: str) -> None:
        """Stop every held job here and report nothing (revoked)."""
        for h in self.held.values():
            if not h.lost:
                self._lose(h, reason)
        self._outbox.clear()

    def final_reports(self) -> None:
        """After the broker stopped: report what ended (one try each)."""
        self.stopping = True
        with contextlib.suppress(CredentialRefused):
            self._collect()
            self._send()


# -- running it -----------------------------------------------------------------------


#: the environment variable an agent may take its enrolment token from
ENROLL_ENV = "GPUWARDEN_ENROLL_TOKEN"
#: the most a token file or standard input is read for a token
_SECRET_MAX = 4096
_TOKEN_ID = re.compile(r"^gw_([0-9a-f]{12})_")


def token_on_argv(value: str) -> str:
    """Why ``--enroll VALUE`` (anything but ``-``) is refused, and what to do."""
    m = _TOKEN_ID.match(value)
    seen = (
        f"; it was on a command line for a moment, so treat it as seen: revoke it "
        f"(`gpuwarden token revoke {m.group(1)}`) and make a new one "
        "(`gpuwarden node invite NAME`)"
        if m
        else ""
    )
    return (
        "--enroll takes '-' (read the token from standard input), not the token itself: "
        "a token on the command line can be read by every user of this host (ps, "
        "/proc/PID/cmdline) for as long as the agent runs. Give it one of three ways: "
        "--enroll-file FILE (a file only its owner can read: chmod 600 FILE), "
        "--enroll - (standard input: `gpuwarden agent ... --enroll - < FILE`), or the "
        f"environment variable {ENROLL_ENV}{seen}"
    )


def read_secret_file(path: Path, what: str) -> str:
    """A token from ``path``: a regular file that only its owner may read (no bits for
    group or others, as `chmod 600` leaves it), at most 4 KiB, one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(
                f"{what} {path} is a {safefs.kind_of(st.st_mode)}, not a file: write the "
                "token to a file (chmod 600)"
            )
        if st.st_mode & 0o077:
            raise UserError(
                f"{what} {path} can be read by others (mode {st.st_mode & 0o777:o}): run "
                f"`chmod 600 {path}` and try again"
            )
        data = os.read(fd, _SECRET_MAX + 1)
    finally:
        os.close(fd)
    return _one_token(data, f"{what} {path}")


def _one_token(data: bytes, where: str) -> str:
    if len(data) > _SECRET_MAX:
        raise UserError(f"{where} holds more than {_SECRET_MAX} bytes: it should hold one token")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise UserError(f"{where} is not a token (it is not ASCII text)") from None
    if not text:
        raise UserError(f"{where} is empty: it should hold the token `gpuwarden node invite` made")
    if any(c.isspace() for c in text):
        raise UserError(f"{where} holds more than one word: it should hold one token")
    return text


def enrolment_token(
    *,
    enroll: str | None,
    enroll_file: Path | None,
    environ: MutableMapping[str, str],
    stdin: TextIO,
) -> str | None:
    """The enrolment token from one of ``--enroll -`` (``stdin``), ``--enroll-file``
    or the environment (:data:`ENROLL_ENV`), or None when none is given. The
    variable is removed from ``environ`` first, whatever happens next, so nothing
    this process starts inherits it. A token given as ``--enroll TOKEN`` is refused
    (:func:`token_on_argv`)."""
    from_env = environ.pop(ENROLL_ENV, None)
    if enroll is not None and enroll != "-":
        raise UserError(token_on_argv(enroll))
    ways = [
        name
        for name, given in (
            ("--enroll -", enroll is not None),
            ("--enroll-file", enroll_file is not None),
            (ENROLL_ENV, bool(from_env)),
        )
        if given
    ]
    if len(ways) > 1:
        raise UserError(
            f"the enrolment token was given {len(ways)} ways ({', '.join(ways)}): give it one way"
        )
    if enroll_file is not None:
        return read_secret_file(enroll_file, "enrolment token file")
    if enroll is not None:
        if stdin.isatty():
            return _one_token(
                getpass.getpass("enrolment token (from `gpuwarden node invite`): ").encode(),
                "the token typed",
            )
        return _one_token(stdin.read(_SECRET_MAX + 1).encode(), "standard input")
    if from_env:
        return _one_token(from_env.encode(), ENROLL_ENV)
    return None


def parse_labels(text: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` -> dict."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--labels {text!r}: write them as key=value,key2=value2")
        out[key.strip()] = value.strip()
    return out


def run_agent(
    config: Config,
    *,
    coordinator_url: str | None,
    enroll_token: str | None,
    credential_path: Path | None,
    mock_gpu: bool,
    labels: dict[str, str] | None,
    max_jobs: int | None,
    events: EventLog,
    stop: threading.Event,
    force: threading.Event,
    say: Callable[[str], None] = print,
    on_broker: Callable[[Broker], None] | None = None,
) -> int:
    """Enrol (once) or load the credential, then run the broker loop with the sync
    step until ``stop``. Returns the exit status."""
    cred_path = credential_path or config.state_dir / CREDENTIAL_FILE
    labels = dict(config.cluster.labels if labels is None else labels)
    max_jobs = max_jobs or config.cluster.max_jobs
    coordinator_url = coordinator_url or config.cluster.coordinator_url or None
    if enroll_token is not None and (used := _enrolled_with(cred_path, enroll_token)):
        # started again with the token it enrolled with (a service's environment
        # file still holds it): that token is used up; the credential it got stands
        say(f"already enrolled as node {used.node} with this token: using {cred_path}")
        enroll_token = None
    if enroll_token is None:
        cred = Credential.load(cred_path)
        if coordinator_url and coordinator_url.rstrip("/") != cred.coordinator:
            cred = dataclasses.replace(cred, coordinator=coordinator_url.rstrip("/"))
    elif not coordinator_url:
        raise UserError(
            "enrolling needs the coordinator's URL: --coordinator URL, or [cluster] "
            "coordinator_url in the config"
        )
    else:
        cred = None
    # the agent's own store is SQLite in its state directory, never a shared one
    local = config.model_copy(update={"database": "", "queue_roots": []})
    if cred is not None:
        local = local.model_copy(update={"node_name": cred.node})
    with open_node(local, mock_gpu=mock_gpu, events=events) as node:
        broker = node.broker
        if cred is None:
            assert coordinator_url is not None and enroll_token is not None
            got = enroll(coordinator_url, enroll_token, capabilities(broker, local, labels))
            cred = Credential(
                coordinator=coordinator_url.rstrip("/"),
                node=str(got["node"]),
                token=str(got["token"]),
                token_id=str(got.get("token_id", "")),
                lease_s=float(got.get("lease_s", 90.0)),
                enrolled_with=_token_id(enroll_token),
            )
            cred.save(cred_path)
            say(f"enrolled as node {cred.node}; credential saved to {cred_path} (mode 600)")
            broker.node = cred.node
        if broker.node != cred.node:
            broker.node = cred.node
        if on_broker is not None:
            on_broker(broker)
        broker.recover()
        _clear_leftovers(broker)
        client = Coordinator(cred.coordinator, cred.token)
        agent = Agent(
            broker,
            client,
            node=cred.node,
            lease_s=cred.lease_s,
            max_jobs=max_jobs,
            labels=labels,
            claim_every_s=local.cluster.claim_every_s,
        )
        say(
            f"gpuwarden {__version__} agent for node {cred.node} (PID {os.getpid()})\n"
            f"  coordinator {cred.coordinator}\n"
            f"  state dir   {local.state_dir}\n"
            f"  gpu probe   {node.probe.kind}\n"
            f"  max jobs    {max_jobs}; labels {labels or 'none'}"
        )
        status = 0
        try:
            broker.store.add_event(
                Event(
                    ts=broker.clock(),
                    kind="broker_started",
                    detail={"pid": os.getpid(), "probe": broker.probe.kind, "agent": cred.node},
                )
            )
            while not stop.is_set():
                broker.tick()
                agent.sync()
                broker.idle(local.broker.poll_interval_s)
        except CredentialRefused as exc:
            say(
                f"gpuwarden agent: the coordinator refused node {cred.node}'s credential: "
                f"{exc.message}. Every job here was stopped and none is reported; to rejoin, "
                "get a new invite (`gpuwarden node invite NAME`) and enrol again"
            )
            agent.drop_everything("the node's credential was refused")
            force.set()
            status = EXIT_REVOKED
        agent.stopping = True
        broker.shutdown(0.0 if status else local.broker.shutdown_grace_s, force=force)
        if status == 0:
            agent.final_reports()
        client.close()
    return status


def _token_id(token: str) -> str:
    """The id of a token of gpuwarden's form (``gw_<id>_...``), or ""."""
    m = _TOKEN_ID.match(token)
    return m.group(1) if m else ""


def _enrolled_with(path: Path, token: str) -> Credential | None:
    """The saved credential when it was got with ``token`` (so that token is used up),
    else None (no credential, an unreadable one, or another token: enrol)."""
    token_id = _token_id(token)
    if not token_id or not path.exists():
        return None
    try:
        cred = Credential.load(path)
    except UserError:
        return None
    return cred if cred.enrolled_with == token_id else None


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clear_leftovers(broker: Broker) -> None:
    """Jobs an earlier run of this agent held: their leases are not this run's, so
    they are cancelled here (the coordinator's sweep gives them out again)."""
    now = broker.clock()
    for job in broker.store.list_jobs(
        states=frozenset({JobState.QUEUED, JobState.RUNNING}), limit=100_000
    ):
        with contextlib.suppress(UserError):
            broker.store.add_event(
                Event(
                    ts=now,
                    kind="lease_lost",
                    job_id=job.id,
                    detail={"reason": "the agent restarted: its lease is not this run's"},
                )
            )
            broker.store.request_cancel(job.id, now=now)
