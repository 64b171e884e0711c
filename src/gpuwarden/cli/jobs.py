"""The commands about jobs in the store (or, with ``--url``, through the API):
``jobs``, ``show``, ``cancel``, ``explain``, and ``preview`` of one not submitted.
"""

from __future__ import annotations

import argparse
import getpass
import json
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden.app import coordinator_source_cache, make_probe
from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    age,
    audited,
    checked_store,
    config_of,
    existing_store,
    local_or_http,
    out,
)
from gpuwarden.client import Client
from gpuwarden.cluster import report
from gpuwarden.core.model import GIB, Attempt, Event, Job, Lane
from gpuwarden.core.service import ServiceView
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError, ValidationError
from gpuwarden.node import explain, servicestate
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore


def _add_jobs(sub: Commands) -> None:
    sp = sub.add_parser("jobs", help="list jobs")
    sp.add_argument("--state", choices=[s.value for s in JobState], action="append")
    sp.add_argument("--limit", type=int, default=50)
    sp.add_argument("--json", action="store_true")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_jobs)


def _add_show(sub: Commands) -> None:
    sp = sub.add_parser("show", help="one job: its attempts and events")
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_show)


def _add_cancel(sub: Commands) -> None:
    sp = sub.add_parser("cancel", help="cancel a queued or running job")
    sp.add_argument("job")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_cancel)


def _add_stop(sub: Commands) -> None:
    sp = sub.add_parser("stop", help="stop a running service job (it ends done)")
    sp.add_argument("job")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_stop)


def _add_explain(sub: Commands) -> None:
    sp = sub.add_parser("explain", help="why a job waits (or where it runs, or how it ended)")
    sp.add_argument("job")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_explain)


def _add_preview(sub: Commands) -> None:
    sp = sub.add_parser(
        "preview",
        help="would a job of this type start now, where, or what would it wait for",
        description="Run the admission policy on what the broker last saw (or on the probe, "
        "if no broker runs) with one more job in the queue; with --url, the API's broker, "
        "or a coordinator's nodes. Submits nothing.",
        allow_abbrev=False,
    )
    sp.add_argument("type", help="job type, module.type")
    sp.add_argument("--vram-gib", type=float, help="footprint for this job (default: the type's)")
    sp.add_argument("--priority", type=int, default=0)
    add_remote_options(sp)
    sp.set_defaults(func=cmd_preview)


#: the commands of this module, each with what adds its parser
PARSERS = {
    "jobs": _add_jobs,
    "show": _add_show,
    "cancel": _add_cancel,
    "stop": _add_stop,
    "explain": _add_explain,
    "preview": _add_preview,
}


def _job_json(j: Job) -> dict[str, Any]:
    return {
        "id": j.id,
        "state": j.state.value,
        "type": j.type,
        "priority": j.priority,
        "attempts": j.attempts,
        "submitted_at": j.submitted_at,
        "updated_at": j.updated_at,
        "reason": j.reason,
        "exit_code": j.exit_code,
        "bundle": j.bundle,
        "params": j.params,
        "after": list(j.after),
        "held": j.held,
        "hold_by": j.hold_by,
    }


def _with_service(data: dict[str, Any], view: ServiceView | None) -> dict[str, Any]:
    """A job's JSON with its service's keys (as the API's), for a service job."""
    return data | view.to_json() if view is not None else data


def _state_cell(row: dict[str, Any]) -> str:
    """A job's state in the ``jobs`` table; a service job's service state beside it."""
    service = row.get("service_state")
    return f"{row['state']} ({service})" if service else str(row["state"])


def _service_line(data: dict[str, Any]) -> str | None:
    """``show``'s line of a service job: its state, since when, its last passed
    health check, where it is served; None for another job."""
    path = data.get("service_url_path")
    if not path:
        return None
    state = data.get("service_state") or "not known now (no broker published lately)"
    since = data.get("service_since")
    if since is not None:
        clock = time.strftime("%H:%M:%S", time.localtime(since))
        state += f" since {clock} ({age(since)} ago)"
    last_ok = data.get("service_last_ok")
    checked = "never" if last_ok is None else f"{age(last_ok)} ago"
    error = f"; last check failed: {data['service_error']}" if data.get("service_error") else ""
    return f"service: {state}; last passed its health check {checked}{error}; URL path {path}"


def _attempt_json(a: Attempt) -> dict[str, Any]:
    return {
        "number": a.number,
        "node": a.node,
        "gpu": a.gpu_uuid,
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "exit_code": a.exit_code,
        "outcome": a.outcome,
        "reason": a.reason,
    }


def _get_job(store: Store, job_id: str) -> Job:
    job = store.get_job(job_id)
    if job is None:
        raise UserError(f"no job with id {job_id!r} (see `gpuwarden jobs`)")
    return job


# -- jobs ---------------------------------------------------------------------------


def cmd_jobs(args: argparse.Namespace) -> int:
    """The same rows from the store as from the API (``GET /v1/jobs``)."""
    rows = local_or_http(
        args,
        _jobs_here,
        lambda a, client: client.list(states=a.state or (), limit=a.limit),
    )
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table("job", "state", "type", "attempts", "age", "reason")
    for r in rows:
        table.add_row(
            escape(r["id"]), _state_cell(r), escape(r["type"]), str(r["attempts"]),
            age(r["submitted_at"]), escape(r["reason"]),
        )  # fmt: skip
    out.print(table if rows else "no jobs")
    return 0


def _jobs_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = config_of(args)
    store = existing_store(args, config, writes=False)
    try:
        states = frozenset(JobState(s) for s in args.state) if args.state else None
        jobs = store.list_jobs(states=states, limit=args.limit)
        registry = Registry.load(config.module_paths, config.launch_rules)
        services = servicestate.views(jobs, store, registry, time.time())
        rows = [
            _with_service(_job_json(j), services.get(j.id))
            | {"reason": explain.shown_reason(j, store)}
            for j in jobs
        ]
    finally:
        store.close()
    return rows


# -- show ---------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
    return local_or_http(args, _show_here, _show_http)


def _show_here(args: argparse.Namespace) -> int:
    config = config_of(args)
    store = existing_store(args, config, writes=False)
    try:
        job = _get_job(store, args.job)
        attempts = store.attempts(job.id)
        events = store.events(job_id=job.id)
        job = job.evolve(reason=explain.shown_reason(job, store))
        registry = Registry.load(config.module_paths, config.launch_rules)
        service = servicestate.views([job], store, registry, time.time()).get(job.id)
    finally:
        store.close()
    data = _with_service(_job_json(job), service)
    if args.json:
        data["attempts_detail"] = [_attempt_json(a) for a in attempts]
        data["events"] = [e.to_json() for e in events]
        out.print_json(json.dumps(data))
        return 0
    out.print(f"[bold]{job.id}[/]  {job.type}  [bold]{job.state.value}[/]  priority {job.priority}")
    if job.reason:
        out.print(f"reason: {job.reason}", markup=False)
    if (line := _service_line(data)) is not None:
        out.print(line, markup=False)
    if job.after:
        out.print(f"after: {', '.join(job.after)}" + (" (waiting)" if job.held else ""))
    out.print(f"params: {json.dumps(job.params)}")
    table = Table("attempt", "node", "GPU", "started", "ran", "exit", "outcome", "reason")
    for a in attempts:
        ran = f"{a.ended_at - a.started_at:.2f}s" if a.ended_at else "running"
        table.add_row(
            str(a.number),
            a.node,
            a.gpu_uuid or "-",
            age(a.started_at) + " ago",
            ran,
            "-" if a.exit_code is None else str(a.exit_code),
            a.outcome or "-",
            escape(a.reason),
        )
    out.print(table)
    _logs_hint(job.id, len(attempts))
    out.print(_events_table(events))
    return 0


def _events_table(events: list[Event]) -> Table:
    ev = Table("when", "event", "change", "detail")
    for e in events:
        change = f"{e.from_state or ''} -> {e.to_state}" if e.to_state else ""
        ev.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.ts)), e.kind, change,
            escape(json.dumps(e.detail)),
        )  # fmt: skip
    return ev


def _show_http(args: argparse.Namespace, client: Client) -> int:
    data = client.get(args.job)
    if args.json:
        out.print_json(json.dumps(data))
        return 0
    out.print(
        f"[bold]{escape(data['id'])}[/]  {escape(data['type'])}  [bold]{data['state']}[/]  "
        f"priority {data['priority']}"
    )
    if data.get("reason"):
        out.print(f"reason: {data['reason']}", markup=False)
    if (line := _service_line(data)) is not None:
        out.print(line, markup=False)
    if data.get("after"):
        held = " (waiting)" if data.get("held") else ""
        out.print(f"after: {', '.join(data['after'])}{held}", markup=False)
    out.print(f"params: {json.dumps(data['params'])}", markup=False)
    table = Table("attempt", "node", "GPU", "started", "ran", "exit", "outcome", "reason")
    for a in data.get("attempts_detail", []):
        ran = f"{a['ended_at'] - a['started_at']:.2f}s" if a.get("ended_at") else "running"
        table.add_row(
            str(a["number"]),
            a["node"],
            a.get("gpu") or "-",
            age(a["started_at"]) + " ago",
            ran,
            "-" if a.get("exit_code") is None else str(a["exit_code"]),
            escape(a.get("outcome") or "-"),
            escape(a.get("reason", "")),
        )
    out.print(table)
    _logs_hint(data["id"], len(data.get("attempts_detail", [])))
    ev = Table("when", "event", "change", "detail")
    for e in data.get("events", []):
        rest = {k: v for k, v in e.items() if k not in ("ts", "event", "job", "from", "to")}
        change = f"{e.get('from') or ''} -> {e['to']}" if e.get("to") else ""
        ev.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["ts"])), escape(e["event"]), change,
            escape(json.dumps(rest)),
        )  # fmt: skip
    out.print(ev)
    return 0


def _logs_hint(job_id: str, attempts: int) -> None:
    if attempts:
        more = " --attempt N" if attempts > 1 else ""
        out.print(
            f"output: `gpuwarden logs {job_id}{more}` (stdout; add --stderr for stderr)",
            markup=False,
        )


# -- cancel, explain ------------------------------------------------------------------


def cmd_cancel(args: argparse.Namespace) -> int:
    job_id, state = local_or_http(args, _cancel_here, _cancel_http)
    if state == JobState.CANCELLED.value:
        out.print(f"{job_id} cancelled (it had not started)")
    else:
        out.print(f"{job_id} is running: the broker will stop it and record it cancelled")
    return 0


def _cancel_here(args: argparse.Namespace) -> tuple[str, str]:
    store = existing_store(args)
    try:
        with audited(store, "job.cancel", args.job) as detail:
            job = store.request_cancel(args.job, now=time.time())
            detail["state"] = job.state.value
    finally:
        store.close()
    return job.id, job.state.value


def _cancel_http(args: argparse.Namespace, client: Client) -> tuple[str, str]:
    data = client.cancel(args.job)
    return data["id"], data["state"]


def cmd_stop(args: argparse.Namespace) -> int:
    job_id = local_or_http(args, _stop_here, lambda a, client: client.stop(a.job)["id"])
    out.print(f"{job_id} is running: the broker will stop it and record it done")
    return 0


def _stop_here(args: argparse.Namespace) -> str:
    store = existing_store(args)
    try:
        with audited(store, "job.stop", args.job) as detail:
            job = store.request_stop(
                args.job, by=f"{getpass.getuser()} (on the host)", now=time.time()
            )
            detail["state"] = job.state.value
    finally:
        store.close()
    return job.id


def cmd_explain(args: argparse.Namespace) -> int:
    for line in local_or_http(args, _explain_here, lambda a, client: client.explain(a.job)):
        out.print(line, markup=False)
    return 0


def _explain_here(args: argparse.Namespace) -> list[str]:
    config = config_of(args)
    store = existing_store(args, writes=False)
    try:
        job = _get_job(store, args.job)
        registry = Registry.load(config.module_paths, config.launch_rules)
        # a job from a commit: its module.toml read from the cache (nothing built),
        # under [sources] allow, for what placement would say of it
        registry.sources = coordinator_source_cache(config)
        return report.explain(
            job,
            store,
            registry,
            config.broker.cpu_slots,
            time.time(),
            half_life_s=config.broker.fair_share_half_life_s,
        )
    finally:
        store.close()


# -- preview --------------------------------------------------------------------------


def cmd_preview(args: argparse.Namespace) -> int:
    if args.vram_gib is not None and not 0 < args.vram_gib <= 1_048_576:
        raise ValidationError("--vram-gib must be more than 0 and at most 1048576")
    lines = local_or_http(args, _preview_here, _preview_http)
    for line in lines:
        out.print(line, markup=False, highlight=False)
    return 0


def _preview_here(args: argparse.Namespace) -> list[str]:
    config = config_of(args)
    registry = Registry.load(config.module_paths, config.launch_rules)
    jobtype = registry.get(args.type)
    override = int(args.vram_gib * GIB) if args.vram_gib is not None else None
    if override is not None and jobtype.lane is not Lane.VRAM:
        raise ValidationError(f"{jobtype.name} runs on the cpu lane; --vram-gib does not apply")

    def probe_view() -> explain.View:
        probe = make_probe(config, mock_gpu=args.mock_gpu)
        try:
            reserve = int(config.vram.reserve_gib * GIB)
            return explain.view_from_probe(probe, reserve, config.broker.cpu_slots)
        finally:
            probe.close()

    store = (
        checked_store(config, writes=False) if config.database or config.db_path.exists() else None
    )
    try:
        if isinstance(store, ClusterStore) and report.has_nodes(store):  # a coordinator's
            return report.preview(
                store, registry, jobtype, override=override, priority=args.priority, now=time.time()
            )
        return explain.preview(
            store,
            registry,
            jobtype,
            override=override,
            priority=args.priority,
            cpu_slots=config.broker.cpu_slots,
            probe_view=probe_view,
        )
    finally:
        if store is not None:
            store.close()


def _preview_http(args: argparse.Namespace, client: Client) -> list[str]:
    return client.preview(args.type, vram_gib=args.vram_gib, priority=args.priority)
