"""``gpuwarden status``: each broker's GPUs, ledger, warm servers, queues and health
(from the state directory, or with ``--url`` through the API); on a coordinator's
store, its enrolled nodes as their agents last reported them. Exit 0 when every
node is well, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden.api.leasedesk import LeaseDesk, tally
from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    age,
    checked_store,
    config_of,
    err,
    local_or_http,
    out,
)
from gpuwarden.client import Client
from gpuwarden.cluster import report
from gpuwarden.core import faultlatch
from gpuwarden.core.model import format_bytes
from gpuwarden.core.policy import GpuView
from gpuwarden.core.service import url_path
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError
from gpuwarden.node.status import BrokerStatus
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus
from gpuwarden.store.cluster import ClusterStore

#: a broker whose status is older than this is reported as not running
STALE_AFTER_S = 120.0


def _add_status(sub: Commands) -> None:
    sp = sub.add_parser("status", help="the broker's GPUs, ledger, queues and health")
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=60.0,
        metavar="SECONDS",
        help="first wait until a broker reports and is well (default 60 s; for scripts "
        "that start `gpuwarden serve` in the background)",
    )
    add_remote_options(sp)
    sp.set_defaults(func=cmd_status)


#: the commands of this module, each with what adds its parser
PARSERS = {"status": _add_status}


_Gathered = tuple[list[NodeStatus], dict[JobState, int], str, list[dict[str, Any]] | None]


def cmd_status(args: argparse.Namespace) -> int:
    gathered = _gather_status(args)
    if args.wait is not None:
        deadline = time.monotonic() + args.wait
        where = gathered[2] if gathered else str(config_of(args).state_dir)
        if not _broker_up(gathered):
            err.print(f"waiting up to {args.wait:g} s for a broker to report on {where} ...")
        while not _broker_up(gathered) and time.monotonic() < deadline:
            time.sleep(0.2)
            gathered = _gather_status(args)
    if gathered is None:
        err.print(f"no broker has run on state directory {config_of(args).state_dir}")
        return 1
    return _report_status(args, *gathered, leases=_leases(args))


def _leases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The queued and granted leases (SPEC.md, "VRAM leases"), as ``GET /v1/leases``
    gives them; none where they cannot be read."""
    with contextlib.suppress(GpuwardenError, OSError):
        return local_or_http(args, _leases_here, lambda _a, c: c.leases())
    return []


def _leases_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = config_of(args)
    store = checked_store(config, writes=False)
    try:
        registry = Registry.load(config.module_paths, config.launch_rules)
        desk = LeaseDesk(store, registry, config)
        return [desk.info(j) for j in desk.listed()]
    finally:
        store.close()


def _print_leases(leases: list[dict[str, Any]]) -> None:
    if not leases:
        out.print("leases: none", markup=False)
        return
    got = tally(leases)
    held = ", ".join(f"{gpu} {_maybe_bytes(n)}" for gpu, n in sorted(got.held_bytes.items()))
    out.print(
        f"leases: {len(leases)} ({got.granted} granted, {got.waiting} waiting)"
        + (f"; held: {held}" if held else ""),
        markup=False,
    )
    for x in leases:
        until = x.get("until")
        when = time.strftime("%H:%M:%S", time.localtime(until)) if until else "-"
        out.print(
            f"  {x['id']}  {x.get('holder') or x.get('owner') or '-'}  {x.get('gpu') or '-'}  "
            f"{_maybe_bytes(x.get('vram_bytes'))}  {x['state']}  until {when}",
            markup=False,
        )


def _gather_status(args: argparse.Namespace) -> _Gathered | None:
    """What ``status`` reports, from the API (``--url``) or the state directory;
    None where no broker has made that state directory yet."""
    return local_or_http(args, _gather_here, _gather_http)


def _gather_http(_args: argparse.Namespace, client: Client) -> _Gathered | None:
    data = client.status()
    statuses = [
        NodeStatus(
            node=n["node"],
            pid=n.get("pid"),
            updated_at=n["updated_at"],
            payload={k: v for k, v in n.items() if k not in ("node", "pid", "updated_at")},
        )
        for n in data.get("nodes", [])
    ]
    counts = {JobState(k): int(v) for k, v in data.get("jobs", {}).items()}
    return statuses, counts, client.url, data.get("cluster")


def _gather_here(args: argparse.Namespace) -> _Gathered | None:
    config = config_of(args)
    if not config.database and not config.db_path.exists():
        return None
    store = checked_store(config, writes=False)
    try:
        statuses = store.node_statuses()
        counts = store.count_by_state()
        cluster = None
        if isinstance(store, ClusterStore) and store.list_nodes():
            # a coordinator's store: its agents' reports
            cluster = report.cluster_status(
                store, time.time(), offline_after_s=config.cluster.offline_after_s
            )
    finally:
        store.close()
    return statuses, counts, str(config.state_dir), cluster


def _broker_up(gathered: _Gathered | None) -> bool:
    """Whether ``status --wait`` is done waiting: a broker (or, on a coordinator,
    an enrolled node) reports and reports no problem."""
    if gathered is None:
        return False
    statuses, _, _, cluster = gathered
    if cluster is not None:
        working = [n for n in cluster if n.get("state") != "revoked"]
        return bool(working) and all(not n.get("problem") for n in working)
    return bool(statuses) and not any(_status_problem(s) for s in statuses)


def _status_problem(s: NodeStatus) -> str:
    """What is wrong with one broker's last status, or ``""``."""
    old_s = time.time() - s.updated_at
    st = BrokerStatus.from_json(s.payload)
    if st.stopped:
        return "the broker has stopped"
    if old_s > STALE_AFTER_S:
        return f"status is {old_s:.0f} s old: the broker is not running or is stuck"
    if st.degraded:
        return f"{len(st.degraded)} GPU(s) degraded: VRAM admission paused there"
    if st.probe_error:
        return "the GPU probe fails: VRAM admission paused"
    return ""


def _report_status(
    args: argparse.Namespace,
    statuses: list[NodeStatus],
    counts: dict[JobState, int],
    where: str,
    cluster: list[dict[str, Any]] | None = None,
    *,
    leases: list[dict[str, Any]] | None = None,
) -> int:
    """Print the status (or ``--json``); 0 when every node is well, else 1. With
    ``cluster`` (a coordinator's enrolled nodes), those nodes are what counts;
    ``leases`` are shown beside the jobs."""
    if args.json:
        data: dict[str, Any] = {
            "nodes": [
                {"node": s.node, "pid": s.pid, "updated_at": s.updated_at, **s.payload}
                for s in statuses
            ],
            "jobs": {k.value: v for k, v in counts.items()},
        }
        if cluster is not None:
            data["cluster"] = cluster
        data["leases"] = leases or []
        out.print_json(json.dumps(data))
    healthy = bool(statuses)
    if cluster is not None:
        working = [n for n in cluster if n.get("state") != "revoked"]
        healthy = bool(working) and all(not n.get("problem") for n in working)
        if not working:
            err.print(
                f"no node is enrolled with the coordinator at {where}: "
                "`gpuwarden node invite NAME` makes an enrolment token"
            )
        if not args.json:
            for n in cluster:
                _print_cluster_node(n)
    elif not statuses:
        err.print(f"no broker status in {where}: start `gpuwarden serve`")
    for s in statuses:
        if problem := _status_problem(s):
            healthy = False
        if not args.json:
            st = BrokerStatus.from_json(s.payload)
            _print_status(s.node, s.pid, time.time() - s.updated_at, st, problem)
    if not args.json:
        out.print(
            "jobs: " + (", ".join(f"{k.value} {v}" for k, v in sorted(counts.items())) or "none")
        )
        _print_leases(leases or [])
    return 0 if healthy else 1


def _maybe_bytes(value: Any) -> str:
    return "-" if value is None else format_bytes(int(value))


def _print_cluster_node(n: dict[str, Any]) -> None:
    """One enrolled node of a coordinator, as its agent last reported it."""
    name, state, problem = escape(str(n["node"])), str(n["state"]), str(n.get("problem") or "")
    shown = f"[red]{escape(problem)}[/]" if problem else "[green]ok[/]"
    if state == "revoked":
        out.print(f"[bold]node {name}[/]  revoked")
        return
    leased = f", {n['leased']} leased here and waiting" if n.get("leased") else ""
    out.print(
        f"[bold]node {name}[/]  {state}  heartbeat {float(n['heard_s_ago']):.1f} s ago  "
        f"{len(n.get('running', []))} running{leased}  {shown}"
    )
    out.print(
        f"probe: {escape(str(n.get('probe') or '?'))}"
        + (f"  [red]error: {escape(str(n['probe_error']))}[/]" if n.get("probe_error") else "")
    )
    gpus = Table("GPU", "name", "total", "used", "gpuwarden", "free", "state")
    for g in n.get("gpus", []):
        gpus.add_row(
            escape(str(g["uuid"])),
            escape(str(g["name"])),
            format_bytes(int(g["total_bytes"])),
            _maybe_bytes(g.get("used_bytes")),
            _maybe_bytes(g.get("ledger_bytes")),
            _maybe_bytes(g.get("free_bytes")),
            f"[red]degraded: {escape(str(g['degraded']))}[/]" if g.get("degraded") else "ok",
        )
    out.print(gpus if gpus.row_count else "GPUs: none reported")
    warm = Table("warm server", "GPU", "state", "jobs served")
    for w in n.get("warm", []):
        served = w.get("jobs_served")
        warm.add_row(
            escape(str(w["type"])),
            escape(str(w.get("gpu") or "-")),
            escape(str(w.get("state") or "-")),
            "-" if served is None else str(served),
        )
    out.print(warm if warm.row_count else "warm servers: none")
    running = Table("running job", "type", "attempt", "GPU", "for")
    for r in n.get("running", []):
        running.add_row(
            escape(str(r["job"] or "another job")),
            escape(str(r.get("type") or "")),
            str(r.get("attempt") or "-"),
            escape(str(r.get("gpu") or "-")),
            age(r["started_at"]) if r.get("started_at") else "-",
        )
    out.print(running if running.row_count else "running: none")


def _print_status(node: str, pid: int | None, old_s: float, st: BrokerStatus, problem: str) -> None:
    """One broker's last status, as the broker wrote it."""
    state = f"[red]{problem}[/]" if problem else "[green]running[/]"
    out.print(f"[bold]node {node}[/]  PID {pid}  status {old_s:.1f} s old  {state}")
    out.print(
        f"probe: {st.probe}" + (f"  [red]error: {st.probe_error}[/]" if st.probe_error else "")
    )
    _print_gpus(st)
    warm = Table("warm server", "GPU", "state", "VRAM", "jobs served", "load", "idle", "epoch")
    for w in st.warm:
        warm.add_row(
            w.type + (" (kept warm)" if w.keep_warm else ""),
            w.gpu,
            w.state,
            format_bytes(w.footprint_bytes),
            str(w.jobs_served),
            "-" if w.load_s is None else f"{w.load_s:.2f}s",
            "-" if w.idle_s is None else f"{w.idle_s:.0f}s",
            str(w.epoch),
        )
    out.print(warm if warm.row_count else "warm servers: none")
    footprints = Table("job type", "declared", "measured", "admitted with")
    for name, f in st.footprints.items():
        footprints.add_row(
            name,
            format_bytes(f.declared_bytes),
            format_bytes(f.measured_bytes) if f.measured_bytes else "-",
            format_bytes(f.effective_bytes),
        )
    if footprints.row_count:
        out.print(footprints)
    queues = Table("queue root", "inbox", "processing", "outbox", "failed")
    for root, depth in st.queues.items():
        queues.add_row(
            root, *(str(depth.get(k, 0)) for k in ("inbox", "processing", "outbox", "failed"))
        )
    if st.queues:
        out.print(queues)
    running = Table("running job", "type", "attempt", "GPU", "for")
    for r in st.running:
        # a job asked to yield says so: "preempting X for Y"
        job = r.job if r.preempting_for is None else f"{r.job} (preempting for {r.preempting_for})"
        running.add_row(job, r.type, str(r.attempt), r.gpu or "-", age(r.started_at))
    out.print(running if st.running else "running: none")
    _print_services(st)
    if st.waiting:
        waiting = Table("waiting job", "why")
        for job, why in st.waiting.items():
            waiting.add_row(job, why)
        out.print(waiting)
    if (e := st.last_error) is not None:
        out.print(f"[red]last loop error[/] ({age(e.ts)} ago, in {e.where}): {e.message}")


def _print_services(st: BrokerStatus) -> None:
    """The node's service jobs (running, and those ended in the last 10 minutes)."""
    table = Table("service", "job", "state", "for", "last health check passed", "URL path")
    for sv in st.services:
        name = str(sv.get("name", ""))
        last_ok = sv.get("last_ok")
        state = str(sv.get("state", ""))
        if sv.get("error") and state != "stopped":
            state += f": {sv['error']}"
        table.add_row(
            escape(name),
            escape(str(sv.get("job") or "-")),
            escape(state),
            age(sv.get("since")),
            "never" if last_ok is None else f"{age(last_ok)} ago",
            escape(url_path(name)),
        )
    if table.row_count:
        out.print(table)


def _gpu_state(view: GpuView | None) -> str:
    """A GPU's state column: degraded, kept by a process outside the queue, or ok."""
    if view is not None and view.degraded:
        return f"[red]degraded: {escape(view.degraded)}[/]"
    if view is not None and view.locked:
        return f"[yellow]{escape(view.locked)}[/]"
    return "ok"


def _print_gpus(st: BrokerStatus) -> None:
    """A broker's GPUs and, when any, what the ledger holds on each."""
    gpus = Table(
        "GPU", "name", "total", "used", "gpuwarden", "others", "reserve", "free", "util/temp/power",
        "state",
    )  # fmt: skip
    holdings = Table("GPU", "job", "type", "VRAM", "shares", "state")
    for g in st.gpus:
        view = g.view
        gpus.add_row(
            g.uuid,
            g.name,
            format_bytes(g.total_bytes),
            format_bytes(g.used_bytes),
            format_bytes(view.held_bytes if view else 0),
            format_bytes(view.foreign_bytes if view else 0),
            format_bytes(view.reserve_bytes if view else 0),
            format_bytes(g.free_bytes),
            (g.sensors.text() if g.sensors is not None else "") or "-",
            _gpu_state(view),
        )
        for h in view.holdings if view else ():
            holdings.add_row(
                g.uuid,
                h.job_id or "-",
                h.type,
                format_bytes(h.bytes),
                "yes" if h.coresident else "no",
                h.state.value,
            )
    out.print(gpus)
    for uuid, f in st.faults.items():
        at = f.get("latched_at")
        since = faultlatch.when(float(at)) if isinstance(at, int | float) else "?"
        out.print(
            f"[red]fault latched[/] on {escape(uuid)}: Xid {escape(str(f.get('xid')))} "
            f"since {since}; it survives a broker restart: "
            f"`gpuwarden gpu clear {escape(uuid)} --reason TEXT` ends it"
        )
    if holdings.row_count:
        out.print(holdings)
