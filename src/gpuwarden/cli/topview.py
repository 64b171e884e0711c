"""What ``gpuwarden top`` shows, as a pure function: a :class:`TopSnapshot` (what the
brokers published, the job rows it needs, the time) in, a rich renderable out
(:func:`render`). No I/O and no clock read here, so a frame can be rendered from a
made-up snapshot in a test at any width.

Every line fits ``width``: the bars scale to it, the legends are packed into lines
of at most ``width`` cells, and the tables wrap their cells (a wait reason stays
whole, on several lines) instead of the terminal wrapping a row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuwarden.core.ledger import HoldState
from gpuwarden.core.model import GIB
from gpuwarden.node.status import BrokerStatus, GpuStatus

#: a status older than this (or one that says it stopped) is no running broker
#: (``explain``'s and ``submit``'s rule, ``node.explain.FRESH_S``)
FRESH_S = 120.0

#: how many rows of queued jobs and of recent failures a frame shows
QUEUED_ROWS = 8
FAILED_ROWS = 5

#: a queued job waiting longer than this has its wait shown in yellow
LONG_WAIT_S = 600.0

#: the key of each holding in a bar, in the order the ledger lists them
_KEYS = "123456789abcdefghijkmnopqrstuvwxyz"
_HOLD_STYLES = (
    "black on cyan",
    "black on green",
    "black on yellow",
    "white on blue",
    "black on bright_magenta",
    "black on bright_cyan",
    "black on bright_green",
)
_RUNTIME = ("▒", "magenta")
_FOREIGN = ("░", "red")
_RESERVE = ("▓", "grey50")
_FREE = ("·", "dim")
_USED = ("█", "white")
#: jobs leased to a node that have not started there yet (a coordinator's view)
_LEASED = ("▚", "yellow")
#: "ledger " / "device " before a bar, the brackets, and the figures after it
_BAR_LABEL = 7
_BAR_FIGURES = 20
_BAR_MAX = 120


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One broker's last published status."""

    node: str
    pid: int | None
    updated_at: float
    status: BrokerStatus


@dataclass(frozen=True, slots=True)
class JobRow:
    """A job as ``top`` lists it (queued, or a recent failure)."""

    id: str
    type: str
    submitted_at: float
    updated_at: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TopSnapshot:
    """Everything one frame shows, read at ``now``."""

    #: the state directory or the API's URL
    where: str
    now: float
    nodes: tuple[NodeSnapshot, ...] = ()
    #: job state -> how many jobs are in it
    counts: dict[str, int] = field(default_factory=dict)
    #: queued jobs in queue order (their wait reasons are in each node's ``waiting``)
    queued: tuple[JobRow, ...] = ()
    #: failed jobs, most recent first
    failures: tuple[JobRow, ...] = ()
    #: on a coordinator: each enrolled node as its agent last reported it
    #: (``cluster.report.cluster_status``), else None
    cluster: tuple[dict[str, Any], ...] | None = None
    #: per queued job whose wait reason no live broker published (submitted after its
    #: last status; every job over a coordinator): what ``explain`` says of it
    reasons: dict[str, str] = field(default_factory=dict)
    #: per job type, its run-time estimate in seconds (for the running jobs that hold
    #: no VRAM, whose expected end no holding publishes); empty where not known
    expected_s: dict[str, float] = field(default_factory=dict)
    #: the queued and granted VRAM leases, as ``GET /v1/leases`` gives them
    leases: tuple[dict[str, Any], ...] = ()
    #: no store in ``where`` yet (no broker has ever run there)
    no_state: bool = False
    #: why this frame could not be read (the API did not answer), or ""
    error: str = ""

    def live_nodes(self) -> tuple[NodeSnapshot, ...]:
        """The nodes whose broker runs: a status at most ``FRESH_S`` old, not stopped."""
        return tuple(
            n for n in self.nodes if not n.status.stopped and self.now - n.updated_at <= FRESH_S
        )

    def unexplained(self) -> list[str]:
        """The queued jobs shown whose wait reason no live broker published."""
        published = {j for n in self.live_nodes() for j in n.status.waiting}
        return [j.id for j in self.queued[:QUEUED_ROWS] if j.id not in published]


# -- sizes and times ----------------------------------------------------------------


def gib(n: int | float) -> str:
    """Bytes as GiB with one decimal (``top`` shows every size in GiB)."""
    return f"{n / GIB:.1f}"


def span(seconds: float) -> str:
    """A duration as ``42s``, ``5m07s``, ``3h12m``, ``2d05h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clean(text: object) -> str:
    """Text from the store (ids, reasons) with every control character escaped, so
    nothing a job or client wrote can drive the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


# -- bars -----------------------------------------------------------------------------


def cells(parts: Sequence[int], total: int, width: int) -> list[int]:
    """How many of ``width`` cells each part of ``total`` gets: proportional, by
    largest remainder, with at least one cell for a part above zero while cells are
    left; never more than ``width`` in all (parts above ``total`` are scaled down)."""
    scale = max(total, sum(parts), 1)
    exact = [p * width / scale for p in parts]
    got = [int(x) for x in exact]
    for i, p in enumerate(parts):
        if p > 0 and got[i] == 0 and sum(got) < width:
            got[i] = 1
    order = sorted(range(len(parts)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order:
        if sum(got) >= width:
            break
        if exact[i] - got[i] >= 0.5:
            got[i] += 1
    while sum(got) > width:  # the minimum cells took more than there was
        big = max(range(len(got)), key=lambda i: got[i])
        got[big] -= 1
    return got


def bar_width(width: int) -> int:
    return max(10, min(_BAR_MAX, width - _BAR_LABEL - 2 - _BAR_FIGURES))


def _bar(label: str, segments: Sequence[tuple[str, str, int]], total: int, bw: int) -> Text:
    """``label [segments, then free]``: each segment ``(char, style, bytes)``."""
    line = Text(label.ljust(_BAR_LABEL), style="bold")
    line.append("[")
    n = cells([b for _, _, b in segments], total, bw)
    for (char, style, _), k in zip(segments, n, strict=True):
        line.append(char * k, style=style)
    line.append(_FREE[0] * (bw - sum(n)), style=_FREE[1])
    line.append("]")
    return line


def pack(items: Sequence[Text], width: int, indent: int = 2) -> list[Text]:
    """Legend items, two spaces apart, packed into lines of at most ``width`` cells
    (an item longer than a line is cut with an ellipsis, never wrapped)."""
    lines: list[Text] = []
    line = Text(" " * indent)
    for given in items:
        item = given.copy()
        room = width - indent
        if item.cell_len > room:
            item.truncate(room, overflow="ellipsis")
        if line.cell_len > indent and line.cell_len + 2 + item.cell_len > width:
            lines.append(line)
            line = Text(" " * indent)
        if line.cell_len > indent:
            line.append("  ")
        line.append_text(item)
    if line.cell_len > indent:
        lines.append(line)
    return lines


def _swatch(char: str, style: str, words: str) -> Text:
    t = Text(char, style=style)
    t.append(" " + words)
    return t


def _holding_key(i: int) -> str:
    return _KEYS[i] if i < len(_KEYS) else "+"


def _unnamed(holder: str, type_name: str) -> str:
    """A holding without a job id: a warm server's, or (a job's holder is
    ``ID/ATTEMPT``) a job whose id the viewer may not see."""
    return "another job" if "/" in holder else f"warm {clean(type_name)}"


def gpu_block(g: GpuStatus, width: int) -> list[Text]:
    """One GPU: a title line, the ledger bar (holdings by job and warm server,
    managed runtimes, foreign memory, the reserve), the device's own reading as a
    second bar, and a legend; sizes in GiB."""
    view = g.view
    title = Text(f"{clean(g.uuid)}  {clean(g.name)}  {gib(g.total_bytes)} GiB", style="bold")
    if g.sensors is not None and (said := g.sensors.text()):
        title.append(f"  {said}", style="none")
    if view is not None and view.degraded:
        fault = view.degraded.startswith("hardware fault")
        title.append("  FAULT" if fault else "  DEGRADED", style="bold red")
    title.truncate(width, overflow="ellipsis")
    bw = bar_width(width)
    if view is None:  # the book had no view of it: the device's reading only
        used = _bar("device", [(*_USED, g.used_bytes)], g.total_bytes, bw)
        used.append(f" {gib(g.used_bytes)} used")
        return [title, used]
    segs: list[tuple[str, str, int]] = []
    legend: list[Text] = []
    for i, h in enumerate(view.holdings):
        key, style = _holding_key(i), _HOLD_STYLES[i % len(_HOLD_STYLES)]
        segs.append((key, style, h.bytes))
        # a submitter is shown no other token's job id: its holding is "another job"
        who = clean(h.job_id) if h.job_id else _unnamed(h.holder, h.type)
        what = "" if not h.job_id else f" {clean(h.type)}"
        state = "" if h.state is HoldState.RUNNING else f" ({h.state.value})"
        legend.append(_swatch(key, style, f"{who}{what} {gib(h.bytes)}{state}"))
    for name, nbytes in view.runtimes:
        segs.append((*_RUNTIME, nbytes))
        legend.append(_swatch(*_RUNTIME, f"runtime {clean(name)} {gib(nbytes)}"))
    if view.foreign_bytes:
        segs.append((*_FOREIGN, view.foreign_bytes))
        legend.append(_swatch(*_FOREIGN, f"others {gib(view.foreign_bytes)}"))
    free = max(0, view.total_bytes - view.reserve_bytes - sum(b for *_, b in segs))
    segs.append((_FREE[0], _FREE[1], free))
    segs.append((*_RESERVE, view.reserve_bytes))
    paused = " (admission paused)" if view.degraded else ""
    legend.append(_swatch(*_FREE, f"free {gib(view.free_bytes)}{paused}"))
    if view.reserve_bytes:
        legend.append(_swatch(*_RESERVE, f"reserve {gib(view.reserve_bytes)}"))
    ledger = _bar("ledger", segs, g.total_bytes, bw)
    ledger.append(f" {gib(view.held_bytes)}/{gib(g.total_bytes)} GiB held")
    device = _bar("device", [(*_USED, g.used_bytes)], g.total_bytes, bw)
    device.append(f" {gib(g.used_bytes)} GiB used")
    lines = [title, ledger, device, *pack(legend, width)]
    for line in lines[1:3]:
        line.truncate(width, overflow="ellipsis")
    return lines


# -- the sections ---------------------------------------------------------------------


def _table(*columns: str) -> Table:
    """A borderless table whose cells wrap (a long id folds) to fit the width."""
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", expand=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def short_gpu(uuid: str, width: int) -> str:
    """A GPU's UUID in a table: whole on a wide terminal, else its first 12
    characters (``GPU-5f4a3c1e``, ``GPU-sim-0001``), as its bar's title begins."""
    return clean(uuid) if width >= 120 or len(uuid) <= 13 else clean(uuid[:12]) + "…"


def banners(snap: TopSnapshot) -> list[Text]:
    """The lines that say something is wrong, first on the screen: the frame could
    not be read, no broker runs, a GPU is faulted or degraded (with the reason), a
    probe fails, the loop's last error."""
    out: list[Text] = []
    if snap.error:
        out.append(Text(f"cannot read the status: {clean(snap.error)}", style="bold red"))
    live = snap.live_nodes()
    if snap.no_state:
        out.append(
            Text(
                f"no broker has run on {clean(snap.where)} yet: start `gpuwarden serve`",
                style="bold yellow",
            )
        )
    elif not live and snap.cluster is None and not snap.error:
        last = max((n.updated_at for n in snap.nodes), default=None)
        seen = f" (last status {span(snap.now - last)} ago)" if last is not None else ""
        out.append(
            Text(
                f"no broker is running on {clean(snap.where)}{seen}: queued jobs wait "
                "until `gpuwarden serve` runs",
                style="bold yellow",
            )
        )
    for n in live:
        st = n.status
        for uuid, why in st.degraded.items():
            word = "FAULT" if why.startswith("hardware fault") else "DEGRADED"
            out.append(
                Text(
                    f"{word} {clean(uuid)} on {clean(n.node)}: {clean(why)}",
                    style="bold white on red" if word == "FAULT" else "bold red",
                )
            )
        if st.probe_error:
            out.append(
                Text(
                    f"PROBE FAILS on {clean(n.node)}: {clean(st.probe_error)}; VRAM "
                    "admission paused",
                    style="bold red",
                )
            )
        if (e := st.last_error) is not None:
            out.append(
                Text(
                    f"loop error on {clean(n.node)} {span(snap.now - e.ts)} ago in "
                    f"{clean(e.where)}: {clean(e.message)}",
                    style="yellow",
                )
            )
    for c in snap.cluster or ():
        if c.get("problem"):
            out.append(
                Text(f"node {clean(c.get('node'))}: {clean(c['problem'])}", style="bold red")
            )
        for g in c.get("gpus") or ():
            if g.get("degraded"):
                out.append(
                    Text(
                        f"DEGRADED {clean(g.get('uuid'))} on {clean(c.get('node'))}: "
                        f"{clean(g['degraded'])}",
                        style="bold red",
                    )
                )
    return out


def node_section(n: NodeSnapshot, now: float, width: int) -> list[RenderableType]:
    st = n.status
    head = Text(f"node {clean(n.node)}", style="bold reverse")
    head.append(f"  PID {n.pid}  status {now - n.updated_at:.1f} s old  probe {clean(st.probe)}")
    if not st.accepting:
        head.append("  not accepting jobs", style="yellow")
    head.truncate(width, overflow="ellipsis")
    out: list[RenderableType] = [head]
    for g in st.gpus:
        out += gpu_block(g, width)
    if not st.gpus:
        out.append(Text("no GPUs", style="dim"))
    return out


def running_table(snap: TopSnapshot, nodes: Sequence[NodeSnapshot], width: int) -> Table | Text:
    """Running jobs with their elapsed time against the expected one (the type's
    run-time estimate: published with each holding, else the snapshot's)."""
    now = snap.now
    wide = width >= 100
    t = _table("running job", "type", *(["node", "GPU"] if wide else []), "elapsed / expected")
    for n in nodes:
        expected = {
            h.job_id: h.expected_end - h.since
            for g in n.status.gpu_views()
            for h in g.holdings
            if h.job_id and h.expected_end is not None
        }
        for r in n.status.running:
            t.add_row(
                clean(r.job) if r.job else Text("another job", style="dim"),
                clean(r.type),
                *([clean(n.node), short_gpu(r.gpu or "cpu", width)] if wide else []),
                _progress(r.started_at, expected.get(r.job, snap.expected_s.get(r.type)), now),
            )
    for c in snap.cluster or ():  # a coordinator's nodes, as their agents reported
        for r in c.get("running") or ():
            job, type_name = r.get("job"), str(r.get("type") or "")
            started = r.get("started_at")
            t.add_row(
                clean(job) if job else Text("another job", style="dim"),
                clean(type_name),
                *(
                    [clean(c.get("node")), short_gpu(str(r.get("gpu") or "cpu"), width)]
                    if wide
                    else []
                ),
                _progress(
                    float(started) if isinstance(started, int | float) else None,
                    snap.expected_s.get(type_name),
                    now,
                ),
            )
    return t if t.row_count else Text("running: none", style="dim")


def _progress(started_at: float | None, expected_s: float | None, now: float) -> Text:
    if started_at is None:
        return Text("-")
    took = now - started_at
    if expected_s is None or expected_s <= 0:
        return Text(f"{span(took)} / -")
    shown = Text(f"{span(took)} / ~{span(expected_s)}")
    if took > expected_s:
        shown.append(f" (over by {span(took - expected_s)})", style="yellow")
    else:
        shown.append(f" ({100 * took / expected_s:.0f} %)")
    return shown


def queued_table(snap: TopSnapshot) -> Table | Text | None:
    """Queued jobs, in queue order, with how long they have waited and why (the
    reason the broker published, the sentence ``explain`` gives after "it waits:")."""
    if not snap.queued:
        return None
    live = snap.live_nodes()
    waiting: dict[str, str] = {}
    for n in live:
        waiting.update(n.status.waiting)
    t = _table("queued job", "type", "waited", "why")
    for j in snap.queued[:QUEUED_ROWS]:
        waited = snap.now - j.submitted_at
        t.add_row(
            clean(j.id),
            clean(j.type),
            Text(span(waited), style="bold yellow" if waited >= LONG_WAIT_S else ""),
            _why(j.id, waiting, snap, bool(live)),
        )
    total = snap.counts.get("queued", len(snap.queued))
    if total > QUEUED_ROWS:
        t.add_row(f"… and {total - QUEUED_ROWS} more", "", "", "")
    return t


def _why(job_id: str, waiting: dict[str, str], snap: TopSnapshot, live: bool) -> str:
    if (why := waiting.get(job_id)) is not None:
        return clean(why)
    if job_id in snap.reasons:
        return clean(snap.reasons[job_id])
    if snap.cluster is not None:
        return "waits for an enrolled node to take it (`gpuwarden explain` says why)"
    if not live:
        return "no broker is running here, so nothing will start it: run `gpuwarden serve`"
    return "not planned yet: the broker's next status says why it waits"


def warm_table(nodes: Sequence[NodeSnapshot], now: float, width: int) -> Table | None:
    """Warm servers with the grace they have left before an idle one may be evicted."""
    t = _table("warm server", "GPU", "state", "VRAM", "served", "grace left")
    for n in nodes:
        views = {(v.type, v.gpu_uuid): v for v in n.status.warm_views}
        for w in n.status.warm:
            v = views.get((w.type, w.gpu))
            t.add_row(
                clean(w.type),
                short_gpu(w.gpu, width),
                clean(w.state),
                f"{gib(w.footprint_bytes)} GiB",
                str(w.jobs_served),
                _grace(w.state, w.keep_warm, v, now),
            )
    return t if t.row_count else None


def _grace(state: str, keep_warm: bool, v: Any, now: float) -> str:
    if keep_warm:
        return "kept warm"
    if state != "idle" or v is None or v.idle_since is None:
        return "-"
    left = v.idle_grace_s - (now - v.idle_since)
    return span(left) if left > 0 else "over: evicted when idle or VRAM is needed"


def leases_table(snap: TopSnapshot) -> Table | None:
    """The VRAM leases beside the jobs: who holds room where, how much, until when."""
    if not snap.leases:
        return None
    t = _table("lease", "holder", "gpu", "GiB", "state", "until")
    for x in snap.leases:
        until = x.get("until")
        left = f"{span(float(until) - snap.now)} left" if until else "-"
        t.add_row(
            clean(x.get("id")),
            clean(x.get("holder") or x.get("owner") or "local"),
            clean(x.get("gpu") or x.get("pinned_gpu") or "-"),
            gib(int(x.get("vram_bytes") or 0)),
            clean(x.get("state")),
            left,
        )
    return t


def failures_table(snap: TopSnapshot) -> Table | None:
    if not snap.failures:
        return None
    t = _table("failed job", "type", "ago", "reason")
    for j in snap.failures[:FAILED_ROWS]:
        t.add_row(clean(j.id), clean(j.type), span(snap.now - j.updated_at), clean(j.reason))
    return t


def cluster_section(c: dict[str, Any], now: float, width: int) -> list[RenderableType]:
    """One enrolled node as ``status`` shows it over a coordinator: state, heartbeat
    age, its GPUs (ledger and device against the total), warm servers, running jobs."""
    head = Text(f"node {clean(c.get('node'))}", style="bold reverse")
    head.append(
        f"  {clean(c.get('state'))}  heartbeat {float(c.get('heard_s_ago') or 0):.1f} s "
        f"ago  {len(c.get('running') or ())} running"
    )
    if c.get("leased"):
        head.append(f", {c['leased']} leased here and waiting")
    head.truncate(width, overflow="ellipsis")
    out: list[RenderableType] = [head]
    bw = bar_width(width)
    for g in c.get("gpus") or ():
        total = int(g.get("total_bytes") or 0)
        ledger, free = int(g.get("ledger_bytes") or 0), int(g.get("free_bytes") or 0)
        used = int(g.get("used_bytes") or 0)
        title = Text(
            f"{clean(g.get('uuid'))}  {clean(g.get('name'))}  {gib(total)} GiB", style="bold"
        )
        if g.get("degraded"):
            title.append("  DEGRADED", style="bold red")
        title.truncate(width, overflow="ellipsis")
        # jobs leased there and not started yet: theirs, not "others"
        waiting = int(g.get("waiting_bytes") or 0)
        other = max(0, total - ledger - waiting - free)
        bar = _bar(
            "ledger",
            [("█", "cyan", ledger), (*_LEASED, waiting), (*_FOREIGN, other), (*_FREE, free)],
            total,
            bw,
        )
        bar.append(f" {gib(ledger)}/{gib(total)} GiB held")
        dev = _bar("device", [(*_USED, used)], total, bw)
        dev.append(f" {gib(used)} GiB used")
        out += [
            title,
            bar,
            dev,
            *pack(
                [
                    _swatch("█", "cyan", f"gpuwarden {gib(ledger)}"),
                    *([_swatch(*_LEASED, f"leased, starting {gib(waiting)}")] if waiting else []),
                    _swatch(*_FOREIGN, f"others+reserve {gib(other)}"),
                    _swatch(*_FREE, f"free {gib(free)}"),
                ],
                width,
            ),
        ]
    for w in c.get("warm") or ():
        out.append(
            Text(
                f"  warm {clean(w.get('type'))} on {clean(w.get('gpu') or '-')} "
                f"{clean(w.get('state') or '')}"
            )
        )
    for r in c.get("running") or ():
        started = r.get("started_at")
        took = span(now - float(started)) if started else "-"
        out.append(
            Text(
                f"  running {clean(r.get('job') or 'another job')} "
                f"{clean(r.get('type') or '')} for {took}"
            )
        )
    return out


def render(snap: TopSnapshot, width: int, *, footer: str = "") -> RenderableType:
    """One frame of ``top`` for a terminal ``width`` cells wide."""
    counts = ", ".join(f"{k} {v}" for k, v in sorted(snap.counts.items())) or "no jobs"
    clock = time.strftime("%H:%M:%S", time.localtime(snap.now))
    head = [
        Text(f"gpuwarden top  {clean(snap.where)}  {clock}", style="bold"),
        Text(f"jobs: {counts}"),
    ]
    parts: list[RenderableType] = [*pack(head, width, indent=0), *banners(snap)]
    live = snap.live_nodes()
    for n in live:
        parts += node_section(n, snap.now, width)
    for c in snap.cluster or ():
        if c.get("state") != "revoked":
            parts += cluster_section(c, snap.now, width)
    if snap.cluster is not None and not snap.cluster:
        parts.append(Text("no node is enrolled with this coordinator", style="yellow"))
    parts += [Text(""), running_table(snap, live, width)]
    tables = (
        leases_table(snap),
        queued_table(snap),
        warm_table(live, snap.now, width),
        failures_table(snap),
    )
    for table in tables:
        if table is not None:
            parts += [Text(""), table]
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)
