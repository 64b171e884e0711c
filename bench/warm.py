"""Warm servers benchmark: real processes, then model loads on a seeded trace.

Part 1, ``warm`` (real processes, real broker, simulated GPU)
-------------------------------------------------------------
A module written at run time into a temporary folder has two job types doing the
same work: load a "model" (sleep ``--load-s``, then allocate ``--gib`` GiB on the
simulated GPU), then run the job (sleep ``--work-s``, write an output file).
``benchwarm.serve`` has ``launch = "serve"`` (one warm server loads once and
serves every job), ``benchwarm.host`` is a one-shot process per job (each job
pays the interpreter start and the load). Both declare the same footprint and do
not co-reside, so the GPU runs one job (or one server) at a time either way.

For each type, an in-process node (``gpuwarden.app.open_node(config,
mock_gpu=True)``, a fresh state directory, one simulated 24 GiB GPU) runs its
real loop (``Broker.recover()`` then ``Broker.run`` in a thread, poll interval
``--poll``); ``--jobs`` jobs are submitted at once with ``node.store.submit``
(the broker is woken right after); the main thread polls the store every 5 ms
until all are terminal. Per job, latency = the job's ``updated_at`` when it
ended (the broker's clock at the tick that recorded its end) minus its
``submitted_at``; jobs/s = jobs / (last end - submission). All submitted at
once, the latencies are mostly queueing: p50 is about half the run.

Part 3, ``fast`` (real processes: a handler that returns at once)
-----------------------------------------------------------------
What the broker itself costs per warm job. A module ``benchfast`` written at run
time has one serve type, ``benchfast.noop``, whose ``load`` and ``handle`` return
at once (no output file, 0.25 GiB declared, co-resident). The broker runs with
the config's default poll interval (``[broker] poll_interval_s`` = 0.1 s): a
figure under it shows that nothing waits for a poll. Two paths, each measured
after one warm-up job has loaded the server:

- ``warm_store``: an in-process node as in part 1; jobs go in with
  ``node.store.submit`` (then ``broker.wake()``), and the bench reads the store.
  ``result_p50_ms``: ``--fast-idle`` jobs one at a time, each from right before
  its submit until the bench saw it ``done`` (the store read every 0.5 ms).
  ``jobs_per_s``: ``--fast-jobs`` jobs submitted at once, N / (the last job's
  end, its ``updated_at``, minus the submission).
- ``warm_http``: ``gpuwarden serve --api 127.0.0.1:0`` in a subprocess, a
  submitter token made with ``gpuwarden token create``, and the Python client
  (``gpuwarden.client.Client``, one per thread, keep-alive).
  ``result_p50_ms``: ``--fast-idle`` jobs one at a time, each one request
  ``submit(..., wait=30)`` (the long poll: the answer carries the ended job);
  ``jobs_per_s``: ``--fast-jobs`` jobs over ``--fast-clients`` client threads,
  each submitting with ``wait`` in turn, N / (the last answer - the first submit).

Targets (PASS/FAIL lines): ``warm_http``'s ``jobs_per_s`` >= 1000 and its
``result_p50_ms`` <= 5 (issue 14).

Part 2, ``loads`` (virtual time, a seeded trace)
------------------------------------------------
The trace (fixed before any result was looked at; do not tune it) is below:
``MODELS`` (name, GiB) in order of popularity, ``ZIPF_S``, ``JOBS``,
``RATE_PER_S``, ``SERVICE_MEAN_S``, ``LOAD_S_PER_GIB``, ``SEED``. ``generate()``
draws with ``random.Random(SEED)``, for each job in turn: the gap to the previous
arrival from an exponential distribution of mean ``1 / RATE_PER_S`` (Poisson
arrivals), the model with weight ``1 / rank ** ZIPF_S`` (Zipf), the service time
``SERVICE_MEAN_S * uniform(0.5, 1.5)``. A model's load takes ``LOAD_S_PER_GIB``
seconds per GiB of its size. Every model is a co-resident serve type (a server
preallocates its size; real use = declared), so several share the one
``GPU_GIB`` GPU, but only some at once (the eight need 54 GiB).

Policies, each counting model loads over the same trace:

- ``gpuwarden``: ``replay.simulate.simulate`` with ``core.policy.plan``: warm
  servers as the broker drives them (one per model, one job at a time; a job
  whose model has a server waits for it, or starts it when idle; others start a
  server where they fit, else the idle servers cheapest to reload are evicted for
  them), order priority, then warm first, then arrival; idle grace
  ``KEEP_ALIVE_S``; an evicted server's memory shows free ``RECLAIM_DELAY_S``
  later. Loads: servers started.
- ``belady``: offline, no time: the requests in arrival order through a cache of
  ``GPU_GIB``; a request whose model is not loaded is one load; to make room the
  loaded model whose next request is furthest in the future (never: first) is
  unloaded, again until the new one fits (Belady's rule; with models of
  different sizes it is the reference the issue names, not a proven optimum).
- ``fcfs_lru``: first come first served with least-recently-used unloading after
  a keep-alive (how the issue describes Ollama's scheduling, its default 5 min
  keep-alive): the same simulator and device, with a planner (``FcfsLru``) that
  takes the requests strictly in arrival order. A request for a loaded model
  joins that model's queue (its server runs one job at a time) and the next
  request is taken; a request for a model not loaded starts loading it if it fits
  the free memory, else the idle models no earlier request is queued for are
  unloaded, least recently used first, until it fits (memory being freed counts),
  and it waits; while it waits no later request is taken (head of line). A model
  idle for ``KEEP_ALIVE_S`` with no request queued is unloaded. Loads: servers
  started.

The table also shows the seconds spent loading (the sum of the loads' times),
and for ``gpuwarden`` and ``fcfs_lru`` the makespan (the last job's end), the
mean, p95 (nearest rank) and max of arrival-to-end, how many jobs were handed to
a model already loaded (``warm``) and how many ended done. A context line gives
Belady's loads over the order in which gpuwarden started the jobs (gpuwarden
reorders the queue, so the arrival-order reference is not a bound for it).

Targets (PASS/FAIL lines; exit status 1 on any FAIL): ``gpuwarden``'s loads
within 1.3x ``belady``'s, and at most half of ``fcfs_lru``'s. The last line of
stdout is one JSON object::

    {"warm": {"warm_jobs_per_s", "oneshot_jobs_per_s", "warm_p50_ms",
     "oneshot_p50_ms"}, "warm_store": {"jobs_per_s", "result_p50_ms"},
     "warm_http": {"jobs_per_s", "result_p50_ms"},
     "loads": {"gpuwarden", "belady", "fcfs_lru"}}

A part that is skipped has ``null`` figures. Exit status 1 on any FAIL (not with
``--smoke``, whose sizes are too small to judge a target by).

Usage::

    .venv/bin/python bench/warm.py                # all three parts
    .venv/bin/python bench/warm.py --no-real      # part 2 only (about 20 s)
    .venv/bin/python bench/warm.py --no-fast      # parts 1 and 2
    .venv/bin/python bench/warm.py --jobs 50 --load-s 2
    .venv/bin/python bench/warm.py --smoke        # every part, tiny sizes (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.core.ledger import HoldState
from gpuwarden.core.model import GIB
from gpuwarden.core.policy import Decision, Evict, QueuedJob, Snapshot, Start, Wait, plan
from gpuwarden.replay.simulate import (
    Outcome,
    Planner,
    SimGpu,
    SimOptions,
    SimResult,
    TraceJob,
    simulate,
)

# --- part 2's trace: fixed before any result was looked at ----------------------------

SEED = 4
GPU_GIB = 24
JOBS = 2000
RATE_PER_S = 1.0  # Poisson arrivals
SERVICE_MEAN_S = 2.0  # a job's own run time: mean * uniform(0.5, 1.5)
LOAD_S_PER_GIB = 1.0  # a model's load time is proportional to its size
ZIPF_S = 1.0  # popularity of the model of rank r: 1 / r ** ZIPF_S
KEEP_ALIVE_S = 300.0  # gpuwarden's idle grace ([warm] idle_grace_s) and Ollama's keep-alive
RECLAIM_DELAY_S = 1.0  # an unloaded model's memory shows free this long after
#: (name, GiB), most popular first; 54 GiB in all on one 24 GiB GPU
MODELS = (
    ("chat-8b", 8),
    ("embed-1b", 2),
    ("chat-14b", 14),
    ("code-7b", 7),
    ("whisper", 3),
    ("vision-11b", 11),
    ("rerank-1b", 2),
    ("math-7b", 7),
)

TARGET_VS_BELADY = 1.3
TARGET_VS_FCFS = 0.5


def generate(seed: int = SEED, jobs: int = JOBS) -> list[TraceJob]:
    rng = random.Random(seed)
    weights = [1 / (rank**ZIPF_S) for rank in range(1, len(MODELS) + 1)]
    trace = []
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(RATE_PER_S)
        name, gib = rng.choices(MODELS, weights)[0]
        trace.append(
            TraceJob(
                id=f"j{i:05d}",
                type=name,
                arrival_s=t,
                duration_s=SERVICE_MEAN_S * rng.uniform(0.5, 1.5),
                vram_bytes=gib * GIB,
                coresident=True,
                serve=True,
                load_s=LOAD_S_PER_GIB * gib,
                idle_grace_s=KEEP_ALIVE_S,
            )
        )
    return trace


# --- the policies -----------------------------------------------------------------------


def belady_loads(trace: Sequence[TraceJob], capacity: int, *, ordered: bool = False) -> list[str]:
    """The models an offline cache that evicts the model needed furthest in the
    future loads, in order (one entry per load). The requests are taken in arrival
    order, or in the trace's own order if ``ordered``."""
    jobs = trace if ordered else sorted(trace, key=lambda t: t.arrival_s)
    requests = [t.type for t in jobs]
    size = {t.type: t.vram_bytes for t in trace}
    # next_use[i]: the index of the next request for requests[i]'s model after i
    next_use = [math.inf] * len(requests)
    last: dict[str, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = last.get(requests[i], math.inf)
        last[requests[i]] = i
    loaded: dict[str, float] = {}  # model -> index of its next request
    used = 0
    loads: list[str] = []
    for i, model in enumerate(requests):
        if model not in loaded:
            loads.append(model)
            while used + size[model] > capacity:
                victim = max(loaded, key=lambda m: (loaded[m], m))
                used -= size[victim]
                del loaded[victim]
            used += size[model]
        loaded[model] = next_use[i]
    return loads


class FcfsLru:
    """First come first served, least-recently-used unloading, a fixed keep-alive
    (one GPU). A planner for ``replay.simulate``; see the module's docstring."""

    def __init__(self, keep_alive_s: float) -> None:
        self.keep_alive_s = keep_alive_s

    def __call__(self, s: Snapshot, now: float) -> list[Decision]:
        [gpu] = s.gpus
        queue = sorted(s.queued, key=lambda q: q.seq)
        queued_types = {q.type for q in queue}
        servers = {w.type: w for w in s.warm}
        evictions: list[Decision] = []
        evicting: set[str] = set()

        def evict(holder: str, type_: str, why: str) -> None:
            evicting.add(holder)
            evictions.append(Evict(holder, type_, gpu.uuid, why))

        for view in s.warm:  # the keep-alive
            if view.busy or view.idle_since is None or view.type in queued_types:
                continue
            idle_s = now - view.idle_since
            if idle_s >= self.keep_alive_s:
                evict(view.holder, view.type, f"idle for {idle_s:.0f} s (keep-alive)")
        free = gpu.free_bytes
        coming = sum(h.bytes for h in gpu.holdings if h.state is HoldState.RECLAIMING)
        coming += sum(w_bytes(gpu.holdings, h) for h in evicting)
        decisions: list[Decision] = []
        referenced: set[str] = set()  # models an earlier request is queued for
        handed: set[str] = set()  # idle servers given a job in this pass
        blocked: QueuedJob | None = None
        for q in queue:
            if blocked is not None:
                decisions.append(Wait(q.id, f"behind {blocked.id} (first come, first served)"))
                continue
            w = servers.get(q.type)
            if q.type in referenced or (w is not None and w.holder not in evicting):
                referenced.add(q.type)
                if w is not None and not w.busy and q.type not in handed:
                    handed.add(q.type)
                    decisions.append(Start(q.id, gpu.uuid, warm=True))
                else:
                    decisions.append(Wait(q.id, "in its model's queue"))
                continue
            need = q.vram_bytes
            if need <= free:
                free -= need
                referenced.add(q.type)
                decisions.append(Start(q.id, gpu.uuid))
                continue
            blocked = q
            if need > free + coming:
                lru = sorted(
                    (
                        v
                        for v in s.warm
                        if not v.busy
                        and v.holder not in evicting
                        and v.type not in referenced
                        and v.type not in handed
                    ),
                    key=lambda v: (v.idle_since or 0.0, v.holder),
                )
                for v in lru:
                    if need <= free + coming:
                        break
                    coming += w_bytes(gpu.holdings, v.holder)
                    evict(v.holder, v.type, f"least recently used; room for {q.id}")
            decisions.append(Wait(q.id, "waits for memory to be freed"))
        return [*evictions, *decisions]


def w_bytes(holdings: Sequence[Any], holder: str) -> int:
    return sum(h.bytes for h in holdings if h.holder == holder)


@dataclass
class Row:
    policy: str
    loads: int
    load_s: float  # model-load seconds in all
    result: SimResult | None = None


def run_sim(trace: list[TraceJob], planner: Planner) -> SimResult:
    opts = SimOptions(reclaim_delay_s=RECLAIM_DELAY_S, idle_grace_s=KEEP_ALIVE_S)
    return simulate([SimGpu("GPU-0", GPU_GIB * GIB)], trace, planner, opts)


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def loads_part(jobs: int = JOBS) -> tuple[dict[str, int], bool]:
    trace = generate(jobs=jobs)
    span = trace[-1].arrival_s
    weights = [1 / (rank**ZIPF_S) for rank in range(1, len(MODELS) + 1)]
    total = sum(weights)
    print(
        f"loads: seed {SEED}, 1 x {GPU_GIB} GiB, {jobs} jobs over {span:.0f} s "
        f"({RATE_PER_S:g}/s Poisson), service {SERVICE_MEAN_S:g} s x uniform(0.5, 1.5), "
        f"load {LOAD_S_PER_GIB:g} s/GiB, Zipf s={ZIPF_S:g}, keep-alive {KEEP_ALIVE_S:g} s, "
        f"reclaim {RECLAIM_DELAY_S:g} s"
    )
    counts = {name: 0 for name, _ in MODELS}
    for t in trace:
        counts[t.type] += 1
    print(
        "  models: "
        + ", ".join(
            f"{n} {g} GiB {w / total:.0%} ({counts[n]})"
            for (n, g), w in zip(MODELS, weights, strict=True)
        )
    )
    load_s = {name: LOAD_S_PER_GIB * gib for name, gib in MODELS}
    rows = []
    for name, planner in (
        ("gpuwarden", plan),
        ("belady", None),
        ("fcfs_lru", FcfsLru(KEEP_ALIVE_S)),
    ):
        if planner is None:
            models = belady_loads(trace, GPU_GIB * GIB)
            rows.append(Row(name, len(models), sum(load_s[m] for m in models)))
            continue
        res = run_sim(trace, planner)
        rows.append(Row(name, res.model_loads, sum(load_s[s.type] for s in res.servers), res))
    print(
        f"  {'policy':<10} {'loads':>6} {'load_s':>7} {'makespan_s':>11} {'mean_s':>8} "
        f"{'p95_s':>8} {'max_s':>8} {'warm':>5} {'done':>5}"
    )
    for row in rows:
        r = row.result
        if r is None:
            print(
                f"  {row.policy:<10} {row.loads:>6} {row.load_s:>7.0f}   "
                "(offline: the requests in order, no time)"
            )
            continue
        c = r.completions
        warm = sum(1 for j in r.jobs.values() if j.served_warm)
        done = r.outcomes()[Outcome.DONE]
        print(
            f"  {row.policy:<10} {row.loads:>6} {row.load_s:>7.0f} {r.makespan_s:>11.1f} "
            f"{statistics.fmean(c):>8.1f} {nearest_rank(c, 0.95):>8.1f} {max(c):>8.1f} "
            f"{warm:>5} {done:>5}"
        )
    gw = rows[0].result
    assert gw is not None
    by_start = sorted(trace, key=lambda t: (gw.jobs[t.id].start_s or 0.0, t.arrival_s))
    again = belady_loads(by_start, GPU_GIB * GIB, ordered=True)
    print(
        f"  (context: belady over the order gpuwarden started the jobs in: {len(again)} loads, "
        f"{sum(load_s[m] for m in again):.0f} s)"
    )
    loads = {row.policy: row.loads for row in rows}
    ok = True
    print("targets:")
    for passed, what in (
        (
            loads["gpuwarden"] <= TARGET_VS_BELADY * loads["belady"],
            f"gpuwarden's loads within {TARGET_VS_BELADY}x belady's "
            f"({loads['gpuwarden'] / loads['belady']:.2f}x)",
        ),
        (
            loads["gpuwarden"] <= TARGET_VS_FCFS * loads["fcfs_lru"],
            f"gpuwarden's loads at most {TARGET_VS_FCFS}x fcfs_lru's "
            f"({loads['gpuwarden'] / loads['fcfs_lru']:.2f}x)",
        ),
    ):
        print(f"  {'PASS' if passed else 'FAIL'}  {what}")
        ok = ok and passed
    return loads, ok


# --- part 1: real processes ----------------------------------------------------------

MODULE_TOML = """\
[module]
name = "benchwarm"
description = "bench/warm.py: the same load and work, as a warm server or one process per job."

[types.serve]
lane = "vram"
launch = "serve"
command = ["{{python}}", "src/serve.py"]
vram_gib = {gib}
timeout_s = 120
load_timeout_s = 600

[types.serve.params.work_s]
type = "number"
default = 0.0

[types.host]
lane = "vram"
launch = "container"
command = ["{{python}}", "src/host.py"]
vram_gib = {gib}
timeout_s = 600

[types.host.params.work_s]
type = "number"
default = 0.0
"""

SERVE_PY = """\
import time

from gpuwarden.gpu import simclient
from gpuwarden.server.worker import serve

LOAD_S = {load_s!r}
NBYTES = {nbytes!r}


def load(ctx):
    gpu = simclient.attach()
    time.sleep(LOAD_S)
    gpu.allocate(NBYTES)
    return gpu


def handle(gpu, job):
    time.sleep(float(job.params["work_s"]))
    (job.output_dir / "out.txt").write_text("done")
    return "done"


serve(load, handle, device_bytes=lambda gpu: NBYTES)
"""

HOST_PY = """\
import json
import os
import time
from pathlib import Path

from gpuwarden.gpu import simclient

LOAD_S = {load_s!r}
NBYTES = {nbytes!r}

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
gpu = simclient.attach()
time.sleep(LOAD_S)
gpu.allocate(NBYTES)
time.sleep(float(params["work_s"]))
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "out.txt").write_text("done")
"""


def write_module(root: Path, load_s: float, gib: float) -> Path:
    mod = root / "modules" / "benchwarm"
    (mod / "src").mkdir(parents=True)
    nbytes = int(gib * GIB)
    (mod / "module.toml").write_text(MODULE_TOML.format(gib=gib))
    (mod / "src" / "serve.py").write_text(SERVE_PY.format(load_s=load_s, nbytes=nbytes))
    (mod / "src" / "host.py").write_text(HOST_PY.format(load_s=load_s, nbytes=nbytes))
    return mod.parent


def run_real(root: Path, modules: Path, kind: str, args: argparse.Namespace) -> dict[str, float]:
    from gpuwarden.app import open_node
    from gpuwarden.config import Config
    from gpuwarden.core.model import JobSpec
    from gpuwarden.intake.jobs import prepare

    config = Config.model_validate(
        {
            "state_dir": root / f"state-{kind}",
            "node_name": f"bench-{kind}",
            "gpu": "sim",
            "module_paths": [modules],
            # the warm protocol's own cost, measured on plain host processes: a serve
            # type needs a sandbox unless the node allows running it without one
            "allow_unsandboxed_containers": True,
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": args.poll},
            "vram": {"reserve_gib": 0},
            "warm": {"idle_grace_s": 300},
        }
    )
    with open_node(config, mock_gpu=True) as node:
        broker = node.broker
        broker.recover()
        stop = threading.Event()
        loop = threading.Thread(target=broker.run, args=(stop,), name="broker", daemon=True)
        loop.start()
        try:
            specs = [
                prepare(
                    broker.registry,
                    JobSpec(
                        id=f"{kind}-{i:04d}",
                        type=f"benchwarm.{kind}",
                        params={"work_s": args.work_s},
                    ),
                )
                for i in range(args.jobs)
            ]
            submitted = time.time()
            node.store.submit(specs, now=submitted)
            broker.wake()
            ids = [s.id for s in specs]
            ended: dict[str, tuple[str, float]] = {}
            deadline = time.monotonic() + args.timeout
            while len(ended) < len(ids):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: timed out with {len(ended)}/{len(ids)} jobs ended")
                for job_id in ids:
                    if job_id in ended:
                        continue
                    job = node.store.get_job(job_id)
                    if job is not None and job.state.terminal:
                        ended[job_id] = (job.state.value, job.updated_at - job.submitted_at)
                time.sleep(0.005)
        finally:
            stop.set()
            loop.join(timeout=60)
    bad = [f"{j} {state}" for j, (state, _) in ended.items() if state != "done"]
    if bad:
        raise SystemExit(f"{kind}: jobs did not end done: {', '.join(bad[:5])}")
    lat = [seconds for _, seconds in ended.values()]
    span = max(lat)
    return {
        "jobs_per_s": len(lat) / span,
        "p50_ms": statistics.median(lat) * 1000,
        "first_ms": min(lat) * 1000,
        "span_s": span,
    }


def warm_part(args: argparse.Namespace) -> dict[str, float]:
    print(
        f"warm: {args.jobs} jobs submitted at once, load {args.load_s:g} s, "
        f"work {args.work_s:g} s, {args.gib:g} GiB (one at a time on one simulated GPU), "
        f"poll {args.poll:g} s"
    )
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-warm-") as tmp:
        root = Path(tmp)
        modules = write_module(root, args.load_s, args.gib)
        serve = run_real(root, modules, "serve", args)
        host = run_real(root, modules, "host", args)
    print(f"  {'mode':<22} {'jobs/s':>8} {'p50_ms':>9} {'first_ms':>9} {'all_s':>7}")
    for name, r in (("warm server (serve)", serve), ("one-shot (host)", host)):
        print(
            f"  {name:<22} {r['jobs_per_s']:>8.2f} {r['p50_ms']:>9.0f} "
            f"{r['first_ms']:>9.0f} {r['span_s']:>7.1f}"
        )
    print(f"  warm server: {serve['jobs_per_s'] / host['jobs_per_s']:.1f}x the jobs/s")
    return {
        "warm_jobs_per_s": round(serve["jobs_per_s"], 2),
        "oneshot_jobs_per_s": round(host["jobs_per_s"], 2),
        "warm_p50_ms": round(serve["p50_ms"], 1),
        "oneshot_p50_ms": round(host["p50_ms"], 1),
    }


# --- part 3: the broker's own cost per warm job -------------------------------------

FAST_TOML = """\
[module]
name = "benchfast"
description = "bench/warm.py: a warm server whose handler returns at once."

[types.noop]
lane = "vram"
launch = "serve"
command = ["{python}", "src/serve.py"]
vram_gib = 0.25
coresident = true
timeout_s = 60
load_timeout_s = 60
"""

FAST_PY = """\
from gpuwarden.server.worker import serve

serve(lambda ctx: None, lambda model, job: None)
"""

FAST_TYPE = "benchfast.noop"
#: the long poll every HTTP submit of the bench asks for (seconds)
HTTP_WAIT_S = 30.0
TARGET_HTTP_JOBS_PER_S = 1000.0
TARGET_HTTP_P50_MS = 5.0


def write_fast_module(root: Path) -> Path:
    mod = root / "fast-modules" / "benchfast"
    (mod / "src").mkdir(parents=True)
    (mod / "module.toml").write_text(FAST_TOML)
    (mod / "src" / "serve.py").write_text(FAST_PY)
    return mod.parent


def fast_config(root: Path, modules: Path, name: str) -> dict[str, Any]:
    """The node's config: one simulated GPU, the default poll interval, an API
    that limits no rate (the bench is the only client)."""
    return {
        "state_dir": str(root / f"state-{name}"),
        "node_name": f"bench-{name}",
        "gpu": "sim",
        "module_paths": [str(modules)],
        "allow_unsandboxed_containers": True,
        "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
        "vram": {"reserve_gib": 0},
        "warm": {"idle_grace_s": 300},
        "api": {"rate_per_s": 1_000_000, "burst": 1_000_000},
    }


def fast_store(root: Path, modules: Path, args: argparse.Namespace) -> dict[str, float]:
    """``warm_store``: an in-process node; jobs through its store."""
    from gpuwarden.app import open_node
    from gpuwarden.config import Config
    from gpuwarden.core.model import JobSpec
    from gpuwarden.core.states import JobState
    from gpuwarden.intake.jobs import prepare

    config = Config.model_validate(fast_config(root, modules, "store"))
    with open_node(config, mock_gpu=True) as node:
        broker, store = node.broker, node.store
        broker.recover()
        stop = threading.Event()
        loop = threading.Thread(target=broker.run, args=(stop,), name="broker", daemon=True)
        loop.start()
        seq = iter(range(1_000_000))

        def submit(n: int) -> tuple[list[str], float]:
            specs = [
                prepare(broker.registry, JobSpec(id=f"f-{next(seq):06d}", type=FAST_TYPE))
                for _ in range(n)
            ]
            now = time.time()
            store.submit(specs, now=now)
            broker.wake()
            return [sp.id for sp in specs], now

        def ended(job_id: str, deadline: float) -> float:
            while True:
                job = store.get_job(job_id)
                if job is not None and job.state.terminal:
                    if job.state is not JobState.DONE:
                        raise SystemExit(f"warm_store: {job_id} ended {job.state.value}")
                    return time.perf_counter()
                if time.monotonic() > deadline:
                    raise SystemExit(f"warm_store: {job_id} did not end in {args.timeout:g} s")
                time.sleep(0.0005)

        try:
            deadline = time.monotonic() + args.timeout
            ended(submit(1)[0][0], deadline)  # the warm-up: loads the server
            idle = []
            for _ in range(args.fast_idle):
                t0 = time.perf_counter()
                [job_id], _ = submit(1)
                idle.append(ended(job_id, deadline) - t0)
            ids, submitted = submit(args.fast_jobs)
            while any(
                store.count_by_state().get(st, 0) for st in (JobState.QUEUED, JobState.RUNNING)
            ):
                if time.monotonic() > deadline:
                    raise SystemExit("warm_store: the jobs submitted at once did not all end")
                time.sleep(0.005)
            last = max(ended_at(store, j) for j in ids)
            rtt = exchange_rtt(broker, root, max(5, args.fast_idle))
        finally:
            stop.set()
            loop.join(timeout=60)
    return {
        "jobs_per_s": len(ids) / (last - submitted),
        "result_p50_ms": statistics.median(idle) * 1000,
        "result_p99_ms": nearest_rank(idle, 0.99) * 1000,
        "done": 1 + len(idle) + len(ids),  # every one was checked done
        "exchange_rtt_ms": rtt,
    }


def exchange_rtt(broker: Any, root: Path, n: int) -> float:
    """p50 ms of one job message to the idle warm server and its result, alone: the
    bench drives the server's ``WarmProcess`` itself (nothing is queued, so the
    loop leaves the idle server alone), with no slot, store or loop in the way."""
    [server] = list(broker.warm)
    where = root / "rtt"
    where.mkdir()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        server.worker.run_job(f"rtt-{i}", 1, {}, where, where, where, 10.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def alone_bounds(root: Path, n: int) -> dict[str, float]:
    """What one piece of a warm job's path costs alone, on the state directory's
    file system: a SQLite commit with ``synchronous=FULL`` (WAL, as the store),
    one ``mkdir`` + ``rmdir``, and one exchange slot made, emptied and removed."""
    import sqlite3

    from gpuwarden.node.attemptfs import ExchangeSlot

    where = root / "bounds"
    where.mkdir()
    db = sqlite3.connect(str(where / "t.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t (a)")

    def p50_us(step: Any) -> float:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e6, 1)

    def commit(i: int) -> None:
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t VALUES (?)", (i,))
        db.execute("COMMIT")

    def mkdir_rmdir(i: int) -> None:
        (where / f"d{i}").mkdir()
        (where / f"d{i}").rmdir()

    (where / "ex").mkdir()
    (where / "out").mkdir()

    def slot(i: int) -> None:
        one = ExchangeSlot(where / "ex", f"job-{i}-1")
        one.open(None)
        one.collect(where / "out")
        one.close()

    out = {
        "commit_full_us": p50_us(commit),
        "mkdir_rmdir_us": p50_us(mkdir_rmdir),
        "exchange_slot_us": p50_us(slot),
    }
    db.close()
    return out


def ended_at(store: Any, job_id: str) -> float:
    """When the job ended (the broker's clock), failing the bench unless it is done."""
    job = store.get_job(job_id)
    if job is None or job.state.value != "done":
        raise SystemExit(f"{job_id} did not end done: {job and job.state.value}")
    return float(job.updated_at)


class ApiNode:
    """``gpuwarden serve --api 127.0.0.1:0`` in a subprocess, and a submitter token."""

    def __init__(self, root: Path, modules: Path) -> None:
        import subprocess

        cfg = root / "http.toml"
        conf = fast_config(root, modules, "http")
        cfg.write_text(toml_of(conf))
        gw = [sys.executable, "-m", "gpuwarden", "--config", str(cfg)]
        made = subprocess.run(
            [*gw, "token", "create", "bench", "--role", "submitter", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if made.returncode != 0:
            raise SystemExit(f"warm_http: token create failed: {made.stderr.strip()}")
        self.token: str = json.loads(made.stdout)["token"]
        self.stderr = root / "serve.stderr"
        self.proc = subprocess.Popen(
            [*gw, "serve", "--api", "127.0.0.1:0", "--log", str(root / "events.jsonl")],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr.open("w"),
            start_new_session=True,
        )
        self.url = self._listening()

    def _listening(self) -> str:
        import re

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = self.stderr.read_text()
            if m := re.search(r"api\s+(http://127\.0\.0\.1:\d+)", text):
                return m.group(1)
            if self.proc.poll() is not None:
                raise SystemExit(f"warm_http: serve exited: {text.strip()[-2000:]}")
            time.sleep(0.05)
        raise SystemExit("warm_http: serve --api did not listen within 120 s")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


def toml_of(conf: dict[str, Any]) -> str:
    """The few TOML shapes :func:`fast_config` uses (strings, numbers, lists of
    strings, one level of tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    top = [f"{k} = {value(v)}" for k, v in conf.items() if not isinstance(v, dict)]
    tables = [
        f"\n[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in v.items())
        for k, v in conf.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


def fast_http(root: Path, modules: Path, args: argparse.Namespace) -> dict[str, float]:
    """``warm_http``: ``serve --api`` in a subprocess, jobs through the Python client."""
    from gpuwarden.client import Client

    node = ApiNode(root, modules)
    try:

        def one(c: Client) -> float:
            t0 = time.perf_counter()
            job = c.submit(FAST_TYPE, {}, wait=HTTP_WAIT_S)
            if job["state"] != "done":
                raise SystemExit(f"warm_http: {job['id']} came back {job['state']}")
            return time.perf_counter() - t0

        def timed(step: Any) -> float:
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

        with Client(node.url, node.token) as c:
            one(c)  # the warm-up: loads the server
            idle = [one(c) for _ in range(args.fast_idle)]
            # alone: one HTTP round trip (no store), and one submit without a wait
            health = [timed(c.health) for _ in range(max(5, args.fast_idle))]
            alone = [timed(lambda: c.submit(FAST_TYPE, {})) for _ in range(max(5, args.fast_idle))]
            c.wait(c.submit(FAST_TYPE, {}, wait=HTTP_WAIT_S)["id"], timeout=HTTP_WAIT_S)
        left = iter(range(args.fast_jobs))
        lock = threading.Lock()
        failed: list[BaseException] = []

        def client_thread() -> None:
            try:
                with Client(node.url, node.token) as c:
                    while True:
                        with lock:
                            if next(left, None) is None:
                                return
                        one(c)
            except BaseException as exc:
                failed.append(exc)

        threads = [threading.Thread(target=client_thread) for _ in range(args.fast_clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        span = time.perf_counter() - t0
        if failed:
            raise SystemExit(f"warm_http: a client failed: {failed[0]!r}")
    finally:
        node.stop()
    return {
        "jobs_per_s": args.fast_jobs / span,
        "result_p50_ms": statistics.median(idle) * 1000,
        "result_p99_ms": nearest_rank(idle, 0.99) * 1000,
        "done": 1 + len(idle) + args.fast_jobs,  # every one was checked done
        "http_roundtrip_ms": statistics.median(health) * 1000,
        "http_submit_ms": statistics.median(alone) * 1000,
    }


def fast_part(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    print(
        f"fast: a warm server whose handler returns at once; {args.fast_idle} jobs one at a "
        f"time (idle broker), then {args.fast_jobs} at once (store) or over "
        f"{args.fast_clients} clients (HTTP); the default poll interval (0.1 s)"
    )
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-fast-") as tmp:
        root = Path(tmp)
        modules = write_fast_module(root)
        store = fast_store(root, modules, args)
        http = fast_http(root, modules, args)
        alone = alone_bounds(root, max(20, args.fast_idle * 4))
    print(f"  {'path':<26} {'jobs/s':>8} {'result_p50_ms':>14} {'result_p99_ms':>14}")
    for name, r in (("store (in-process node)", store), ("HTTP (serve --api)", http)):
        print(
            f"  {name:<26} {r['jobs_per_s']:>8.1f} {r['result_p50_ms']:>14.2f} "
            f"{r['result_p99_ms']:>14.2f}"
        )
    bounds = {
        **alone,
        "exchange_rtt_ms": round(store["exchange_rtt_ms"], 3),
        "http_roundtrip_ms": round(http["http_roundtrip_ms"], 3),
        "http_submit_ms": round(http["http_submit_ms"], 3),
    }
    print("  alone, p50 (what bounds the path; see bench/README.md):")
    for what, key in (
        ("one SQLite commit, synchronous=FULL (us)", "commit_full_us"),
        ("one mkdir + rmdir (us)", "mkdir_rmdir_us"),
        ("one exchange slot made and removed (us)", "exchange_slot_us"),
        ("one job message to the server and back (ms)", "exchange_rtt_ms"),
        ("one HTTP round trip, GET /v1/health (ms)", "http_roundtrip_ms"),
        ("one HTTP submit without wait (ms)", "http_submit_ms"),
    ):
        print(f"    {what:<46} {bounds[key]:>9}")
    ok = True
    print("targets:")
    for passed, what in (
        (
            http["jobs_per_s"] >= TARGET_HTTP_JOBS_PER_S,
            f"warm_http jobs/s >= {TARGET_HTTP_JOBS_PER_S:g} ({http['jobs_per_s']:.1f})",
        ),
        (
            http["result_p50_ms"] <= TARGET_HTTP_P50_MS,
            f"warm_http idle submit -> result p50 <= {TARGET_HTTP_P50_MS:g} ms "
            f"({http['result_p50_ms']:.2f} ms)",
        ),
    ):
        print(f"  {'PASS' if passed else 'FAIL'}  {what}")
        ok = ok and passed

    def keys(r: dict[str, float]) -> dict[str, float]:
        return {
            "jobs_per_s": round(r["jobs_per_s"], 1),
            "result_p50_ms": round(r["result_p50_ms"], 2),
            "result_p99_ms": round(r["result_p99_ms"], 2),
            "done": r["done"],
        }

    return {"warm_store": keys(store), "warm_http": keys(http), "bounds": bounds}, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--jobs", type=int, default=30, help="part 1: jobs per mode")
    ap.add_argument("--load-s", type=float, default=1.0, help="part 1: the model's load time")
    ap.add_argument("--work-s", type=float, default=0.05, help="part 1: each job's own work")
    ap.add_argument("--gib", type=float, default=8.0, help="part 1: the model's footprint")
    ap.add_argument("--poll", type=float, default=0.02, help="part 1: broker poll interval")
    ap.add_argument("--timeout", type=float, default=600.0, help="parts 1 and 3: per mode")
    ap.add_argument("--fast-jobs", type=int, default=300, help="part 3: jobs at once")
    ap.add_argument("--fast-idle", type=int, default=50, help="part 3: jobs one at a time")
    ap.add_argument("--fast-clients", type=int, default=8, help="part 3: HTTP client threads")
    ap.add_argument("--trace-jobs", type=int, default=JOBS, help="part 2: jobs in the trace")
    ap.add_argument("--no-real", action="store_true", help="skip parts 1 and 3 (processes)")
    ap.add_argument("--no-fast", action="store_true", help="skip part 3")
    ap.add_argument(
        "--smoke", action="store_true", help="every part at a tiny size, targets not enforced"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.jobs, args.load_s, args.work_s, args.gib = 3, 0.05, 0.0, 1.0
        args.fast_jobs, args.fast_idle, args.fast_clients = 20, 5, 2
        args.trace_jobs, args.timeout = 200, 120.0
    warm: dict[str, float | None]
    if args.no_real:
        warm = dict.fromkeys(
            ("warm_jobs_per_s", "oneshot_jobs_per_s", "warm_p50_ms", "oneshot_p50_ms")
        )
    else:
        warm = dict(warm_part(args))
        print()
    fast: dict[str, Any] = {
        k: dict.fromkeys(("jobs_per_s", "result_p50_ms")) for k in ("warm_store", "warm_http")
    }
    fast["bounds"] = None
    fast_ok = True
    if not (args.no_real or args.no_fast):
        fast, fast_ok = fast_part(args)
        print()
    loads, ok = loads_part(args.trace_jobs)
    print(json.dumps({"warm": warm, **fast, "loads": loads}))
    return 0 if args.smoke or (ok and fast_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
