"""Placement across hosts: which queued jobs the coordinator offers to a node.

Pure. A node reports what it has (GPUs with their room by its own ledger, warm
servers, running jobs, labels, the job types its modules have and its launch
rules); the coordinator offers it only jobs of types it runs that fit one of its
GPUs and meet the job's constraints, and leaves a job whose model is warm
on another node that can take it soon for that node, for a while. The node's own
broker loop still admits each job against its live ledger: an offer is a lease,
not a start.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.command import is_command_type
from gpuwarden.core.fairshare import claim_rank
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, Lane, LaunchMode, format_bytes
from gpuwarden.core.preempt import Choice, Need, Victim, choose
from gpuwarden.core.sources import SourceAbility

__all__ = [
    "CONSTRAINT_KEYS",
    "Constraints",
    "CrossPreempt",
    "GpuRoom",
    "NodeView",
    "Offerable",
    "check_constraints",
    "never_placeable",
    "offers_for",
    "preemptions_for",
    "refusal",
    "type_refusal",
]

#: the keys of a job's ``constraints`` object (SPEC.md section 4)
CONSTRAINT_KEYS = ("min_gpu_vram_gib", "gpu_model", "labels", "node", "gpu")
#: the constraints that only mean something for a job on the vram lane
GPU_CONSTRAINTS = frozenset({"min_gpu_vram_gib", "gpu_model", "gpu"})
#: a GPU's UUID as a ``gpu`` constraint names it (``lease --gpu UUID``)
_GPU_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9._:/-]{1,124}$")
_MAX_GIB = 1_048_576
_MAX_TEXT = 200
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_constraints(raw: Any) -> dict[str, Any]:
    """Check a job's ``constraints`` object and return a copy of it. Raise
    :class:`ValueError` saying what is wrong (the caller names where it was)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"constraints must be an object, got {_show(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in CONSTRAINT_KEYS:
            raise ValueError(
                f"unknown constraint {_show(key)} (allowed: {', '.join(CONSTRAINT_KEYS)})"
            )
        if key == "min_gpu_vram_gib":
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(
                    f"constraint min_gpu_vram_gib must be a number, got {_show(value)}"
                )
            if not math.isfinite(value) or value <= 0 or value > _MAX_GIB:
                raise ValueError(
                    f"constraint min_gpu_vram_gib must be > 0 and at most {_MAX_GIB}, "
                    f"got {_show(value)}"
                )
            out[key] = value
        elif key in ("gpu_model", "node"):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"constraint {key} must be a non-empty string, got {_show(value)}")
            if len(value) > _MAX_TEXT:
                raise ValueError(f"constraint {key} is longer than {_MAX_TEXT} characters")
            if key == "node" and not _NODE_NAME.fullmatch(value):
                raise ValueError(
                    f"constraint node {_show(value)} is not a node name (1-64 letters, digits, "
                    "'.', '_' or '-', starting with a letter or digit)"
                )
            out[key] = value
        elif key == "gpu":
            if not isinstance(value, str) or not _GPU_UUID.fullmatch(value):
                raise ValueError(
                    "constraint gpu must be a GPU's UUID as `gpuwarden status` lists it "
                    f"(GPU-... or MIG-...; a model name is gpu_model), got {_show(value)}"
                )
            out[key] = value
        else:  # labels
            if not isinstance(value, Mapping):
                raise ValueError(f"constraint labels must be an object, got {_show(value)}")
            labels: dict[str, str] = {}
            for k, v in value.items():
                if not isinstance(k, str) or not k or len(k) > _MAX_TEXT:
                    raise ValueError(f"constraint labels has a bad key {_show(k)}")
                if not isinstance(v, str) or len(v) > _MAX_TEXT:
                    raise ValueError(f"constraint label {k} must be a string, got {_show(v)}")
                labels[k] = v
            out[key] = labels
    return out


@dataclass(frozen=True, slots=True)
class Constraints:
    """What a job asks of the host it runs on (all optional)."""

    min_gpu_vram_bytes: int = 0
    gpu_model: str = ""  # a substring of the GPU's name, case-insensitive
    labels: Mapping[str, str] = field(default_factory=dict)
    node: str = ""  # this node only
    gpu: str = ""  # this GPU only (its UUID)

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> Constraints:
        """From a job's checked ``constraints`` object (see :func:`check_constraints`)."""
        if not raw:
            return cls()
        gib = raw.get("min_gpu_vram_gib") or 0
        return cls(
            min_gpu_vram_bytes=math.ceil(float(gib) * GIB),
            gpu_model=str(raw.get("gpu_model", "")),
            labels={str(k): str(v) for k, v in dict(raw.get("labels") or {}).items()},
            node=str(raw.get("node", "")),
            gpu=str(raw.get("gpu", "")),
        )

    def refusal(self, node: NodeView) -> str | None:
        """Why ``node`` can never take a job with these constraints, or None."""
        if self.node and node.name != self.node:
            return f"the job asks for node {self.node!r}"
        for key, value in self.labels.items():
            if node.labels.get(key) != value:
                return (
                    f"the job asks for label {key}={value} (the node has {node.labels or 'none'})"
                )
        if (self.min_gpu_vram_bytes or self.gpu_model or self.gpu) and not self.gpus(node):
            want = [f"GPU {self.gpu}"] if self.gpu else []
            if self.min_gpu_vram_bytes:
                want.append(f"at least {format_bytes(self.min_gpu_vram_bytes)} per GPU")
            if self.gpu_model:
                want.append(f"a GPU model matching {self.gpu_model!r}")
            return f"the job asks for {' and '.join(want)}"
        return None

    def gpus(self, node: NodeView) -> list[GpuRoom]:
        """The node's GPUs these constraints allow."""
        model = self.gpu_model.lower()
        return [
            g
            for g in node.gpus
            if g.total_bytes >= self.min_gpu_vram_bytes
            and model in g.name.lower()
            and (not self.gpu or g.uuid == self.gpu)
        ]


@dataclass(frozen=True, slots=True)
class GpuRoom:
    uuid: str
    name: str
    total_bytes: int
    #: what the node's ledger says a new job may take there now (0 when paused)
    free_bytes: int
    #: the most a job could ever get there: total less the node's reserve
    usable_bytes: int


#: why a node that did not report it runs command jobs is offered none
NO_COMMANDS = "runs no command jobs (it did not report that it does)"
#: why no node is offered a host command job (one of a host's local socket)
NO_HOST_COMMANDS = (
    "runs no host command jobs (a host command runs only on the host it was submitted "
    "on, through that node's local socket)"
)


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: tuple[GpuRoom, ...] = ()
    #: job types with a warm server on the node
    warm: frozenset[str] = frozenset()
    #: jobs the node runs or holds leases for now
    busy: int = 0
    max_jobs: int = 4
    labels: Mapping[str, str] = field(default_factory=dict)
    #: False when draining, revoked or offline: no new work
    accepting: bool = True
    #: the job types it runs (its modules have them, its launch rules allow them);
    #: None when it did not say (judged by ``modules`` and ``rules`` then)
    types: frozenset[str] | None = None
    #: the job types its modules have, whatever its rules say; None: not reported
    modules: frozenset[str] | None = None
    #: its launch rules (runtime, ``allow_*``); None: not reported
    rules: LaunchRules | None = None
    #: its running jobs of preemptible types (``job_id`` the coordinator's id,
    #: ``since`` on the coordinator's clock), with what each holds
    victims: tuple[Victim, ...] = ()
    #: whether it runs jobs from commits, and of which repositories (None: it did
    #: not say, or said it in a shape not taken: it runs none)
    sources: SourceAbility | None = None
    #: whether it runs sandboxed command jobs: None when it does, else why not
    #: (a phrase about the node; an agent that did not say runs none)
    commands: str | None = NO_COMMANDS

    @property
    def slots(self) -> int:
        return max(0, self.max_jobs - self.busy) if self.accepting else 0


@dataclass(frozen=True, slots=True)
class Offerable:
    """A queued job as placement sees it."""

    id: str
    type: str
    lane: Lane
    vram_bytes: int
    priority: int
    seq: int
    submitted_at: float
    constraints: Constraints = Constraints()
    #: nodes where an earlier attempt of this job was lost (prefer another)
    avoid: frozenset[str] = frozenset()
    #: its type's launch mode, for the node's launch rules
    launch: LaunchMode = LaunchMode.CONTAINER
    #: a runtime type's job: its own process runs no model code on a GPU (the
    #: launch rules judge it as a cpu type's), its runtime does
    runtime: bool = False
    #: how many GPUs of one node it holds at once, ``vram_bytes`` on each
    gpus: int = 1
    #: its owner's fair-share use in GiB-hours (``core.fairshare``): at equal
    #: priority, the job of the owner who used least is offered first
    usage: float = 0.0
    #: a job from a pinned commit: its repository (its type, ``m.t@<commit>``, is
    #: no node's module; a node that runs jobs from commits of it may take it)
    source_repo: str | None = None

    @property
    def rank(self) -> tuple[int, float, int]:
        """Its place in the queue: priority, its owner's use, arrival."""
        return claim_rank(self.priority, self.usage, self.seq)


def type_refusal(job: Offerable, node: NodeView, *, sources: bool = True) -> str | None:
    """Why ``node`` does not run jobs of ``job``'s type, as a phrase about the node
    (``has no module for m.t``, ``refuses container types (its runtime is local)``),
    or None when it does. The types it says it runs decide; its modules and launch
    rules say why not (and decide alone before it has said, from its enrolment).
    A job from a commit is judged by what the node says of jobs from commits and
    its launch rules (``sources``: False leaves both out, for a submission: they
    are a config edit away, and such a job waits for a node that runs it)."""
    if job.source_repo is not None:
        return _source_refusal(job, node, sources=sources)
    if is_command_type(job.type):  # no module has it: the node says if it runs them
        return NO_HOST_COMMANDS if job.launch is LaunchMode.HOST else node.commands
    if node.types is not None and job.type in node.types:
        return None
    if node.modules is not None and job.type not in node.modules:
        return f"has no module for {job.type}"
    lane = Lane.CPU if job.runtime else job.lane
    if node.rules is not None and (why := node.rules.node_refusal(job.launch, lane)):
        return why
    if node.types is not None:
        return f"does not run {job.type}"
    return None


def _ability_refusal(job: Offerable, node: NodeView) -> str | None:
    """Why ``node`` runs no job from a commit of ``job.source_repo``, by what it
    reported of jobs from commits, or None when it does."""
    assert job.source_repo is not None
    if node.sources is None:
        return "runs no jobs from commits (it did not report that it does)"
    return node.sources.refusal(job.source_repo)


def _source_refusal(job: Offerable, node: NodeView, *, sources: bool) -> str | None:
    """:func:`type_refusal` of a job from a commit of ``job.source_repo``."""
    if not sources:
        return None  # at submission: it waits for a node that runs it (explain says)
    if (why := _ability_refusal(job, node)) is not None:
        return why
    lane = Lane.CPU if job.runtime else job.lane
    if node.rules is not None and (why := node.rules.node_refusal(job.launch, lane)):
        return why
    return None


def refusal(job: Offerable, node: NodeView, *, sources: bool = True) -> str | None:
    """Why ``node`` can never take ``job`` as it is now (its types and launch rules,
    then the job's constraints), or None. ``sources``: as :func:`type_refusal`."""
    return type_refusal(job, node, sources=sources) or job.constraints.refusal(node)


def offers_for(
    node: NodeView,
    queued: Sequence[Offerable],
    others: Iterable[NodeView],
    *,
    now: float,
    affinity_wait_s: float = 30.0,
) -> list[str]:
    """The ids of the jobs to lease to ``node`` now, best first, at most its free
    slots. A vram job is offered only if it fits the room a GPU of the node has
    now (the jobs offered in this call count against it); a job warm elsewhere
    waits up to ``affinity_wait_s`` for that node; a job lost on this node goes
    to another one when another could take it. Jobs are taken highest priority
    first, then the least-used owner's (fair share), then in arrival order."""
    if node.slots == 0:
        return []
    others = [o for o in others if o.name != node.name]
    room = {g.uuid: g.free_bytes for g in node.gpus}
    chosen: list[str] = []
    for job in sorted(queued, key=lambda j: j.rank):
        if len(chosen) >= node.slots:
            break
        if refusal(job, node) is not None:
            continue
        waited = now - job.submitted_at
        if job.type not in node.warm and waited < affinity_wait_s:
            warm_elsewhere = [
                o for o in others if job.type in o.warm and o.slots > 0 and _could_run(job, o)
            ]
            if warm_elsewhere:
                continue  # its model is loaded on another node that can take it soon
        if node.name in job.avoid and any(o.slots > 0 and _could_run(job, o) for o in others):
            continue
        if job.lane is Lane.VRAM:
            fits = [
                g
                for g in job.constraints.gpus(node)
                if room.get(g.uuid, 0) >= job.vram_bytes or job.type in node.warm
            ]
            if len(fits) < job.gpus:  # a multi-GPU job: all its GPUs on this node, now
                continue
            # the tightest fits pack best
            for best in sorted(fits, key=lambda g: (room[g.uuid], g.uuid))[: job.gpus]:
                room[best.uuid] -= 0 if job.type in node.warm else job.vram_bytes
        chosen.append(job.id)
    return chosen


def _could_run(job: Offerable, node: NodeView) -> bool:
    if refusal(job, node) is not None:
        return False
    if job.lane is not Lane.VRAM:
        return True
    return _big_enough(job, node) >= job.gpus


def _big_enough(job: Offerable, node: NodeView) -> int:
    """How many of the node's GPUs (those the job's constraints allow) could ever
    hold its footprint."""
    return sum(g.usable_bytes >= job.vram_bytes for g in job.constraints.gpus(node))


def never_placeable(
    job: Offerable, nodes: Sequence[NodeView], *, sources: bool = True
) -> str | None:
    """Why no known node could ever take ``job`` (for a refusal at submission and
    for ``explain``), or None when one could. With no node known yet there is
    nothing to judge by: None (the job waits for one). ``sources``: False leaves
    out whether the nodes run jobs from commits (their runtime, launch rules and
    ``[sources] allow``: a config edit away, so such a job waits for one; its
    constraints and GPUs still count). A job from a commit
    that no node runs jobs from commits of is ``no node runs jobs from commits of
    REPO``, then each node's reason."""
    if not nodes:
        return None
    if job.source_repo is not None and sources:
        whys = [(n.name, _ability_refusal(job, n)) for n in nodes]
        if all(why is not None for _, why in whys):
            each = "; ".join(f"{name}: {why}" for name, why in whys)
            return f"no node runs jobs from commits of {job.source_repo}: {each}"
    reasons = []
    for node in nodes:
        why = refusal(job, node, sources=sources)
        if why is None and job.lane is Lane.VRAM:
            biggest = max((g.usable_bytes for g in job.constraints.gpus(node)), default=0)
            if biggest < job.vram_bytes:
                why = (
                    f"needs {format_bytes(job.vram_bytes)} on one GPU; its largest has "
                    f"{format_bytes(biggest)}"
                )
            elif (big := _big_enough(job, node)) < job.gpus:
                why = (
                    f"needs {job.gpus} GPUs at once with {format_bytes(job.vram_bytes)} on "
                    f"each; it has {big} such GPU(s)"
                )
        if why is None:
            return None
        reasons.append(f"{node.name}: {why}")
    return "no node can ever run it: " + "; ".join(reasons)


# -- preemption across hosts ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CrossPreempt:
    """Ask the node's running ``choice.victims`` to checkpoint, for ``for_job``."""

    node: str
    for_job: str
    choice: Choice


def _has_room(job: Offerable, node: NodeView) -> bool:
    """Could ``node`` take ``job`` now, by the room its GPUs reported?"""
    if not node.accepting or refusal(job, node) is not None:
        return False
    if job.lane is not Lane.VRAM or job.type in node.warm:
        return node.slots > 0
    return node.slots > 0 and any(
        g.free_bytes >= job.vram_bytes for g in job.constraints.gpus(node)
    )


def _gpu_if_yielded(gpu: GpuRoom, victims: Sequence[Victim]) -> tuple[str, int, Sequence[Holding]]:
    """One GPU as :func:`gpuwarden.core.preempt.choose` reads it, from a report: its
    room now plus what its victims hold, and the victims as its holdings (the
    node's own plan judges co-residence when the job gets there)."""
    here = [v for v in victims if v.gpu_uuid == gpu.uuid]
    capacity = min(gpu.usable_bytes, gpu.free_bytes + sum(v.bytes for v in here))
    holdings = [Holding(v.holder, "", v.bytes, coresident=True, job_id=v.job_id) for v in here]
    return gpu.uuid, capacity, holdings


def preemptions_for(
    node: NodeView, queued: Sequence[Offerable], others: Iterable[NodeView], *, now: float
) -> list[CrossPreempt]:
    """Which of ``node``'s running preemptible jobs to ask to checkpoint, and for which
    queued jobs: a vram job that no node has room for now (``node`` nor ``others``),
    that ``node`` runs, and that one of its GPUs would hold were some of its
    preemptible jobs of lower priority, run at least their ``min_run_s``, gone
    (:func:`gpuwarden.core.preempt.choose`: the fewest, the cheapest). Highest
    priority first; a job some node's victims already yield to waits for them and
    asks nothing more; one GPU yields to one job a pass. Never a job that is not
    preemptible: only ``node.victims`` (what the node reported of preemptible
    types) are ever chosen."""
    if not node.accepting or not node.victims:
        return []
    nodes = [node, *(o for o in others if o.name != node.name)]
    waited_for = {v.preempting_for for n in nodes for v in n.victims if v.preempting_for}
    # a GPU with a victim asked already is held for that job
    held = {v.gpu_uuid for v in node.victims if v.preempting_for}
    free = [v for v in node.victims if v.preempting_for is None]
    out: list[CrossPreempt] = []
    for job in sorted(queued, key=lambda j: (-j.priority, j.seq)):
        if not free:
            break
        if job.lane is not Lane.VRAM or job.id in waited_for or job.type in node.warm:
            continue
        if refusal(job, node) is not None or any(_has_room(job, n) for n in nodes):
            continue
        gpus = [
            _gpu_if_yielded(g, free)
            for g in job.constraints.gpus(node)
            if g.uuid not in held and g.usable_bytes >= job.vram_bytes
        ]
        need = Need(job.id, job.vram_bytes, True, job.priority)
        choice = choose(need, gpus, free, now)
        if choice is None or not choice.victims:
            continue
        out.append(CrossPreempt(node.name, job.id, choice))
        held.add(choice.gpu_uuid)
        chosen = {v.holder for v in choice.victims}
        free = [v for v in free if v.holder not in chosen]
    return out
