"""Chaos campaign: kill the broker again and again, restart it, count what was lost.

Each round drops a round's bundles into one queue root (half before the broker
starts, as clients do while it is down, half while it runs), starts
``python -m gpuwarden --config <tmp> serve --log <tmp>/events-N.jsonl`` and
kills it with SIGKILL, either

- at a named fault point (``GPUWARDEN_FAULT=NAME@N``, ``gpuwarden.faults``): the
  point and N are drawn from the seed; if the point is not reached within
  ``--fault-wait`` seconds the broker is killed by the timer instead (shown), or
- at a random moment: during start-up and recovery (a quarter of the timer
  kills) or 0.2-2.5 s after the broker said it started.

Bundles not dropped when the broker died are dropped while it is down. After the
last round a broker without faults runs until every bundle has its result, and
is stopped with SIGTERM. Then every job of every bundle (the bench's own record)
is checked against the queue root and the store:

- accepted: its bundle was not refused;
- lost: accepted, and not terminal in the store, or without a result in the
  result bundle named like its bundle (``outbox/`` or ``failed/``);
- duplicated: two results (two result bundles hold it; ``<name>.duplicate-*``
  refusals of a second copy are not results) or two terminal transitions in the
  store's events.

Restart to running: for every broker start after a kill, the time from starting
the process to the ``ts`` of the first ``transition`` event ``"to": "running"``
in that broker's event log (both are this host's clock). A broker killed before
its log shows a job running gives no figure.

The last line of stdout is one JSON object::

    {"rounds", "accepted", "done", "failed", "lost", "duplicated", "restart_to_running_s"}

with ``restart_to_running_s`` the median over the restarts. The exit status is 1
when a job was lost or duplicated (the temporary directory is then kept), else 0.

Usage::

    .venv/bin/python bench/chaos.py [--seed 1] [--rounds 10] [--jobs-per-round 40]
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


def say(msg: str) -> None:
    print(msg, flush=True)


# -- the node ---------------------------------------------------------------------


def write_config(tmp: Path) -> Path:
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

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> bool:
        """True once it logged ``broker_started``; False if it died first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.events("broker_started"):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise SystemExit(f"the broker did not start in {timeout} s: {self.stderr}")

    def first_running(self) -> tuple[float, float] | None:
        """Seconds from starting the process, and from its ``broker_started``, to its
        first job running, from its log; None when the log shows none."""
        events = self.events()
        # the log starts with what the killed broker before had not written yet
        # (its cursor, SPEC.md section 9): this broker's own lines follow its start
        starts = [i for i, r in enumerate(events) if r["event"] == "broker_started"]
        if not starts:
            return None
        own = events[starts[-1] :]
        ts = [r["ts"] for r in own if r["event"] == "transition" and r.get("to") == "running"]
        if not ts:
            return None
        return min(ts) - self.started, min(ts) - own[0]["ts"]


@dataclass
class Node:
    tmp: Path
    bundles: dict[str, list[str]] = field(default_factory=dict)  # the record: name -> job ids
    brokers: list[Serve] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = write_config(self.tmp)
        self.root = self.tmp / "queue"
        self.state = self.tmp / "state"
        for sub in ("inbox", "processing", "outbox", "failed"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def serve(self, fault: str | None = None) -> Serve:
        b = Serve(self.config, self.tmp / f"events-{len(self.brokers)}.jsonl", fault)
        self.brokers.append(b)
        return b

    def drop(self, jobs: list[JobSpec]) -> None:
        path = write_bundle(self.root / "inbox", jobs, now=time.time())
        self.bundles[path.name] = [j.id for j in jobs]

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

    def db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.state / "gpuwarden.db", timeout=10)
        db.row_factory = sqlite3.Row
        return db

    def kill_all(self) -> None:
        for b in self.brokers:
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait(30)


# -- the jobs -----------------------------------------------------------------------


def round_bundles(rng: random.Random, r: int, per_round: int) -> list[list[JobSpec]]:
    """Bundles of 1-4 jobs: echo jobs (4 % exit 3 by request), sleepers (0.1-0.6 s)
    and simulated-GPU jobs (2, 4 or 8 GiB for 0.2 s)."""
    bundles: list[list[JobSpec]] = []
    n = 0
    while n < per_round:
        bundle = []
        for _ in range(min(rng.randint(1, 4), per_round - n)):
            jid, n = f"r{r}-j{n}", n + 1
            x = rng.random()
            if x < 0.08:
                bundle.append(
                    JobSpec(
                        id=jid,
                        type="testmods.sleep",
                        params={"seconds": round(rng.uniform(0.1, 0.6), 2)},
                    )
                )
            elif x < 0.16:
                bundle.append(
                    JobSpec(
                        id=jid,
                        type="testmods.gpu",
                        params={"gib": rng.choice((2, 4, 8)), "seconds": 0.2},
                    )
                )
            else:
                params: dict[str, Any] = {"text": jid}
                if rng.random() < 0.04:
                    params["exit_code"] = 3
                bundle.append(JobSpec(id=jid, type="echo.echo", params=params))
        bundles.append(bundle)
    return bundles


# -- the check --------------------------------------------------------------------


@dataclass
class Audit:
    accepted: int = 0
    refused_bundles: list[str] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    anomalies: list[str] = field(default_factory=list)
    refusals: int = 0


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, so that alike reasons count together."""
    return "".join("N" if c.isdigit() else c for c in reason)[:200]


def audit(node: Node) -> Audit:
    a = Audit()
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
            a.accepted += 1
            row = jobs.get(jid)
            state = row["state"] if row is not None else "(not stored)"
            results = got.get(jid, [])
            a.states[state] += 1
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
    if node.zips("processing") or node.zips("inbox"):
        a.anomalies.append(
            f"left in processing/ {node.zips('processing')}, inbox/ {node.zips('inbox')}"
        )
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
        a.anomalies.append(
            f"{unlogged.total()} events in the store never reached an event log "
            f"(written by a broker killed before it copied them): {dict(unlogged)}"
        )
    staging = node.state / "staging"
    if staging.is_dir() and (left := [f.name for d in staging.iterdir() for f in d.iterdir()]):
        a.anomalies.append(f"staging folders left: {left}")
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("GPUWARDEN_OUTPUT_DIR", "").startswith(str(node.state)):
                a.anomalies.append(f"job process left running: PID {proc.pid}")
    return a


# -- the campaign -------------------------------------------------------------------


@dataclass
class Round:
    kill: str
    fired: bool
    code: int | None
    alive_s: float
    to_running: tuple[float, float] | None


def run_round(node: Node, rng: random.Random, r: int, args: argparse.Namespace) -> Round:
    """One round; everything it draws comes from ``rng``, its own, before any timing
    can change how many draws are made."""
    bundles = round_bundles(rng, r, args.jobs_per_round)
    half = len(bundles) // 2
    fault = None
    if rng.random() < args.fault_share:
        fault = f"{rng.choice(faults.POINTS)}@{rng.randint(1, 8)}"
    early = rng.random() < 0.25  # a timer kill during start-up and recovery
    delay = rng.uniform(0.2, 1.0) if early else rng.uniform(0.2, 2.5)
    for bundle in bundles[:half]:
        node.drop(bundle)
    b = node.serve(fault)
    if fault is not None:
        kill_at = b.started + args.fault_wait
    elif early:
        kill_at = b.started + delay
    else:
        b.wait_started()
        kill_at = time.time() + delay
    rest = bundles[half:]
    while rest and time.time() < kill_at and b.proc.poll() is None:
        node.drop(rest.pop(0))
        time.sleep(rng.uniform(0, 0.05))
    while time.time() < kill_at and b.proc.poll() is None:
        time.sleep(0.01)
    fired = fault is not None and b.proc.poll() is not None
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGKILL)
    code = b.proc.wait(30)
    alive_s = time.time() - b.started
    for bundle in rest:  # what clients drop while the broker is down
        node.drop(bundle)
    kill = f"fault {fault}" if fault else f"timer {kill_at - b.started:.2f} s"
    if fault is not None and not fired:
        kill += f" (not reached in {args.fault_wait:g} s: timer)"
    return Round(kill, fired, code, alive_s, b.first_running())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seed", type=int, default=1, help="seed of everything drawn (default 1)")
    p.add_argument("--rounds", type=int, default=10, help="kill-and-restart rounds (default 10)")
    p.add_argument("--jobs-per-round", type=int, default=40, help="jobs per round (default 40)")
    p.add_argument(
        "--fault-share",
        type=float,
        default=0.5,
        help="share of the rounds killed at a named fault point, the rest by a timer (0.5)",
    )
    p.add_argument(
        "--fault-wait",
        type=float,
        default=6.0,
        help="seconds a round waits for its fault point before the timer kills (default 6)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="for the final broker (s)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 rounds of 8 jobs, the fault wait 3 s (the test suite runs this: seconds)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.jobs_per_round, args.fault_wait = 2, 8, 3.0
    if args.rounds < 1 or args.jobs_per_round < 1:
        p.error("--rounds and --jobs-per-round must be at least 1")

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-chaos-"))
    node = Node(tmp)
    say(
        f"chaos: seed {args.seed}, {args.rounds} rounds of {args.jobs_per_round} jobs, "
        f"{args.fault_share:.0%} of the kills at a fault point ({tmp})"
    )
    say("  round  kill                                           exit  alive_s  to_running_s")
    ok = False
    try:
        rounds: list[Round] = []
        restarts: list[tuple[float, float]] = []
        for r in range(args.rounds):
            rd = run_round(node, random.Random(rng.random()), r, args)
            rounds.append(rd)
            # round 0's broker is a first start; every later one restarts after a kill
            if r > 0 and rd.to_running is not None:
                restarts.append(rd.to_running)
            shown = "-" if rd.to_running is None else f"{rd.to_running[0]:.2f}"
            say(f"  {r:5d}  {rd.kill:45s}  {rd.code!s:>4}  {rd.alive_s:7.2f}  {shown:>12}")
        final = node.serve()
        if not final.wait_started():
            raise SystemExit(f"the final broker died: {final.stderr.read_text()}")
        deadline = time.monotonic() + args.timeout
        while not node.settled() and time.monotonic() < deadline:
            time.sleep(0.05)
        settle_s = time.time() - final.started
        if (t := final.first_running()) is not None:
            restarts.append(t)
        final.proc.send_signal(signal.SIGTERM)
        final_code = final.proc.wait(60)
        say(
            f"  final  no fault, until every bundle has its result       {final_code!s:>4}"
            f"  {settle_s:7.2f}  {'-' if t is None else f'{t[0]:.2f}':>12}"
        )
        a = audit(node)
        not_killed = [i for i, rd in enumerate(rounds) if rd.code != -signal.SIGKILL]
        if not_killed:
            a.anomalies.append(f"rounds whose broker did not die of SIGKILL: {not_killed}")
        if final_code != 0:
            a.anomalies.append(f"the final broker exited {final_code}")
        failed = sum(a.reasons.values())
        med = round(statistics.median(t[0] for t in restarts), 3) if restarts else None
        say("")
        say(f"rounds         {args.rounds} ({sum(rd.fired for rd in rounds)} at a fault point)")
        say(f"accepted       {a.accepted} (bundles refused: {len(a.refused_bundles)})")
        say(f"done           {a.states['done']}")
        others = {s: n for s, n in sorted(a.states.items()) if s != "done"}
        say(f"failed         {failed} with a reason (by state: {others})")
        for reason, n in a.reasons.most_common():
            say(f"  {n:5d}  {reason}")
        say(f"lost           {len(a.lost)}")
        say(f"duplicated     {len(a.duplicated)}")
        with contextlib.closing(node.db()) as db:
            interrupted = db.execute(
                "SELECT count(*) FROM attempts WHERE outcome = 'interrupted'"
            ).fetchone()[0]
        say(f"interrupted    {interrupted} attempts, ended by a restart's recovery")
        say(f"refusals       {a.refusals} duplicate refusals (none expected)")
        if restarts:
            q = sorted(t[0] for t in restarts)
            up = statistics.median(t[1] for t in restarts)
            say(
                f"restart->running  p50 {med:.2f} s  min {q[0]:.2f} s  max {q[-1]:.2f} s "
                f"(n={len(q)}: process start to the first transition to running; "
                f"p50 {up:.2f} s of it after broker_started)"
            )
        for line in a.lost + a.duplicated + a.anomalies:
            say(f"  ! {line}")
        ok = not a.lost and not a.duplicated
        say(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "accepted": a.accepted,
                    "done": a.states["done"],
                    "failed": failed,
                    "lost": len(a.lost),
                    "duplicated": len(a.duplicated),
                    "restart_to_running_s": med,
                }
            )
        )
    finally:
        node.kill_all()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
