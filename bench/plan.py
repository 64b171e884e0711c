"""One planning pass over a synthetic backlog, and the broker's memory holding it.

Part 1 (no broker, no processes): a seeded backlog of queued jobs (mixed
footprints, co-resident and exclusive types, three priorities, per-job
footprints on some, warm servers on some GPUs, ``--owners`` submitters with
their fair-share use; default 4: each owner is a class of its own) is put in a
:class:`gpuwarden.core.queueindex.QueueIndex` the way the broker loop keeps it,
and :func:`gpuwarden.core.policy.plan_pass` is timed over it, ``--passes`` times
(default 50) per size, on GPUs most of whose memory is held by running jobs (so a
backlog stays, as in a busy node). Each pass builds its lineups from the index as
the loop does (``Broker._lineup``: a lineup per class but for owner and own
footprint, its shelves kept between passes, built once before the passes are
timed). The sizes: 2,000 jobs on 8 GPUs and 100,000 on 64. Then the same over
an ad-hoc backlog (``plan_adhoc``): command jobs (``gpuwarden run --vram ... --
CMD``), each with its own footprint (GiB with one decimal, 0.5 to 79), four
command types, the same priorities and owners: thousands of distinct sizes.

Part 2 (a real broker): ``gpuwarden serve`` on a node without a GPU, with the
bench's module, ``--rss-jobs`` (default 100,000) jobs submitted to its store in
batches while it runs (``gpu = "none"``: its vram jobs wait, in 12 classes: three
types and three priorities); once its status says its queue index holds them all,
its RSS (psutil) is read.

Part 3 (the loop): the same backlog in an in-process broker (``Broker.tick()``),
the cost of the first tick (it loads the queue index) and of a tick once
nothing changes (``idle_tick``: ``queued``, ``load_ms``, ``p50_ms``, ``max_ms``).

Targets: a pass <= 2 ms p99 at 2,000 x 8 and <= 20 ms p99 at 100,000 x 64, for
both backlogs; RSS <= 300 MiB with 100,000 queued. The last line of stdout is
one JSON object: ``{"plan": {"2000x8": {"p50_ms", "p99_ms"}, "100000x64": {...}},
"plan_adhoc": {the same keys}, "rss_mib", "idle_tick": {...}}`` (with
``--smoke``, the sizes are 200x8 and 2000x16).

    .venv/bin/python bench/plan.py            # both parts (about a minute)
    .venv/bin/python bench/plan.py --no-rss   # part 1 only (no broker)
    .venv/bin/python bench/plan.py --smoke    # seconds: small sizes (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    GpuView,
    QueuedJob,
    SizedLineup,
    Snapshot,
    WarmView,
    plan_pass,
)
from gpuwarden.core.queueindex import QueueIndex
from gpuwarden.node.queue import Shelves, settle_memory

SEED = 14
GPU_GIB = 80
#: name, footprint GiB, co-resident, expected run time s (None: unknown), serve, weight
TYPES = [
    ("llm-70b", 70, False, 600.0, False, 0.06),
    ("llm-34b", 40, False, 300.0, False, 0.08),
    ("train-80g", 78, False, None, False, 0.03),
    ("vision-11b", 11, False, 45.0, False, 0.08),
    ("llm-8b", 16, True, 120.0, False, 0.15),
    ("diffusion", 20, True, 60.0, False, 0.12),
    ("whisper", 8, True, 90.0, False, 0.12),
    ("embed", 3, True, 15.0, True, 0.14),
    ("tts", 6, True, 30.0, True, 0.12),
    ("rerank", 2, True, 10.0, True, 0.10),
]
PRIORITIES = [(0, 0.7), (5, 0.2), (10, 0.1)]
#: the ad-hoc backlog's command types (``gpuwarden run --vram ... -- CMD``): they
#: declare no footprint, each job gives its own; name, co-resident, expected run
#: time s (None: unknown), serve, weight
ADHOC_TYPES = [
    ("command:train", False, None, False, 0.25),
    ("command:train[share]", True, None, False, 0.30),
    ("command:infer[share]", True, 120.0, False, 0.30),
    ("command:eval", False, 600.0, False, 0.15),
]


def backlog(n: int, rng: random.Random) -> list[tuple[str, int, str, int, int | None]]:
    """``(id, seq, type, priority, per-job GiB or None)`` for n queued jobs."""
    names = [t[0] for t in TYPES]
    weights = [t[5] for t in TYPES]
    prios = [p for p, _ in PRIORITIES]
    pw = [w for _, w in PRIORITIES]
    out = []
    for seq in range(n):
        t = rng.choices(names, weights)[0]
        own = rng.choice([2, 4]) if rng.random() < 0.1 else None
        out.append((f"j{seq}", seq, t, rng.choices(prios, pw)[0], own))
    return out


def backlog_adhoc(n: int, rng: random.Random) -> list[tuple[str, int, str, int, int | None]]:
    """``(id, seq, type, priority, per-job bytes)`` for n queued command jobs, each
    with its own ``--vram`` in GiB with one decimal (mostly small, some big)."""
    names = [t[0] for t in ADHOC_TYPES]
    weights = [t[4] for t in ADHOC_TYPES]
    prios = [p for p, _ in PRIORITIES]
    pw = [w for _, w in PRIORITIES]
    out = []
    for seq in range(n):
        t = rng.choices(names, weights)[0]
        gib = rng.uniform(0.5, 24.0) if rng.random() < 0.8 else rng.uniform(24.0, 79.0)
        out.append((f"c{seq}", seq, t, rng.choices(prios, pw)[0], round(round(gib, 1) * GIB)))
    return out


def gpus_busy(g: int, rng: random.Random) -> tuple[list[GpuView], list[WarmView]]:
    """GPUs mostly full of running jobs, some with idle or busy warm servers."""
    views, warm = [], []
    serve_types = [t for t in TYPES if t[4]]
    for i in range(g):
        uuid = f"GPU-{i:04d}"
        holdings: list[Holding] = []
        used = 0
        if i < len(serve_types):  # one warm server per serve type, on the first GPUs
            name, gib, *_ = serve_types[i]
            holdings.append(
                Holding(f"warm-{name}", name, gib * GIB, True, HoldState.WARM, since=0.0)
            )
            warm.append(
                WarmView(name, uuid, f"warm-{name}", busy=rng.random() < 0.5, idle_since=0.0)
            )
            used += gib
        while used < GPU_GIB * 0.85:
            name, gib, co, est, _, _ = rng.choice([t for t in TYPES if t[2] and not t[4]])
            holdings.append(
                Holding(
                    f"r{i}-{len(holdings)}",
                    name,
                    gib * GIB,
                    co,
                    job_id=f"r{i}-{len(holdings)}",
                    since=0.0,
                    expected_end=None if est is None else 10.0 + est * rng.random(),
                )
            )
            used += gib
        views.append(GpuView(uuid, GPU_GIB * GIB, holdings=tuple(holdings), name="sim"))
    return views, warm


def lineups(shelves: Shelves[Any], warm: set[str], use: dict[str, float]) -> list[SizedLineup]:
    """What the loop builds before each pass (``Broker._lineup``): one lineup per
    class of the plan but for the owner and the job's own footprint, each owner's
    classes a shelf of it, by footprint (``node.queue.Shelves``, kept between
    passes as the loop keeps them)."""
    by_name = {t[0]: (t[0], t[1], t[2], t[3], t[4]) for t in TYPES}
    by_name.update((t[0], (t[0], 0, t[1], t[2], t[3])) for t in ADHOC_TYPES)
    out = []
    for sized, owners in shelves.groups().items():
        name, priority = sized
        _, gib, co, est, serve = by_name[name]

        def size(own: int | None, gib: int = gib) -> int:
            return max(gib * GIB, own or 0)

        job = QueuedJob(
            "",
            name,
            Lane.VRAM,
            0,
            priority,
            0,
            coresident=co,
            warm=name in warm,
            expected_s=est,
            serve=serve,
        )
        shelf_list = [shelves.shelf(sized, o, use.get(o, 0.0), size, gib) for o in owners]

        def size_of(job_id: str, size: Callable[[int | None], int] = size) -> int:
            key = shelves.index.key_of(job_id)
            return 0 if key is None else size(key[2])

        out.append(
            SizedLineup(sized, job, shelf_list, lambda own, s=sized: (s[0], s[1], own), size_of)
        )
    return out


def time_passes(
    n: int, g: int, passes: int, owners: int = 1, adhoc: bool = False
) -> dict[str, float]:
    """Time ``passes`` plan passes over n queued jobs on g GPUs: the typed backlog,
    or (``adhoc``) command jobs each with its own footprint."""
    rng = random.Random(SEED)
    who = random.Random(SEED + 1)  # owners drawn apart: the backlog stays the same
    names = [f"owner{i}" for i in range(owners)]
    use = {o: who.uniform(0.0, 500.0) for o in names}  # fair share: GiB-hours used
    index = QueueIndex()
    if adhoc:
        jobs = backlog_adhoc(n, rng)
    else:
        jobs = [
            (i, s, t, p, None if own is None else own * GIB) for i, s, t, p, own in backlog(n, rng)
        ]
    for job_id, seq, t, prio, own in jobs:
        index.add(job_id, seq, (t, prio, own, who.choice(names)))
    views, warm = gpus_busy(g, rng)
    settle_memory()  # as the broker does once it has read its queue in (node/queue.py)
    snapshot = Snapshot(queued=(), gpus=tuple(views), cpu_slots=4, warm=tuple(warm))
    warm_types = {w.type for w in warm}
    shelves = Shelves(index)
    lineups(shelves, warm_types, use)  # built once, as the loop's first tick builds them
    times = []
    decided = None
    for _ in range(passes):
        t0 = time.perf_counter()
        decided = plan_pass(lineups(shelves, warm_types, use), snapshot, now=100.0)
        times.append((time.perf_counter() - t0) * 1000)
    assert decided is not None
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    print(
        f"  {n:>7} jobs x {g:>2} GPUs: {len(index.classes()):>3} classes, "
        f"{len(decided.starts)} starts, {len(decided.waits)} waits, "
        f"{len(decided.evictions)} evictions; pass p50 {statistics.median(times):.3f} ms, "
        f"p99 {p99:.3f} ms, max {times[-1]:.3f} ms"
    )
    return {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(p99, 3)}


MODULE = """
[module]
name = "benchplan"
description = "Jobs that never start: the backlog of bench/plan.py (the node has no GPU)."
version = "1"

[types.a]
description = "A vram job of 4 GiB; on a node without a GPU it waits."
lane = "vram"
launch = "container"
command = ["/bin/true"]
vram_gib = 4
coresident = true

[types.b]
description = "A vram job of 10 GiB; on a node without a GPU it waits."
lane = "vram"
launch = "container"
command = ["/bin/true"]
vram_gib = 10
coresident = true

[types.c]
description = "A vram job of 20 GiB; on a node without a GPU it waits."
lane = "vram"
launch = "container"
command = ["/bin/true"]
vram_gib = 20
coresident = false
"""
TYPES_RSS = ["benchplan.a", "benchplan.b", "benchplan.c"]


def broker_rss(jobs: int, keep: bool) -> float | None:
    """Start a broker, queue ``jobs`` jobs in its store, read its RSS in MiB."""
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-bench-plan-"))
    (tmp / "modules" / "benchplan").mkdir(parents=True)
    (tmp / "modules" / "benchplan" / "module.toml").write_text(MODULE)
    config = tmp / "config.toml"
    config.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        f'module_paths = ["{tmp / "modules"}"]\n'
        'gpu = "none"\nallow_unsandboxed_containers = true\n'  # no GPU: vram jobs wait
        "[broker]\npoll_interval_s = 0.05\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gpuwarden", "--config", str(config), "serve"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return _fill_and_measure(proc, config, jobs)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if not keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)


def _fill_and_measure(proc: subprocess.Popen[bytes], config: Path, jobs: int) -> float | None:
    from gpuwarden.app import open_store  # the bench's own store handle
    from gpuwarden.config import load_config
    from gpuwarden.core.model import JobSpec

    cfg = load_config(config)
    store = open_store(cfg)
    deadline = time.monotonic() + 60
    while not store.node_statuses():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the broker did not start: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        time.sleep(0.1)
    base = psutil.Process(proc.pid).memory_info().rss / 2**20
    t0 = time.monotonic()
    batch = 5000
    for start in range(0, jobs, batch):
        specs = [
            JobSpec(id=f"q{i}", type=TYPES_RSS[i % 3], priority=(0, 0, 5, 10)[i % 4])
            for i in range(start, min(jobs, start + batch))
        ]
        store.submit(specs, now=time.time())
        print(f"\r  queued {min(jobs, start + batch):>7} / {jobs}", end="", flush=True)
    print(f" in {time.monotonic() - t0:.1f} s; waiting for the broker to hold them all")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        statuses = store.node_statuses()
        held = statuses[0].payload.get("queued_indexed", 0) if statuses else 0
        if held >= jobs:
            break
        if proc.poll() is not None:
            raise SystemExit("the broker exited while the jobs were queued")
        time.sleep(0.5)
    else:
        print("  ! the broker did not report every job indexed within 300 s")
        return None
    time.sleep(1.0)  # a few more ticks with the full queue
    rss = psutil.Process(proc.pid).memory_info().rss / 2**20
    print(f"  broker RSS: {base:.1f} MiB idle, {rss:.1f} MiB holding {jobs} queued jobs")
    store.close()
    return rss


def idle_ticks(jobs: int, ticks: int = 50) -> dict[str, float]:
    """Part 3: ``Broker.tick()`` in this process with ``jobs`` queued that cannot
    start (no GPU), once the index is loaded and the event log has caught up: what
    a tick costs when nothing changed, however long the queue."""
    from gpuwarden.app import open_node
    from gpuwarden.config import Config
    from gpuwarden.core.model import JobSpec

    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-bench-tick-"))
    (tmp / "modules" / "benchplan").mkdir(parents=True)
    (tmp / "modules" / "benchplan" / "module.toml").write_text(MODULE)
    config = Config.model_validate(
        {
            "state_dir": tmp / "state",
            "gpu": "none",
            "allow_unsandboxed_containers": True,
            "module_paths": [tmp / "modules"],
        }
    )
    try:
        with open_node(config, mock_gpu=False) as node:
            node.broker.recover()
            for start in range(0, jobs, 5000):
                node.store.submit(
                    [
                        JobSpec(id=f"q{i}", type=TYPES_RSS[i % 3], priority=(0, 0, 5, 10)[i % 4])
                        for i in range(start, min(jobs, start + 5000))
                    ],
                    now=time.time(),
                )
            t0 = time.perf_counter()
            node.broker.tick()
            load_ms = (time.perf_counter() - t0) * 1000
            for _ in range(jobs // 1000 + 10):  # the event log copies 1,000 a tick
                node.broker.tick()
            times = []
            for _ in range(ticks):
                t0 = time.perf_counter()
                node.broker.tick()
                times.append((time.perf_counter() - t0) * 1000)
            assert len(node.broker.queue) == jobs, "the index does not hold every job"
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    print(
        f"  idle broker tick with {jobs} queued: first tick (loads the index) {load_ms:.0f} ms; "
        f"then p50 {statistics.median(times):.3f} ms, max {max(times):.3f} ms over {ticks}"
    )
    return {
        "queued": jobs,
        "load_ms": round(load_ms, 1),
        "p50_ms": round(statistics.median(times), 3),
        "max_ms": round(max(times), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=50)
    ap.add_argument("--rss-jobs", type=int, default=100_000)
    ap.add_argument("--no-rss", action="store_true", help="skip part 2 (the real broker)")
    ap.add_argument("--smoke", action="store_true", help="small sizes, for the test suite")
    ap.add_argument(
        "--owners", type=int, default=4, help="submitters (fair share splits classes by owner)"
    )
    ap.add_argument("--keep", action="store_true", help="keep part 2's temporary folder")
    args = ap.parse_args()
    sizes = [(2000, 8), (100_000, 64)]
    if args.smoke:
        sizes, args.passes, args.rss_jobs = [(200, 8), (2000, 16)], 5, 2000
    print(f"plan: one plan_pass over a seeded backlog (seed {SEED}), {args.passes} passes each")
    out: dict[str, dict[str, float]] = {}
    for n, g in sizes:
        out[f"{n}x{g}"] = time_passes(n, g, args.passes, args.owners)
    print("plan_adhoc: the same over command jobs, each with its own footprint (--vram)")
    adhoc: dict[str, dict[str, float]] = {}
    for n, g in sizes:
        adhoc[f"{n}x{g}"] = time_passes(n, g, args.passes, args.owners, adhoc=True)
    rss = None if args.no_rss else broker_rss(args.rss_jobs, args.keep)
    tick = None if args.no_rss else idle_ticks(args.rss_jobs)
    if not args.smoke:
        print("targets:")
        for part, figures in (("plan", out), ("plan_adhoc", adhoc)):
            for key, goal in (("2000x8", 2.0), ("100000x64", 20.0)):
                p99 = figures[key]["p99_ms"]
                verdict = "PASS" if p99 <= goal else "FAIL"
                print(f"  {verdict}  {part} {key}: p99 {p99} ms <= {goal} ms")
        if rss is not None:
            print(f"  {'PASS' if rss <= 300 else 'FAIL'}  RSS {rss:.1f} MiB <= 300 MiB")
    print(
        json.dumps(
            {
                "plan": out,
                "plan_adhoc": adhoc,
                "rss_mib": None if rss is None else round(rss, 1),
                "idle_tick": tick,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
