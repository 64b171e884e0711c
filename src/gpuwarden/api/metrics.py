"""``GET /metrics``: what the nodes published, as Prometheus series.

:class:`GpuwardenCollector` is a ``prometheus_client`` custom collector. On each
scrape it reads only what is published: the latest status of each node (one small
query, ``Store.node_statuses``: the loop's GPUs, ledger, warm servers, running
attempts and its counts, :mod:`gpuwarden.node.stats`), the measured footprints (a
small table), and on a coordinator the node records with the report each agent
last sent, the leases and the count of queued jobs. Nothing scans the store's jobs,
attempts or events per request.

Names follow Prometheus' conventions: the ``gpuwarden_`` prefix, base units
(``_bytes``, ``_seconds``), ``_total`` on counters; labels ``node``, ``gpu`` (the
GPU's UUID) and ``type`` where they apply. Per-GPU memory is also given under the
names of NVIDIA's DCGM exporter (``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE``,
MiB, labelled ``gpu`` (the index), ``UUID``, ``device``, ``modelName`` and
``Hostname`` as it labels them: its ``etc/default-counters.csv``), so that existing
GPU dashboards work unchanged beside gpuwarden's own ledger series. SPEC text:
``SPEC.md, section 18``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from gpuwarden.cluster.nodeview import heard_s_ago
from gpuwarden.core.lease import LEASE_TYPE, is_lease
from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import MIB, Lane
from gpuwarden.gpu.base import GpuSensors
from gpuwarden.node.stats import Histogram, StatsSnapshot
from gpuwarden.node.status import BrokerStatus
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Store
from gpuwarden.store.cluster import ClusterStore, NodeRecord, NodeState

__all__ = ["CONTENT_TYPE", "GpuwardenCollector", "scrape"]

#: the text exposition format ``generate_latest`` writes (Prometheus' 0.0.4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: the queue depth's states
QUEUED, RUNNING = "queued", "running"


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU of a node, as the series need it."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    ledger_bytes: int = 0
    foreign_bytes: int = 0
    reserve_bytes: int = 0
    free_bytes: int = 0
    degraded: bool = False
    fault: bool = False
    #: what each managed runtime holds here, by its name
    runtimes: tuple[tuple[str, int], ...] = ()
    #: what granted VRAM leases hold here (their running holdings on the ledger)
    lease_bytes: int = 0
    #: utilisation, temperature, power (None: not read)
    sensors: GpuSensors | None = None


@dataclass(slots=True)
class NodeSource:
    """One node, from its published status or from its agent's last report."""

    node: str
    gpus: list[GpuRow] = field(default_factory=list)
    #: type -> attempts running now
    running: dict[str, int] = field(default_factory=dict)
    #: (type, state) -> warm servers
    warm: dict[tuple[str, str], int] = field(default_factory=dict)
    stats: StatsSnapshot = field(default_factory=StatsSnapshot)
    accepting: bool = True
    heartbeat_age_s: float | None = None
    #: on a coordinator: the node's state and its live leases
    state: str | None = None
    leases: int | None = None


def _int(value: Any) -> int:
    """A byte count or a count from a published document (anything else is 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, int(value)) if math.isfinite(value) else 0


def from_status(row: NodeStatus, now: float) -> NodeSource:
    """A node as its broker published its status (``serve``, an agent's own store)."""
    st = BrokerStatus.from_json(row.payload)
    faults = set(st.stats.faults)
    gpus = []
    for i, g in enumerate(st.gpus):
        v = g.view
        gpus.append(
            GpuRow(
                index=i,
                uuid=g.uuid,
                name=g.name,
                total_bytes=g.total_bytes,
                used_bytes=g.used_bytes,
                ledger_bytes=v.held_bytes if v else 0,
                foreign_bytes=v.foreign_bytes if v else 0,
                reserve_bytes=v.reserve_bytes if v else 0,
                free_bytes=g.free_bytes,
                degraded=bool(v and v.degraded) and g.uuid not in faults,
                fault=g.uuid in faults,
                runtimes=v.runtimes if v else (),
                lease_bytes=lease_held_bytes(v.holdings) if v else 0,
                sensors=g.sensors,
            )
        )
    source = NodeSource(
        node=row.node,
        gpus=gpus,
        stats=st.stats,
        accepting=st.accepting and not st.stopped,
        heartbeat_age_s=max(0.0, now - row.updated_at),
    )
    for r in st.running:
        source.running[r.type] = source.running.get(r.type, 0) + 1
    for w in st.warm:
        source.warm[(w.type, w.state)] = source.warm.get((w.type, w.state), 0) + 1
    return source


def lease_held_bytes(holdings: Iterable[Holding]) -> int:
    """What granted VRAM leases hold among a GPU's ledger holdings (one that ended
    and waits for the reclaim gate is no longer held by its lease)."""
    return sum(h.bytes for h in holdings if is_lease(h.type) and h.state is HoldState.RUNNING)


def from_record(record: NodeRecord, now: float, leases: int) -> NodeSource:
    """A node as a coordinator knows it: its enrolment and its agent's last report
    (written by the agent: every value is checked for its kind)."""
    rep = record.report if isinstance(record.report, dict) else {}
    stats = StatsSnapshot.from_json(rep.get("stats"))
    faults = set(stats.faults)
    gpus = []
    reported = rep.get("gpus")
    for i, g in enumerate(reported if isinstance(reported, list) else []):
        if not isinstance(g, dict) or not isinstance(g.get("uuid"), str):
            continue
        uuid = str(g["uuid"])
        gpus.append(
            GpuRow(
                index=i,
                uuid=uuid,
                name=str(g.get("name", "")),
                total_bytes=_int(g.get("total_bytes")),
                used_bytes=_int(g.get("used_bytes")),
                ledger_bytes=_int(g.get("ledger_bytes")),
                foreign_bytes=_int(g.get("foreign_bytes")),
                reserve_bytes=_int(g.get("reserve_bytes")),
                free_bytes=_int(g.get("free_bytes")),
                degraded=bool(g.get("degraded")) and uuid not in faults,
                fault=uuid in faults,
                sensors=GpuSensors.from_json(g.get("sensors")),
            )
        )
    source = NodeSource(
        node=record.name,
        gpus=gpus,
        stats=stats,
        accepting=bool(rep.get("accepting", True)) and record.state is NodeState.ACTIVE,
        heartbeat_age_s=heard_s_ago(record, now),
        state=record.state.value,
        leases=leases,
    )
    for r in _rows(rep.get("running")):
        source.running[str(r["type"])] = source.running.get(str(r["type"]), 0) + 1
    for r in _rows(rep.get("warm_servers")):
        key = (str(r["type"]), str(r.get("state", "")))
        source.warm[key] = source.warm.get(key, 0) + 1
    return source


def _rows(value: Any) -> list[dict[str, Any]]:
    """The rows of a reported list that name a type."""
    if not isinstance(value, list):
        return []
    return [r for r in value if isinstance(r, dict) and isinstance(r.get("type"), str)]


class GpuwardenCollector:
    """The custom collector: every series, from what is published, at each scrape."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        *,
        clock: Callable[[], float],
        coordinator: bool = False,
    ) -> None:
        self.store = store
        self.registry = registry
        self.clock = clock
        self.coordinator = coordinator and isinstance(store, ClusterStore)

    def sources(self) -> tuple[list[NodeSource], int | None]:
        """Each node once (its published status first, else its agent's report),
        and on a coordinator the jobs queued there."""
        now = float(self.clock())
        found = {row.node: from_status(row, now) for row in self.store.node_statuses()}
        queued: int | None = None
        if self.coordinator:
            store = self.store
            assert isinstance(store, ClusterStore)
            live: dict[str, int] = {}
            for lease in store.leases():
                if lease.live(now):
                    live[lease.node] = live.get(lease.node, 0) + 1
            for record in store.list_nodes():
                if record.name in found:  # its status is richer; the record adds these
                    mine = found[record.name]
                    mine.state, mine.leases = record.state.value, live.get(record.name, 0)
                    mine.heartbeat_age_s = heard_s_ago(record, now)
                else:
                    found[record.name] = from_record(record, now, live.get(record.name, 0))
                if record.state is NodeState.REVOKED:
                    # its last figures are no one's now: only its state is shown
                    gone = found[record.name]
                    gone.gpus, gone.running, gone.warm = [], {}, {}
            queued = store.queued_count()
        return [found[n] for n in sorted(found)], queued

    def collect(self) -> Iterator[Metric]:
        nodes, queued = self.sources()
        yield from gpu_families(nodes)
        yield from dcgm_families(nodes)
        yield from queue_families(nodes, self.registry, queued)
        yield from attempt_families(nodes)
        yield from footprint_families(self.store, self.registry)
        yield from lease_families(nodes)
        yield from warm_families(nodes)
        yield from runtime_families(nodes)
        yield from node_families(nodes)


def scrape(
    store: Store, registry: Registry, *, clock: Callable[[], float], coordinator: bool = False
) -> bytes:
    """One scrape: the text exposition of every series."""
    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(GpuwardenCollector(store, registry, clock=clock, coordinator=coordinator))
    return generate_latest(metrics)


# -- the families -------------------------------------------------------------------

GPU = ["node", "gpu"]


def _gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: Sequence[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _le(bound: float) -> str:
    """A bucket's bound as Prometheus writes it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _add_histogram(family: HistogramMetricFamily, labels: list[str], h: Histogram) -> None:
    buckets = [(_le(le), float(n)) for le, n in h.cumulative()]
    family.add_metric(labels, buckets, sum_value=h.sum)


def _histograms(
    name: str, doc: str, label: str, nodes: Iterable[NodeSource], pick: Any
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["node", label])
    for n in nodes:
        for key, h in sorted(pick(n.stats).items()):
            _add_histogram(family, [n.node, key], h)
    return family


def gpu_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    """Per GPU: memory (device, ledger, foreign, reserve), the flags, the Xids."""
    fields = (
        ("total_bytes", "The GPU's memory.", lambda g: g.total_bytes),
        ("device_used_bytes", "Memory the device itself shows used.", lambda g: g.used_bytes),
        ("ledger_bytes", "Memory gpuwarden's ledger holds (jobs, warm servers, reclaiming).",
         lambda g: g.ledger_bytes),
        ("foreign_bytes", "Memory used by processes gpuwarden did not start.",
         lambda g: g.foreign_bytes),
        ("reserve_bytes", "Memory held back from admission ([vram] reserve).",
         lambda g: g.reserve_bytes),
        ("free_bytes", "What VRAM admission may still give out on the GPU.",
         lambda g: g.free_bytes),
        ("degraded", "1 while VRAM admission is paused because device and ledger disagree "
         "or the GPU stopped answering (clears by itself).", lambda g: int(g.degraded)),
        ("fault", "1 while the GPU has a hardware fault (Xid): admission paused until "
         "an operator clears it.", lambda g: int(g.fault)),
    )  # fmt: skip
    for suffix, doc, get in fields:
        family = _gauge(f"gpuwarden_gpu_{suffix}", doc, GPU)
        for n in nodes:
            for g in n.gpus:
                family.add_metric([n.node, g.uuid], float(get(g)))
        yield family
    info = _gauge(
        "gpuwarden_gpu_info", "A GPU of a node: its index and model.", [*GPU, "index", "name"]
    )
    xids = _counter("gpuwarden_gpu_xid_errors", "Xid errors the GPU reported.", [*GPU, "xid"])
    for n in nodes:
        for g in n.gpus:
            info.add_metric([n.node, g.uuid, str(g.index), g.name], 1.0)
        for gpu, codes in sorted(n.stats.xids.items()):
            for code, count in sorted(codes.items()):
                xids.add_metric([n.node, gpu, code], float(count))
    yield info
    yield xids


def dcgm_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    """Per GPU memory under the DCGM exporter's names, units and labels."""
    labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
    used = _gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels)
    free = _gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels)
    util = _gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels)
    temp = _gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", labels)
    power = _gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels)
    for n in nodes:
        for g in n.gpus:
            at = [str(g.index), g.uuid, f"nvidia{g.index}", g.name, n.node]
            used.add_metric(at, float(g.used_bytes // MIB))
            free.add_metric(at, float(max(0, g.total_bytes - g.used_bytes) // MIB))
            s = g.sensors or GpuSensors()
            for family, value in ((util, s.util_pct), (temp, s.temp_c), (power, s.power_w)):
                if value is not None:  # a sensor the GPU does not have: no series
                    family.add_metric(at, float(value))
    yield from (used, free, util, temp, power)


def queue_families(
    nodes: Sequence[NodeSource], registry: Registry, cluster_queued: int | None
) -> Iterator[Metric]:
    """The queue depth per node, state and type (every known type, 0 included)."""
    depth = _gauge(
        "gpuwarden_queue_depth", "Jobs in a node's queue, by state.", ["node", "state", "type"]
    )
    for n in nodes:
        types = set(registry.types) | set(n.stats.queued) | set(n.running)
        for t in sorted(types):
            depth.add_metric([n.node, QUEUED, t], float(n.stats.queued.get(t, 0)))
            depth.add_metric([n.node, RUNNING, t], float(n.running.get(t, 0)))
    yield depth
    if cluster_queued is not None:
        cluster = _gauge(
            "gpuwarden_cluster_queued_jobs", "Jobs queued at the coordinator (all nodes).", []
        )
        cluster.add_metric([], float(cluster_queued))
        yield cluster


def attempt_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    """Attempts by outcome; queue wait and run time histograms."""
    attempts = _counter(
        "gpuwarden_attempts", "Attempts ended, by outcome.", ["node", "type", "outcome"]
    )
    for n in nodes:
        for t, outcomes in sorted(n.stats.attempts.items()):
            for outcome, count in sorted(outcomes.items()):
                attempts.add_metric([n.node, t, outcome], float(count))
    yield attempts
    yield _histograms(
        "gpuwarden_queue_wait_seconds",
        "Seconds a job waited in the queue before an attempt started (a retry: since "
        "it was queued again).",
        "type",
        nodes,
        lambda s: s.wait,
    )
    yield _histograms(
        "gpuwarden_attempt_run_seconds",
        "Seconds an attempt ran, from its start to its end.",
        "type",
        nodes,
        lambda s: s.run,
    )
    yield _histograms(
        "gpuwarden_reclaim_seconds",
        "Seconds from a holder's end until the device showed its memory free.",
        "gpu",
        nodes,
        lambda s: s.reclaim,
    )


def footprint_families(store: Store, registry: Registry) -> Iterator[Metric]:
    """Each vram-lane type's declared footprint, and the measured ones."""
    declared = _gauge(
        "gpuwarden_footprint_declared_bytes", "A type's VRAM footprint as declared.", ["type"]
    )
    for t in sorted(registry.types.values(), key=lambda t: t.name):
        if t.lane is Lane.VRAM:
            declared.add_metric([t.name], float(t.vram_bytes))
    yield declared
    measured = _gauge(
        "gpuwarden_footprint_measured_bytes",
        "A type's VRAM footprint as measured (raised, never lowered, by measurement).",
        ["type"],
    )
    for name, fp in sorted(store.footprints().items()):
        measured.add_metric([name], float(fp.bytes))
    yield measured


def lease_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    """VRAM leases (SPEC.md, "VRAM leases"), from what each node published: how
    many per node and state (``queued``: waiting for admission, ``granted``: held),
    and what the granted ones hold on each GPU. No lease id: a series per lease
    would be a series per job."""
    count = _gauge("gpuwarden_vram_leases", "VRAM leases, by state.", ["node", "state"])
    for n in nodes:
        count.add_metric([n.node, "queued"], float(n.stats.queued.get(LEASE_TYPE, 0)))
        count.add_metric([n.node, "granted"], float(n.running.get(LEASE_TYPE, 0)))
    yield count
    held = _gauge("gpuwarden_vram_lease_held_bytes", "VRAM the granted leases hold on a GPU.", GPU)
    for n in nodes:
        for g in n.gpus:
            held.add_metric([n.node, g.uuid], float(g.lease_bytes))
    yield held


def warm_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    servers = _gauge("gpuwarden_warm_servers", "Warm servers, by state.", ["node", "type", "state"])
    evictions = _counter("gpuwarden_warm_evictions", "Warm servers evicted.", ["node", "type"])
    for n in nodes:
        for (t, state), count in sorted(n.warm.items()):
            servers.add_metric([n.node, t, state], float(count))
        for t, count in sorted(n.stats.evictions.items()):
            evictions.add_metric([n.node, t], float(count))
    yield servers
    yield evictions
    yield _histograms(
        "gpuwarden_warm_load_seconds",
        "Seconds a warm server took to load its model (the count: loads).",
        "type",
        nodes,
        lambda s: s.warm_loads,
    )


def runtime_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    held = _gauge(
        "gpuwarden_runtime_held_bytes",
        "Memory a managed runtime's processes hold on a GPU.",
        [*GPU, "runtime"],
    )
    releases = _counter(
        "gpuwarden_runtime_releases",
        "Releases asked of a managed runtime, by result (released, ineffective, reloaded).",
        ["node", "runtime", "result"],
    )
    back = _counter(
        "gpuwarden_runtime_released_bytes",
        "Bytes a managed runtime's releases gave back.",
        ["node", "runtime"],
    )
    for n in nodes:
        for g in n.gpus:
            for name, nbytes in g.runtimes:
                held.add_metric([n.node, g.uuid, name], float(nbytes))
        for name, results in sorted(n.stats.releases.items()):
            for result, count in sorted(results.items()):
                releases.add_metric([n.node, name, result], float(count))
        for name, nbytes in sorted(n.stats.released_bytes.items()):
            back.add_metric([n.node, name], float(nbytes))
    yield held
    yield releases
    yield back


def node_families(nodes: Sequence[NodeSource]) -> Iterator[Metric]:
    age = _gauge(
        "gpuwarden_node_heartbeat_age_seconds",
        "Seconds since the node was last heard from (its status published, its heartbeat).",
        ["node"],
    )
    accepting = _gauge("gpuwarden_node_accepting", "1 while the node takes new work.", ["node"])
    leases = _gauge("gpuwarden_node_leases", "Live job leases a node holds.", ["node"])
    state = _gauge(
        "gpuwarden_node_state", "1 for the node's state on the coordinator.", ["node", "state"]
    )
    for n in nodes:
        if n.heartbeat_age_s is not None:
            age.add_metric([n.node], n.heartbeat_age_s)
        accepting.add_metric([n.node], float(n.accepting))
        if n.leases is not None:
            leases.add_metric([n.node], float(n.leases))
        if n.state is not None:
            for s in NodeState:
                state.add_metric([n.node, s.value], float(s.value == n.state))
    yield from (age, accepting, leases, state)
