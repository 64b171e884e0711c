"""Throughput benchmark: N echo jobs through a queue root and a real broker.

Starts ``python -m gpuwarden --mock-gpu --config <tmp> serve`` as a subprocess
(temporary state directory and queue root), drops N echo jobs into the queue
root's ``inbox/`` as zip bundles (the client path, ``write_bundle``), waits for
every result bundle in ``outbox/`` (or ``failed/``), stops the broker with
SIGTERM, and prints jobs per second and latencies. The last line of stdout is
one JSON object::

    {"jobs": N, "jobs_per_s": ..., "start_p50_ms": ..., "start_p99_ms": ...,
     "result_p50_ms": ..., "result_p99_ms": ...}

How each time is taken (all are wall-clock ``time.time()`` on this one host, so
the client's and the broker's clocks are the same clock):

- submit: the client-side time right after ``write_bundle`` returned, that is
  once the bundle was fsynced and renamed into ``inbox/``: the moment a client
  has handed the job over. Every job of a bundle shares its bundle's time.
- start: the ``ts`` of the job's first ``transition`` event to ``running`` in the
  broker's event log (``serve --log``). That is the broker's clock at the top of
  the scheduling step that started the attempt, the value the store records as
  the attempt's ``started_at``. The launcher's own start (``timings.started_at``
  in result.json, taken in the worker thread just before it spawns the process)
  is shown beside it as a cross-check.
- result: the first time a background thread of this script saw the result's
  name in a listing of ``outbox/`` (or ``failed/``), polled every
  ``--result-poll`` seconds: what a client watching the folder observes, late by
  at most one poll interval. The result file's mtime (its last write before the
  fsync and rename, so a lower bound) is shown beside it as a cross-check.
- throughput: N / (last result seen - first submit).

Usage::

    .venv/bin/python bench/throughput.py [--jobs 200] [--batch 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pstats
import random
import resource
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from gpuwarden.core.model import JobSpec
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle

REPO = Path(__file__).resolve().parents[1]
JOB_TYPE = "echo.echo"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


# -- settings -------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    jobs: int
    batch: int
    seed: int
    cpu_slots: int
    poll_interval_s: float
    status_interval_s: float
    result_poll_s: float
    timeout_s: float
    keep: bool
    profile: bool
    rate: float

    @property
    def bundles(self) -> int:
        return math.ceil(self.jobs / self.batch)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(
        description="Push N echo jobs through a queue root and a real broker; "
        "print jobs/s and p50/p99 latencies (last stdout line: JSON).",
    )
    p.add_argument("--jobs", type=int, default=200, help="number of echo jobs (default 200)")
    p.add_argument("--batch", type=int, default=1, help="jobs per bundle (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for the job texts (default 0)")
    p.add_argument(
        "--cpu-slots",
        type=int,
        default=os.cpu_count() or 1,
        help="broker cpu_slots: cpu-lane jobs run at once (default: os.cpu_count())",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.02,
        help="broker poll_interval_s, its sleep between loop ticks (default 0.02)",
    )
    p.add_argument(
        "--status-interval",
        type=float,
        default=2.0,
        help="broker status_interval_s (default 2, the product default)",
    )
    p.add_argument(
        "--result-poll",
        type=float,
        default=0.005,
        help="seconds between listings of outbox/ by this script (default 0.005)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="submit at most this many bundles per second (default 0: as fast as possible, "
        "so latencies include the backlog; a rate below the throughput shows the "
        "broker's own latency)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the broker under cProfile (its main thread, the loop, only: not the "
        "launcher threads) and print the top functions; slows the broker down",
    )
    a = p.parse_args(argv)
    if a.jobs < 1 or a.batch < 1 or a.cpu_slots < 1:
        p.error("--jobs, --batch and --cpu-slots must be at least 1")
    if a.poll_interval <= 0 or a.result_poll <= 0 or a.status_interval <= 0:
        p.error("intervals must be > 0")
    return Settings(
        jobs=a.jobs,
        batch=a.batch,
        seed=a.seed,
        cpu_slots=a.cpu_slots,
        poll_interval_s=a.poll_interval,
        status_interval_s=a.status_interval,
        result_poll_s=a.result_poll,
        timeout_s=a.timeout,
        keep=a.keep,
        profile=a.profile,
        rate=max(a.rate, 0.0),
    )


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the broker -------------------------------------------------------------------


def _toml_str(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string here


def write_config(tmp: Path, s: Settings) -> Path:
    cfg = tmp / "bench.toml"
    cfg.write_text(
        "\n".join(
            [
                f"state_dir = {_toml_str(tmp / 'state')}",
                'node_name = "bench"',
                'gpu = "sim"',
                f"module_paths = [{_toml_str(REPO / 'src' / 'gpuwarden' / 'modules')}]",
                f"queue_roots = [{_toml_str(tmp / 'queue')}]",
                "create_queue_roots = true",
                "",
                "[broker]",
                f"cpu_slots = {s.cpu_slots}",
                f"poll_interval_s = {s.poll_interval_s}",
                f"status_interval_s = {s.status_interval_s}",
                "shutdown_grace_s = 10",
                "",
            ]
        )
    )
    return cfg


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    log_path: Path
    events_path: Path
    started: float
    ready_s: float = math.nan

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@contextlib.contextmanager
def running_broker(tmp: Path, cfg: Path, prof: Path | None) -> Iterator[Broker]:
    """Start ``gpuwarden serve``; SIGTERM it (then SIGKILL) when the block ends,
    however it ends."""
    events = tmp / "events.jsonl"
    log_path = tmp / "broker.log"
    profile = [] if prof is None else ["-m", "cProfile", "-o", str(prof)]
    argv = [
        sys.executable,
        *profile,
        "-m",
        "gpuwarden",
        "--mock-gpu",
        "--config",
        str(cfg),
        "serve",
        "--log",
        str(events),
    ]
    say(f"starting broker: {' '.join(argv)}")
    with log_path.open("wb") as log_f:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_f,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            start_new_session=True,  # our Ctrl-C does not reach it; we stop it ourselves
        )
    broker = Broker(proc=proc, log_path=log_path, events_path=events, started=time.time())
    try:
        yield broker
    finally:
        stop_broker(broker)


def stop_broker(b: Broker) -> None:
    if b.proc.poll() is not None:
        return
    say(f"stopping broker (SIGTERM to PID {b.proc.pid})")
    b.proc.send_signal(signal.SIGTERM)
    try:
        b.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say(f"broker still running after {STOP_TIMEOUT_S:g} s: SIGKILL")
        b.proc.kill()
        b.proc.wait()


def broker_cpu(b: Broker) -> tuple[float, float] | None:
    """(the broker process's own CPU seconds, its reaped children's: the jobs),
    read just before it is stopped; None when it cannot be read."""
    try:
        t = psutil.Process(b.proc.pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system, t.children_user + t.children_system


def wait_ready(b: Broker, inbox: Path) -> None:
    """Ready = the queue root's inbox/ exists and the event log holds the
    ``broker_started`` event, which the loop writes at the end of its first tick
    (after the store, probe, registry and queue roots are open)."""
    say(f"waiting for the broker: {inbox} to exist and 'broker_started' in {b.events_path}")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if b.proc.poll() is not None:
            raise BenchError(
                f"the broker exited with code {b.proc.returncode} before it was ready:\n{b.tail()}"
            )
        if inbox.is_dir() and b.events_path.exists():
            with b.events_path.open() as f:
                if any('"broker_started"' in line for line in f):
                    b.ready_s = time.time() - b.started
                    say(f"broker ready after {b.ready_s:.2f} s")
                    return
        time.sleep(0.01)
    raise BenchError(f"the broker was not ready after {READY_TIMEOUT_S:g} s:\n{b.tail()}")


# -- submitting and watching ------------------------------------------------------


class BenchError(Exception):
    pass


@dataclass
class Submitted:
    name: str
    job_ids: list[str]
    at: float  # client time right after write_bundle returned


@dataclass
class Watcher:
    """A thread that lists outbox/ and failed/ and notes when each name first shows."""

    folders: tuple[Path, ...]
    interval_s: float
    seen: dict[str, tuple[float, Path]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    listings: int = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.scan()
            self.stop.wait(self.interval_s)

    def scan(self) -> None:
        now = time.time()
        self.listings += 1
        for folder in self.folders:
            with os.scandir(folder) as it:
                for entry in it:
                    name = entry.name
                    if name.startswith(".") or not name.endswith(".zip"):
                        continue  # a result still being written (.<name>.tmp)
                    if name not in self.seen:
                        self.seen[name] = (now, Path(entry.path))


def make_bundles(s: Settings) -> list[list[JobSpec]]:
    rng = random.Random(s.seed)
    specs = [
        JobSpec(
            id=f"bench-s{s.seed}-{i:06d}",
            type=JOB_TYPE,
            params={"text": "".join(rng.choices(string.ascii_letters + string.digits, k=32))},
        )
        for i in range(s.jobs)
    ]
    return [specs[i : i + s.batch] for i in range(0, len(specs), s.batch)]


def submit_all(inbox: Path, bundles: list[list[JobSpec]], rate: float) -> list[Submitted]:
    out: list[Submitted] = []
    t0 = time.monotonic()
    for i, specs in enumerate(bundles):
        if rate > 0:
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        path = write_bundle(inbox, specs, now=time.time())
        out.append(Submitted(name=path.name, job_ids=[j.id for j in specs], at=time.time()))
    return out


def wait_results(
    watcher: Watcher, broker: Broker, names: set[str], jobs_per: dict[str, int], s: Settings
) -> None:
    total = sum(jobs_per.values())
    tty = sys.stderr.isatty()
    deadline = time.monotonic() + s.timeout_s
    last_line = 0.0
    while True:
        done = [n for n in names if n in watcher.seen]
        got = sum(jobs_per[n] for n in done)
        now = time.monotonic()
        if tty:
            print(f"\rresults {got}/{total}", end="", file=sys.stderr, flush=True)
        elif now - last_line >= 1.0 or got == total:
            say(f"results {got}/{total}")
            last_line = now
        if got == total:
            if tty:
                print(file=sys.stderr)
            return
        if broker.proc.poll() is not None:
            raise BenchError(
                f"the broker exited with code {broker.proc.returncode} with "
                f"{total - got} results missing:\n{broker.tail()}"
            )
        if now > deadline:
            raise BenchError(f"gave up after {s.timeout_s:g} s: {got}/{total} results")
        time.sleep(0.1)


# -- analysis ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def read_events(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with path.open() as f:
        for raw in f:
            line = raw.strip()
            if line:
                out.append(json.loads(line))
    return out


@dataclass
class JobTimes:
    submit: float
    result_seen: float | None = None
    result_mtime: float | None = None
    intake: float | None = None  # "submitted" event: the broker stored the job
    start: float | None = None  # first transition to running (event log)
    end: float | None = None  # last transition to a terminal state (event log)
    launch_start: float | None = None  # result.json timings.started_at (launcher)
    launch_end: float | None = None  # result.json timings.ended_at
    status: str = "missing"
    attempts: int = 0


def ms(x: float) -> float:
    return round(x * 1000.0, 1)


def stat_line(label: str, values: Sequence[float]) -> str:
    if not values:
        return f"  {label:<38} (no data)"
    return (
        f"  {label:<38} p50 {ms(percentile(values, 50)):8.1f}   "
        f"p99 {ms(percentile(values, 99)):8.1f}   max {ms(max(values)):8.1f}   (n={len(values)})"
    )


def _on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the broker


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with it ignored
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-bench-"))
    ok = False
    try:
        ok = run(s, tmp)
    except BenchError as exc:
        say(f"bench failed: {exc}")
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        if s.keep or not ok:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


def run(s: Settings, tmp: Path) -> bool:
    cfg = write_config(tmp, s)
    queue = tmp / "queue"
    inbox, outbox, failed = queue / "inbox", queue / "outbox", queue / "failed"
    bundles = make_bundles(s)
    prof = tmp / "broker.prof" if s.profile else None
    with running_broker(tmp, cfg, prof) as broker:
        wait_ready(broker, inbox)
        watcher = Watcher(folders=(outbox, failed), interval_s=s.result_poll_s)
        thread = threading.Thread(target=watcher.run, name="outbox-watcher", daemon=True)
        thread.start()
        try:
            pace = f" at {s.rate:g} bundles/s" if s.rate > 0 else " as fast as possible"
            say(f"submitting {s.jobs} jobs in {len(bundles)} bundles of up to {s.batch}{pace}")
            t_submit0 = time.time()
            submitted = submit_all(inbox, bundles, s.rate)
            t_submit1 = time.time()
            say(f"submitted in {t_submit1 - t_submit0:.2f} s")
            names = {b.name for b in submitted}
            jobs_per = {b.name: len(b.job_ids) for b in submitted}
            wait_results(watcher, broker, names, jobs_per, s)
        finally:
            watcher.stop.set()
            thread.join()
        t_last = max(watcher.seen[n][0] for n in names)
        cpu = broker_cpu(broker)
        own_cpu = resource.getrusage(resource.RUSAGE_SELF)
    if broker.proc.returncode != 0:
        raise BenchError(f"the broker exited with code {broker.proc.returncode}:\n{broker.tail()}")

    # -- join what the client saw with the broker's event log and result bundles
    times: dict[str, JobTimes] = {}
    bundle_of: dict[str, str] = {}
    for b in submitted:
        for jid in b.job_ids:
            times[jid] = JobTimes(submit=b.at)
            bundle_of[jid] = b.name
    by_bundle: dict[str, list[str]] = {b.name: b.job_ids for b in submitted}
    for name, (seen_at, path) in watcher.seen.items():
        if name not in by_bundle:
            continue
        mtime = path.stat().st_mtime
        results = read_result_bundle(path)
        for jid in by_bundle[name]:
            t = times[jid]
            t.result_seen, t.result_mtime = seen_at, mtime
            r = results.get(jid)
            if r is None:
                t.status = "no result for the job in its result bundle"
                continue
            t.status = str(r.get("status"))
            t.attempts = int(r.get("attempts") or 0)
            timings = r.get("timings") or {}
            t.launch_start = timings.get("started_at")
            t.launch_end = timings.get("ended_at")

    events = read_events(broker.events_path)
    kinds = Counter(str(e.get("event")) for e in events)
    running_now = 0
    peak_running = 0
    for e in events:
        kind, job = e.get("event"), e.get("job")
        if not isinstance(job, str) or job not in times:
            continue
        t = times[job]
        if kind == "submitted" and t.intake is None:
            t.intake = e["ts"]
        elif kind == "transition" and e.get("to") == "running":
            running_now += 1
            peak_running = max(peak_running, running_now)
            if t.start is None:
                t.start = e["ts"]
        elif kind == "transition" and e.get("from") == "running":
            running_now -= 1
            if e.get("to") in ("done", "failed", "cancelled"):
                t.end = e["ts"]

    jt = list(times.values())
    statuses = Counter(t.status for t in jt)
    start_lat = [t.start - t.submit for t in jt if t.start is not None]
    result_lat = [t.result_seen - t.submit for t in jt if t.result_seen is not None]
    wall = t_last - t_submit0
    jobs_per_s = s.jobs / wall if wall > 0 else math.nan

    def span(a: str, b: str) -> list[float]:
        out = []
        for t in jt:
            x, y = getattr(t, a), getattr(t, b)
            if x is not None and y is not None:
                out.append(y - x)
        return out

    # -- human-readable summary
    print("gpuwarden throughput benchmark")
    print(f"  python            {sys.executable}")
    print(f"  job type          {JOB_TYPE} (cpu lane, host launch: one Python process per job)")
    pace = f"at {s.rate:g} bundles/s" if s.rate > 0 else "as fast as possible"
    print(
        f"  jobs              {s.jobs} in {len(bundles)} bundles of up to {s.batch} "
        f"(seed {s.seed}), submitted {pace}"
    )
    print(
        f"  broker settings   cpu_slots={s.cpu_slots} poll_interval_s={s.poll_interval_s:g} "
        f"status_interval_s={s.status_interval_s:g} --mock-gpu, SQLite in a temp state dir"
    )
    print(f"  host              {os.cpu_count()} CPUs; outbox polled every {s.result_poll_s:g} s")
    print(f"  broker ready in   {broker.ready_s:.2f} s (process start, not counted below)")
    print(f"  submit            {t_submit1 - t_submit0:.3f} s for {len(bundles)} bundles")
    print(f"  wall              {wall:.3f} s (first submit -> last result seen)")
    print(f"  throughput        {jobs_per_s:.2f} jobs/s")
    if cpu is not None:
        print(
            f"  CPU seconds       broker process {cpu[0]:.2f} ({cpu[0] / wall:.0%} of one core "
            f"over the wall time), its job processes {cpu[1]:.2f}, this client "
            f"{own_cpu.ru_utime + own_cpu.ru_stime:.2f}"
        )
    held = sum(span("start", "end"))
    ran = sum(span("launch_start", "launch_end"))
    print(
        f"  slot use          attempts held {held / (s.cpu_slots * wall):.0%} of cpu_slots x wall "
        f"(running -> terminal event), their processes ran {ran / (s.cpu_slots * wall):.0%} "
        "(launcher start -> end)"
    )
    print(f"  peak running      {peak_running} attempts at once (from the event log)")
    print(f"  outcome           {dict(statuses)}")
    print("latency, ms:")
    print("  (submit: client clock right after write_bundle returned, bundle renamed into inbox/;")
    print("   start: ts of the job's first 'running' transition in the broker's event log, the")
    print("   broker clock at the top of the scheduling step that started it;")
    print(f"   result: first seen in a listing of outbox/, polled every {s.result_poll_s:g} s)")
    print(stat_line("submit -> start", start_lat))
    print(stat_line("submit -> result", result_lat))
    print("stages, ms (where the time goes):")
    print(stat_line("submit -> stored (intake, 'submitted')", span("submit", "intake")))
    print(stat_line("stored -> running (queue wait)", span("intake", "start")))
    print(stat_line("running -> launcher start", span("start", "launch_start")))
    print(stat_line("launcher start -> end (attempt run)", span("launch_start", "launch_end")))
    print(stat_line("launcher end -> terminal transition", span("launch_end", "end")))
    print(stat_line("terminal -> result written (its mtime)", span("end", "result_mtime")))
    print(stat_line("result mtime -> seen in outbox/", span("result_mtime", "result_seen")))
    print(f"events logged     {sum(kinds.values())} ({dict(sorted(kinds.items()))})")

    if prof is not None and prof.exists():
        print("broker main thread, cProfile, top 25 by cumulative time:")
        stats = pstats.Stats(str(prof), stream=sys.stdout)
        stats.strip_dirs().sort_stats("cumulative").print_stats(25)

    bad = [jid for jid, t in times.items() if t.status != "done"]
    ok = not bad and len(start_lat) == s.jobs
    if bad:
        print(f"FAILED: {len(bad)} of {s.jobs} jobs did not end done, e.g.:")
        for jid in bad[:10]:
            print(f"  {jid}: {times[jid].status} (bundle {bundle_of[jid]})")
    elif len(start_lat) != s.jobs:
        print(f"FAILED: only {len(start_lat)} of {s.jobs} jobs have a 'running' event")
    if not ok:
        say(f"bench FAILED: {len(bad)} of {s.jobs} jobs did not end done (see stdout)")

    print(
        json.dumps(
            {
                "jobs": s.jobs,
                "jobs_per_s": round(jobs_per_s, 3),
                "start_p50_ms": ms(percentile(start_lat, 50)),
                "start_p99_ms": ms(percentile(start_lat, 99)),
                "result_p50_ms": ms(percentile(result_lat, 50)),
                "result_p99_ms": ms(percentile(result_lat, 99)),
            }
        )
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
