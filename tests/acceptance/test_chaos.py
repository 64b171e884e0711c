"""Acceptance: a broker SIGKILLed at every named fault point (``gpuwarden.faults``)
and at random moments, restarted each time, loses no accepted job and records no
result twice (issue 5).

Real ``gpuwarden serve`` processes on the simulated GPU, real job processes. The
tests keep their own record of every job they dropped into the queue root (the
ledger) and check it, once the last broker has stopped, against the queue root
and the store:

- every accepted job has exactly one result, in the result bundle named like its
  own bundle, in ``outbox/`` or ``failed/`` (refusals of a second copy,
  ``<name>.duplicate-*``, are not results: their jobs are ``refused``);
- every job is terminal in the store, with the state its result shows, and one
  terminal transition in the store's events; one that did not end ``done`` says
  why;
- nothing is left in ``inbox/`` or ``processing/``, and no job process is left.

Each test first proves that its fault happened (the broker died of SIGKILL, and
what the store and the queue root show at that moment is what that fault point
leaves) before it looks at the outcome.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from gpuwarden import faults
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle
from tests.acceptance.test_cli import GW, env, wait_for, write_config

TERMINAL = frozenset(s.value for s in JobState if s.terminal)


# -- the broker, the queue root and the record of what was handed over --------


class Serve:
    """``gpuwarden serve`` in a subprocess that may die at a fault point."""

    def __init__(self, config: Path, log: Path, *, fault: str | None = None) -> None:
        e = env()
        if fault is not None:
            e[faults.ENV] = fault
        self.log = log
        self.stderr = log.with_suffix(".stderr")
        self.started = time.time()
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen(
                [*GW, "--config", str(config), "serve", "--log", str(log)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=e,
                start_new_session=True,
            )

    def events(self, kind: str | None = None) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        rows = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line still being written
                rows.append(json.loads(line))
        return [r for r in rows if kind is None or r["event"] == kind]

    def wait_started(self) -> None:
        wait_for(
            lambda: bool(self.events("broker_started")) or self.proc.poll() is not None, "serve"
        )
        assert self.proc.poll() is None, self.stderr.read_text()

    def wait_dead(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int:
        assert self.proc.poll() is None, "the broker died before it was killed"
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@dataclass
class Rig:
    """One node: a config, its state directory and queue root, and the ledger."""

    tmp: Path
    config: Path = field(init=False)
    bundles: dict[str, list[str]] = field(default_factory=dict)  # bundle name -> job ids
    brokers: list[Serve] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = write_config(self.tmp)
        self.root = self.tmp / "queues" / "demo"
        self.state = self.tmp / "state"
        for sub in ("inbox", "processing", "outbox", "failed"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def serve(self, fault: str | None = None) -> Serve:
        b = Serve(self.config, self.tmp / f"events-{len(self.brokers)}.jsonl", fault=fault)
        self.brokers.append(b)
        return b

    def drop(self, jobs: list[JobSpec]) -> str:
        """Hand a bundle over the way a client does; remember its jobs."""
        path = write_bundle(self.root / "inbox", jobs, now=time.time())
        self.bundles[path.name] = [j.id for j in jobs]
        return path.name

    def zips(self, sub: str) -> list[str]:
        return sorted(p.name for p in (self.root / sub).glob("*.zip"))

    def results(self) -> list[str]:
        """Result bundles (refused inputs and duplicate refusals left out)."""
        return [
            f"{sub}/{n}"
            for sub in ("outbox", "failed")
            for n in self.zips(sub)
            if ".duplicate-" not in n
        ]

    def settled(self) -> bool:
        names = {r.split("/", 1)[1] for r in self.results()}
        return set(self.bundles) <= names and not self.zips("processing") and not self.zips("inbox")

    def db(self) -> sqlite3.Connection:
        """The store, read directly (only while no broker runs)."""
        db = sqlite3.connect(self.state / "gpuwarden.db", timeout=10)
        db.row_factory = sqlite3.Row
        return db

    def cleanup(self) -> None:
        for b in self.brokers:
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait(30)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.cleanup()


def echo(jid: str, *, fail: bool = False, sleep_s: float = 0.0) -> JobSpec:
    params: dict[str, object] = {"text": jid, "sleep_s": sleep_s}
    if fail:
        params["exit_code"] = 3
    return JobSpec(id=jid, type="echo.echo", params=params)


def sleeper(jid: str, seconds: float) -> JobSpec:
    return JobSpec(id=jid, type="testmods.sleep", params={"seconds": seconds})


def gpu(jid: str, gib: float, seconds: float) -> JobSpec:
    return JobSpec(id=jid, type="testmods.gpu", params={"gib": gib, "seconds": seconds})


# -- the check against the ledger ------------------------------------------------


@dataclass
class Audit:
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    refusals: list[tuple[str, str, str]] = field(default_factory=list)  # file, id, status

    def assert_clean(self) -> None:
        assert not self.lost, f"accepted jobs lost: {self.lost}\n{self.problems}"
        assert not self.duplicated, f"jobs with two results: {self.duplicated}\n{self.problems}"
        assert not self.problems, "\n".join(self.problems)


def job_processes(state: Path) -> list[int]:
    """Live processes of any attempt of this state directory (by their environment)."""
    prefix = str(state)
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("GPUWARDEN_OUTPUT_DIR", "").startswith(prefix):
                found.append(p.pid)
    return found


def audit(rig: Rig) -> Audit:
    """Check every job of the ledger against the queue root and the store."""
    a = Audit()
    got: dict[str, list[tuple[str, dict[str, object]]]] = {}
    for rel in rig.results():
        for jid, body in read_result_bundle(rig.root / rel).items():
            got.setdefault(jid, []).append((rel, body))
    for sub in ("outbox", "failed"):
        for n in sorted(p.name for p in (rig.root / sub).glob("*.duplicate-*")):
            if not n.endswith("-input"):  # the refused copy itself, kept beside
                for jid, body in read_result_bundle(rig.root / sub / n).items():
                    a.refusals.append((n, jid, str(body["status"])))
    for n, jid, status in a.refusals:
        # a refused copy: per job "refused"; a name clash before extraction has
        # no jobs, only bundle/result.json
        if not (status == "refused" or (jid == "bundle" and status == "failed")):
            a.problems.append(f"refusal {n}: {jid} has status {status}")
    with contextlib.closing(rig.db()) as db:
        jobs = {r["id"]: r for r in db.execute("SELECT id, state, reason, bundle FROM jobs")}
        terminal_moves = Counter(
            r["job_id"]
            for r in db.execute("SELECT job_id, to_state FROM events WHERE kind = 'transition'")
            if r["to_state"] in TERMINAL
        )
        rejected = {
            r["name"] for r in db.execute("SELECT name FROM bundles WHERE outcome = 'rejected'")
        }
    ledger = {jid: name for name, ids in rig.bundles.items() for jid in ids}
    for name in rig.bundles:
        if name in rejected:
            a.problems.append(f"bundle {name} was refused; every bundle here is valid")
    for jid, name in sorted(ledger.items()):
        results = got.get(jid, [])
        row = jobs.get(jid)
        state = row["state"] if row is not None else "(not in the store)"
        a.states[state] += 1
        if len(results) > 1 or terminal_moves[jid] > 1:
            a.duplicated.append(jid)
            a.problems.append(
                f"{jid} (bundle {name}): results {[r for r, _ in results]}, "
                f"{terminal_moves[jid]} terminal transitions"
            )
        if not results or row is None or state not in TERMINAL:
            a.lost.append(jid)
            a.problems.append(
                f"{jid} (bundle {name}): state {state}, results {[r for r, _ in results]}"
            )
            continue
        rel, body = results[0]
        if rel.split("/", 1)[1] != name:
            a.problems.append(f"{jid}: result in {rel}, its bundle is {name}")
        if body["status"] != state:
            a.problems.append(f"{jid}: result says {body['status']}, the store {state}")
        if terminal_moves[jid] != 1:
            a.problems.append(f"{jid}: {terminal_moves[jid]} terminal transitions")
        if state != "done" and not str(body.get("reason") or "").strip():
            a.problems.append(f"{jid}: {state} without a reason")
    for jid in sorted(set(got) - set(ledger)):
        a.problems.append(f"a result for {jid}, which no bundle held")
    for jid in sorted(set(jobs) - set(ledger)):
        a.problems.append(f"job {jid} in the store, which no bundle held")
    if rig.zips("processing") or rig.zips("inbox"):
        a.problems.append(f"left: processing {rig.zips('processing')}, inbox {rig.zips('inbox')}")
    if left := job_processes(rig.state):
        a.problems.append(f"job processes left running: {left}")
    return a


def finish(rig: Rig, timeout: float = 45) -> Audit:
    """Run a broker without faults until every bundle has its result, stop it, audit."""
    b = rig.serve()
    b.wait_started()
    wait_for(rig.settled, "every bundle's result", timeout=timeout)
    assert b.stop() == 0, b.stderr.read_text()
    return audit(rig)


# -- what each fault point leaves behind (the proof that it fired there) --------


def witness(rig: Rig, point: str, n: int) -> None:
    """Assert that the store and the queue root show the broker died right at
    the ``n``-th pass of ``point``."""
    processing = set(rig.zips("processing"))
    with contextlib.closing(rig.db()) as db:
        rows = db.execute(
            "SELECT name, finished_at, job_ids FROM bundles ORDER BY rowid"
        ).fetchall()
        attempts = db.execute(
            "SELECT a.job_id, a.number, a.ended_at, j.state FROM attempts a "
            "JOIN jobs j ON j.id = a.job_id ORDER BY a.rowid"
        ).fetchall()
        states = {r["id"]: (r["state"], r["attempts"]) for r in db.execute("SELECT * FROM jobs")}
    names = {r["name"] for r in rows}
    finished = [r["name"] for r in rows if r["finished_at"] is not None]
    seen = f"bundles {[tuple(r) for r in rows]}, processing {sorted(processing)}"
    if point == "after_claim":  # n bundles claimed, the n-th not recorded
        # extraction runs on threads (two at a time): a claim may come before the
        # bundle claimed just before it is recorded, so 1 or 2 are claimed only
        claimed_only = processing - names
        assert len(rows) + len(claimed_only) == n and 1 <= len(claimed_only) <= 2, seen
    elif point == "after_bundle_commit":  # the n-th bundle's jobs stored, never started
        assert len(rows) == n, seen
        last = rows[-1]
        assert last["name"] in processing and last["finished_at"] is None, seen
        assert all(states[j] == ("queued", 0) for j in json.loads(last["job_ids"])), states
    elif point in ("after_start_attempt", "after_launch"):
        # the starts of one plan share a commit (group commit), made before the
        # first of their launches: the n-th start is committed, maybe with later ones
        assert len(attempts) >= n, [tuple(a) for a in attempts]
        nth = attempts[n - 1]  # launched in the order started
        assert nth["ended_at"] is None and nth["state"] == "running", tuple(nth)
        attempt_dir = rig.state / "jobs" / nth["job_id"] / f"attempt-{nth['number']}"
        # the directory is laid out after the start is committed, before the launch
        assert (attempt_dir / "params.json").exists() == (point == "after_launch"), attempt_dir
    elif point == "after_finish_attempt":  # the n-th end committed (with those drained with it)
        assert sum(a["ended_at"] is not None for a in attempts) >= n, [tuple(a) for a in attempts]
    elif point == "after_result_write":  # n results written, the n-th not recorded
        results = {r.split("/", 1)[1] for r in rig.results()}
        assert len(results) == n and len(finished) == n - 1, (results, seen)
        (unrecorded,) = results - set(finished)
        assert unrecorded in processing, seen
    elif point == "after_bundle_finish":  # n recorded, the n-th input still there
        assert len(finished) == n and len(processing & set(finished)) == 1, seen
    else:  # a new point: this test must learn what it leaves
        raise AssertionError(f"no witness for fault point {point}")


# -- the tests --------------------------------------------------------------------


def six_bundles(tag: str) -> list[list[JobSpec]]:
    """12 jobs: echo jobs (one fails by request), sleepers, simulated-GPU jobs."""
    return [
        [echo(f"{tag}-a1"), echo(f"{tag}-a2")],
        [sleeper(f"{tag}-b1", 0.3), echo(f"{tag}-b2")],
        [gpu(f"{tag}-c1", 8, 0.2), echo(f"{tag}-c2", fail=True)],
        [echo(f"{tag}-d1"), sleeper(f"{tag}-d2", 0.2)],
        [gpu(f"{tag}-e1", 4, 0.2), echo(f"{tag}-e2")],
        [echo(f"{tag}-f1"), echo(f"{tag}-f2")],
    ]


FIRES_AT = 3  # the third pass: the broker is mid-run, with work before and after

#: what the next broker's recovery logs after a death at each point
RECOVERY = {
    "after_claim": "bundle_recovered",  # never recorded: read again
    "after_bundle_commit": "bundle_recovered",  # its jobs are in the store
    "after_start_attempt": "attempt_recovered",
    "after_launch": "attempt_recovered",
    "after_finish_attempt": "bundle_recovered",  # its result not written yet
    "after_result_write": "bundle_recovered",
    "after_bundle_finish": "bundle_recovered",  # result already written: removed
}


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_kill_at_each_fault_point_loses_and_repeats_nothing(rig: Rig, point: str) -> None:
    b = rig.serve(fault=f"{point}@{FIRES_AT}")
    b.wait_started()
    for jobs in six_bundles(point.replace("_", "-")):
        rig.drop(jobs)
    code = b.wait_dead(30)
    # the fault happened: the broker died of SIGKILL, at that point
    assert code == -signal.SIGKILL, f"{point}@{FIRES_AT} never fired (exit {code})"
    witness(rig, point, FIRES_AT)

    findings = finish(rig)
    restarted = rig.brokers[-1]
    assert restarted.events(RECOVERY[point]), f"the restart logged no {RECOVERY[point]}"
    findings.assert_clean()
    assert sum(findings.states.values()) == 12
    assert findings.states["failed"] >= 1  # the job that fails by request, with its reason


def campaign_round(rng: random.Random, r: int, per_round: int) -> list[list[JobSpec]]:
    """One round's bundles (1-4 jobs each): mostly echo jobs, a few failing by
    request, sleepers and simulated-GPU jobs."""
    bundles: list[list[JobSpec]] = []
    n = 0
    while n < per_round:
        bundle = []
        for _ in range(min(rng.randint(1, 4), per_round - n)):
            jid, n = f"r{r}-j{n}", n + 1
            x = rng.random()
            if x < 0.08:
                bundle.append(sleeper(jid, round(rng.uniform(0.1, 0.6), 2)))
            elif x < 0.16:
                bundle.append(gpu(jid, rng.choice((2, 4, 8)), 0.2))
            else:
                bundle.append(echo(jid, fail=rng.random() < 0.04))
        bundles.append(bundle)
    return bundles


@pytest.mark.slow
def test_random_kills_across_a_run_of_240_jobs(rig: Rig) -> None:
    rng = random.Random(5)
    rounds, per_round = 6, 40
    for r in range(rounds):
        bundles = campaign_round(rng, r, per_round)
        early = rng.random() < 0.25  # during start-up and recovery
        delay = rng.uniform(0.2, 1.0) if early else rng.uniform(0.2, 2.5)
        gaps = [rng.uniform(0, 0.05) for _ in bundles]
        # half the round's bundles wait in inbox/ before the broker starts, the rest
        # come while it runs, or, once it is dead, while it is down
        half = len(bundles) // 2
        for bundle in bundles[:half]:
            rig.drop(bundle)
        b = rig.serve()
        if early:
            kill_at = b.started + delay
        else:
            b.wait_started()
            kill_at = time.time() + delay
        rest = bundles[half:]
        while rest and time.time() < kill_at:
            rig.drop(rest.pop(0))
            time.sleep(gaps.pop())
        time.sleep(max(0.0, kill_at - time.time()))
        # the fault happened: the broker was alive until this SIGKILL
        assert b.kill() == -signal.SIGKILL
        for bundle in rest:
            rig.drop(bundle)

    findings = finish(rig, timeout=60)
    with contextlib.closing(rig.db()) as db:
        recovered = db.execute(
            "SELECT count(*) FROM events WHERE kind IN ('attempt_recovered', 'bundle_recovered')"
        ).fetchone()[0]
    findings.assert_clean()
    assert sum(findings.states.values()) == rounds * per_round
    assert recovered >= 1, "no kill ever interrupted an attempt or a bundle"


def test_the_same_bundle_dropped_twice_makes_one_job(rig: Rig) -> None:
    b = rig.serve()
    b.wait_started()
    # the client keeps its bundle, and hands the very same file over more than once
    kept = write_bundle(rig.tmp, [gpu("twice-1", 2, 2.0)], now=time.time())  # runs 2 s
    name, data = kept.name, kept.read_bytes()
    rig.bundles[name] = ["twice-1"]

    def again(as_name: str) -> None:
        tmp = rig.root / "inbox" / f".{as_name}.tmp"
        tmp.write_bytes(data)
        tmp.rename(rig.root / "inbox" / as_name)

    again(name)
    wait_for(lambda: name in rig.zips("processing"), "the first copy claimed")
    again(name)  # while the first copy is being processed
    wait_for(lambda: name in rig.zips("outbox"), "the first copy's result")
    time.sleep(1.05)  # a refusal's name carries the second: keep them apart
    again(name)  # after the first copy's result is out
    again("twice-copy.zip")  # the same content under a new name
    wait_for(
        lambda: len(list((rig.root / "failed").iterdir())) == 6, "three refusals and their inputs"
    )
    assert b.stop() == 0

    findings = audit(rig)
    findings.assert_clean()
    assert findings.states == {"done": 1}
    # three refusals (each checked by audit: its jobs "refused", or, for a name
    # clash found before extraction, a bundle/result.json)
    assert len(findings.refusals) == 3, findings.refusals
    assert {jid for _, jid, _ in findings.refusals} <= {"twice-1", "bundle"}
    with contextlib.closing(rig.db()) as db:
        assert db.execute("SELECT count(*) FROM attempts").fetchone()[0] == 1


def test_killed_after_recording_before_the_bundle_moves_makes_one_job(rig: Rig) -> None:
    b = rig.serve(fault="after_bundle_commit")
    b.wait_started()
    name = rig.drop([echo("rec-1"), sleeper("rec-2", 0.2)])
    code = b.wait_dead(30)
    assert code == -signal.SIGKILL, f"after_bundle_commit never fired (exit {code})"
    witness(rig, "after_bundle_commit", 1)
    assert rig.zips("processing") == [name] and not rig.results()

    # the client saw no result and drops its bundle again while the broker is down,
    # under its name and under a new one
    data = (rig.root / "processing" / name).read_bytes()
    for as_name in (name, "rec-copy.zip"):
        (rig.root / "inbox" / f".{as_name}.tmp").write_bytes(data)
        (rig.root / "inbox" / f".{as_name}.tmp").rename(rig.root / "inbox" / as_name)

    findings = finish(rig)
    assert rig.brokers[-1].events("bundle_recovered")
    findings.assert_clean()
    assert findings.states == {"done": 2}
    assert len({f for f, _, _ in findings.refusals}) == 2, findings.refusals
    with contextlib.closing(rig.db()) as db:
        assert db.execute("SELECT count(*) FROM attempts").fetchone()[0] == 2
        assert db.execute("SELECT count(*) FROM bundles").fetchone()[0] == 1
