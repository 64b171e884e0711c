"""The agent's durable outbox and its lease files, in one process (the rig of
``test_agent``: a real broker on a simulated GPU, the coordinator's app on SQLite
through an in-process transport that a test can cut or make fail).

A finished attempt's end is kept until the coordinator answers: through an
outage longer than the agent's watchdog, a lease that lapsed meanwhile, 503s,
and a restart of the agent; a refusal for good is dropped with an event. Each
running attempt's supervisor is told its lease's end, and again at each renewal.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster.held import Held
from gpuwarden.cluster.outbox import OUTBOX_DIR, Outbox
from gpuwarden.cluster.sync import Agent
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.launch.supervisor import read_lease
from gpuwarden.registry import Registry
from tests.integration.test_agent import MODULES, Rig, gpu_job, make_rig

pytestmark = pytest.mark.timeout(180)
DONE = JobState.DONE


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


class Failing(httpx.BaseTransport):
    """The coordinator, answering 503 (its store unreachable) on ``paths``."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.paths: set[str] = set()
        self.failed = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if any(request.url.path.endswith(p) for p in self.paths):
            self.failed += 1
            return httpx.Response(
                503,
                json={"error": "the store is unreachable (PostgreSQL): retry in 2 s"},
                headers={"Retry-After": "2"},
            )
        return self.inner.handle_request(request)


def kept(rig: Rig) -> list[str]:
    """The kinds of the reports the agent's outbox keeps, in order."""
    assert rig.agent.box is not None
    return [s.kind for s in rig.agent.box.load()]


def local_state(rig: Rig, job_id: str) -> JobState | None:
    job = rig.node.store.get_job(job_id)
    return None if job is None else job.state


def test_an_end_reached_while_the_coordinator_is_down_is_kept_and_taken_late(rig: Rig) -> None:
    rig.store.submit([gpu_job("o1", 0.3)], now=time.time())
    rig.until("o1 running there", lambda: rig.job("o1").state is JobState.RUNNING)
    rig.switch.down = True
    rig.until("o1 done here", lambda: local_state(rig, "o1") is JobState.DONE)
    rig.step()
    assert kept(rig) == ["finish"]  # on disk before it could be sent
    # silent past the watchdog: a finished job is not stopped nor its end dropped
    rig.mono.offset += rig.agent.stop_after_s + 5
    for _ in range(5):
        rig.step()
    assert kept(rig) == ["finish"]
    assert not [e for e in rig.node.store.events(job_id="o1") if e.kind == "lease_lost"]
    # meanwhile the lease lapsed on the coordinator (nothing replaced it, no sweep)
    now = time.time()
    assert rig.store.renew_leases("a", now - 1, now=now, job_ids=["o1"]) == 1
    assert not rig.store.lease_of("o1").live(time.time())  # type: ignore[union-attr]
    rig.switch.down = False
    rig.until("o1 done there", lambda: rig.job("o1").state is JobState.DONE)
    [attempt] = rig.store.attempts("o1")  # its one attempt: nothing runs again
    assert attempt.outcome == "succeeded" and attempt.node == "a"
    rig.until("the outbox emptied", lambda: kept(rig) == [])


def test_a_503_keeps_the_report_and_it_goes_again_after_a_backoff(rig: Rig) -> None:
    failing = Failing(rig.switch.inner)
    rig.switch.inner = failing
    failing.paths = {"/finish", "/v1/node/reports"}
    rig.store.submit([gpu_job("o2", 0.2)], now=time.time())
    rig.until("o2 done here", lambda: local_state(rig, "o2") is JobState.DONE)
    rig.until("a 503 answered", lambda: failing.failed >= 2)
    assert rig.job("o2").state is JobState.RUNNING
    assert "finish" in kept(rig)
    failing.paths = set()
    rig.until("o2 done there", lambda: rig.job("o2").state is JobState.DONE)
    assert len(rig.store.attempts("o2")) == 1
    rig.until("the outbox emptied", lambda: kept(rig) == [])


def restart(rig: Rig) -> None:
    """What a restarted agent does with its state directory: a new sync step over
    the same broker, outbox and held jobs (the held-lease file's rows)."""
    held = [Held(h.job_id, h.local_id, h.lease_id) for h in rig.agent.held.values()]
    again = Agent(
        rig.node.broker,
        rig.agent.coordinator,  # the same client: the process that starts has the credential
        node="a",
        lease_s=rig.agent.lease_s,
        max_jobs=4,
        labels={},
        claim_every_s=0.05,
        outbox=Outbox(rig.node.broker.settings.state_dir / OUTBOX_DIR),
    )
    again.resume([], held)
    rig.agent = again


def test_a_restarted_agent_sends_the_reports_it_kept(rig: Rig) -> None:
    rig.store.submit([gpu_job("o3", 0.3)], now=time.time())
    rig.until("o3 running there", lambda: rig.job("o3").state is JobState.RUNNING)
    rig.switch.down = True
    rig.until("o3 done here", lambda: local_state(rig, "o3") is JobState.DONE)
    rig.step()
    assert kept(rig) == ["finish"]  # then the agent "dies" with it unsent
    rig.switch.down = False
    restart(rig)
    rig.until("o3 done there", lambda: rig.job("o3").state is JobState.DONE)
    [attempt] = rig.store.attempts("o3")
    assert attempt.outcome == "succeeded"
    rig.until("the outbox emptied", lambda: kept(rig) == [])


def test_a_restarted_agent_reports_an_end_it_had_not_read(rig: Rig) -> None:
    rig.store.submit([gpu_job("o4", 1.0)], now=time.time())
    rig.until("o4 running there", lambda: rig.job("o4").state is JobState.RUNNING)
    deadline = time.monotonic() + 60
    while local_state(rig, "o4") is not JobState.DONE:  # the broker runs, no agent
        assert time.monotonic() < deadline, "o4 did not end"
        rig.node.broker.tick()
        time.sleep(0.02)
    assert kept(rig) == []  # the agent "died" before it read the end
    assert rig.job("o4").state is JobState.RUNNING
    restart(rig)
    rig.until("o4 done there", lambda: rig.job("o4").state is JobState.DONE)
    [attempt] = rig.store.attempts("o4")
    assert attempt.outcome == "succeeded"
    rig.until("the outbox emptied", lambda: kept(rig) == [])


def test_a_restarted_agent_reports_a_start_and_end_it_never_read(rig: Rig) -> None:
    rig.store.submit([gpu_job("o7", 0.3)], now=time.time())
    rig.until("o7 leased here", lambda: "o7" in rig.agent.held)
    deadline = time.monotonic() + 60
    while local_state(rig, "o7") is not JobState.DONE:  # the agent "died" at once
        assert time.monotonic() < deadline, "o7 did not end"
        rig.node.broker.tick()
        time.sleep(0.02)
    assert rig.job("o7").state is JobState.QUEUED  # its start was never reported
    assert kept(rig) == []
    restart(rig)
    rig.until("o7 done there", lambda: rig.job("o7").state is JobState.DONE)
    [attempt] = rig.store.attempts("o7")
    assert attempt.outcome == "succeeded" and attempt.node == "a"


def test_a_report_refused_for_good_is_dropped_with_an_event(rig: Rig) -> None:
    rig.store.submit([gpu_job("o5", 0.3)], now=time.time())
    rig.until("o5 running there", lambda: rig.job("o5").state is JobState.RUNNING)
    rig.switch.down = True
    rig.until("o5 done here", lambda: local_state(rig, "o5") is JobState.DONE)
    rig.step()
    assert kept(rig) == ["finish"]
    # meanwhile the coordinator took the job back (a later attempt may start)
    now = time.time()
    lease = rig.store.lease_of("o5")
    assert lease is not None
    rig.store.renew_leases("a", now - 1, now=now, job_ids=["o5"])
    assert co.sweep(rig.store, time.time(), 60.0)["interrupted"] == 1
    assert rig.job("o5").state is JobState.QUEUED
    rig.switch.down = False
    rig.until(
        "the report dropped",
        lambda: [e for e in rig.node.store.events(job_id="o5") if e.kind == "report_dropped"],
    )
    [ev] = [e for e in rig.node.store.events(job_id="o5") if e.kind == "report_dropped"]
    assert ev.detail["report"] == "finish" and ev.detail["status"] == 409
    assert "superseded" in ev.detail["reason"]
    assert kept(rig) == []
    first = rig.store.attempts("o5")[0]  # the refused end changed nothing there
    assert first.outcome == "interrupted" and "stopped renewing" in first.reason


def test_a_job_leased_again_after_it_ended_here_is_reported_not_run_again(
    rig: Rig, tmp_path: Path
) -> None:
    """Its end came too late (the sweep took the job back first); the claim that
    brings it back gets the end kept here, under the new lease: the job's own
    ledger says it ran once."""
    ledger = tmp_path / "o6.ledger"
    registry = Registry.load(MODULES)
    spec = JobSpec("o6", "testmods.ledger", {"ledger": str(ledger), "seconds": 0.3})
    rig.store.submit([prepare(registry, spec)], now=time.time())
    rig.until("o6 running there", lambda: rig.job("o6").state is JobState.RUNNING)
    rig.switch.down = True
    rig.until("o6 done here", lambda: local_state(rig, "o6") is JobState.DONE)
    rig.step()
    assert kept(rig) == ["finish"]
    now = time.time()
    rig.store.renew_leases("a", now - 1, now=now, job_ids=["o6"])
    assert co.sweep(rig.store, time.time(), 60.0)["interrupted"] == 1  # taken back
    assert rig.job("o6").state is JobState.QUEUED
    rig.switch.down = False
    rig.until("o6 done there", lambda: rig.job("o6").state is JobState.DONE)
    assert ledger.read_text().count("done o6 ") == 1  # it ran once
    assert rig.node.store.get_job("o6.2") is None  # no second copy here
    [again] = [e for e in rig.node.store.events(job_id="o6") if e.kind == "end_reported_again"]
    assert again.detail["lease_id"] != ""
    first, second = rig.store.attempts("o6")
    assert first.outcome == "interrupted" and "stopped renewing" in first.reason
    assert second.outcome == "succeeded" and second.node == "a"
    rig.until("the outbox emptied", lambda: kept(rig) == [])


def test_a_leased_job_whose_id_is_another_ended_job_here_runs_as_a_copy(
    rig: Rig, tmp_path: Path
) -> None:
    """Only this job's own ``done`` end is reported again: a job of that id here
    with other parameters, or one that did not end ``done``, is not it; the
    leased job runs, as a copy (``ID.2``)."""
    ledger = tmp_path / "copies.ledger"
    registry = Registry.load(MODULES)

    def ledger_job(job_id: str, seconds: float) -> JobSpec:
        params = {"ledger": str(ledger), "seconds": seconds}
        return prepare(registry, JobSpec(job_id, "testmods.ledger", params))

    rig.node.store.submit([ledger_job("o7", 0.1), ledger_job("o8", 0.1)], now=time.time())
    rig.node.store.request_cancel("o8", now=time.time())  # o8 here: cancelled, never ran
    rig.until("o7 done here", lambda: local_state(rig, "o7") is JobState.DONE)
    assert local_state(rig, "o8") is JobState.CANCELLED
    rig.store.submit([ledger_job("o7", 0.2), ledger_job("o8", 0.1)], now=time.time())
    rig.until("o7, o8 done there", lambda: rig.job("o7").state is rig.job("o8").state is DONE)
    lines = ledger.read_text()
    assert lines.count("done o7 ") == 1 and lines.count("done o7.2 ") == 1
    assert lines.count("done o8.2 ") == 1 and "done o8 " not in lines
    assert not [e for e in rig.node.store.events() if e.kind == "end_reported_again"]


def test_each_running_attempt_is_told_its_lease_end_and_each_renewal(rig: Rig) -> None:
    rig.store.submit([gpu_job("o6", 30)], now=time.time())
    rig.until("o6 running here", lambda: "o6" in rig.node.broker.attempts.by_job)
    run = rig.node.broker.attempts.by_job["o6"]
    folder = str(run.attempt_dir)
    rig.until("its lease file", lambda: read_lease(folder) is not None)
    first = read_lease(folder)
    assert first is not None
    # from when the claim (or the last heartbeat) was sent: within one lease of now
    assert time.time() - 1 < first <= time.time() + rig.agent.lease_s
    time.sleep(0.05)
    rig.mono.offset += rig.agent.heartbeat_every_s  # the next sync heartbeats
    rig.until("a renewal", lambda: (read_lease(folder) or 0) > first)
    renewed = read_lease(folder)
    assert renewed is not None and renewed <= time.time() + rig.agent.lease_s
    rig.store.request_cancel("o6", now=time.time())
    rig.mono.offset += rig.agent.heartbeat_every_s
    rig.until("o6 stopped", lambda: rig.job("o6").state is JobState.CANCELLED)
