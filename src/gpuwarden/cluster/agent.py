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
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden import __version__
from gpuwarden.app import open_node
from gpuwarden.cluster.coordinator import heartbeat_every_s
from gpuwarden.cluster.coordinator_client import (
    Coordinator,
    CoordinatorError,
    Credential,
    CredentialRefused,
    Refused,
    capabilities,
    enroll,
)
from gpuwarden.cluster.enrolment import ENROLL_ENV, enrolment_token, parse_labels, token_id
from gpuwarden.cluster.transfer import Outputs, fetch_inputs, upload_outputs
from gpuwarden.config import Config
from gpuwarden.core.model import Event, Job, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.eventlog import EventLog
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.intake.jobs import JOB_ID
from gpuwarden.node.loop import Broker
from gpuwarden.node.warmpool import ServerState
from gpuwarden.registry import Registry
from gpuwarden.store.base import DIRECT, DuplicateJobError, Store, Submission

# what ``gpuwarden agent`` (cluster/cli.py) and the tests take from here
__all__ = [
    "CREDENTIAL_FILE",
    "ENROLL_ENV",
    "EXIT_REVOKED",
    "Agent",
    "Coordinator",
    "CredentialRefused",
    "Held",
    "enroll",
    "enrolment_token",
    "parse_labels",
    "run_agent",
]

log = logging.getLogger("gpuwarden.agent")

#: the credential file's name in the state directory (mode 600)
CREDENTIAL_FILE = "node-credential"

#: exit status of an agent whose credential the coordinator refused
EXIT_REVOKED = 3

#: outcomes of a local attempt ended because this agent stopped
_SHUTDOWN_OUTCOMES = frozenset({"shutdown"})


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
        room (``free_bytes``, what its ledger lets a new job take, less what is
        leased here and not started yet), what the probe shows used and what the
        ledger holds; the job types it runs, its modules' types and its launch
        rules; warm servers, running jobs, labels."""
        b = self.broker
        st = b.status()
        return {
            "gpus": [g.to_json() for g in b.room(self._leased_jobs())],
            "warm": sorted(w.type for w in st.warm if w.state != ServerState.STOPPING),
            "warm_servers": [
                {"type": w.type, "gpu": w.gpu, "state": w.state, "jobs_served": w.jobs_served}
                for w in st.warm
            ],
            "running": [
                {
                    "job": self._by_local[r.job],
                    "type": r.type,
                    "gpu": r.gpu,
                    "started_at": r.started_at,
                }
                for r in st.running
                if r.job in self._by_local
            ],
            "busy": self._busy(),
            "max_jobs": self.max_jobs,
            "labels": self.labels,
            "types": sorted(
                t.name for t in b.registry.types.values() if b.rules.refusal(t) is None
            ),
            "modules": sorted(b.registry.types),
            "launch_rules": b.rules.to_json(),
            "probe": st.probe,
            "probe_error": st.probe_error,
            "heartbeat_every_s": self.heartbeat_every_s,
            "accepting": self.state == "active" and b.accepting and not self.stopping,
        }

    def _leased_jobs(self) -> list[Job]:
        """The local jobs of what is leased here and has not ended."""
        held = [h for h in self.held.values() if not (h.lost or h.ended)]
        jobs = (self.store.get_job(h.local_id) for h in held)
        return [job for job in jobs if job is not None]

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
            folder = fetch_inputs(
                self.coordinator,
                self.broker.settings.state_dir,
                job_id=job_id,
                lease_id=str(payload["lease_id"]),
                local_id=local_id,
                inputs=inputs,
            )
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
                upload_outputs(
                    self.coordinator,
                    Outputs(r.held.job_id, r.held.lease_id, r.uploaded, r.not_uploaded),
                    r.body,
                )
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
    cred = _saved_credential(cred_path, coordinator_url, enroll_token, say)
    # the agent's own store is SQLite in its state directory, never a shared one
    local = config.model_copy(update={"database": "", "queue_roots": []})
    enrolment: Enrolment | None = None
    if cred is not None:
        local = local.model_copy(update={"node_name": cred.node})
    elif not coordinator_url or enroll_token is None:
        raise UserError(
            "enrolling needs the coordinator's URL: --coordinator URL, or [cluster] "
            "coordinator_url in the config"
        )
    else:
        enrolment = Enrolment(coordinator_url, enroll_token, cred_path, local, labels, say)
    with open_node(local, mock_gpu=mock_gpu, events=events, name=enrolment) as node:
        cred = enrolment.credential if enrolment is not None else cred
        assert cred is not None  # enrolled as the node was built, or loaded
        broker = node.broker
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
        sync = _SyncStep(agent, stop, force, say)
        broker.run(stop, force=force, between=sync, started={"agent": cred.node})
        agent.stopping = True
        if not sync.revoked:
            agent.final_reports()
        client.close()
    return EXIT_REVOKED if sync.revoked else 0


@dataclass
class Enrolment:
    """Enrols the node as its broker is built (``open_node``'s ``name``): the
    coordinator names the node, so the broker has its name from the start."""

    url: str
    token: str
    path: Path
    config: Config
    labels: dict[str, str]
    say: Callable[[str], None]
    #: what enrolling got
    credential: Credential | None = None

    def __call__(self, probe: GpuProbe, registry: Registry) -> str:
        caps = capabilities(
            probe,
            registry,
            container_runtime=self.config.container_runtime.value,
            labels=self.labels,
        )
        got = enroll(self.url, self.token, caps)
        cred = Credential(
            coordinator=self.url.rstrip("/"),
            node=str(got["node"]),
            token=str(got["token"]),
            token_id=str(got.get("token_id", "")),
            lease_s=float(got.get("lease_s", 90.0)),
            enrolled_with=token_id(self.token),
        )
        cred.save(self.path)
        self.say(f"enrolled as node {cred.node}; credential saved to {self.path} (mode 600)")
        self.credential = cred
        return cred.node


@dataclass
class _SyncStep:
    """The agent's step after each broker tick. A credential the coordinator
    refuses stops everything at once: every job here is stopped, none reported."""

    agent: Agent
    stop: threading.Event
    force: threading.Event
    say: Callable[[str], None]
    revoked: bool = False

    def __call__(self) -> None:
        try:
            self.agent.sync()
        except CredentialRefused as exc:
            self.say(
                f"gpuwarden agent: the coordinator refused node {self.agent.node}'s credential: "
                f"{exc.message}. Every job here was stopped and none is reported; to rejoin, "
                "get a new invite (`gpuwarden node invite NAME`) and enrol again"
            )
            self.agent.drop_everything("the node's credential was refused")
            self.revoked = True
            self.force.set()  # the broker's shutdown gives its jobs no grace
            self.stop.set()


def _saved_credential(
    path: Path, coordinator_url: str | None, enroll_token: str | None, say: Callable[[str], None]
) -> Credential | None:
    """The credential to run with, or None to enrol with ``enroll_token``."""
    if enroll_token is not None and (used := _enrolled_with(path, enroll_token)):
        # started again with the token it enrolled with (a service's environment
        # file still holds it): that token is used up; the credential it got stands
        say(f"already enrolled as node {used.node} with this token: using {path}")
        enroll_token = None
    if enroll_token is not None:
        return None
    cred = Credential.load(path)
    if coordinator_url and coordinator_url.rstrip("/") != cred.coordinator:
        cred = dataclasses.replace(cred, coordinator=coordinator_url.rstrip("/"))
    return cred


def _enrolled_with(path: Path, token: str) -> Credential | None:
    """The saved credential when it was got with ``token`` (so that token is used up),
    else None (no credential, an unreadable one, or another token: enrol)."""
    wanted = token_id(token)
    if not wanted or not path.exists():
        return None
    try:
        cred = Credential.load(path)
    except UserError:
        return None
    return cred if cred.enrolled_with == wanted else None


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
