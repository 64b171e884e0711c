"""``explain`` and ``preview``: the broker's own policy, run on what it last saw.

The broker publishes, with its status, each GPU's view (total, reserve, foreign
memory, ledger holdings, degraded) and why each queued job waits. ``explain``
reads that reason; ``preview`` adds a would-be job to the queue and runs
:func:`gpuwarden.core.policy.plan` on the same view, without submitting
anything. It is the broker's policy on the broker's last view, not a promise:
run-time estimates and the broker's running cpu jobs are not published, so a
backfill the broker would allow may show here as a wait.

Both apply the node's launch rules first, as ``submit`` and the broker do: a
type this node refuses "would be refused" (``preview``), and a queued job of
such a type (accepted under another configuration) "will fail when it is due
to start" (``explain``), whatever room the GPUs have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuwarden.core import dependencies, footprint, jobcontrol, policy, profile
from gpuwarden.core.fairshare import DEFAULT_HALF_LIFE_S, Usage, why_behind
from gpuwarden.core.model import Job, JobType, Lane, LaunchMode, format_bytes, gpu_count
from gpuwarden.core.ramadmit import UNSAMPLED, RamNeed, RamView, never_admits
from gpuwarden.core.runtime import resolve_runtime
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.node.hostram import effective_need
from gpuwarden.node.measured import RunTimes
from gpuwarden.node.status import BrokerStatus
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Store

#: a status older than this is not trusted for a preview (the probe is read instead)
FRESH_S = 120.0

PREVIEW_ID = "(preview)"


@dataclass(frozen=True, slots=True)
class View:
    """What planning is based on, and where it came from (said to the user)."""

    gpus: tuple[policy.GpuView, ...]
    cpu_slots: int
    source: str
    waiting: dict[str, str]
    vram_paused: str = ""
    warm: tuple[policy.WarmView, ...] = ()
    #: the managed runtimes as the broker last saw them (who may be asked)
    runtimes: tuple[policy.RuntimeView, ...] = ()
    #: the running jobs asked to checkpoint and yield, each with the job it yields to
    preempting: dict[str, str] = field(default_factory=dict)
    #: the host's RAM as the broker last published it (not sampled: RAM admits all)
    ram: RamView = UNSAMPLED


def effective_footprint(jobtype: JobType, override: int | None, store: Store) -> int:
    measured = store.footprints().get(jobtype.name)
    return footprint.effective(jobtype.vram_bytes, override, measured.bytes if measured else 0)


def never_admitted(ram: RamView, jobtype: JobType, need: RamNeed) -> str | None:
    """Why a job of ``jobtype`` asking ``need`` can never start on the host whose
    RAM ``ram`` published (its type's ``ram_gib`` counts as its cap), or None."""
    return never_admits(ram, effective_need(jobtype, need))


def latest_status(store: Store, now: float) -> NodeStatus | None:
    """The freshest status of a running broker, if there is one."""
    live = [
        s
        for s in store.node_statuses()
        if not s.payload.get("stopped") and now - s.updated_at <= FRESH_S
    ]
    return max(live, key=lambda s: s.updated_at, default=None)


def view_from_status(status: NodeStatus, cpu_slots: int) -> View:
    published = BrokerStatus.from_json(status.payload)
    age = time.time() - status.updated_at
    paused = f"the GPU probe failed: {published.probe_error}" if published.probe_error else ""
    source = f"broker on {status.node}, {age:.0f} s ago"
    return View(
        published.gpu_views(),
        cpu_slots,
        source,
        dict(published.waiting),
        paused,
        published.warm_views,
        tuple(
            policy.RuntimeView(
                str(r.get("name", "")),
                may_ask=bool(r.get("may_be_asked")),
                why=str(r.get("why", "")),
                releasing=bool(r.get("releasing")),
                reachable=r.get("state") != "unreachable",
                models=_strings(r.get("models")),
                gpus=_strings(r.get("gpus")),
                kind=str(r.get("kind", "")),
            )
            for r in published.runtimes
        ),
        {r.job: r.preempting_for for r in published.running if r.preempting_for is not None},
        published.ram,
    )


def _strings(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def runtime_of(jobtype: JobType, runtimes: tuple[policy.RuntimeView, ...]) -> str:
    """A runtime type's runtime as the plan knows it: its name among ``runtimes``,
    or the word its type gave (which the plan refuses) when none answers to it."""
    if jobtype.runtime is None:
        return ""
    pairs = ((r.name, r.kind) for r in runtimes)
    return resolve_runtime(jobtype.runtime, pairs) or jobtype.runtime


def view_from_probe(probe: GpuProbe, reserve_bytes: int, cpu_slots: int) -> View:
    """No broker runs: everything the probe shows used is someone else's."""
    gpus = tuple(
        policy.GpuView(
            uuid=r.uuid,
            name=r.name,
            total_bytes=r.total_bytes,
            reserve_bytes=reserve_bytes,
            foreign_bytes=r.used_bytes,
        )
        for r in probe.read()
    )
    return View(gpus, cpu_slots, f"{probe.kind} probe now (no broker is running)", {})


def queued_entries(
    store: Store,
    registry: Registry,
    warm_types: frozenset[str] = frozenset(),
    runtimes: tuple[policy.RuntimeView, ...] = (),
    use: Mapping[str, float] | None = None,
) -> list[policy.QueuedJob]:
    """Every queued job as the broker's planner sees it (footprints and run-time
    estimates as measured, its owner's fair-share ``use``), read in one query of
    light rows."""
    use = use or {}
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    run_times = RunTimes(store.recent_run_times())
    out = []
    for job in store.queue_entries():
        jobtype = registry.types.get(job.type)
        if jobtype is None:
            continue
        need = 0
        if jobtype.lane is Lane.VRAM:
            need = footprint.effective(
                jobtype.vram_bytes, job.vram_bytes, footprints.get(jobtype.name, 0)
            )
        out.append(
            policy.QueuedJob(
                id=job.id,
                type=job.type,
                lane=jobtype.lane,
                vram_bytes=need,
                priority=job.priority,
                seq=job.seq,
                coresident=jobtype.coresident or jobtype.runtime is not None,
                expected_s=run_times.expected_s(jobtype.name, job.est_s),
                serve=jobtype.launch is LaunchMode.SERVE,
                warm=jobtype.name in warm_types,
                runtime=runtime_of(jobtype, runtimes),
                model=jobtype.model or "",
                owner=job.owner or "",
                usage=use.get(job.owner or "", 0.0),
                ram=effective_need(jobtype, job.ram),
                gpus=gpu_count(jobtype, job.gpus),
                gpu=job.gpu,
            )
        )
    return out


def decide(view: View, queued: list[policy.QueuedJob], job_id: str) -> policy.Decision:
    """What a planning pass on ``view`` decides for ``job_id`` (one of ``queued``):
    the same pass the broker runs, over the queue's classes, whose reason is
    written for this job only."""
    snapshot = policy.Snapshot(
        queued=(),
        gpus=view.gpus,
        cpu_slots=view.cpu_slots,
        vram_paused=view.vram_paused,
        warm=view.warm,
        runtimes=view.runtimes,
        ram=view.ram,
    )
    lineups, _ = policy.sized_lineups_of(queued)
    done = policy.plan_pass(lineups, snapshot, time.time())
    decided: list[policy.Start | policy.Refuse] = [*done.starts, *done.refusals]
    for d in decided:
        if d.job_id == job_id:
            return d
    me = next(j for j in queued if j.id == job_id)
    for w in done.waits:
        if w.key == policy.class_key(me):
            return w.wait(job_id)
    for w in done.waits:  # a bigger size than one that waited: not looked at
        if isinstance(w, policy.RangeWait) and w.key == policy.sized_key(me):
            return w.wait(job_id)
    raise AssertionError(f"plan gave no decision for {job_id}")  # pragma: no cover


def refused_line(registry: Registry, jobtype: JobType) -> str | None:
    """``preview``: the launch rules' refusal of ``jobtype`` (as ``submit`` says it)."""
    why = registry.rules.refusal(jobtype)
    return None if why is None else f"would be refused: this node's launch rules: {why}"


def sandbox_line(registry: Registry, jobtype: JobType) -> str:
    """How attempts of ``jobtype`` run here, for a type the rules let run."""
    rules = registry.rules
    if rules.sandboxed(jobtype):
        return f"it would run sandboxed ({rules.runtime.value})"
    if (why := rules.unsandboxed_reason(jobtype)) is not None:
        return f"it would run UNSANDBOXED, as a plain host process ({why})"
    return "it would run as a plain host process (no sandbox on this node)"


def describe(decision: policy.Decision) -> str:
    if isinstance(decision, policy.Start) and decision.warm:
        return f"would go now to its warm server on {decision.gpu_uuid} (no load)"
    if isinstance(decision, policy.Start):
        where = f"on {decision.gpu_uuid}" if decision.gpu_uuid else "on a cpu slot"
        return f"would start now {where}"
    if isinstance(decision, policy.Refuse):
        return f"would be refused: {decision.reason}"
    return f"would wait: {decision.reason}"


def shown_reason(job: Job, store: Store) -> str:
    """The reason people are shown with a job: who holds it (a person's hold), a
    held job's why it waits (``waits for job X (running)``, its dependency's state
    now), else the stored one."""
    if job.hold_by is not None:
        return jobcontrol.held_line(job)
    if not job.held:
        return job.reason
    return dependencies.judge(store.dependencies(job.id)).reason or job.reason


def dependency_lines(job: Job, store: Store) -> list[str]:
    """A held job's wait: the reason (``waits for job X (running)``), then each
    dependency with its job's state and where it stands."""
    deps = store.dependencies(job.id)
    verdict = dependencies.judge(deps)
    lines = [f"it waits: {verdict.reason or 'its dependencies hold; it is being released'}"]
    for dep, state in deps:
        stands = dependencies.standing(dep, state)
        lines.append(f"  {dep}: {dep.job_id} is {state.value} ({stands})")
    return lines


#: what a coordinator adds to a job's explanation, given by the caller (the node knows
#: nothing of the cluster): why no node took a queued job, which node runs a leased
#: one; ``[]`` where it has nothing to add. ``cluster.report.explain`` passes them.
ClusterLines = Callable[[Job], list[str]]


def estimate_line(type_name: str, est_s: float, store: Store) -> str:
    """What a job that declared ``est_s`` is planned with (section 11, "Profiles")."""
    measured = RunTimes(store.recent_run_times()).estimate(type_name)
    planned = profile.est_class(est_s)
    assert planned is not None  # est_s is a number: it has a class
    if measured is None:
        return (
            f"declared run time {est_s:g} s (planned as {planned:g} s): used for backfill "
            f"until {type_name} has a measured run time"
        )
    if planned >= measured:
        return (
            f"declared run time {est_s:g} s (planned as {planned:g} s): used for backfill, "
            f"as it is longer than {type_name}'s measured run time, {measured:.1f} s"
        )
    return (
        f"declared run time {est_s:g} s; {type_name}'s measured run time, {measured:.1f} s "
        "(the longest of its latest runs), is longer and is used instead"
    )


def use_now(store: Store, half_life_s: float) -> dict[str, float]:
    """Each owner's fair-share use now, from the store's table."""
    usage = Usage(half_life_s)
    usage.load(store.fair_share())
    return usage.table(time.time())


def fair_share_lines(job: Job, store: Store, half_life_s: float) -> list[str]:
    """A queued job behind the jobs of another owner who used less, at equal priority
    (fair share): the owner who used least of them, with both uses."""
    if half_life_s <= 0:
        return []
    now = time.time()
    usage = Usage(half_life_s)
    usage.load(store.fair_share())
    mine = job.owner or ""
    others = {
        e.owner or ""
        for e in store.queue_entries()
        if e.priority == job.priority and (e.owner or "") != mine
    }
    if not others:
        return []
    least = min(others, key=lambda o: (usage.of(o, now), o))
    why = why_behind(mine, usage.of(mine, now), least, usage.of(least, now))
    return [] if why is None else [f"it waits behind another owner's jobs: {why}"]


def explain_job(
    job: Job,
    store: Store,
    registry: Registry,
    view: View | None,
    *,
    placement: ClusterLines | None = None,
    running: ClusterLines | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
) -> list[str]:
    """Lines that say where a job stands and, if it waits, why."""
    lines = [f"{job.id} ({job.type}) is {job.state.value}"]
    jobtype = registry.types.get(job.type)
    if jobtype is not None and jobtype.lane is Lane.VRAM:
        need = effective_footprint(jobtype, job.vram_bytes, store)
        declared = job.vram_bytes or jobtype.vram_bytes
        note = "" if need == declared else f", raised by measurement from {format_bytes(declared)}"
        share = (
            "shares a GPU with co-resident types" if jobtype.coresident else "needs a GPU to itself"
        )
        lines.append(f"footprint {format_bytes(need)}{note}; it {share}")
    if job.after and not job.held:
        lines.append(f"after {', '.join(job.after)}")
    if job.state.terminal:
        lines.append(f"it ended: {job.reason}")
        return lines
    if job.est_s is not None:
        lines.append(estimate_line(job.type, job.est_s, store))
    if job.state.value == "running":
        attempts = store.attempts(job.id)
        a = attempts[-1]
        where = f"on {a.gpu_uuid}" if a.gpu_uuid else "on a cpu slot"
        lines.append(f"attempt {a.number} runs {where} since {time.ctime(a.started_at)}")
        if view is not None and (for_job := view.preempting.get(job.id)) is not None:
            lines.append(f"preempting {job.id} for {for_job}: it was asked to checkpoint and yield")
        lines += running(job) if running else []
        return lines
    if job.hold_by is not None or job.held:  # not planned, nor offered, until released
        lines += [jobcontrol.held_line(job)] if job.hold_by is not None else []  # by a person
        lines += dependency_lines(job, store) if job.held else []  # when its dependencies hold
        return lines
    cluster = placement(job) if placement else []
    if cluster:  # several hosts: agents are offered jobs by the coordinator
        lines += cluster
        return lines
    if jobtype is None:
        lines.append(
            f"its type {job.type} is not among this node's job types (module_paths, "
            f"installed modules): a broker here fails it when it is due to start"
        )
        return lines
    if (refused := registry.rules.refusal(jobtype)) is not None:
        lines.append(
            f"it will fail when it is due to start: this node's launch rules refuse it "
            f"now (it was accepted under another configuration): {refused}"
        )
        return lines
    if view is None:
        lines.append("no broker is running here, so nothing will start it: run `gpuwarden serve`")
        return lines
    reason = view.waiting.get(job.id)
    if reason is not None:
        lines.append(f"it waits: {reason}")
    else:
        warm_types = frozenset(w.type for w in view.warm)
        queued = queued_entries(
            store, registry, warm_types, view.runtimes, use_now(store, half_life_s)
        )
        if any(j.id == job.id for j in queued):
            lines.append(describe(decide(view, queued, job.id)))
        else:  # it started (or ended) between the two reads
            now = store.get_job(job.id)
            state = now.state.value if now is not None else "gone"
            lines.append(f"it left the queue just now: it is {state}")
    if reason is not None:  # it waits: behind another owner's jobs, by fair share?
        lines += fair_share_lines(job, store, half_life_s)
    lines.append(f"(as seen by the {view.source})")
    return lines


def preview(
    store: Store | None,
    registry: Registry,
    jobtype: JobType,
    *,
    override: int | None,
    priority: int,
    cpu_slots: int,
    probe_view: Callable[[], View] | None = None,
) -> list[str]:
    """What ``preview`` says of one more job of ``jobtype`` (``override``: its own
    footprint): the broker's policy on what the broker last published to
    ``store``; with no broker's status there, on ``probe_view()`` (the CLI on the
    host reads the probe), or, without one (the API), that there is nothing to
    preview against."""
    if (refused := refused_line(registry, jobtype)) is not None:
        return [f"{jobtype.name} {refused}"]  # what `submit` would answer
    status = latest_status(store, time.time()) if store is not None else None
    if status is not None:
        view = view_from_status(status, cpu_slots)
        warm_types = frozenset(w.type for w in view.warm)
        queued = queued_entries(store, registry, warm_types, view.runtimes) if store else []
    elif probe_view is not None:
        view = probe_view()
        queued = queued_entries(store, registry) if store is not None else []
    else:
        return [
            f"{jobtype.name}: no broker has published its status here lately, so there is "
            "nothing to preview it against (is `gpuwarden serve` running on this store?)"
        ]
    need = 0
    if jobtype.lane is Lane.VRAM:
        measured = store.footprints().get(jobtype.name) if store is not None else None
        need = max(override or jobtype.vram_bytes, measured.bytes if measured else 0)
    me = policy.QueuedJob(
        id=PREVIEW_ID,
        type=jobtype.name,
        lane=jobtype.lane,
        vram_bytes=need,
        priority=priority,
        seq=max((q.seq for q in queued), default=0) + 1,
        coresident=jobtype.coresident or jobtype.runtime is not None,
        serve=jobtype.launch is LaunchMode.SERVE,
        warm=any(w.type == jobtype.name for w in view.warm),
        runtime=runtime_of(jobtype, view.runtimes),
        model=jobtype.model or "",
    )
    decision = decide(view, [*queued, me], me.id)
    lines = [f"{jobtype.name}: footprint {format_bytes(need)}"] if jobtype.lane is Lane.VRAM else []
    return [
        *lines,
        describe(decision),
        sandbox_line(registry, jobtype),
        f"(as seen by the {view.source}; {len(queued)} job(s) queued ahead or around it)",
    ]
