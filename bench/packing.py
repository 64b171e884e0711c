"""Packing benchmark: seeded traces through gpuwarden's policy and three baselines.

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

Baselines do not retry: without a broker a crash is a crash (the job fails; Ray
does not retry a task that raised). They do not measure footprints either.

Lower bound (the issue's): ``max(sum(vram * duration) / total capacity,
max(arrival + duration))`` with the declared footprint, and a job that needs its
GPU to itself counting that GPU's whole memory.

Metrics per policy: makespan (the last job's end, from t = 0), its ratio to the
bound, mean and p95 (nearest rank) of arrival-to-end over the jobs that ended
``done`` (a crashed job never completes; the ``done`` column says how many did),
out-of-memory crashes, model loads (every start of a vram job). The last line of
stdout is one JSON object::

    {"traces": {TRACE: {POLICY: {"makespan_s", "ratio_to_bound",
     "mean_completion_s", "p95_completion_s", "oom_crashes", "model_loads"}}}}

Usage::

    .venv/bin/python bench/packing.py            # both traces, all four policies
    .venv/bin/python bench/packing.py --speed    # also: simulator jobs/s on long traces

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
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from gpuwarden.core.ledger import HoldState
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

#: the device frees an ended process's memory this long after it exits
RECLAIM_DELAY_S = 1.0
GPUWARDEN_OPTIONS = SimOptions(
    reclaim_delay_s=RECLAIM_DELAY_S, max_retries=3, retry_delay_s=5.0, measure=True
)
BASELINE_OPTIONS = SimOptions(reclaim_delay_s=RECLAIM_DELAY_S, max_retries=0, measure=False)

TARGET_RATIO = 1.15
TARGET_SPEEDUP = 1.5


# --- traces ---------------------------------------------------------------------------


def sim_gpus(spec: TraceSpec) -> list[SimGpu]:
    return [SimGpu(f"GPU-{i}", spec.gpu_gib * GIB) for i in range(spec.gpus)]


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


def lower_bound(spec: TraceSpec, trace: list[TraceJob]) -> float:
    total = spec.gpus * spec.gpu_gib * GIB
    area = sum((j.vram_bytes if j.coresident else spec.gpu_gib * GIB) * j.duration_s for j in trace)
    latest = max(j.arrival_s + j.duration_s for j in trace)
    return max(area / total, latest)


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


POLICIES: dict[str, tuple[Planner, SimOptions]] = {
    "gpuwarden": (plan, GPUWARDEN_OPTIONS),
    "one_per_gpu": (one_per_gpu, BASELINE_OPTIONS),
    "all_at_once": (all_at_once, BASELINE_OPTIONS),
    "fractional": (fractional, BASELINE_OPTIONS),
}


# --- running and reporting ---------------------------------------------------------------


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(0.95 * len(s)) - 1)]


def metrics(result: SimResult, bound: float) -> dict[str, Any]:
    done = result.completions
    return {
        "makespan_s": round(result.makespan_s, 1),
        "ratio_to_bound": round(result.makespan_s / bound, 3),
        "mean_completion_s": round(sum(done) / len(done), 1) if done else 0.0,
        "p95_completion_s": round(p95(done), 1),
        "oom_crashes": result.oom_crashes,
        "model_loads": result.model_loads,
    }


Table = dict[str, dict[str, Any]]


def run_trace(spec: TraceSpec) -> tuple[float, Table, Table]:
    trace = generate(spec)
    bound = lower_bound(spec, trace)
    out: Table = {}
    extra: Table = {}
    for name, (planner, options) in POLICIES.items():
        t0 = time.perf_counter()
        result = simulate(sim_gpus(spec), trace, planner, options)
        wall = time.perf_counter() - t0
        out[name] = metrics(result, bound)
        outcomes = result.outcomes()
        extra[name] = {
            "done": outcomes[Outcome.DONE],
            "failed": outcomes[Outcome.FAILED],
            "jobs_per_s": len(trace) / wall if wall > 0 else float("inf"),
            "plan_calls": result.plan_calls,
        }
    return bound, out, extra


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


def speed(jobs: int = 5000, load: float = 0.5) -> tuple[float, float]:
    """Simulator jobs/s through gpuwarden's policy on a long mixed trace, and the mean
    number of queued jobs per planning pass (each pass costs time in proportion)."""
    spec = TraceSpec(
        name="speed",
        seed=7,
        gpus=MIXED_24G.gpus,
        gpu_gib=MIXED_24G.gpu_gib,
        jobs=jobs,
        load=load,
        types=MIXED_24G.types,
    )
    trace = generate(spec)
    queued: list[int] = []

    def counting(snapshot: Snapshot, now: float) -> list[Decision]:
        queued.append(len(snapshot.queued))
        return plan(snapshot, now)

    t0 = time.perf_counter()
    simulate(sim_gpus(spec), trace, counting, GPUWARDEN_OPTIONS)
    return jobs / (time.perf_counter() - t0), sum(queued) / max(1, len(queued))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="also time 5000-job replays")
    args = ap.parse_args(argv)

    report: dict[str, dict[str, dict[str, Any]]] = {}
    checks: list[tuple[str, bool]] = []
    for spec in TRACES:
        bound, res, extra = run_trace(spec)
        report[spec.name] = res
        print(describe(spec))
        print(f"  lower bound {bound:.1f} s")
        head = (
            f"  {'policy':<12} {'makespan_s':>10} {'ratio':>6} {'mean_s':>8} {'p95_s':>8} "
            f"{'oom':>5} {'loads':>6} {'done':>5} {'failed':>6} {'sim jobs/s':>10}"
        )
        print(head)
        for name, m in res.items():
            e = extra[name]
            print(
                f"  {name:<12} {m['makespan_s']:>10.1f} {m['ratio_to_bound']:>6.3f} "
                f"{m['mean_completion_s']:>8.1f} {m['p95_completion_s']:>8.1f} "
                f"{m['oom_crashes']:>5} {m['model_loads']:>6} {e['done']:>5} {e['failed']:>6} "
                f"{e['jobs_per_s']:>10.0f}"
            )
        gw = res["gpuwarden"]
        checks.append(
            (f"{spec.name}: gpuwarden has no out-of-memory crash", gw["oom_crashes"] == 0)
        )
        checks.append(
            (
                f"{spec.name}: gpuwarden makespan within {TARGET_RATIO}x of the bound "
                f"({gw['ratio_to_bound']:.3f}x)",
                gw["ratio_to_bound"] <= TARGET_RATIO,
            )
        )
        if spec is MIXED_24G:
            speedup = res["one_per_gpu"]["makespan_s"] / gw["makespan_s"]
            checks.append(
                (
                    f"{spec.name}: gpuwarden makespan at least {TARGET_SPEEDUP}x shorter than "
                    f"one_per_gpu ({speedup:.2f}x)",
                    speedup >= TARGET_SPEEDUP,
                )
            )
        print()
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
    print("targets:")
    for text, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    print(json.dumps({"traces": report}, separators=(", ", ": ")))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
