"""Placement across hosts: which queued jobs the coordinator offers to a node.

Pure. A node reports what it has (GPUs with their room by its own ledger, warm
servers, running jobs, labels); the coordinator offers it only jobs that fit one
of its GPUs and meet the job's constraints, and leaves a job whose model is warm
on another node that can take it soon for that node, for a while. The node's own
broker loop still admits each job against its live ledger: an offer is a lease,
not a start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwarden.core.model import Lane, format_bytes

__all__ = ["Constraints", "GpuRoom", "NodeView", "Offerable", "never_placeable", "offers_for"]


@dataclass(frozen=True, slots=True)
class Constraints:
    """What a job asks of the host it runs on (all optional)."""

    min_gpu_vram_bytes: int = 0
    gpu_model: str = ""  # a substring of the GPU's name, case-insensitive
    labels: Mapping[str, str] = field(default_factory=dict)
    node: str = ""  # this node only

    def refusal(self, node: NodeView) -> str | None:
        """Why ``node`` can never take a job with these constraints, or None."""
        if self.node and node.name != self.node:
            return f"the job asks for node {self.node!r}"
        for key, value in self.labels.items():
            if node.labels.get(key) != value:
                return (
                    f"the job asks for label {key}={value} (the node has {node.labels or 'none'})"
                )
        if (self.min_gpu_vram_bytes or self.gpu_model) and not self.gpus(node):
            want = []
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
            if g.total_bytes >= self.min_gpu_vram_bytes and model in g.name.lower()
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
    to another one when another could take it."""
    if node.slots == 0:
        return []
    others = [o for o in others if o.name != node.name]
    room = {g.uuid: g.free_bytes for g in node.gpus}
    chosen: list[str] = []
    for job in sorted(queued, key=lambda j: (-j.priority, j.seq)):
        if len(chosen) >= node.slots:
            break
        if job.constraints.refusal(node) is not None:
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
            if not fits:
                continue
            best = min(fits, key=lambda g: room[g.uuid])  # the tightest fit packs best
            room[best.uuid] -= 0 if job.type in node.warm else job.vram_bytes
        chosen.append(job.id)
    return chosen


def _could_run(job: Offerable, node: NodeView) -> bool:
    if job.constraints.refusal(node) is not None:
        return False
    if job.lane is not Lane.VRAM:
        return True
    return any(g.usable_bytes >= job.vram_bytes for g in job.constraints.gpus(node))


def never_placeable(job: Offerable, nodes: Sequence[NodeView]) -> str | None:
    """Why no known node could ever take ``job`` (for a refusal at submission and
    for ``explain``), or None when one could. With no node known yet there is
    nothing to judge by: None (the job waits for one)."""
    if not nodes:
        return None
    reasons = []
    for node in nodes:
        why = job.constraints.refusal(node)
        if why is None and job.lane is Lane.VRAM:
            biggest = max((g.usable_bytes for g in job.constraints.gpus(node)), default=0)
            if biggest < job.vram_bytes:
                why = (
                    f"needs {format_bytes(job.vram_bytes)} on one GPU; its largest has "
                    f"{format_bytes(biggest)}"
                )
        if why is None:
            return None
        reasons.append(f"{node.name}: {why}")
    return "no node can ever run it: " + "; ".join(reasons)
