"""Chaos campaign: kill the broker again and again, restart it, stop it
gracefully under running jobs; judge from the jobs' own side effects what was
lost, completed twice, stopped or repeated.

Every job is a ``testmods.ledger`` job (or ``testmods.ledger_gpu``, the same on
the simulated GPU) that writes ``start JOB ATTEMPT PID`` when it starts and
``done JOB ATTEMPT PID`` when its work is complete (then exits ``exit_code``)
to one ledger file outside the broker's state directory: what the jobs did is
counted there, as a user would count it, not in the store.

Kill rounds. Each round drops its bundles into one queue root (half before the
broker starts, as clients do while it is down, half while it runs), starts
``python -m gpuwarden --config <tmp> serve --log <tmp>/events-N.jsonl`` and
kills it with SIGKILL, by one of (drawn from the seed):

- ``fault``: a named fault point (``GPUWARDEN_FAULT=NAME@N``, ``gpuwarden.faults``);
  if it is not reached within ``--fault-wait`` seconds the timer kills instead;
- ``early``: a timer 0.2-1.0 s after the process started (start-up, adoption,
  recovery);
- ``busy``: a timer 0.2-2.5 s after it logged ``broker_started``;
- ``idle`` (every fifth round, starting with round 1): once the ledger shows
  every job dropped so far done and none running, 0-0.3 s later: a kill while
  no job runs.

The broker then stays down 0.2-2.0 s (drawn), so that jobs it left running end
while no broker runs; the next broker must adopt the live ones
(``attempt_adopted``) and judge the ended ones from their supervisors' exit
records (``attempt_end_recovered``). Jobs (1-4 a bundle): short (0.05-0.4 s),
long (1-3 s: kills land while they run, and many end while no broker runs),
failing (``exit_code`` 1, 3 or 7 after 0.05-1 s) and simulated-GPU ones.
After the last round a broker without faults runs until every bundle has its
result.

Graceful restart. That broker is then given ``--restart-jobs`` ledger jobs held
by an ``until`` file; once all have written 'start', it gets SIGTERM (a routine
stop: ``systemctl restart``), must exit while they run on (``broker_stopped``
with ``left_running``), and a new broker is started, which must adopt every one
of them. Then the file is made, the jobs end, and the broker is stopped.

The figures, from the ledger (the headline) and from the store (a secondary
check of the same jobs, as before this bench counted side effects):

- accepted: jobs whose bundle was not refused;
- lost: accepted, and not terminal in the store, or without a result in the
  result bundle named like its bundle (``outbox/`` or ``failed/``);
- completed_twice: jobs with two or more 'done' lines (their work completed
  more than once);
- restart.running: held jobs running (ledger 'start', process alive) when the
  SIGTERM was sent;
- restart.stopped: held jobs whose process was gone before the release without
  a 'done' line, or that started twice before it;
- restart.repeated: held jobs with two or more 'start' lines in the end;
- restart.adopt_p50_ms: from starting the new broker's process to the ``ts`` of
  each held job's ``attempt_adopted`` event (adoption is part of recovery and
  comes before ``broker_started``; the event marks the moment that job is the
  broker's again, so it is the figure per job; the part after the process start
  is mostly the interpreter and gpuwarden's imports, reported beside it).

The last line of stdout is one JSON object::

    {"rounds", "accepted", "lost", "completed_twice",
     "restart": {"running", "stopped", "repeated", "adopt_p50_ms", ...}, ...}

The exit status is 1 (the temporary directory is then kept) when lost,
completed_twice, stopped or repeated is not 0, or the store shows a job
duplicated; else 0.

Usage::

    .venv/bin/python bench/chaos.py [--seed 1] [--rounds 10] [--jobs-per-round 40]
                                    [--restart-jobs 20]
    .venv/bin/python bench/chaos.py --smoke     # 2 rounds of 8, 4 held jobs (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from gpuwarden import faults
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle

REPO = Path(__file__).resolve().parents[1]
TERMINAL = frozenset(s.value for s in JobState if s.terminal)
START_TIMEOUT_S = 60.0
GW = [sys.executable, "-m", "gpuwarden"]
#: every fifth round (1, 6, 11, ...) is killed while no job runs
IDLE_EVERY = 5
#: how long an idle round waits for every job to end before its timer kills anyway
IDLE_WAIT_S = 90.0
#: how long a held job may run at most (its `until` file ends it sooner)
HOLD_S = 240.0


def say(msg: str) -> None:
    print(msg, flush=True)


def wait_until(check: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


# -- the node ---------------------------------------------------------------------


def write_config(tmp: Path, cpu_slots: int) -> Path:
    cfg = tmp / "chaos.toml"
    paths = ", ".join(
        json.dumps(str(p))
        for p in (REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules")
    )
    cfg.write_text(
        f"""
state_dir = {json.dumps(str(tmp / "state"))}
node_name = "chaos"
gpu = "sim"
allow_unsandboxed_containers = true
module_paths = [{paths}]
queue_roots = [{json.dumps(str(tmp / "queue"))}]

[sim_gpu]
release_delay_s = 0

[broker]
poll_interval_s = 0.05
status_interval_s = 0.5
shutdown_grace_s = 20
kill_grace_s = 0.3
cpu_slots = {cpu_slots}
"""
    )
    return cfg


class Serve:
    """One ``gpuwarden serve`` process, maybe with a fault point armed."""

    def __init__(self, config: Path, log: Path, fault: str | None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        env["PYTHONUNBUFFERED"] = "1"
        if fault is not None:
            env[faults.ENV] = fault
        self.log = log
        self.stderr = log.with_suffix(".stderr")
        self.started = time.time()
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen(
                [*GW, "--config", str(config), "serve", "--log", str(log)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                start_new_session=True,
            )

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        rows = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line still being written
                rows.append(json.loads(line))
        return [r for r in rows if kind is None or r.get("event") == kind]

    def own(self, kind: str) -> list[dict[str, Any]]:
        """Its own events of ``kind`` (its log starts with what the broker before it
        had not copied yet: SPEC.md section 9)."""
        return [e for e in self.events(kind) if e["ts"] >= self.started]

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> bool:
        """True once it logged ``broker_started``; False if it died first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.own("broker_started"):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise SystemExit(f"the broker did not start in {timeout} s: {self.stderr}")

    def first_running(self) -> tuple[float, float] | None:
        """Seconds from starting the process, and from its ``broker_started``, to its
        first job running, from its log; None when the log shows none."""
        events = self.events()
        starts = [i for i, r in enumerate(events) if r["event"] == "broker_started"]
        if not starts:
            return None
        own = events[starts[-1] :]
        ts = [r["ts"] for r in own if r["event"] == "transition" and r.get("to") == "running"]
        if not ts:
            return None
        return min(ts) - self.started, min(ts) - own[0]["ts"]


def alive(pid: int, job: str) -> bool:
    """Whether ``pid`` runs, and is ``job``'s process (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.environ().get("GPUWARDEN_JOB_ID") == job
    except psutil.Error:
        return False


@dataclass
class Ledger:
    """The jobs' own lines: ``start|done JOB ATTEMPT PID``, one ``write`` each."""

    path: Path

    def lines(self) -> list[tuple[str, str, str, int]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines(keepends=True):
            parts = line.split()
            if line.endswith("\n") and len(parts) == 4 and parts[3].isdigit():
                out.append((parts[0], parts[1], parts[2], int(parts[3])))
        return out

    def count(self, what: str) -> Counter[str]:
        return Counter(job for w, job, _, _ in self.lines() if w == what)

    def running(self) -> dict[str, int]:
        """Jobs whose attempt wrote 'start' and no 'done', and whose process is alive:
        job -> pid."""
        lines = self.lines()
        done = {(job, att) for w, job, att, _ in lines if w == "done"}
        return {
            job: pid
            for w, job, att, pid in lines
            if w == "start" and (job, att) not in done and alive(pid, job)
        }


@dataclass
class Node:
    tmp: Path
    cpu_slots: int
    bundles: dict[str, list[str]] = field(default_factory=dict)  # the record: name -> job ids
    exit_codes: dict[str, int] = field(default_factory=dict)  # job -> the exit it asked for
    brokers: list[Serve] = field(default_factory=list)
    #: the ledger's length when the last broker was killed (lines after it and before
    #: the next start were written while no broker ran)
    mark: int | None = None

    def __post_init__(self) -> None:
        self.config = write_config(self.tmp, self.cpu_slots)
        self.root = self.tmp / "queue"
        self.state = self.tmp / "state"
        self.ledger = Ledger(self.tmp / "ledger.txt")
        for sub in ("inbox", "processing", "outbox", "failed"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def serve(self, fault: str | None = None) -> tuple[Serve, int]:
        """A new broker, and how many jobs ended ('done') since the last kill."""
        ended = 0
        if self.mark is not None:
            ended = sum(w == "done" for w, *_ in self.ledger.lines()[self.mark :])
            self.mark = None
        b = Serve(self.config, self.tmp / f"events-{len(self.brokers)}.jsonl", fault)
        self.brokers.append(b)
        return b, ended

    def killed(self) -> None:
        self.mark = len(self.ledger.lines())

    def drop(self, jobs: list[JobSpec]) -> None:
        path = write_bundle(self.root / "inbox", jobs, now=time.time())
        self.bundles[path.name] = [j.id for j in jobs]
        for j in jobs:
            self.exit_codes[j.id] = int(j.params.get("exit_code", 0))

    def zips(self, sub: str) -> list[str]:
        return sorted(p.name for p in (self.root / sub).glob("*.zip"))

    def results(self) -> list[str]:
        return [
            f"{sub}/{n}"
            for sub in ("outbox", "failed")
            for n in self.zips(sub)
            if ".duplicate-" not in n
        ]

    def settled(self) -> bool:
        names = {r.split("/", 1)[1] for r in self.results()}
        return set(self.bundles) <= names and not self.zips("processing") and not self.zips("inbox")

    def quiet(self) -> bool:
        """Every job dropped so far wrote 'done', and none runs (by the ledger)."""
        done = self.ledger.count("done")
        return all(done[j] for j in self.exit_codes) and not self.ledger.running()

    def db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.state / "gpuwarden.db", timeout=10)
        db.row_factory = sqlite3.Row
        return db

    def supervisors(self) -> list[psutil.Process]:
        """The attempts' supervisors under this node's folder, still running."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            args = proc.info["cmdline"] or []
            if any(a.endswith("/supervisor.py") for a in args) and any(
                a.startswith(str(self.tmp)) for a in args
            ):
                found.append(proc)
        return found

    def kill_all(self) -> None:
        """Kill the brokers, then stop the supervisors they left (each stops its job)."""
        for b in self.brokers:
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait(30)
        left = self.supervisors()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, still = psutil.wait_procs(left, timeout=5)
        for proc in still:
            with contextlib.suppress(psutil.Error):
                proc.kill()


# -- the jobs -----------------------------------------------------------------------


def ledger_job(
    jid: str,
    ledger: Path,
    seconds: float,
    *,
    kind: str = "ledger",
    exit_code: int = 0,
    until: str = "",
) -> JobSpec:
    params = {"ledger": str(ledger), "seconds": seconds, "exit_code": exit_code, "until": until}
    return JobSpec(id=jid, type=f"testmods.{kind}", params=params)


def draw_job(rng: random.Random, jid: str, ledger: Path) -> JobSpec:
    """Short (0.05-0.4 s, 40 %), long (1-3 s, 25 %), longer (4-8 s, 10 %: they often
    outlive a kill and the next start, and are adopted live), failing (exit 1, 3 or 7
    after 0.05-1 s, 10 %) or on the simulated GPU (``ledger_gpu``, 4 GiB, 0.2-1.5 s,
    15 %)."""
    x = rng.random()
    if x < 0.40:
        return ledger_job(jid, ledger, round(rng.uniform(0.05, 0.4), 2))
    if x < 0.65:
        return ledger_job(jid, ledger, round(rng.uniform(1.0, 3.0), 2))
    if x < 0.75:
        return ledger_job(jid, ledger, round(rng.uniform(4.0, 8.0), 2))
    if x < 0.85:
        code = rng.choice((1, 3, 7))
        return ledger_job(jid, ledger, round(rng.uniform(0.05, 1.0), 2), exit_code=code)
    return ledger_job(jid, ledger, round(rng.uniform(0.2, 1.5), 2), kind="ledger_gpu")


def round_bundles(rng: random.Random, r: int, per_round: int, ledger: Path) -> list[list[JobSpec]]:
    """Bundles of 1-4 ledger jobs, ``per_round`` jobs in all."""
    bundles: list[list[JobSpec]] = []
    n = 0
    while n < per_round:
        bundle = []
        for _ in range(min(rng.randint(1, 4), per_round - n)):
            bundle.append(draw_job(rng, f"r{r}-j{n}", ledger))
            n += 1
        bundles.append(bundle)
    return bundles


# -- the check --------------------------------------------------------------------


@dataclass
class Audit:
    """The store and the queue root: the secondary check."""

    accepted: list[str] = field(default_factory=list)
    refused_bundles: list[str] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    final: dict[str, str] = field(default_factory=dict)  # job -> its state
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    anomalies: list[str] = field(default_factory=list)
    refusals: int = 0


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, so that alike reasons count together."""
    return "".join("N" if c.isdigit() else c for c in reason)[:200]


def _results(node: Node, a: Audit) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Every job's results (result bundles), refusals of second copies counted."""
    got: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for rel in node.results():
        for jid, body in read_result_bundle(node.root / rel).items():
            got.setdefault(jid, []).append((rel, body))
    for sub in ("outbox", "failed"):
        for n in sorted(p.name for p in (node.root / sub).glob("*.duplicate-*")):
            if not n.endswith("-input"):  # the refused copy itself, kept beside
                for jid, body in read_result_bundle(node.root / sub / n).items():
                    a.refusals += 1
                    if body.get("status") != "refused" and jid != "bundle":
                        a.anomalies.append(f"refusal {n}: {jid} is {body.get('status')}")
        for p in (node.root / sub).iterdir():
            if p.name.startswith("."):
                a.anomalies.append(f"temporary file left: {sub}/{p.name}")
    return got


def audit(node: Node) -> Audit:
    a = Audit()
    got = _results(node, a)
    with contextlib.closing(node.db()) as db:
        jobs = {r["id"]: r for r in db.execute("SELECT id, state, reason, attempts FROM jobs")}
        moves = Counter(
            r["job_id"]
            for r in db.execute("SELECT job_id, to_state FROM events WHERE kind = 'transition'")
            if r["to_state"] in TERMINAL
        )
        rejected = {
            r["name"] for r in db.execute("SELECT name FROM bundles WHERE outcome = 'rejected'")
        }
    for name, ids in sorted(node.bundles.items()):
        if name in rejected:
            a.refused_bundles.append(name)
            continue
        for jid in ids:
            a.accepted.append(jid)
            row = jobs.get(jid)
            state = row["state"] if row is not None else "(not stored)"
            results = got.get(jid, [])
            a.states[state] += 1
            a.final[jid] = state
            where = f"{jid} (bundle {name}): state {state}, results {[r for r, _ in results]}"
            if len(results) > 1 or moves[jid] > 1:
                a.duplicated.append(f"{where}, {moves[jid]} terminal transitions")
            if row is None or state not in TERMINAL or not results:
                a.lost.append(where)
                continue
            if results[0][0].split("/", 1)[1] != name:
                a.anomalies.append(f"{where}: not in its own bundle's result")
            if results[0][1].get("status") != state:
                a.anomalies.append(f"{where}: the result says {results[0][1].get('status')}")
            if state != "done":
                if row["reason"].strip():
                    a.reasons[_reason_kind(row["reason"])] += 1
                else:
                    a.anomalies.append(f"{where}: no reason")
    ledger = {j for ids in node.bundles.values() for j in ids}
    a.anomalies += [f"result for {j}, which no bundle held" for j in sorted(set(got) - ledger)]
    a.anomalies += [f"stored job {j}, which no bundle held" for j in sorted(set(jobs) - ledger)]
    a.anomalies += leftovers(node)
    return a


def leftovers(node: Node) -> list[str]:
    """What should not be left once every job ended and the last broker stopped."""
    out = []
    if node.zips("processing") or node.zips("inbox"):
        out.append(f"left in processing/ {node.zips('processing')}, inbox/ {node.zips('inbox')}")
    logged = {
        (round(e["ts"], 6), e["event"], e.get("job")) for b in node.brokers for e in b.events()
    }
    with contextlib.closing(node.db()) as db:
        unlogged = Counter(
            r["kind"]
            for r in db.execute("SELECT ts, kind, job_id FROM events")
            if (round(r["ts"], 6), r["kind"], r["job_id"]) not in logged
        )
    if unlogged:
        out.append(
            f"{unlogged.total()} events in the store never reached an event log "
            f"(written by a broker killed before it copied them): {dict(unlogged)}"
        )
    staging = node.state / "staging"
    if staging.is_dir() and (left := [f.name for d in staging.iterdir() for f in d.iterdir()]):
        out.append(f"staging folders left: {left}")
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("GPUWARDEN_OUTPUT_DIR", "").startswith(str(node.state)):
                out.append(f"job process left running: PID {proc.pid}")
    out += [f"supervisor left running: PID {p.pid}" for p in node.supervisors()]
    return out


def evidence(node: Node, jid: str) -> str:
    """What the store and the supervisors' records say of ``jid``'s attempts: for a
    job that started or completed twice, where the broker went wrong."""
    with contextlib.closing(node.db()) as db:
        rows = db.execute(
            "SELECT number, outcome, pid, exit_code FROM attempts WHERE job_id = ? ORDER BY number",
            (jid,),
        ).fetchall()
    out = []
    for r in rows:
        sup = node.state / "jobs" / jid / f"attempt-{r['number']}" / "supervisor"
        record = "no supervisor"
        if (sup / "exit.json").is_file():
            record = f"exit record {json.loads((sup / 'exit.json').read_text())['exit_code']}"
        elif (sup / "started.json").is_file():
            record = "started, no exit record"
        out.append(
            f"#{r['number']} {r['outcome']} (store pid {r['pid']}, exit {r['exit_code']}; {record})"
        )
    return "attempts " + ", ".join(out)


@dataclass
class Judged:
    """The ledger's verdict on the accepted jobs (the headline)."""

    completed_twice: list[str] = field(default_factory=list)
    started_twice: list[str] = field(default_factory=list)
    no_done: list[str] = field(default_factory=list)
    wrong_state: list[str] = field(default_factory=list)


def judge(node: Node, a: Audit) -> Judged:
    """Each accepted job by its own lines: 'done' twice is work completed twice;
    'start' twice is work begun again (allowed after a kill only when no supervisor
    and no record was left, SPEC.md "Attempts outlive the broker"); and its final
    state against the exit it asked for (done for 0, failed for the others)."""
    j = Judged()
    lines = node.ledger.lines()
    for jid in a.accepted:
        mine = [(w, att, pid) for w, job, att, pid in lines if job == jid]
        dones = [f"attempt {att} pid {pid}" for w, att, pid in mine if w == "done"]
        starts = [f"attempt {att} pid {pid}" for w, att, pid in mine if w == "start"]
        state = a.final.get(jid)
        if len(dones) > 1:
            j.completed_twice.append(f"{jid}: done by {dones}; {evidence(node, jid)}")
        if len(starts) > 1:
            j.started_twice.append(f"{jid}: started by {starts}; {evidence(node, jid)}")
        if not dones:
            j.no_done.append(f"{jid}: no 'done' line (state {state}, starts {starts})")
        want = "done" if node.exit_codes[jid] == 0 else "failed"
        if state != want:
            j.wrong_state.append(f"{jid}: {state}, its exit code {node.exit_codes[jid]}")
    return j


# -- the kill rounds ----------------------------------------------------------------


@dataclass
class Round:
    kill: str
    fired: bool
    code: int | None
    alive_s: float
    #: jobs running (ledger 'start', process alive) right after the kill
    running: int
    down_s: float
    #: at this broker's start: jobs that ended while no broker ran (since the kill
    #: before), and what it did with the attempts it found
    ended_down: int
    adopted: int
    recovered: int
    to_running: tuple[float, float] | None


@dataclass(frozen=True)
class KillPlan:
    mode: str  # fault, early, busy or idle
    fault: str | None
    delay: float
    down_s: float


def draw_kill(rng: random.Random, r: int, args: argparse.Namespace) -> KillPlan:
    """Always the same number of draws, whatever the mode."""
    fault = f"{rng.choice(faults.POINTS)}@{rng.randint(1, 8)}"
    x, early = rng.random(), rng.random() < 0.25
    delay, down_s = rng.random(), rng.uniform(0.2, 2.0)
    if r % IDLE_EVERY == 1:
        return KillPlan("idle", None, 0.3 * delay, down_s)
    if x < args.fault_share:
        return KillPlan("fault", fault, args.fault_wait, down_s)
    if early:
        return KillPlan("early", None, 0.2 + 0.8 * delay, down_s)
    return KillPlan("busy", None, 0.2 + 2.3 * delay, down_s)


def kill_time(node: Node, b: Serve, plan: KillPlan, rest: list[list[JobSpec]]) -> tuple[float, str]:
    """When to kill ``b`` (``time.time()``), and how that reads."""
    if plan.mode in ("fault", "early"):
        return b.started + plan.delay, f"{plan.mode} {plan.fault or f'{plan.delay:.2f} s'}"
    if not b.wait_started():
        return time.time(), f"{plan.mode}: died in start-up"
    if plan.mode == "busy":
        return time.time() + plan.delay, f"busy {plan.delay:.2f} s after start"
    while rest:  # idle: every job in, then wait until none runs
        node.drop(rest.pop(0))
    quiet = wait_until(lambda: node.quiet() or b.proc.poll() is not None, IDLE_WAIT_S, step=0.1)
    label = f"idle, {plan.delay:.2f} s after the last job ended"
    if not (quiet and node.quiet()):
        label = f"idle: not quiet in {IDLE_WAIT_S:g} s, killed anyway"
    return time.time() + plan.delay, label


def run_round(node: Node, rng: random.Random, r: int, args: argparse.Namespace) -> Round:
    """One round; everything it draws comes from ``rng``, its own, before any timing
    can change how many draws are made."""
    bundles = round_bundles(rng, r, args.jobs_per_round, node.ledger.path)
    plan = draw_kill(rng, r, args)
    gaps = [rng.uniform(0, 0.05) for _ in bundles]
    half = len(bundles) // 2
    for bundle in bundles[:half]:
        node.drop(bundle)
    b, ended_down = node.serve(plan.fault)
    rest = bundles[half:]
    kill_at, kill = kill_time(node, b, plan, rest)
    while rest and time.time() < kill_at and b.proc.poll() is None:
        node.drop(rest.pop(0))
        time.sleep(gaps[len(rest)])
    while time.time() < kill_at and b.proc.poll() is None:
        time.sleep(0.01)
    fired = plan.fault is not None and b.proc.poll() is not None
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGKILL)
    code = b.proc.wait(30)
    node.killed()
    alive_s = time.time() - b.started
    running = len(node.ledger.running())
    for bundle in rest:  # what clients drop while the broker is down
        node.drop(bundle)
    if plan.fault is not None and not fired:
        kill += f" (not reached in {args.fault_wait:g} s: timer)"
    time.sleep(plan.down_s)
    return Round(
        kill,
        fired,
        code,
        alive_s,
        running,
        plan.down_s,
        ended_down,
        len(b.own("attempt_adopted")),
        len(b.own("attempt_end_recovered")),
        b.first_running(),
    )


def show_round(name: str, rd: Round) -> None:
    shown = "-" if rd.to_running is None else f"{rd.to_running[0]:.2f}"
    say(
        f"  {name:>5}  {rd.ended_down:5d} {rd.adopted:5d} {rd.recovered:5d}  "
        f"{rd.kill:48.48s} {'-' if rd.code is None else rd.code:>4} {rd.alive_s:7.2f} "
        f"{rd.running:5d} {rd.down_s:6.2f} {shown:>7}"
    )


def final_broker(node: Node, args: argparse.Namespace) -> tuple[Serve, Round]:
    """A broker without faults, run until every bundle has its result."""
    b, ended_down = node.serve()
    if not b.wait_started():
        raise SystemExit(f"the final broker died: {b.stderr.read_text()}")
    wait_until(node.settled, args.timeout)
    rd = Round(
        "none: until every bundle has its result",
        False,
        None,
        time.time() - b.started,
        0,
        0.0,
        ended_down,
        len(b.own("attempt_adopted")),
        len(b.own("attempt_end_recovered")),
        b.first_running(),
    )
    return b, rd


# -- the graceful restart -------------------------------------------------------------


@dataclass
class Restart:
    running: int = 0
    stopped: list[str] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)
    adopt_ms: list[float] = field(default_factory=list)
    started_ms: float | None = None  # process start -> broker_started
    stop_s: float = 0.0  # SIGTERM -> exit
    stop_code: int | None = None
    left_running: Any = None
    not_adopted: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)


def hold_jobs(node: Node, b: Serve, n: int, release: Path) -> dict[str, int]:
    """``n`` ledger jobs held by ``release``, all running: job -> pid."""
    ids = [f"held-{i}" for i in range(n)]
    node.drop([ledger_job(j, node.ledger.path, HOLD_S, until=str(release)) for j in ids])
    if not wait_until(lambda: set(ids) <= set(node.ledger.running()), START_TIMEOUT_S):
        raise SystemExit(
            f"the held jobs did not all start in {START_TIMEOUT_S:g} s "
            f"(running: {sorted(node.ledger.running())}; broker exit {b.proc.poll()})"
        )
    running = node.ledger.running()
    return {j: running[j] for j in ids}


def check_held(node: Node, pids: dict[str, int], rs: Restart, when: str) -> None:
    """Held jobs whose process is gone without a 'done' line, or that started twice."""
    lines = node.ledger.lines()
    for job, pid in pids.items():
        starts = [p for w, j, _, p in lines if w == "start" and j == job]
        done = any(w == "done" and j == job for w, j, _, _ in lines)
        if len(starts) > 1:
            why = f"{job}: started again ({starts}) {when}"
        elif not done and not alive(pid, job):
            why = f"{job}: its process {pid} gone, no 'done' line, {when}"
        else:
            continue
        if not any(s.startswith(f"{job}:") for s in rs.stopped):
            rs.stopped.append(why)


def restart_phase(node: Node, b: Serve, n: int, args: argparse.Namespace) -> tuple[Serve, Restart]:
    """SIGTERM ``b`` under ``n`` running held jobs, start a new broker, measure its
    adoption, release the jobs; the broker left running once they all ended."""
    rs = Restart()
    release = node.tmp / "release"
    pids = hold_jobs(node, b, n, release)
    running = node.ledger.running()
    rs.running = sum(j in running for j in pids)
    t0 = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    rs.stop_code = b.proc.wait(60)
    rs.stop_s = time.monotonic() - t0
    stopped = b.own("broker_stopped")
    rs.left_running = stopped[-1].get("left_running") if stopped else "(no broker_stopped)"
    check_held(node, pids, rs, "after the SIGTERM")
    if rs.stop_code != 0:
        rs.anomalies.append(f"the stopped broker exited {rs.stop_code}")
    if rs.left_running != n:
        rs.anomalies.append(f"broker_stopped says left_running {rs.left_running}, not {n}")
    nb, _ = node.serve()
    if not nb.wait_started():
        raise SystemExit(f"the broker after the graceful stop died: {nb.stderr.read_text()}")
    adopted = {e["job"]: e["ts"] for e in nb.own("attempt_adopted")}
    rs.adopt_ms = [round((adopted[j] - nb.started) * 1000, 1) for j in pids if j in adopted]
    rs.not_adopted = sorted(set(pids) - set(adopted))
    rs.started_ms = round((nb.own("broker_started")[0]["ts"] - nb.started) * 1000, 1)
    check_held(node, pids, rs, "after the new broker started")
    release.touch()
    wait_until(node.settled, args.timeout)
    starts = node.ledger.count("start")
    rs.repeated = [f"{j}: {starts[j]} 'start' lines" for j in pids if starts[j] > 1]
    return nb, rs


# -- the campaign ---------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seed", type=int, default=1, help="seed of everything drawn (default 1)")
    p.add_argument("--rounds", type=int, default=10, help="kill-and-restart rounds (default 10)")
    p.add_argument("--jobs-per-round", type=int, default=40, help="jobs per round (default 40)")
    p.add_argument(
        "--restart-jobs",
        type=int,
        default=20,
        help="jobs running through the graceful restart (default 20)",
    )
    p.add_argument(
        "--fault-share",
        type=float,
        default=0.5,
        help="share of the busy rounds killed at a named fault point, the rest by a timer (0.5)",
    )
    p.add_argument(
        "--fault-wait",
        type=float,
        default=6.0,
        help="seconds a round waits for its fault point before the timer kills (default 6)",
    )
    p.add_argument("--timeout", type=float, default=180.0, help="for the jobs to settle (s)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 rounds of 8 jobs, 4 held jobs, the fault wait 3 s (the test suite runs this)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.jobs_per_round, args.restart_jobs = 2, 8, 4
        args.fault_wait = 3.0
    if args.rounds < 1 or args.jobs_per_round < 1 or args.restart_jobs < 1:
        p.error("--rounds, --jobs-per-round and --restart-jobs must be at least 1")
    return args


def p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def report(
    args: argparse.Namespace, rounds: list[Round], rs: Restart, a: Audit, j: Judged
) -> dict[str, Any]:
    """Print the figures; the JSON line's object (:func:`figures`)."""
    fired = sum(rd.fired for rd in rounds)
    kills = rounds[:-1]  # the last one is the final broker's, never killed
    busy = sum(rd.running > 0 for rd in kills)
    others = {s: n for s, n in sorted(a.states.items()) if s != "done"}
    say("")
    say(f"rounds           {args.rounds} ({fired} at a fault point)")
    say(f"kills            {busy} while jobs ran, {len(kills) - busy} while none ran")
    say(f"ended while down {sum(rd.ended_down for rd in rounds)} jobs ('done' while no broker ran)")
    adopted, recovered = sum(rd.adopted for rd in rounds), sum(rd.recovered for rd in rounds)
    say(f"taken back       {adopted} adopted live, {recovered} judged from the exit record")
    say(f"accepted         {len(a.accepted)} (bundles refused: {len(a.refused_bundles)})")
    say(f"done             {a.states['done']}; others {others}")
    for reason, n in a.reasons.most_common():
        say(f"  {n:5d}  {reason}")
    say(f"lost             {len(a.lost)} (store or result bundle)")
    say(f"completed_twice  {len(j.completed_twice)} (two or more 'done' lines)")
    say(f"started_twice    {len(j.started_twice)} (two or more 'start' lines; kills allow it)")
    say(f"no 'done' line   {len(j.no_done)}")
    say(f"wrong state      {len(j.wrong_state)} (not done for exit 0, failed for others)")
    say(f"duplicated       {len(a.duplicated)} (two results or terminal transitions)")
    say(
        f"restart          {rs.running} held jobs running at SIGTERM; the broker exited "
        f"{rs.stop_code} in {rs.stop_s:.2f} s, left_running {rs.left_running}; "
        f"stopped {len(rs.stopped)}, repeated {len(rs.repeated)}, "
        f"not adopted {len(rs.not_adopted)}"
    )
    if rs.adopt_ms:
        q = sorted(rs.adopt_ms)
        say(
            f"adoption         p50 {p50(q)} ms, min {q[0]} ms, max {q[-1]} ms from the new "
            f"broker's process start to each job's attempt_adopted (broker_started at "
            f"{rs.started_ms} ms: adoption comes first, in recovery)"
        )
    for line in (
        a.lost
        + j.completed_twice
        + j.started_twice
        + j.no_done
        + j.wrong_state
        + a.duplicated
        + rs.stopped
        + rs.repeated
        + [f"not adopted: {x}" for x in rs.not_adopted]
        + rs.anomalies
        + a.anomalies
    ):
        say(f"  ! {line}")
    return figures(args, rounds, rs, a, j)


def figures(
    args: argparse.Namespace, rounds: list[Round], rs: Restart, a: Audit, j: Judged
) -> dict[str, Any]:
    """The JSON line's object: the issue's keys first, then the rest."""
    kills = rounds[:-1]
    busy = sum(rd.running > 0 for rd in kills)
    restarts = [rd.to_running[0] for rd in rounds[1:] if rd.to_running is not None]
    return {
        "rounds": args.rounds,
        "accepted": len(a.accepted),
        "lost": len(a.lost),
        "completed_twice": len(j.completed_twice),
        "restart": {
            "running": rs.running,
            "stopped": len(rs.stopped),
            "repeated": len(rs.repeated),
            "adopt_p50_ms": p50(rs.adopt_ms),
            "broker_started_ms": rs.started_ms,
            "stop_s": round(rs.stop_s, 2),
            "not_adopted": len(rs.not_adopted),
        },
        "kills_while_running": busy,
        "kills_while_idle": len(kills) - busy,
        "ended_while_down": sum(rd.ended_down for rd in rounds),
        "adopted": sum(rd.adopted for rd in rounds),
        "recovered": sum(rd.recovered for rd in rounds),
        "started_twice": len(j.started_twice),
        "no_done": len(j.no_done),
        "wrong_state": len(j.wrong_state),
        "done": a.states["done"],
        "duplicated": len(a.duplicated),
        "restart_to_running_s": round(statistics.median(restarts), 3) if restarts else None,
    }


def campaign(node: Node, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    say("         at its start:       kill                                          at the kill")
    say(
        "  round  ended adopt recov  how                                              "
        "exit alive_s   run down_s first_running_s"
    )
    rounds: list[Round] = []
    for r in range(args.rounds):
        rounds.append(run_round(node, random.Random(rng.random()), r, args))
        show_round(str(r), rounds[-1])
    b, rd = final_broker(node, args)
    rounds.append(rd)
    show_round("final", rd)
    b, rs = restart_phase(node, b, args.restart_jobs, args)
    b.proc.send_signal(signal.SIGTERM)
    final_code = b.proc.wait(60)
    a = audit(node)
    not_killed = [i for i, x in enumerate(rounds[:-1]) if x.code != -signal.SIGKILL]
    if not_killed:
        a.anomalies.append(f"rounds whose broker did not die of SIGKILL: {not_killed}")
    if final_code != 0:
        a.anomalies.append(f"the last broker exited {final_code}")
    return report(args, rounds, rs, a, judge(node, a))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-chaos-"))
    node = Node(tmp, cpu_slots=max(8, args.restart_jobs))
    say(
        f"chaos: seed {args.seed}, {args.rounds} rounds of {args.jobs_per_round} ledger jobs, "
        f"{args.fault_share:.0%} of the busy kills at a fault point, every {IDLE_EVERY}th "
        f"while none runs; then a graceful restart under {args.restart_jobs} jobs ({tmp})"
    )
    ok = False
    try:
        figures = campaign(node, args)
        r = figures["restart"]
        ok = not (
            figures["lost"]
            or figures["completed_twice"]
            or r["stopped"]
            or r["repeated"]
            or figures["duplicated"]
        )
        say(json.dumps(figures))
    finally:
        node.kill_all()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
