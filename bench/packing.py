"""Packing benchmark: seeded traces through gpuwarden's policy and five baselines.

Every policy replays the same trace in virtual time through
``gpuwarden.replay.simulate.simulate`` (the same ledger, the same physical device
model: an attempt whose real peak does not fit what the device has left crashes
with a CUDA out-of-memory). The policies:

- ``gpuwarden``: ``gpuwarden.core.policy.plan``, as the broker runs it (holdings
  grow to the measured peak; a crash while others used the GPU is retried up to
  3 times, 5 s later, as DESIGN.md's failure table says).
- ``one_per_gpu``: one job per GPU at a time, in arrival order, priority ignored
  (task-spooler, whole-GPU Slurm): a GPU takes the next job once nothing of the
  previous one is left on it.
- ``all_at_once``: no broker: every job starts when it arrives, on the GPU with
  the fewest running jobs.
- ``fractional``: Ray's ``num_gpus``: each job asks ``declared / total`` of a
  GPU rounded up to a quarter, first fit in arrival order without head-of-line
  blocking; a task's fraction is given back when it returns (its memory may not
  be freed yet); actual memory and co-residence are ignored.
- ``first_fit``: arrival order, priority ignored, each job on the first GPU where
  its declared footprint fits the ledger's budget and co-residence allows it (as
  gpuwarden admits, without measuring); the first job that fits nowhere blocks
  every later one (FIFO, head-of-line blocking).
- ``first_fit_backfill``: the same, but a job that fits nowhere blocks nothing:
  any queued job that fits starts, in arrival order (no reservation).

Baselines do not retry: without a broker a crash is a crash (the job fails; Ray
does not retry a task that raised). They do not measure footprints either.

Lower bound (the issue's): ``max(sum(vram * duration) / total capacity,
max(arrival + duration))`` with the declared footprint, and a job that needs its
GPU to itself counting that GPU's whole memory.

Metrics per policy: makespan (the last job's end, from t = 0), its ratio to the
bound, mean and p95 (nearest rank) of arrival-to-end over the jobs that ended
``done`` (a crashed job never completes; ``done`` says how many did), the p99
(nearest rank) of arrival-to-first-start over the jobs that need their GPU to
themselves (``p99_wait_whole_s``; on the heavy-tail traces the whole-card jobs),
out-of-memory crashes, model loads (every start of a vram job). The last line of
stdout is one JSON object::

    {"traces": {TRACE: {POLICY: {"makespan_s", "ratio_to_bound",
     "mean_completion_s", "p95_completion_s", "p99_wait_whole_s", "oom_crashes",
     "model_loads", "done"}}}}

Usage::

    .venv/bin/python bench/packing.py            # every trace, every policy (minutes)
    .venv/bin/python bench/packing.py --smoke    # the same shapes, a few dozen jobs each
    .venv/bin/python bench/packing.py --only heavy-tail-16g-poisson
    .venv/bin/python bench/packing.py --speed    # also: simulator jobs/s on long traces

The exit status is 1 when a target fails (never with ``--smoke``, which judges none).

The traces (fixed before any result was looked at; do not tune them)
---------------------------------------------------------------------
``generate(spec, seed)``: ``random.Random(seed)``; for each of ``spec.jobs`` jobs,
in order: the gap to the previous arrival is ``expovariate(rate)`` (Poisson
arrivals; the first job arrives after one gap), the type is drawn with the
``weight``s, the duration is ``mean_s * uniform(0.5, 1.5)``, the priority is 0,
5 or 10 with probability 0.7, 0.2, 0.1. ``rate`` makes the offered load
``spec.load`` (1.25: a backlog builds, so makespan measures packing): the mean
bound area of one job (``weight * (declared if co-resident else the GPU's total)
* mean_s``, summed) divided by the total capacity, times ``load``, is the mean gap.
A type that does not opt in to co-residence has a non-flat profile: it peaks above
its declared footprint (``peak``); co-resident types preallocate (peak = declared).

``generate_heavy_tail(spec)`` (``heavy-tail-16g-t0`` and ``heavy-tail-16g-poisson``,
the same 2,000 jobs on 8 x 16 GiB, all at t = 0 or Poisson at offered load 0.9):
see its docstring. Two types only, ``whole-card`` and ``shared``, so a type's
run-time estimate (the longest of its last 20 runs) says little about one job.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from gpuwarden.core.ledger import Holding, HoldState, compatible
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    Decision,
    QueuedJob,
    Snapshot,
    Start,
    Wait,
    plan,
)
from gpuwarden.replay.simulate import (
    Outcome,
    Planner,
    SimGpu,
    SimOptions,
    SimResult,
    TraceJob,
    simulate,
)


@dataclass(frozen=True)
class JobType:
    name: str
    declared_gib: float
    peak_gib: float
    coresident: bool
    mean_s: float
    weight: float


@dataclass(frozen=True)
class TraceSpec:
    name: str
    seed: int
    gpus: int
    gpu_gib: int
    jobs: int
    load: float
    types: tuple[JobType, ...]


PRIORITIES = ((0, 0.7), (5, 0.2), (10, 0.1))

MIXED_24G = TraceSpec(
    name="mixed-24g",
    seed=1,
    gpus=1,
    gpu_gib=24,
    jobs=300,
    load=1.25,
    types=(
        JobType("llm-14b", 14, 17, coresident=False, mean_s=120, weight=0.10),
        JobType("vision-6g", 6, 7.5, coresident=False, mean_s=20, weight=0.15),
        JobType("embedder", 3, 3, coresident=True, mean_s=10, weight=0.30),
        JobType("whisper-small", 2, 2, coresident=True, mean_s=45, weight=0.25),
        JobType("diffusion", 9, 9, coresident=True, mean_s=30, weight=0.20),
    ),
)

FOUR_80G = TraceSpec(
    name="four-80g",
    seed=2,
    gpus=4,
    gpu_gib=80,
    jobs=400,
    load=1.25,
    types=(
        JobType("llm-70b", 70, 76, coresident=False, mean_s=300, weight=0.10),
        JobType("llm-34b", 40, 46, coresident=False, mean_s=180, weight=0.15),
        JobType("diffusion-xl", 20, 20, coresident=True, mean_s=60, weight=0.25),
        JobType("whisper-large", 8, 8, coresident=True, mean_s=90, weight=0.25),
        JobType("embedder", 3, 3, coresident=True, mean_s=15, weight=0.25),
    ),
)

TRACES = (MIXED_24G, FOUR_80G)


@dataclass(frozen=True)
class HeavyTailSpec:
    """A GPU-cluster-like trace: heavy-tailed run times, whole-card and shared jobs."""

    name: str
    seed: int
    gpus: int
    gpu_gib: int
    jobs: int
    #: median and 99th percentile of the log-normal run time
    p50_s: float
    p99_s: float
    #: share of jobs that need a whole card to themselves (exclusive, all its memory)
    whole: float
    #: a shared (co-resident) job's footprint: uniform in this range, of a card
    shared_lo: float
    shared_hi: float
    #: None: every job arrives at t = 0; else Poisson arrivals at this offered load
    load: float | None


HEAVY_TAIL_T0 = HeavyTailSpec(
    name="heavy-tail-16g-t0",
    seed=14,
    gpus=8,
    gpu_gib=16,
    jobs=2000,
    p50_s=600.0,
    p99_s=40 * 3600.0,
    whole=0.55,
    shared_lo=0.05,
    shared_hi=0.95,
    load=None,
)
HEAVY_TAIL_POISSON = replace(HEAVY_TAIL_T0, name="heavy-tail-16g-poisson", load=0.9)
HEAVY_TAILS = (HEAVY_TAIL_T0, HEAVY_TAIL_POISSON)

#: z of the 99th percentile of the standard normal distribution
Z99 = 2.3263478740408408

#: the device frees an ended process's memory this long after it exits
RECLAIM_DELAY_S = 1.0
GPUWARDEN_OPTIONS = SimOptions(
    reclaim_delay_s=RECLAIM_DELAY_S, max_retries=3, retry_delay_s=5.0, measure=True
)
BASELINE_OPTIONS = SimOptions(reclaim_delay_s=RECLAIM_DELAY_S, max_retries=0, measure=False)

TARGET_RATIO = 1.15
TARGET_SPEEDUP = 1.5


@dataclass(frozen=True)
class Case:
    """One trace to replay: its jobs, its GPUs, its lower bound and how it was made."""

    name: str
    gpus: int
    gpu_gib: int
    trace: list[TraceJob]
    about: str


# --- traces ---------------------------------------------------------------------------


def generate(spec: TraceSpec, seed: int | None = None, jobs: int | None = None) -> list[TraceJob]:
    rng = random.Random(spec.seed if seed is None else seed)
    n = spec.jobs if jobs is None else jobs
    area = sum(
        t.weight * (t.declared_gib if t.coresident else spec.gpu_gib) * t.mean_s for t in spec.types
    )
    mean_gap = area / (spec.gpus * spec.gpu_gib) / spec.load
    weights = [t.weight for t in spec.types]
    prios = [p for p, _ in PRIORITIES]
    prio_w = [w for _, w in PRIORITIES]
    out: list[TraceJob] = []
    t_arr = 0.0
    for i in range(n):
        t_arr += rng.expovariate(1.0 / mean_gap)
        jt = rng.choices(spec.types, weights)[0]
        duration = jt.mean_s * rng.uniform(0.5, 1.5)
        priority = rng.choices(prios, prio_w)[0]
        out.append(
            TraceJob(
                id=f"{spec.name}-{i:04d}",
                type=jt.name,
                arrival_s=round(t_arr, 3),
                duration_s=round(duration, 3),
                vram_bytes=int(jt.declared_gib * GIB),
                actual_peak_bytes=int(jt.peak_gib * GIB),
                coresident=jt.coresident,
                priority=priority,
            )
        )
    return out


def generate_heavy_tail(spec: HeavyTailSpec, jobs: int | None = None) -> list[TraceJob]:
    """``random.Random(seed)`` draws, for each job in turn, whether it needs a whole
    card (probability ``whole``), a shared job's footprint (``uniform(lo, hi)`` of a
    card), and the run time (log-normal: ``mu = ln p50``, ``sigma = ln(p99 / p50) /
    z99``). The arrivals come after, from ``random.Random(seed + 1)``: all at t = 0,
    or Poisson with the mean gap that makes this trace's own bound area (footprint x
    run time, a whole card for a whole-card job) over the capacity, divided by the
    jobs, match the offered load. Every job preallocates (peak = declared), priority 0."""
    rng = random.Random(spec.seed)
    n = spec.jobs if jobs is None else jobs
    mu = math.log(spec.p50_s)
    sigma = math.log(spec.p99_s / spec.p50_s) / Z99
    card = spec.gpu_gib * GIB
    drawn: list[tuple[bool, int, float]] = []
    for _ in range(n):
        whole = rng.random() < spec.whole
        share = rng.uniform(spec.shared_lo, spec.shared_hi)
        duration = round(rng.lognormvariate(mu, sigma), 3)
        drawn.append((whole, card if whole else int(share * card), duration))
    arrivals = [0.0] * n
    if spec.load is not None:
        arr_rng = random.Random(spec.seed + 1)
        area = sum(b * d for _, b, d in drawn)
        mean_gap = area / (spec.gpus * card) / n / spec.load
        t_arr = 0.0
        for i in range(n):
            t_arr += arr_rng.expovariate(1.0 / mean_gap)
            arrivals[i] = round(t_arr, 3)
    return [
        TraceJob(
            id=f"{spec.name}-{i:04d}",
            type="whole-card" if whole else "shared",
            arrival_s=arrivals[i],
            duration_s=duration,
            vram_bytes=need,
            coresident=not whole,
        )
        for i, (whole, need, duration) in enumerate(drawn)
    ]


def sim_gpus(case: Case) -> list[SimGpu]:
    return [SimGpu(f"GPU-{i}", case.gpu_gib * GIB) for i in range(case.gpus)]


def lower_bound(case: Case) -> float:
    card = case.gpu_gib * GIB
    total = case.gpus * card
    area = sum((j.vram_bytes if j.coresident else card) * j.duration_s for j in case.trace)
    latest = max(j.arrival_s + j.duration_s for j in case.trace)
    return max(area / total, latest)


def describe(spec: TraceSpec) -> str:
    lines = [
        f"{spec.name}: seed {spec.seed}, {spec.gpus} x {spec.gpu_gib} GiB, {spec.jobs} jobs, "
        f"offered load {spec.load}, reclaim delay {RECLAIM_DELAY_S} s"
    ]
    for t in spec.types:
        share = "co-resident" if t.coresident else "exclusive"
        lines.append(
            f"  {t.name:<14} {t.declared_gib:>5g} GiB declared, peak {t.peak_gib:>5g} GiB, "
            f"{share:<11} mean {t.mean_s:>4g} s, weight {t.weight}"
        )
    return "\n".join(lines)


def describe_heavy_tail(spec: HeavyTailSpec, trace: list[TraceJob]) -> str:
    arrive = "all at t = 0" if spec.load is None else f"Poisson, offered load {spec.load}"
    runs = sorted(j.duration_s for j in trace)
    whole = sum(1 for j in trace if not j.coresident)
    return (
        f"{spec.name}: seed {spec.seed}, {spec.gpus} x {spec.gpu_gib} GiB, {len(trace)} jobs, "
        f"{arrive}, reclaim delay {RECLAIM_DELAY_S} s\n"
        f"  run time log-normal p50 {spec.p50_s:g} s, p99 {spec.p99_s:g} s (drawn: p50 "
        f"{nearest_rank(runs, 0.5):.0f} s, p99 {nearest_rank(runs, 0.99):.0f} s, longest "
        f"{runs[-1]:.0f} s)\n"
        f"  {whole} whole-card (exclusive, {spec.gpu_gib} GiB), {len(trace) - whole} shared "
        f"(co-resident, {spec.shared_lo:.0%}-{spec.shared_hi:.0%} of a card), priority 0"
    )


def cases(smoke: bool = False) -> list[Case]:
    """The traces to replay; ``smoke``: the same shapes, a few dozen jobs each."""
    out = [
        Case(
            s.name,
            s.gpus,
            s.gpu_gib,
            generate(s, jobs=30 if smoke else None),
            describe(s),
        )
        for s in TRACES
    ]
    for h in HEAVY_TAILS:
        trace = generate_heavy_tail(h, jobs=60 if smoke else None)
        out.append(Case(h.name, h.gpus, h.gpu_gib, trace, describe_heavy_tail(h, trace)))
    return out


# --- baselines: planners with plan's signature -----------------------------------------


def _cpu_and_fifo(snapshot: Snapshot) -> tuple[list[QueuedJob], list[Decision], int]:
    """Arrival order (priority ignored), cpu jobs started on free slots."""
    decisions: list[Decision] = []
    cpu_free = snapshot.cpu_slots - snapshot.running_cpu
    vram: list[QueuedJob] = []
    for job in sorted(snapshot.queued, key=lambda j: j.seq):
        if job.lane is Lane.CPU:
            if cpu_free > 0:
                cpu_free -= 1
                decisions.append(Start(job.id, None))
            else:
                decisions.append(Wait(job.id, "no cpu slot"))
        else:
            vram.append(job)
    return vram, decisions, cpu_free


def one_per_gpu(snapshot: Snapshot, now: float) -> list[Decision]:
    """One job per GPU at a time, arrival order, FIFO (the head blocks the rest)."""
    vram, decisions, _ = _cpu_and_fifo(snapshot)
    free = [g.uuid for g in snapshot.gpus if not g.holdings]
    for job in vram:
        if free:
            decisions.append(Start(job.id, free.pop(0)))
        else:
            decisions.append(Wait(job.id, "every GPU runs a job"))
    return decisions


def all_at_once(snapshot: Snapshot, now: float) -> list[Decision]:
    """Start everything now, on the GPU with the fewest running jobs."""
    vram, decisions, _ = _cpu_and_fifo(snapshot)
    if not snapshot.gpus:
        return decisions + [Wait(j.id, "no GPU") for j in vram]
    running = {
        g.uuid: sum(1 for h in g.holdings if h.state is HoldState.RUNNING) for g in snapshot.gpus
    }
    for job in vram:
        uuid = min(running, key=lambda u: running[u])
        running[uuid] += 1
        decisions.append(Start(job.id, uuid))
    return decisions


def _quarters(vram_bytes: int, total_bytes: int) -> int:
    """The job's ``num_gpus`` in quarters of a GPU: declared / total, rounded up."""
    return max(1, min(4, math.ceil(vram_bytes / total_bytes * 4 - 1e-9)))


def fractional(snapshot: Snapshot, now: float) -> list[Decision]:
    """Ray-like fractional GPUs: first fit by quarters, arrival order, no blocking."""
    vram, decisions, _ = _cpu_and_fifo(snapshot)
    used = {
        g.uuid: sum(
            _quarters(h.bytes, g.total_bytes) for h in g.holdings if h.state is HoldState.RUNNING
        )
        for g in snapshot.gpus
    }
    totals = {g.uuid: g.total_bytes for g in snapshot.gpus}
    for job in vram:
        for uuid, quarters in used.items():
            q = _quarters(job.vram_bytes, totals[uuid])
            if quarters + q <= 4:
                used[uuid] += q
                decisions.append(Start(job.id, uuid))
                break
        else:
            decisions.append(Wait(job.id, "no GPU has the fraction free"))
    return decisions


def _first_fit(snapshot: Snapshot, *, backfill: bool) -> list[Decision]:
    """First fit in arrival order (priority ignored) by the ledger's budget and
    co-residence, as gpuwarden admits; no reservation. ``backfill``: a job that does
    not fit does not stop later ones; else it blocks the queue (head of line)."""
    vram, decisions, _ = _cpu_and_fifo(snapshot)
    gpus = [(g, list(g.holdings)) for g in snapshot.gpus if not g.degraded]
    blocked = False
    for job in vram:
        if not blocked:
            for g, holdings in gpus:
                if compatible(job.coresident, holdings) and (
                    job.vram_bytes + sum(h.bytes for h in holdings) <= g.capacity
                ):
                    holdings.append(
                        Holding(f"{job.id}/next", job.type, job.vram_bytes, job.coresident)
                    )
                    decisions.append(Start(job.id, g.uuid))
                    break
            else:
                blocked = not backfill
                decisions.append(Wait(job.id, "no GPU has room for it"))
        else:
            decisions.append(Wait(job.id, "an earlier job waits (first in, first out)"))
    return decisions


def first_fit(snapshot: Snapshot, now: float) -> list[Decision]:
    """First fit, arrival order, the first job that does not fit blocks the rest."""
    return _first_fit(snapshot, backfill=False)


def first_fit_backfill(snapshot: Snapshot, now: float) -> list[Decision]:
    """First fit, arrival order, any job that fits starts (no reservation)."""
    return _first_fit(snapshot, backfill=True)


POLICIES: dict[str, tuple[Planner, SimOptions]] = {
    "gpuwarden": (plan, GPUWARDEN_OPTIONS),
    "one_per_gpu": (one_per_gpu, BASELINE_OPTIONS),
    "all_at_once": (all_at_once, BASELINE_OPTIONS),
    "fractional": (fractional, BASELINE_OPTIONS),
    "first_fit": (first_fit, BASELINE_OPTIONS),
    "first_fit_backfill": (first_fit_backfill, BASELINE_OPTIONS),
}


# --- running and reporting ---------------------------------------------------------------


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (0 for no value)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def metrics(result: SimResult, case: Case, bound: float) -> dict[str, Any]:
    done = result.completions
    whole = {j.id for j in case.trace if not j.coresident}
    waits = [
        r.start_s - r.arrival_s
        for r in result.jobs.values()
        if r.id in whole and r.start_s is not None
    ]
    return {
        "makespan_s": round(result.makespan_s, 1),
        "ratio_to_bound": round(result.makespan_s / bound, 3),
        "mean_completion_s": round(sum(done) / len(done), 1) if done else 0.0,
        "p95_completion_s": round(nearest_rank(done, 0.95), 1),
        "p99_wait_whole_s": round(nearest_rank(waits, 0.99), 1),
        "oom_crashes": result.oom_crashes,
        "model_loads": result.model_loads,
        "done": len(done),
    }


Table = dict[str, dict[str, Any]]


def run_case(case: Case) -> tuple[float, Table, Table]:
    bound = lower_bound(case)
    out: Table = {}
    extra: Table = {}
    for name, (planner, options) in POLICIES.items():
        t0 = time.perf_counter()
        result = simulate(sim_gpus(case), case.trace, planner, options)
        wall = time.perf_counter() - t0
        out[name] = metrics(result, case, bound)
        outcomes = result.outcomes()
        extra[name] = {
            "failed": outcomes[Outcome.FAILED],
            "jobs_per_s": len(case.trace) / wall if wall > 0 else float("inf"),
            "plan_calls": result.plan_calls,
        }
    return bound, out, extra


def print_table(case: Case, bound: float, res: Table, extra: Table) -> None:
    print(case.about)
    print(f"  lower bound {bound:.1f} s")
    print(
        f"  {'policy':<18} {'makespan_s':>10} {'ratio':>6} {'mean_s':>9} {'p95_s':>9} "
        f"{'p99_wait_whole_s':>16} {'oom':>5} {'loads':>6} {'done':>5} {'failed':>6} "
        f"{'sim jobs/s':>10}"
    )
    for name, m in res.items():
        e = extra[name]
        print(
            f"  {name:<18} {m['makespan_s']:>10.1f} {m['ratio_to_bound']:>6.3f} "
            f"{m['mean_completion_s']:>9.1f} {m['p95_completion_s']:>9.1f} "
            f"{m['p99_wait_whole_s']:>16.1f} {m['oom_crashes']:>5} {m['model_loads']:>6} "
            f"{m['done']:>5} {e['failed']:>6} {e['jobs_per_s']:>10.0f}"
        )
    print()


def judge(case: Case, res: Table) -> list[tuple[str, bool]]:
    """The targets for one trace (see bench/README.md)."""
    name = case.name
    gw = res["gpuwarden"]
    checks = [(f"{name}: gpuwarden has no out-of-memory crash", gw["oom_crashes"] == 0)]
    if name in {s.name for s in TRACES}:
        checks.append(
            (
                f"{name}: gpuwarden makespan within {TARGET_RATIO}x of the bound "
                f"({gw['ratio_to_bound']:.3f}x)",
                gw["ratio_to_bound"] <= TARGET_RATIO,
            )
        )
    if name == MIXED_24G.name:
        speedup = res["one_per_gpu"]["makespan_s"] / gw["makespan_s"]
        checks.append(
            (
                f"{name}: gpuwarden makespan at least {TARGET_SPEEDUP}x shorter than "
                f"one_per_gpu ({speedup:.2f}x)",
                speedup >= TARGET_SPEEDUP,
            )
        )
    if name in {h.name for h in HEAVY_TAILS}:
        ffb = res["first_fit_backfill"]
        ff = res["first_fit"]
        for key, what in (("makespan_s", "makespan"), ("mean_completion_s", "mean completion")):
            checks.append(
                (
                    f"{name}: gpuwarden {what} <= first_fit_backfill's "
                    f"({gw[key]:.0f} s vs {ffb[key]:.0f} s)",
                    gw[key] <= ffb[key],
                )
            )
        checks.append(
            (
                f"{name}: gpuwarden p99 wait of whole-card jobs <= first_fit's "
                f"({gw['p99_wait_whole_s']:.0f} s vs {ff['p99_wait_whole_s']:.0f} s)",
                gw["p99_wait_whole_s"] <= ff["p99_wait_whole_s"],
            )
        )
        checks.append(
            (
                f"{name}: gpuwarden ran every job to its end ({gw['done']} of {len(case.trace)})",
                gw["done"] == len(case.trace),
            )
        )
    return checks


def speed(jobs: int = 5000, load: float = 0.5) -> tuple[float, float]:
    """Simulator jobs/s through gpuwarden's policy on a long mixed trace, and the mean
    number of queued jobs per planning pass (each pass costs time in proportion)."""
    spec = replace(MIXED_24G, name="speed", seed=7, jobs=jobs, load=load)
    case = Case(spec.name, spec.gpus, spec.gpu_gib, generate(spec), describe(spec))
    queued: list[int] = []

    def counting(snapshot: Snapshot, now: float) -> list[Decision]:
        queued.append(len(snapshot.queued))
        return plan(snapshot, now)

    t0 = time.perf_counter()
    simulate(sim_gpus(case), case.trace, counting, GPUWARDEN_OPTIONS)
    return jobs / (time.perf_counter() - t0), sum(queued) / max(1, len(queued))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="also time 5000-job replays")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny traces (a few dozen jobs each, seconds); the targets are not judged",
    )
    ap.add_argument(
        "--only",
        metavar="TRACE",
        action="append",
        help="replay only this trace (repeatable)",
    )
    args = ap.parse_args(argv)

    report: dict[str, Table] = {}
    checks: list[tuple[str, bool]] = []
    for case in cases(args.smoke):
        if args.only and case.name not in args.only:
            continue
        bound, res, extra = run_case(case)
        report[case.name] = res
        print_table(case, bound, res, extra)
        checks += judge(case, res)
    if args.speed:
        for load in (0.5, 0.7):
            rate, backlog = speed(load=load)
            print(
                f"simulator speed: {rate:.0f} jobs/s (5000 jobs, gpuwarden policy, offered "
                f"load {load}, {backlog:.1f} jobs queued per planning pass on average)"
            )
        print()
    print(
        "(a ratio below 1 is possible only for a policy that runs a job needing its GPU "
        "alone beside others, or whose crashed jobs never do their work)"
    )
    print()
    if args.smoke:
        print("targets: not judged on the smoke traces (too small to mean anything)")
    else:
        print("targets:")
        for text, ok in checks:
            print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    print(json.dumps({"traces": report}, separators=(", ", ": ")))
    return 0 if args.smoke or all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
