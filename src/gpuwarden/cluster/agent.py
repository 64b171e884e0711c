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
  naming its lease, kept in a durable outbox (:mod:`gpuwarden.cluster.outbox`)
  until the coordinator answers: one it cannot be reached for (or that fails
  there, 5xx) is sent again with a backoff, also after a restart; a report the
  coordinator refuses (4xx: its attempt was superseded) is dropped with a
  ``report_dropped`` event, and a job whose start is refused is stopped here.
* the lease watchdog: when the last heartbeat that got an answer is older than
  ``lease_s`` less a margin, every held job still running or waiting here is
  stopped (its end reported as given back, saying why); a finished one's report
  waits in the outbox.
* self-fencing: each running attempt's supervisor is told its lease's end
  (:func:`gpuwarden.launch.supervisor.write_lease`) when it starts and at every
  renewal; a supervisor whose lease passes stops its job on its own.

At start, what an earlier run of the agent left: the broker's recovery adopts
the services that still run and answer (:mod:`gpuwarden.node.adoption`); those
whose leases the held-lease file names (:mod:`gpuwarden.cluster.held`) stay held
under the same lease, which the first heartbeat renews; every other job is
cancelled (its lease is not this run's).

Before the finish of a ``done`` or ``failed`` attempt, its output files go up
(``PUT /v1/node/jobs/{id}/outputs/{path}``); the coordinator keeps them and the
result (what ``result.json`` holds) points at its copy. The agent keeps its own
copy in the state directory's ``jobs/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuwarden import __version__
from gpuwarden.app import open_node
from gpuwarden.cluster.coordinator_client import (
    Coordinator,
    Credential,
    CredentialRefused,
    capabilities,
    enroll,
)
from gpuwarden.cluster.enrolment import token_id
from gpuwarden.cluster.held import HELD_FILE, Held, load_held
from gpuwarden.cluster.outbox import OUTBOX_DIR, Outbox
from gpuwarden.cluster.sync import Agent
from gpuwarden.config import Config
from gpuwarden.core.model import Event
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.eventlog import EventLog
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.node.loop import Broker
from gpuwarden.registry import Registry

# ``gpuwarden agent`` (cluster/cli.py) takes the token and the labels from here too
__all__ = [
    "CREDENTIAL_FILE",
    "EXIT_REVOKED",
    "run_agent",
]

#: the credential file's name in the state directory (mode 600)
CREDENTIAL_FILE = "node-credential"

#: exit status of an agent whose credential the coordinator refused
EXIT_REVOKED = 3


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
    # the agent's own store is SQLite in its state directory, never a shared one; it
    # keeps no fair-share use (the coordinator's store does, from the finish reports)
    broker_cfg = config.broker.model_copy(update={"fair_share_half_life_s": 0.0})
    local = config.model_copy(update={"database": "", "queue_roots": [], "broker": broker_cfg})
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
        held_path = local.state_dir / HELD_FILE
        saved = load_held(held_path, cred.node)
        adopted = _clear_leftovers(broker, saved)
        client = Coordinator(cred.coordinator, cred.token)
        agent = Agent(
            broker,
            client,
            node=cred.node,
            lease_s=cred.lease_s,
            max_jobs=max_jobs,
            labels=labels,
            claim_every_s=local.cluster.claim_every_s,
            held_file=held_path,
            outbox=Outbox(local.state_dir / OUTBOX_DIR),
            command_roles=local.commands.roles,
        )
        kept = {h.job_id for h in adopted}
        agent.resume(adopted, [h for h in saved if h.job_id not in kept])
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


def _clear_leftovers(broker: Broker, saved: list[Held]) -> list[Held]:
    """Jobs an earlier run of this agent held: a service its broker adopted (still
    running here after :meth:`Broker.recover`, its lease in ``saved``) stays held
    under its lease, and is returned; every other one's lease is not this run's, so
    it is cancelled here (the coordinator's sweep gives it out again)."""
    now = broker.clock()
    by_local = {h.local_id: h for h in saved}
    kept: list[Held] = []
    for job in broker.store.list_jobs(
        states=frozenset({JobState.QUEUED, JobState.RUNNING}), limit=100_000
    ):
        h = by_local.get(job.id)
        if h is not None and job.state is JobState.RUNNING and job.id in broker.attempts.by_job:
            kept.append(h)
            continue
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
    return kept
