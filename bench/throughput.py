"""Throughput and start latency of no-op host jobs, side by side with task-spooler.

What it measures, on one host (every clock is this host's ``CLOCK_REALTIME``):

- **drain**: N no-op host jobs (``/bin/true``, no Python per job) handed over at
  once on 2 slots (``[broker] cpu_slots = 2``), timed from the hand-over to the
  last result: through a queue root (one bundle of N jobs, from ``write_bundle``
  returning to the result bundle showing in ``outbox/``) and over HTTP
  (``serve --api``, the Python client ``gpuwarden.client``, one ``POST /v1/jobs``
  per job since the API takes no batches, from the first POST to the last job
  ``done`` in the store).
- **start**: on an idle broker, one job at a time, from just before the submit
  call to the job's first instruction. The job is ``/bin/date +%s%N`` (one
  ``exec``, no shell): the clock reading it prints, which the store keeps as the
  attempt's stdout, is taken by the job's ``main`` after the dynamic loader ran.
  Three ways of handing the job over: ``store`` (the local submit, what
  ``gpuwarden submit`` on the node does without ``--url``: a ``SqliteStore``
  opened in this process; the headline figure), ``http`` (the client's
  ``submit``) and ``bundle`` (``write_bundle`` into the queue root's ``inbox/``).
- **tsp** (when ``tsp``, Debian's task-spooler, is on PATH): the same work through
  task-spooler in the same run: its own server (``TS_SOCKET`` in the temporary
  folder, ``tsp -S 2``), N ``tsp /bin/true`` submissions timed from the first to
  the last job finished, and ``tsp /bin/date +%s%N`` one at a time, from just
  before running the ``tsp`` client (its process start included, as the local
  submit's is not: see the README) to the clock reading in its output file.

The broker runs with the store's durable settings (WAL, ``synchronous=FULL``);
the bench prints what the store sets. The last line of stdout is one JSON
object::

    {"noop": {"drain_jobs_per_s", "start_p50_ms", "start_p99_ms", ...},
     "tsp": {"drain_jobs_per_s", "start_p50_ms", "start_p99_ms"} | null values,
     "ratio_drain", "ratio_start_p50", ...}

Usage::

    .venv/bin/python bench/throughput.py [--jobs 500] [--starts 30] [--no-tsp]
    .venv/bin/python bench/throughput.py --smoke        # a few jobs, seconds
    .venv/bin/python bench/throughput.py --profile      # cProfile of the broker
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pstats
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.client import Client
from gpuwarden.core.model import JobSpec
from gpuwarden.intake.bundlewrite import write_bundle
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[1]
GW = [sys.executable, "-m", "gpuwarden"]
NOOP, STAMP = "bench.noop", "bench.stamp"
READY_TIMEOUT_S = 60.0
TERMINAL = ("done", "failed", "cancelled", "quarantined")


@dataclass(frozen=True)
class Settings:
    jobs: int
    starts: int
    slots: int
    tsp: bool
    http: bool
    profile: bool
    keep: bool
    timeout_s: float


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=500, help="no-op jobs per drain (default 500)")
    p.add_argument("--starts", type=int, default=30, help="idle starts per path (default 30)")
    p.add_argument("--slots", type=int, default=2, help="cpu_slots and tsp -S (default 2)")
    p.add_argument("--no-tsp", action="store_true", help="skip task-spooler even if on PATH")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP parts")
    p.add_argument("--smoke", action="store_true", help="a few jobs, a few seconds")
    p.add_argument("--profile", action="store_true", help="run the broker under cProfile")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after (s)")
    a = p.parse_args(argv)
    jobs, starts = (12, 3) if a.smoke else (a.jobs, a.starts)
    if jobs < 1 or starts < 1 or a.slots < 1:
        p.error("--jobs, --starts and --slots must be at least 1")
    return Settings(
        jobs=jobs,
        starts=starts,
        slots=a.slots,
        tsp=not a.no_tsp and shutil.which("tsp") is not None,
        http=not a.no_http,
        profile=a.profile,
        keep=a.keep,
        timeout_s=a.timeout,
    )


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.002) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise BenchError(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(starts_ms: Sequence[float]) -> dict[str, float | None]:
    if not starts_ms:
        return {"start_p50_ms": None, "start_p99_ms": None}
    return {
        "start_p50_ms": round(percentile(starts_ms, 50), 2),
        "start_p99_ms": round(percentile(starts_ms, 99), 2),
    }


# -- the gpuwarden side ----------------------------------------------------------


def write_module(tmp: Path) -> Path:
    modules = tmp / "modules"
    (modules / "bench").mkdir(parents=True)
    true = shutil.which("true") or "/bin/true"
    date = shutil.which("date") or "/bin/date"
    (modules / "bench" / "module.toml").write_text(
        "\n".join(
            [
                "[module]",
                'name = "bench"',
                'description = "No-op host jobs for bench/throughput.py."',
                "",
                "[types.noop]",
                'lane = "cpu"',
                'launch = "host"',
                f"command = [{json.dumps(true)}]",
                "timeout_s = 60",
                "",
                "[types.stamp]",
                'description = "Prints the clock (ns since the epoch) as its first act."',
                'lane = "cpu"',
                'launch = "host"',
                f'command = [{json.dumps(date)}, "+%s%N"]',
                "timeout_s = 60",
                "",
            ]
        )
    )
    return modules


def write_config(tmp: Path, s: Settings) -> Path:
    cfg = tmp / "bench.toml"
    q = json.dumps
    cfg.write_text(
        "\n".join(
            [
                f"state_dir = {q(str(tmp / 'state'))}",
                'node_name = "bench"',
                'gpu = "sim"',
                f"module_paths = [{q(str(write_module(tmp)))}]",
                f"queue_roots = [{q(str(tmp / 'queue'))}]",
                "create_queue_roots = true",
                "",
                "[broker]",
                f"cpu_slots = {s.slots}",
                "",
                "[api]",
                "rate_per_s = 1000000",
                "burst = 1000000",
                "",
            ]
        )
    )
    return cfg


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    stderr: Path
    events: Path
    url: str = ""

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.stderr.read_text(errors="replace").splitlines()[-n:])
        return ""

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"the broker exited ({self.proc.returncode}):\n{self.tail()}")


@contextlib.contextmanager
def running_broker(tmp: Path, cfg: Path, s: Settings) -> Iterator[Broker]:
    """``gpuwarden serve`` (with ``--api`` on a free port unless ``--no-http``);
    SIGTERM (then SIGKILL) when the block ends, however it ends."""
    prof = ["-m", "cProfile", "-o", str(tmp / "broker.prof")] if s.profile else []
    api = ["--api", "127.0.0.1:0"] if s.http else []
    events, stderr = tmp / "events.jsonl", tmp / "broker.stderr"
    argv = [sys.executable, *prof, "-m", "gpuwarden", "--mock-gpu", "--config", str(cfg)]
    argv += ["serve", *api, "--log", str(events)]
    say(f"starting broker: {' '.join(argv)}")
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
        )
    b = Broker(proc=proc, stderr=stderr, events=events)
    try:
        yield b
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(b: Broker, s: Settings) -> None:
    def ready() -> bool:
        b.alive()
        if not (b.events.exists() and '"broker_started"' in b.events.read_text()):
            return False
        if s.http:
            m = re.search(r"api\s+(http://127\.0\.0\.1:\d+)", b.stderr.read_text())
            if m is None:
                return False
            b.url = m.group(1)
        return True

    wait_for("the broker to start", ready, READY_TIMEOUT_S, 0.02)


def make_token(cfg: Path) -> str:
    made = subprocess.run(
        [*GW, "--config", str(cfg), "token", "create", "bench", "--role", "owner", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        raise BenchError(f"token create failed: {made.stderr}")
    return str(json.loads(made.stdout)["token"])


class Watch:
    """Reads the broker's store (read-only connection) for what the bench waits on."""

    def __init__(self, db: Path) -> None:
        self.db = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)

    def ended(self, prefix: str) -> int:
        marks = ",".join("?" * len(TERMINAL))
        row = self.db.execute(
            f"SELECT count(*) FROM jobs WHERE id LIKE ? AND state IN ({marks})",
            (f"{prefix}%", *TERMINAL),
        ).fetchone()
        return int(row[0])

    def states(self, prefix: str) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT state, count(*) FROM jobs WHERE id LIKE ? GROUP BY state", (f"{prefix}%",)
        )
        return {str(r[0]): int(r[1]) for r in rows}

    def stamp(self, job_id: str) -> int | None:
        """The clock reading the stamp job printed (its attempt's stdout), once ended."""
        row = self.db.execute(
            "SELECT a.stdout FROM attempts a JOIN jobs j ON j.id = a.job_id "
            "WHERE a.job_id = ? AND a.ended_at IS NOT NULL ORDER BY a.number LIMIT 1",
            (job_id,),
        ).fetchone()
        if row is None:
            return None
        text = str(row[0] or "").strip()
        return int(text) if text.isdigit() else -1

    def span(self, prefix: str) -> tuple[float, float]:
        """First attempt start and last attempt end of these jobs (broker clock)."""
        row = self.db.execute(
            "SELECT min(started_at), max(ended_at) FROM attempts WHERE job_id LIKE ?",
            (f"{prefix}%",),
        ).fetchone()
        return float(row[0]), float(row[1])


def specs(prefix: str, n: int, jobtype: str = NOOP) -> list[JobSpec]:
    return [JobSpec(id=f"{prefix}{i:06d}", type=jobtype, params={}) for i in range(n)]


def drain_bundle(tmp: Path, watch: Watch, s: Settings) -> dict[str, float]:
    inbox, outbox = tmp / "queue" / "inbox", tmp / "queue" / "outbox"
    jobs = specs("d-", s.jobs)
    t0 = time.time()
    path = write_bundle(inbox, jobs, now=t0)
    handed = time.time()
    wait_for("the drain's result bundle", (outbox / path.name).exists, s.timeout_s, 0.001)
    t1 = time.time()
    states = watch.states("d-")
    if states.get("done") != s.jobs:
        raise BenchError(f"bundle drain: not every job done: {states}")
    first, last = watch.span("d-")
    return {
        "drain_jobs_per_s": round(s.jobs / (t1 - handed), 2),
        "drain_s": round(t1 - handed, 3),
        "run_jobs_per_s": round(s.jobs / (last - first), 2),  # first start to last end
        "write_bundle_ms": round((handed - t0) * 1000, 2),
    }


def drain_http(client: Client, watch: Watch, s: Settings) -> dict[str, float]:
    t0 = time.time()
    for spec in specs("h-", s.jobs):
        client.submit(NOOP, id=spec.id)
    submitted = time.time()
    wait_for("the HTTP drain", lambda: watch.ended("h-") == s.jobs, s.timeout_s, 0.005)
    t1 = time.time()
    states = watch.states("h-")
    if states.get("done") != s.jobs:
        raise BenchError(f"HTTP drain: not every job done: {states}")
    return {
        "drain_jobs_per_s": round(s.jobs / (t1 - t0), 2),
        "drain_s": round(t1 - t0, 3),
        "submits_per_s": round(s.jobs / (submitted - t0), 2),
    }


def wait_stamp(watch: Watch, job_id: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (stamp := watch.stamp(job_id)) is None:
        if time.monotonic() > deadline:
            raise BenchError(f"gave up after {timeout_s:g} s waiting for stamp job {job_id}")
        time.sleep(0.001)
    return stamp


def idle_starts(
    tag: str, submit: Callable[[JobSpec], None], watch: Watch, s: Settings
) -> list[float]:
    """Submit one stamp job at a time on an idle broker; submit -> first instruction, ms."""
    out: list[float] = []
    for spec in specs(f"{tag}-", s.starts, STAMP):
        time.sleep(0.05)  # let the broker go idle (its loop waits for work)
        t0 = time.time_ns()
        submit(spec)
        got = wait_stamp(watch, spec.id, s.timeout_s)
        if got <= 0:
            raise BenchError(f"stamp job {spec.id} printed no clock reading")
        out.append((got - t0) / 1e6)
    return out


def run_gpuwarden(tmp: Path, s: Settings) -> dict[str, Any]:
    cfg = write_config(tmp, s)
    token = make_token(cfg) if s.http else ""
    db = tmp / "state" / "gpuwarden.db"
    out: dict[str, Any] = {}
    with running_broker(tmp, cfg, s) as b:
        wait_ready(b, s)
        store = SqliteStore(db)
        out["store_settings"] = store.durability()
        watch = Watch(db)
        say(f"drain: {s.jobs} no-op jobs in one bundle")
        out["bundle"] = drain_bundle(tmp, watch, s)
        say(f"idle starts: {s.starts} stamp jobs one at a time (store, bundle, http)")
        starts = {
            "store": idle_starts("s", lambda j: store.submit([j], now=time.time()), watch, s),
            "bundle": idle_starts(
                "b",
                lambda j: write_bundle(tmp / "queue" / "inbox", [j], now=time.time()) and None,
                watch,
                s,
            ),
        }
        if s.http:
            with Client(b.url, token) as client:
                say(f"drain: {s.jobs} no-op jobs over HTTP, one POST each")
                out["http"] = drain_http(client, watch, s)
                starts["http"] = idle_starts(
                    "w", lambda j: client.submit(STAMP, id=j.id) and None, watch, s
                )
        out["starts"] = starts
        b.alive()
    store.close()
    return out


# -- task-spooler -------------------------------------------------------------------


def run_tsp(tmp: Path, s: Settings) -> dict[str, Any]:
    folder = tmp / "tsp"
    folder.mkdir()
    env = {**os.environ, "TS_SOCKET": str(folder / "socket"), "TMPDIR": str(folder)}
    env["TS_MAXFINISHED"] = str(s.jobs + s.starts + 10)
    true = shutil.which("true") or "/bin/true"
    date = shutil.which("date") or "/bin/date"

    def tsp(*args: str) -> str:
        done = subprocess.run(["tsp", *args], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"tsp {' '.join(args)}: exit {done.returncode}: {done.stderr}")
        return done.stdout.strip()

    tsp("-S", str(s.slots))  # starts its server
    try:
        say(f"tsp: {s.jobs} `tsp {true}` submissions, then waiting for the last")
        t0 = time.time()
        ids = [tsp("-n", true) for _ in range(s.jobs)]
        submitted = time.time()
        for job in ids[-s.slots :]:  # FIFO on s.slots slots: the last to end
            tsp("-w", job)
        t1 = time.time()
        starts: list[float] = []
        for _ in range(s.starts):
            time.sleep(0.05)
            t = time.time_ns()
            job = tsp(date, "+%s%N")
            tsp("-w", job)
            stamp = Path(tsp("-o", job)).read_text().strip()
            starts.append((int(stamp) - t) / 1e6)
    finally:
        with contextlib.suppress(BenchError):
            tsp("-K")
    return {
        "drain_jobs_per_s": round(s.jobs / (t1 - t0), 2),
        "drain_s": round(t1 - t0, 3),
        "submits_per_s": round(s.jobs / (submitted - t0), 2),
        "starts": starts,
    }


# -- report -------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def report(s: Settings, gw: dict[str, Any], tsp: dict[str, Any] | None) -> dict[str, Any]:
    starts: dict[str, list[float]] = gw["starts"]
    settings = gw["store_settings"]
    print(
        f"throughput: {s.jobs} no-op host jobs on {s.slots} slots; idle starts: {s.starts} "
        f"per path; store: journal_mode={settings['journal_mode']} "
        f"synchronous={settings['synchronous']}"
    )
    print(f"  {'what':<44} {'jobs/s':>9} {'p50_ms':>8} {'p99_ms':>8}")
    rows: list[tuple[str, float | None, list[float]]] = [
        ("gpuwarden drain, one bundle", gw["bundle"]["drain_jobs_per_s"], []),
    ]
    if "http" in gw:
        http_rate = gw["http"]["drain_jobs_per_s"]
        rows.append(("gpuwarden drain, HTTP (one POST per job)", http_rate, []))
    for path, values in starts.items():
        rows.append((f"gpuwarden idle submit -> start ({path})", None, values))
    if tsp is not None:
        rows.append(("task-spooler drain", tsp["drain_jobs_per_s"], []))
        rows.append(("task-spooler idle submit -> start", None, tsp["starts"]))
    for label, rate, values in rows:
        r = f"{rate:9.1f}" if rate is not None else f"{'':>9}"
        p = summary(values)
        p50 = f"{p['start_p50_ms']:8.2f}" if values else f"{'':>8}"
        p99 = f"{p['start_p99_ms']:8.2f}" if values else f"{'':>8}"
        print(f"  {label:<44} {r} {p50} {p99}")
    noop = {"drain_jobs_per_s": gw["bundle"]["drain_jobs_per_s"], **summary(starts["store"])}
    peer: dict[str, Any] = {"drain_jobs_per_s": None, "start_p50_ms": None, "start_p99_ms": None}
    if tsp is not None:
        peer = {"drain_jobs_per_s": tsp["drain_jobs_per_s"], **summary(tsp["starts"])}
    out: dict[str, Any] = {
        "noop": noop,
        "tsp": peer,
        "ratio_drain": ratio(noop["drain_jobs_per_s"], peer["drain_jobs_per_s"]),
        "ratio_start_p50": ratio(noop["start_p50_ms"], peer["start_p50_ms"]),
        "jobs": s.jobs,
        "slots": s.slots,
        "synchronous": settings["synchronous"],
        "bundle": gw["bundle"],
        "starts": {k: summary(v) for k, v in starts.items()},
    }
    if "http" in gw:
        out["http"] = gw["http"]
    if out["ratio_drain"] is not None:
        print(
            f"  ratios: drain {out['ratio_drain']}x task-spooler's (target >= 1); idle start "
            f"p50 {out['ratio_start_p50']}x task-spooler's (target <= 2)"
        )
    return out


def print_profile(path: Path) -> None:
    if path.exists():
        say("broker profile (main thread, cumulative):")
        pstats.Stats(str(path), stream=sys.stderr).sort_stats("cumulative").print_stats(40)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gw-throughput-"))
    ok = False
    try:
        gw = run_gpuwarden(tmp, s)
        tsp = run_tsp(tmp, s) if s.tsp else None
        result = report(s, gw, tsp)
        if s.profile:
            print_profile(tmp / "broker.prof")
        print(json.dumps(result), flush=True)
        ok = True
        return 0
    except BenchError as exc:
        say(f"throughput: {exc}")
        return 1
    finally:
        if s.keep or not ok:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
