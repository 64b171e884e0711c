"""The agent's sync step: a coordinator's leases mirrored into a node's own store.

:class:`Agent` runs after each tick of the node's broker, on the loop's thread
(``Broker.run``'s ``between``): heartbeat, reports, claims, and the lease
watchdog; ``gpuwarden.cluster.agent`` (the module docstring says what each
does) runs it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwarden.cluster.coordinator_client import (
    Coordinator,
    CoordinatorError,
    CredentialRefused,
    Refused,
    source_ability,
)
from gpuwarden.cluster.held import Held, held_rows, save_held
from gpuwarden.cluster.logship import LogShipper
from gpuwarden.cluster.nodeview import heartbeat_every_s
from gpuwarden.cluster.outbox import Outbox, Saved
from gpuwarden.cluster.transfer import Outputs, fetch_inputs, upload_outputs
from gpuwarden.core import command
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import Event, Job, JobSpec
from gpuwarden.core.preempt import DEFAULT_GRACE_S, DEFAULT_SIGNAL, SIGNALS, Preempt
from gpuwarden.core.ramadmit import RamNeed
from gpuwarden.core.service import SERVICE_NAME
from gpuwarden.core.sources import JobSource, check_source
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import JOB_ID
from gpuwarden.launch.supervisor import write_lease
from gpuwarden.node.loop import Broker
from gpuwarden.node.warmpool import ServerState
from gpuwarden.store.base import DIRECT, DuplicateJobError, Store, Submission

log = logging.getLogger("gpuwarden.agent")

#: outcomes of a local attempt ended because this agent stopped
_SHUTDOWN_OUTCOMES = frozenset({"shutdown"})

#: the most reports sent in one request (``POST /v1/node/reports``)
REPORT_BATCH = 64

#: reports the coordinator could not be reached for are sent again after this many
#: seconds, doubled after each failure up to :data:`RETRY_MAX_S`
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


@dataclass
class _Report:
    kind: str  # "start" | "finish"
    held: Held
    body: dict[str, Any] = field(default_factory=dict)
    #: outputs sent to the coordinator already (a finish is retried after them)
    uploaded: set[str] = field(default_factory=set)
    #: outputs not sent, and why: ``[{"path", "why"}]``, in the finish's result
    not_uploaded: list[dict[str, str]] = field(default_factory=list)
    #: a finish: the local attempt it ends (its streams' last bytes go up first)
    attempt: int | None = None
    #: its number in the durable outbox (None: not kept there)
    seq: int | None = None
    #: how many of its outputs the outbox's copy says went up already
    kept_uploads: int = 0


def _unknown_held(r: _Report, got: Refused) -> bool:
    """Whether a finish was refused only for its ``held_bytes`` (fair share), as by a
    coordinator from before the field."""
    return (
        r.kind == "finish"
        and "held_bytes" in r.body
        and got.status == 422
        and "held_bytes" in got.message
    )


def _after_its_start(r: _Report, batch: list[_Report]) -> bool:
    """Whether ``r`` is a finish whose job's start is in ``batch`` (not sent yet): its
    outputs are uploaded before the batch goes, and an upload needs the start."""
    return r.kind == "finish" and any(b.kind == "start" and b.held is r.held for b in batch)


def _service_name(value: Any) -> str | None:
    """A leased service's name in URLs, as the coordinator sent it (None: its id)."""
    return value if isinstance(value, str) and SERVICE_NAME.fullmatch(value) else None


def payload_source(value: Any) -> JobSource | None:
    """A leased job's source as the coordinator sent it (None: a module the node
    has). Its URL is judged by this node's ``[sources] allow`` when its type is
    read (``QueueBook``): a job this node may not fetch fails here, saying why."""
    if value is None:
        return None
    try:
        return check_source(value, None)
    except ValueError as exc:
        log.error("a leased job's source was refused: %s", exc)
        return None


def command_ability(roles: Sequence[str], rules: LaunchRules) -> str:
    """What an agent reports of command jobs (placement's ``NodeView.commands``):
    "" when it runs its coordinator's sandboxed command jobs (its own ``[commands]
    roles`` names any role: it takes them at all; its launch rules sandbox them),
    else why not, as a phrase about the node. Which roles may submit them is the
    coordinator's ``[commands] roles``."""
    if not roles:
        return (
            "runs no command jobs (its [commands] roles is empty: set roles in the "
            "agent's config to take them)"
        )
    if rules.command_refusal() is not None:
        return f"runs no command jobs (no sandbox: its container_runtime is {rules.runtime.value})"
    return ""


def payload_command(payload: dict[str, Any], ability: str) -> tuple[CommandSpec | None, str]:
    """A leased job's command as the coordinator sent it, or why this agent refuses
    it: only a sandboxed command (its type ``command:...[...,sandbox]``, no user of
    this host) and only where this agent takes command jobs (``ability`` "")."""
    type_name = str(payload.get("type", ""))
    raw = payload.get("command")
    if not command.is_command_type(type_name):
        return None, "" if raw is None else "a command came with a module's type"
    try:
        _name, options = command.parse_type(type_name)
        cmd = CommandSpec.from_json(raw) if isinstance(raw, dict) else None
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"its command is not valid: {exc}"
    if cmd is None:
        return None, "a command job's type came without its command"
    if not options.sandbox or cmd.uid is not None or cmd.cwd:
        return None, (
            "a host command never runs on an agent (only sandboxed command jobs do; a host "
            "command runs on the host it was submitted on)"
        )
    if ability:
        return None, f"this node {ability}"
    return cmd, ""


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
        held_file: Path | None = None,
        outbox: Outbox | None = None,
        wall: Callable[[], float] = time.time,
        command_roles: Sequence[str] = (),
    ) -> None:
        self.broker = broker
        self.store: Store = broker.store
        self.coordinator = coordinator
        self.node = node
        self.max_jobs = max_jobs
        self.labels = dict(labels)
        #: "" when it runs its coordinator's sandboxed command jobs, else why not
        self.commands = command_ability(command_roles, broker.rules)
        self.claim_every_s = claim_every_s
        self.monotonic = monotonic
        self.state = "active"
        #: the job of this draining node's open diagnostic grant (the heartbeat says)
        self.granted: str | None = None
        self.held: dict[str, Held] = {}
        self._by_local: dict[str, str] = {}
        #: where the held leases are kept across restarts (:mod:`gpuwarden.cluster.held`)
        self.held_file = held_file
        self._kept: tuple[tuple[str, str, str], ...] | None = None
        self._outbox: deque[_Report] = deque()
        #: where the reports are kept until answered (:mod:`gpuwarden.cluster.outbox`)
        self.box = outbox
        kept = outbox.cursor() if outbox is not None else None
        self._cursor = kept if kept is not None else self.store.last_event_id()
        if outbox is not None and kept is None:
            # from here on: a restart reads again every event it had not made reports of
            outbox.save_cursor(self._cursor)
        #: this host's clock, as the supervisors read their lease files
        self.wall = wall
        #: (local id) -> (attempt, lease end) last written to its supervisor's lease file
        self._fenced: dict[str, tuple[int, float]] = {}
        self._send_after = -1e9
        self._send_wait = RETRY_FIRST_S
        self._last_ok = monotonic()
        self._last_beat = -1e9
        self._last_claim = -1e9
        self._claim_now = True
        self._warned_at = -1e9
        #: whether the coordinator takes several reports a request (until it says no)
        self._batched = True
        #: whether the coordinator takes ``held_bytes`` in a finish (until it says no)
        self._held_ok = True
        self.stopping = False
        #: the running attempts' streams, as they go up
        self.logs = LogShipper(coordinator, broker.settings.state_dir / "jobs", monotonic)
        self.set_lease(lease_s)
        # the coordinator charges each owner's fair share from the finish reports
        broker.fair.keep_ends()

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
        self._ship_logs()
        self._send()
        self._forget_ended()
        if self._may_claim():
            self._claim()
        self._keep_held()
        self._fence()

    def resume(self, saved: list[Held], others: list[Held] | None = None) -> None:
        """Hold again the jobs an earlier run of this agent held whose attempts the
        broker adopted (they run on, started): the next heartbeat renews their
        leases (the same ids), or its answer says they were lost. ``others``: the
        rest of what it held (their attempts ended, or were stopped, while no agent
        ran): not held any more, but the end of each is still reported. Then the
        reports the earlier run kept and got no answer for go again, first."""
        for h in saved:
            h.started = True
            self.held[h.job_id] = h
            self._by_local[h.local_id] = h.job_id
            log.info("job %s: adopted after a restart; holding lease %s", h.job_id, h.lease_id)
        for h in others or ():
            if h.job_id in self.held:
                continue
            h.started = True
            h.lost = True
            h.lost_reason = f"its node {self.node}'s agent restarted and the attempt was gone"
            self.held[h.job_id] = h
            self._by_local[h.local_id] = h.job_id
        self._reload()
        self._keep_held()

    def _reload(self) -> None:
        """The reports the outbox kept (an earlier run got no answer for them), back
        in order at the head of the queue, each with the job it is about."""
        if self.box is None:
            return
        for saved in self.box.load():
            h = self.held.get(saved.job_id)
            if h is None or h.lease_id != saved.lease_id:
                # not held any more (or under another lease): its report still goes
                h = Held(saved.job_id, saved.local_id, saved.lease_id, started=True)
                h.lost = True
                h.lost_reason = "an earlier run of this agent held it"
                self.held.setdefault(saved.job_id, h)
                self._by_local.setdefault(saved.local_id, saved.job_id)
            r = _Report(saved.kind, h, saved.body, attempt=saved.attempt, seq=saved.seq)
            r.uploaded = set(saved.uploaded)
            r.not_uploaded = list(saved.not_uploaded)
            r.kept_uploads = len(r.uploaded)
            self._outbox.append(r)
            log.info("job %s: its %s report is sent again after a restart", h.job_id, r.kind)

    def _keep_held(self) -> None:
        """Write the held leases to :attr:`held_file` when they changed."""
        rows = held_rows(self.held.values())
        if self.held_file is None or rows == self._kept:
            return
        try:
            save_held(self.held_file, self.node, rows)
        except OSError as exc:
            self._warn(f"the held-lease file {self.held_file} could not be written: {exc}")
            return
        self._kept = rows

    def holding(self) -> list[str]:
        """The ids the coordinator should keep leased to this node: the jobs not lost
        (one that ended here is held until its end is reported)."""
        return [h.job_id for h in self.held.values() if not h.lost]

    def _busy(self) -> int:
        return len([h for h in self.held.values() if not h.ended])

    def _watchdog(self) -> None:
        """No answered heartbeat for too long: the leases may be gone; stop every job
        still running or waiting here (a finished one's report waits in the outbox)."""
        silent = self.monotonic() - self._last_ok
        if silent <= self.stop_after_s:
            return
        for h in self.held.values():
            if not h.lost and not h.ended:
                self._lose(
                    h,
                    f"its node {self.node} stopped it: the coordinator did not answer for "
                    f"{silent:.0f} s, so its lease may have ended",
                )

    def _lose(self, h: Held, reason: str) -> None:
        """Stop the job here: its lease is gone or may be. Its reports still go (each
        is fenced by its lease id: refused if another attempt superseded it), and an
        end it has here is reported with ``reason`` and given back."""
        h.lost = True
        h.lost_reason = reason
        for r in self._outbox:
            if r.held is h and r.kind == "finish" and r.body.get("state") == JobState.QUEUED.value:
                r.body["release"] = True  # its retry will not run here: offered again
                self._keep(r)
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
            # warm servers, and runtime types whose model their runtime has loaded
            "warm": sorted(
                {w.type for w in st.warm if w.state != ServerState.STOPPING}
                | set(b.runtime_warm_types())
            ),
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
            # running jobs of preemptible types: a coordinator may ask them to yield
            "victims": self._victims(),
            "busy": self._busy(),
            "max_jobs": self.max_jobs,
            "labels": self.labels,
            "types": sorted(t.name for t in b.registry.types.values() if b.runs(t)),
            "modules": sorted(b.registry.types),
            "launch_rules": b.rules.to_json(),
            # whether it runs jobs from commits, and of which repositories
            "sources": source_ability(b.registry).to_json(),
            # whether it runs sandboxed command jobs ("": it does), else why not
            "commands": self.commands,
            "probe": st.probe,
            "probe_error": st.probe_error,
            "heartbeat_every_s": self.heartbeat_every_s,
            "accepting": self.state == "active" and b.accepting and not self.stopping,
            # what the node counted (its /metrics on the coordinator: gpuwarden.api.metrics)
            "stats": st.stats.to_json(),
        }

    def _services(self) -> dict[str, Any]:
        """The running services leased here, as the coordinator serves them at
        ``/run/<name>/`` (SPEC.md section 16, "Services across hosts"): each one's
        forwarder (on ``service_address``) and its current route credential, with
        this node's clock (``clock``: the coordinator counts ``since`` and
        ``last_ok`` back from it)."""
        routes = [
            {
                "name": r.name,
                "job": self._by_local[r.job_id],
                "state": r.state,
                "since": r.since,
                "last_ok": r.last_ok,
                "upstream": r.upstream,
                "credential": r.credential,
            }
            for r in self.broker.services.routes()
            if r.job_id in self._by_local and r.upstream
        ]
        return {
            "address": self.broker.services.address,
            "clock": self.broker.clock(),
            "routes": routes,
        }

    def _victims(self) -> list[dict[str, Any]]:
        """The running attempts of preemptible types leased here, as a coordinator
        chooses among them (how long each has run, not its start: the clocks of the
        two hosts need not agree)."""
        now = self.broker.clock()
        out = []
        for v, held_bytes in self.broker.victims():
            job = self._by_local.get(v.job_id)
            if job is None:
                continue
            out.append(
                {
                    "job": job,
                    "gpu": v.gpu_uuid,
                    "priority": v.priority,
                    "run_s": max(0.0, now - v.since),
                    "min_run_s": v.min_run_s,
                    "signal": v.signal,
                    "grace_s": v.grace_s,
                    "bytes": held_bytes,
                    "preempting_for": None
                    if v.preempting_for is None
                    else self._by_local.get(v.preempting_for, v.preempting_for),
                }
            )
        return out

    def _leased_jobs(self) -> list[Job]:
        """The local jobs of what is leased here and has not ended."""
        held = [h for h in self.held.values() if not (h.lost or h.ended)]
        jobs = (self.store.get_job(h.local_id) for h in held)
        return [job for job in jobs if job is not None]

    def _heartbeat(self) -> None:
        sent = self.monotonic()
        sent_wall = self.wall()
        self._last_beat = sent
        try:
            # only a heartbeat carries the services' routes (with their credentials)
            report = {**self.report(), "services": self._services()}
            answer = self.coordinator.heartbeat(report, self.holding())
        except CoordinatorError as exc:
            self._warn(f"heartbeat failed: {exc.message}")
            return
        except Refused as exc:
            self._warn(f"heartbeat refused: {exc.message}")
            return
        self._last_ok = sent
        self._renewed(answer, sent_wall)
        # the coordinator holds each service's current credential now: one a lease
        # old is replaced (the forwarder takes the one before it until the next beat)
        now = self.broker.clock()
        self.broker.services.rotate(now - self.lease_s, now)
        self._take_state(str(answer.get("state", "active")))
        granted = answer.get("grant")
        self.granted = str(granted) if granted else None
        lease_s = float(answer.get("lease_s", self.lease_s))
        if lease_s != self.lease_s:
            self.set_lease(lease_s)
        for job in answer.get("jobs", []):  # leased for the room a preemption makes
            self._take(job, until=sent_wall + lease_s)
        for ask in answer.get("preempts", []):
            self._preempt(ask)
        for stop in answer.get("stops", []):
            self._stop(stop)
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

    def _stop(self, stop: Any) -> None:
        """``gpuwarden stop`` on the coordinator: the held job (a service) is stopped
        here as done, as on one host (its broker passes it on once)."""
        h = self.held.get(str(stop.get("id"))) if isinstance(stop, dict) else None
        if h is None or h.lost:
            return
        job = self.store.get_job(h.local_id)
        if job is None or job.state is not JobState.RUNNING or job.stop_requested_by is not None:
            return
        with contextlib.suppress(UserError):
            self.store.request_stop(
                h.local_id, by=str(stop.get("by") or "?"), now=self.broker.clock()
            )
            self.broker.wake()
            log.info("job %s: stopped by %s on the coordinator", h.job_id, stop.get("by"))

    def _renewed(self, answer: dict[str, Any], sent_wall: float) -> None:
        """The lease ends a heartbeat's answer gives the held jobs, by this host's
        clock: from when the heartbeat was sent (so never later than the
        coordinator's end), each job's time left (``leases``), or the lease length
        for every held job from a coordinator that does not say."""
        left = answer.get("leases")
        lease_s = float(answer.get("lease_s", self.lease_s))
        for h in self.held.values():
            if h.lost:
                continue
            if not isinstance(left, dict):
                h.until = sent_wall + lease_s
            elif isinstance(got := left.get(h.job_id), int | float):
                h.until = sent_wall + float(got)

    def _fence(self) -> None:
        """Tell the supervisor of each running attempt held here its lease's end
        (``supervisor/lease`` in the attempt's folder): a supervisor whose lease
        passes unrenewed stops its job on its own, so a job of an agent that died
        never runs beside its retry elsewhere. Written when the attempt starts and
        each time the lease is renewed."""
        running = self.broker.attempts.by_job
        for h in self.held.values():
            run = running.get(h.local_id)
            if run is None or h.until is None or h.lost:
                continue
            mark = (run.attempt.number, h.until)
            if self._fenced.get(h.local_id) == mark or not run.attempt_dir.is_dir():
                continue  # told already, or its folder is not laid out yet
            try:
                write_lease(str(run.attempt_dir), h.until)
            except OSError as exc:
                self._warn(f"job {h.job_id}: its lease file could not be written: {exc}")
                continue
            self._fenced[h.local_id] = mark
        for local in [x for x in self._fenced if x not in running]:
            del self._fenced[local]

    def _preempt(self, ask: dict[str, Any]) -> None:
        """The coordinator chose a job held here to yield to a waiting one (sent at
        each heartbeat until its end is reported): the broker signals it, once."""
        h = self.held.get(str(ask.get("id")))
        for_job = str(ask.get("for_job", ""))
        if h is None or h.lost or h.ended or h.asked_for is not None:
            return
        waiting = self.held.get(for_job)
        decision = Preempt(
            job_id=h.local_id,
            for_job=waiting.local_id if waiting is not None else for_job,
            gpu_uuid=str(ask.get("gpu", "")),
            signal=str(ask.get("signal", DEFAULT_SIGNAL)),
            grace_s=float(ask.get("grace_s", DEFAULT_GRACE_S)),
            reason=str(ask.get("reason", f"job {for_job} needs its memory")),
        )
        if decision.signal not in SIGNALS:
            log.warning("job %s: the coordinator asked for signal %s", h.job_id, decision.signal)
            return
        h.asked_for = for_job  # once: a later attempt of it is never asked on this word
        if self.broker.preempt(decision):
            log.info("job %s: asked to checkpoint for job %s", h.job_id, for_job)

    def _take_state(self, state: str) -> None:
        if state == "revoked":
            raise CredentialRefused(f"node {self.node} was revoked by the coordinator")
        if state != self.state:
            log.warning("node %s is now %s", self.node, state)
            self.state = state

    def _may_claim(self) -> bool:
        open_here = self.state == "active" or (self.state == "draining" and self.granted)
        if self.stopping or not open_here or not self.broker.accepting:
            return False
        if self._busy() >= self.max_jobs:
            return False
        if self.monotonic() - self._last_ok > self.stop_after_s / 2:
            return False  # not while the coordinator does not answer
        if self._claim_now and (
            self.max_jobs - self._busy() >= self._batch or not self._waiting_here()
        ):
            return True  # a job ended, or the last claim was full: no need to wait
        return self.monotonic() - self._last_claim >= self.claim_every_s

    @property
    def _batch(self) -> int:
        """Free slots worth a claim before ``claim_every_s`` is up, while jobs wait
        here: half of ``max_jobs`` (one claim brings several jobs, not one each)."""
        return max(1, self.max_jobs // 2)

    def _waiting_here(self) -> bool:
        """Whether a job leased here has not started yet (the node has work queued)."""
        return any(not (h.started or h.ended or h.lost) for h in self.held.values())

    def _claim(self) -> None:
        self._last_claim = self.monotonic()
        self._claim_now = False
        want = self.max_jobs - self._busy()
        sent_wall = self.wall()
        try:
            answer = self.coordinator.claim(self.report(), want, self.holding())
        except (CoordinatorError, Refused) as exc:
            self._warn(f"claim failed: {exc.message}")
            return
        self._take_state(str(answer.get("state", "active")))
        jobs = answer.get("jobs", [])
        lease_s = float(answer.get("lease_s", self.lease_s))
        for job in jobs:
            self._take(job, until=sent_wall + lease_s)
        if want > 0 and len(jobs) >= want:
            self._claim_now = True  # there may be more: ask again once there is room

    def _take(self, payload: dict[str, Any], until: float | None = None) -> None:
        """Put a leased job into the local queue (a copy under a new local id when
        its id is taken here by an earlier attempt that did not end ``done``)."""
        job_id = str(payload["id"])
        local_id = job_id
        n = 1
        while self.store.get_job(local_id) is not None:
            n += 1
            local_id = f"{job_id}.{n}"
            if not JOB_ID.fullmatch(local_id):
                local_id = f"{job_id[:100]}.{n}"
        if n > 1 and self._report_again(payload, n, until):
            return
        inputs = tuple(str(x) for x in payload.get("inputs") or ())
        spec = JobSpec(
            id=local_id,
            type=str(payload["type"]),
            params=dict(payload.get("params") or {}),
            inputs=inputs,
            outputs=tuple(payload.get("outputs") or ()),
            priority=int(payload.get("priority") or 0),
            vram_bytes=payload.get("vram_bytes"),
            est_s=None if payload.get("est_s") is None else float(payload["est_s"]),
            gpus=None if payload.get("gpus") is None else int(payload["gpus"]),
            ram=RamNeed.from_json(payload),
            service=_service_name(payload.get("service")),
            source=payload_source(payload.get("source")),
        )
        cmd, refused = payload_command(payload, self.commands)
        spec = replace(spec, command=cmd)
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
        if refused:  # it ends here, refused, before it can start; the coordinator is told
            self.store.transition(
                local_id, JobState.FAILED, now=self.broker.clock(), reason=f"refused: {refused}"
            )
        h = Held(job_id=job_id, local_id=local_id, lease_id=str(payload["lease_id"]))
        h.until = until if until is not None else self.wall() + self.lease_s
        self.held[job_id] = h
        self._by_local[local_id] = job_id
        self._keep_held()
        self.broker.wake()

    def _report_again(self, payload: dict[str, Any], copies: int, until: float | None) -> bool:
        """A job leased again after its last copy here ended ``done``: the
        coordinator never took that end (its report was refused after the lease
        lapsed, in an outage of the coordinator's store, say). The end is reported
        under the new lease instead of running the job again: nothing that
        finished runs again. False when the last copy did not end ``done`` or is
        not this job (another type or parameters): it runs."""
        job_id = str(payload["id"])
        local_id = job_id if copies == 2 else f"{job_id}.{copies - 1}"
        if not JOB_ID.fullmatch(local_id):
            local_id = f"{job_id[:100]}.{copies - 1}"
        job = self.store.get_job(local_id)
        if (
            job is None
            or job.state is not JobState.DONE
            or job.type != str(payload["type"])
            or dict(job.params) != dict(payload.get("params") or {})
        ):
            return False
        moves = [e for e in self.store.events(job_id=local_id) if e.kind == "transition"]
        began = next((e for e in reversed(moves) if e.to_state == JobState.RUNNING.value), None)
        ended = next((e for e in reversed(moves) if e.to_state == JobState.DONE.value), None)
        if began is None or ended is None:
            return False
        h = Held(job_id=job_id, local_id=local_id, lease_id=str(payload["lease_id"]))
        h.until = until if until is not None else self.wall() + self.lease_s
        self.held[job_id] = h
        self._by_local[local_id] = job_id
        self._keep_held()
        self.store.add_event(
            Event(
                ts=self.broker.clock(),
                kind="end_reported_again",
                job_id=local_id,
                detail={"lease_id": h.lease_id, "why": "leased again after it ended done here"},
            )
        )
        log.warning(
            "job %s was leased again after it ended done here: its end is reported "
            "under the new lease; it does not run again",
            job_id,
        )
        self._on_transition(h, began)
        self._on_transition(h, ended)
        return True

    # -- reports ----------------------------------------------------------------

    def _collect(self) -> None:
        """Turn new local events of held jobs into reports, in order (a lost job's
        too: its end goes, fenced by its lease). The outbox keeps the reports, then
        the cursor."""
        made = len(self._outbox)
        start = self._cursor
        while True:
            events = self.store.events(after_id=self._cursor, limit=1000)
            if not events:
                break
            for ev in events:
                self._cursor = ev.id or self._cursor
                if ev.kind != "transition" or ev.job_id not in self._by_local:
                    continue
                h = self.held.get(self._by_local[ev.job_id])
                if h is None:
                    continue
                self._on_transition(h, ev)
        if self.box is not None and self._cursor != start and len(self._outbox) != made:
            try:
                self.box.save_cursor(self._cursor)
            except OSError as exc:  # the reports are kept: made again at worst
                self._warn(f"the outbox cursor could not be written: {exc}")

    def _queue(self, r: _Report) -> None:
        """Queue a report to send, kept in the outbox first."""
        self._keep(r)
        self._outbox.append(r)

    def _keep(self, r: _Report) -> None:
        """Write ``r`` to the outbox (again, when it is there already)."""
        if self.box is None:
            return
        saved = Saved(
            seq=r.seq or 0,
            kind=r.kind,
            job_id=r.held.job_id,
            local_id=r.held.local_id,
            lease_id=r.held.lease_id,
            body=r.body,
            attempt=r.attempt,
            uploaded=sorted(r.uploaded),
            not_uploaded=r.not_uploaded,
        )
        try:
            if r.seq is None:
                r.seq = self.box.put(saved)
            else:
                self.box.update(saved)
            r.kept_uploads = len(r.uploaded)
        except (OSError, TypeError, ValueError) as exc:
            log.error("job %s: its %s report could not be kept: %s", r.held.job_id, r.kind, exc)

    def _answered_for_good(self, r: _Report) -> None:
        """The coordinator answered ``r`` (took it or refused it for good): it goes."""
        if self.box is not None and r.seq is not None:
            self.box.done(r.seq)

    def _on_transition(self, h: Held, ev: Event) -> None:
        to, frm = ev.to_state, ev.from_state
        if to == JobState.RUNNING.value:
            # (a lost job is cancelled here before it can start: a start of one is
            # from before, read again after a restart, and its end needs it)
            self._queue(_Report("start", h, {"gpu": ev.detail.get("gpu")}))
            return
        if frm == JobState.RUNNING.value:
            number = ev.detail.get("attempt")
            attempt = number if isinstance(number, int) else None
            self._queue(_Report("finish", h, self._finish_body(h, ev), attempt=attempt))
            if to != JobState.QUEUED.value or h.lost:
                h.ended = True
            self._claim_now = True
            return
        if frm == JobState.QUEUED.value and to == JobState.FAILED.value:
            # refused here before it ran (its type is gone, the launch rules say no)
            self._queue(_Report("start", h, {"gpu": None}))
            body = {
                "state": to,
                "outcome": "launch_error",
                "reason": str(ev.detail.get("reason", "")),
                "result": {"message": str(ev.detail.get("reason", ""))},
            }
            self._queue(_Report("finish", h, body))
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
        if job is not None and job.source is not None and "image_reused" in ev.detail:
            # a job from a commit: the image it ran in (its end event says so there too)
            body["image"] = {
                "id": ev.detail.get("image_id") or None,
                "reused": ev.detail.get("image_reused"),
            }
        held = self.broker.fair.take_end(h.local_id, number) if isinstance(number, int) else None
        if held and self._held_ok:  # what it held here: the coordinator charges its owner
            body["held_bytes"] = held
        if outcome in _SHUTDOWN_OUTCOMES:
            # this agent stopped: not the job's failure; it runs again elsewhere
            body.update(
                state=JobState.QUEUED.value,
                outcome="interrupted",
                reason=f"its node {self.node} shut down while it ran",
                release=True,
            )
        elif h.lost and state in (JobState.CANCELLED.value, JobState.QUEUED.value):
            # stopped here because its lease was lost (or may be): not the job's end,
            # nor a retry here; given back, saying why
            body.update(
                state=JobState.QUEUED.value,
                outcome="interrupted",
                reason=h.lost_reason or reason,
                release=True,
            )
        return body

    def _send(self) -> None:
        """Send the reports in order: several in one request (``POST
        /v1/node/reports``) where the coordinator has it, else one request each.
        One the coordinator could not be reached for, or failed (5xx: its store may
        be unreachable), stays first in line and goes again after a backoff
        (:data:`RETRY_FIRST_S` doubling to :data:`RETRY_MAX_S`); it stays in the
        outbox until answered."""
        if self._outbox and self.monotonic() < self._send_after:
            return
        while self._outbox:
            batch = [self._outbox.popleft()]
            while self._batched and self._outbox and len(batch) < REPORT_BATCH:
                if _after_its_start(self._outbox[0], batch):
                    break  # its outputs go up once its start is taken: the next batch
                batch.append(self._outbox.popleft())
            try:
                answers = self._deliver(batch)
            except CoordinatorError as exc:
                self._outbox.extendleft(reversed(batch))
                for r in batch:
                    if len(r.uploaded) != r.kept_uploads:
                        self._keep(r)  # what went up already is not sent again
                self._send_after = self.monotonic() + self._send_wait
                self._warn(
                    f"{len(batch)} report(s) not delivered, kept and sent again in "
                    f"{self._send_wait:g} s: {exc.message}"
                )
                self._send_wait = min(RETRY_MAX_S, self._send_wait * 2)
                return
            self._send_wait = RETRY_FIRST_S
            for r, got in zip(batch, answers, strict=True):
                if got is not None:
                    self._answered(r, got)

    def _deliver(self, batch: list[_Report]) -> list[dict[str, Any] | Refused | None]:
        """Send the reports of ``batch`` (each finish's outputs first): one answer
        each, or the :class:`Refused` of that report. Raises
        :class:`CoordinatorError` when the coordinator did not answer (the batch is
        sent again: a start is answered alike the second time, and a finish the
        coordinator took already is refused as such)."""
        answers: list[dict[str, Any] | Refused | None] = [None] * len(batch)
        bodies: list[tuple[int, dict[str, Any]]] = []
        for i, r in enumerate(batch):
            if r.kind == "start":
                bodies.append((i, {"lease_id": r.held.lease_id, "gpu": r.body.get("gpu")}))
                continue
            try:
                upload_outputs(
                    self.coordinator,
                    Outputs(r.held.job_id, r.held.lease_id, r.uploaded, r.not_uploaded),
                    r.body,
                )
            except Refused as exc:
                answers[i] = exc
                continue
            bodies.append((i, {**r.body, "lease_id": r.held.lease_id}))
        if not bodies:
            return answers
        if len(batch) == 1 or not self._batched:
            [(i, body)] = bodies
            answers[i] = self._one(batch[i], body)
            return answers
        sent = [{"kind": batch[i].kind, "job": batch[i].held.job_id, **b} for i, b in bodies]
        try:
            results = self.coordinator.reports(sent)
        except Refused as exc:
            if exc.status in (404, 405):
                self._batched = False  # a coordinator without the route: one request each
            # (or the batch as a whole was refused, e.g. too large: one request each)
            for i, body in bodies:
                answers[i] = self._one(batch[i], body)
            return answers
        for (i, _), res in zip(bodies, results, strict=True):
            status = int(res.get("status", 500))
            if status == 200:
                answers[i] = res
            elif status >= 500:
                raise CoordinatorError(str(res.get("error", "a report failed")))
            else:
                answers[i] = Refused(str(res.get("error", "refused")), status)
        return answers

    def _one(self, r: _Report, body: dict[str, Any]) -> dict[str, Any] | Refused:
        try:
            if r.kind == "start":
                return self.coordinator.start(r.held.job_id, r.held.lease_id, body.get("gpu"))
            return self.coordinator.finish(r.held.job_id, body)
        except Refused as exc:
            return exc

    def _answered(self, r: _Report, got: dict[str, Any] | Refused) -> None:
        """What the coordinator said of one report. A refusal (4xx) is final: the
        coordinator says the report can never be taken (its attempt was superseded,
        the job ended); it is dropped, and an event says so."""
        if isinstance(got, Refused) and _unknown_held(r, got):
            # a coordinator that does not know the field (an older one): again without
            self._held_ok = False
            r.body.pop("held_bytes")
            self._keep(r)
            self._outbox.appendleft(r)
            return
        self._answered_for_good(r)
        if isinstance(got, Refused):
            self._dropped(r, got)
            if r.held.lost:
                return
            if r.kind == "start":
                self._lose(r.held, f"its start was refused: {got.message}")
                return
            r.held.ended = True
            local = self.store.get_job(r.held.local_id)
            if local is not None and not local.state.terminal:
                # a retry here the coordinator does not know of: it must not run
                self._lose(r.held, f"its report was refused: {got.message}")
            return
        if r.held.lost:
            return  # stopped here already: nothing more to do
        if r.kind == "start":
            r.held.started = True
            return
        r.held.asked_for = None  # its end is known: the coordinator's mark is cleared
        if not got.get("lease_kept", False) and not r.held.ended:
            # the coordinator ended it (quarantined past its retries, cancelled)
            r.held.ended = True
            self._lose(r.held, f"the coordinator ended it ({got.get('state')})")

    def _dropped(self, r: _Report, got: Refused) -> None:
        """Say that the coordinator refused ``r`` for good, and that it was dropped."""
        log.warning(
            "job %s: %s report refused for good (%s), dropped: %s",
            r.held.job_id, r.kind, got.status, got.message,
        )  # fmt: skip
        detail = {"report": r.kind, "status": got.status, "reason": got.message}
        if r.attempt is not None:
            detail["attempt"] = r.attempt
        with contextlib.suppress(Exception):  # the event is a courtesy; the log has it
            self.store.add_event(
                Event(
                    ts=self.broker.clock(),
                    kind="report_dropped",
                    job_id=r.held.local_id,
                    detail=detail,
                )
            )

    def _ship_logs(self) -> None:
        """Send the new bytes of each running attempt's streams, and the last bytes
        of an attempt whose finish is about to go. A job with a start report not yet
        answered waits: its attempt there may not be the one running here."""
        self.logs.begin()
        first: dict[int, _Report] = {}
        for pending in self._outbox:
            first.setdefault(id(pending.held), pending)
        for h in self.held.values():
            r = first.get(id(h))
            if h.lost or not h.started or (r is not None and r.kind != "finish"):
                continue
            if r is not None:
                if r.attempt is not None:
                    self.logs.ship(h.job_id, h.lease_id, h.local_id, r.attempt, final=True)
                continue
            attempts = self.store.attempts(h.local_id) if not h.ended else []
            if attempts and attempts[-1].ended_at is None:
                self.logs.ship(h.job_id, h.lease_id, h.local_id, attempts[-1].number)
        self.logs.forget({h.local_id for h in self.held.values()})

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
        if self.box is not None:
            self.box.clear()

    def final_reports(self) -> None:
        """After the broker stopped: report what ended (one try each)."""
        self.stopping = True
        self._send_after = -1e9
        with contextlib.suppress(CredentialRefused):
            self._collect()
            self._send()
