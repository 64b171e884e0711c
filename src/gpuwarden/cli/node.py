"""The commands of this node's broker: ``serve`` (the broker, and the HTTP API
beside it), ``run-once`` (one job on a broker of its own), ``gpu clear``, ``gpu lock``
(:mod:`gpuwarden.cli.gpulock`) and
``types`` (what the node's modules offer and its launch rules allow). ``status``
is in :mod:`gpuwarden.cli.status`.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden import __version__, safefs
from gpuwarden.api import localsock
from gpuwarden.app import open_node, open_store
from gpuwarden.cli.common import (
    Commands,
    Progress,
    add_remote_options,
    checked_store,
    config_of,
    err,
    existing_store,
    local_or_http,
    out,
    parse_address,
    progress_text,
    stop_signals,
    with_stop_jobs,
)
from gpuwarden.cli.gpulock import add_lock
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.cli.submit import add_job_options, copy_inputs, copy_outputs, job_spec, print_result
from gpuwarden.cli.topview import span
from gpuwarden.client import Client
from gpuwarden.config import Config, load_config
from gpuwarden.core.faultlatch import CLEAR_REASON_MAX
from gpuwarden.core.model import Job, format_bytes
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.eventlog import CURSOR_FILE, EventLog, NullLog
from gpuwarden.intake.service import result_json
from gpuwarden.node import explain
from gpuwarden.node.loop import Broker
from gpuwarden.node.measured import type_profiles
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission


def _add_run_once(sub: Commands) -> None:
    sp = sub.add_parser(
        "run-once",
        help="run one job on this machine and show its result",
        description="Submit one job, run a broker until it ends, and show the result. "
        "Job parameters follow as --NAME VALUE.",
        allow_abbrev=False,
    )
    add_job_options(sp)
    sp.add_argument("--keep", action="store_true", help="keep the temporary directory")
    sp.set_defaults(func=cmd_run_once)


def _add_serve(sub: Commands) -> None:
    sp = sub.add_parser("serve", help="run the broker", allow_abbrev=False)
    sp.add_argument("--log", type=Path, help="append JSON events to this file (default stdout)")
    sp.add_argument(
        "--queue", dest="queues", action="append", default=[], type=Path, help="extra queue root"
    )
    sp.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="also serve the HTTP API there, e.g. 127.0.0.1:8765 (port 0: any free port)",
    )
    sp.add_argument(
        "--stop-jobs",
        action="store_true",
        help='stop the running jobs when stopped (as [broker] on_stop = "stop-jobs"); by '
        "default a stop leaves them running under their supervisors and the next start takes "
        "them back",
    )
    sp.set_defaults(func=cmd_serve)


def _add_gpu(sub: Commands) -> None:
    sp = sub.add_parser("gpu", help="operator actions on a GPU")
    gpu_sub = sp.add_subparsers(dest="gpu_command", required=True, metavar="ACTION")
    clear = gpu_sub.add_parser(
        "clear",
        help="resume VRAM admission on a GPU after its hardware fault was dealt with",
    )
    clear.add_argument("uuid", help="the GPU's UUID, as `gpuwarden status` shows it")
    clear.add_argument(
        "--reason",
        required=True,
        help="what was done about the fault (recorded with who cleared it), "
        'e.g. --reason "reseated the card"',
    )
    add_remote_options(clear)
    clear.set_defaults(func=cmd_gpu_clear)
    add_lock(gpu_sub)


def _add_types(sub: Commands) -> None:
    sp = sub.add_parser(
        "types",
        help="list the job types: what each does, whether and how it runs here, its source",
        description="List every job type of the modules found (module_paths, packages "
        "installed with pip, the shipped ones): what it does, its lane and VRAM, whether "
        "this node's launch rules refuse it (and why), whether it runs sandboxed, and "
        "where its module came from.",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_types)


#: the commands of this module, each with what adds its parser
PARSERS = {
    "run-once": _add_run_once,
    "serve": _add_serve,
    "gpu": _add_gpu,
    "types": _add_types,
}


# -- run-once ---------------------------------------------------------------------


def cmd_run_once(args: argparse.Namespace) -> int:
    base = load_config(args.config) if args.config else None
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-run-"))
    try:
        raw = base.model_dump() if base else {}
        raw.update({"state_dir": tmp / "state", "queue_roots": []})
        config = Config.model_validate(raw)
        if base is None:
            config = config.model_copy(update={"module_paths": load_config(None).module_paths})
        with open_node(
            config,
            mock_gpu=args.mock_gpu,
            events=EventLog(stream=sys.stderr) if args.verbose else NullLog(),
        ) as node:
            spec = job_spec(node.broker.registry, args)
            node.broker.check_fits([spec])
            input_dir = tmp / "inputs"
            copy_inputs(args.inputs, input_dir)
            node.store.submit([spec], now=time.time(), origin=Submission(input_dir=str(input_dir)))
            job = _drive(node.broker, spec.id)
            result = result_json(job, node.store.attempts(job.id))
        outputs: Path | None = None
        if "output_dir" in job.result:
            outputs = tmp / "outputs"
            copy_outputs(Path(job.result["output_dir"]), outputs)
        print_result(result, outputs, kept=args.keep)
        if args.keep:
            out.print(f"[bold]kept[/]      {tmp}")
        return 0 if job.state is JobState.DONE else 1
    finally:
        if not args.keep:
            try:  # what the job left there is removed without following a link
                safefs.remove_tree(tmp)
            except (OSError, safefs.UnsafePathError) as exc:
                err.print(f"[yellow]warning:[/] could not remove {tmp}: {escape(str(exc))}")


def _drive(broker: Any, job_id: str) -> Job:
    """Tick the broker until the job ends, saying what it waits for."""
    store = broker.store
    stop = threading.Event()
    try:
        with Progress(f"job {job_id}: starting") as status:
            while True:
                broker.tick()
                job = store.get_job(job_id)
                assert job is not None
                if job.state.terminal:
                    return job  # type: ignore[no-any-return]
                reason = broker.wait_reason(job_id)
                if reason and "this node has no GPU" in reason:
                    raise UserError(
                        f"{job.type} needs a GPU and none was found; "
                        "run with --mock-gpu to use the simulated GPU"
                    )
                status.update(
                    progress_text(job_id, job.state.value, f"it waits: {reason}" if reason else "")
                )
                stop.wait(0.02)
    finally:
        broker.shutdown(0.0)  # also on Ctrl-C: the job's processes are stopped first


# -- serve --------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    config = with_stop_jobs(config_of(args), args.stop_jobs)
    # a log file keeps a cursor in the state directory: a restart writes the events
    # the last run had not written yet, none twice (SPEC.md section 9, "Event log")
    events = (
        EventLog(args.log, cursor=config.state_dir / CURSOR_FILE)
        if args.log
        else EventLog(stream=sys.stdout)
    )
    signals = stop_signals(config)
    roots = [q.resolve() for q in args.queues]
    address = parse_address(args.api) if args.api else None
    with open_node(config, mock_gpu=args.mock_gpu, events=events, extra_roots=roots) as node:
        signals.add(node.broker)
        signals.install()
        b = node.broker
        api = _ApiServer(config, b, *address) if address else None
        local = _LocalServer(config, b)
        try:
            err.print(
                f"gpuwarden {__version__} serving on node {config.node_name} "
                f"(PID {os.getpid()})\n"
                f"  state dir   {config.state_dir}\n"
                f"  gpu probe   {node.probe.kind}\n"
                f"  job types   {', '.join(sorted(b.registry.types)) or 'none'}\n"
                f"  queue roots {', '.join(str(r.path) for r in b.roots) or 'none'}\n"
                f"  api         {api.http.url if api else 'none (serve --api HOST:PORT)'}\n"
                f"  commands    {local.server.path} (gpuwarden run -- CMD)"
            )
            if api is not None and not api.http.loopback:
                err.print(
                    "[yellow]warning:[/] the API speaks plain HTTP: tokens cross the network "
                    "in clear text; put it behind a TLS proxy or listen on 127.0.0.1"
                )
            b.recover()
            b.run(signals.stop, force=signals.force)
        finally:
            local.stop()
            if api is not None:
                api.stop()
            _flush_events(b)
    events.close()
    return 0


def _flush_events(broker: Broker) -> None:
    """The stop's last events reach the event log, also when the stop failed."""
    try:
        broker.flush_events()
    except Exception as exc:  # the store may be what failed: say so, and exit
        err.print(f"[yellow]warning:[/] the event log misses the last events: {exc}")


class _ApiServer:
    """The HTTP API beside the broker, over a store connection of its own."""

    def __init__(self, config: Config, broker: Broker, host: str, port: int) -> None:
        self.store = open_store(config)
        self.http = ApiThread(
            self.store,
            broker.registry,
            config,
            host,
            port,
            name="gpuwarden-api",
            broker=broker,
            service_routes=broker.service_routes,
        )
        if not self.http.start():
            self.store.close()
            raise UserError(
                f"the API cannot listen on {host}:{port} (in use, or not an address of "
                "this host?); see the message above"
            )

    def stop(self) -> None:
        self.http.stop()
        self.store.close()


class _LocalServer:
    """The local socket beside the broker (``gpuwarden run``), over a store
    connection of its own."""

    def __init__(self, config: Config, broker: Broker) -> None:
        self.store = open_store(config)
        session = localsock.LocalSession(self.store, broker.registry, config)
        try:
            self.server = localsock.LocalServer(localsock.socket_path(config), session).start()
        except OSError as exc:
            self.store.close()
            raise UserError(
                f"cannot listen on {localsock.socket_path(config)}: {exc.strerror or exc}; set "
                "[commands] socket to a path this node may create"
            ) from None

    def stop(self) -> None:
        self.server.close()
        self.store.close()


# -- gpu clear ----------------------------------------------------------------------


def cmd_gpu_clear(args: argparse.Namespace) -> int:
    return local_or_http(args, _gpu_clear_here, _gpu_clear_http)


def _clear_reason(args: argparse.Namespace) -> str:
    """The operator's reason, checked: said, one line, at most 500 characters."""
    reason = " ".join(str(args.reason).split())
    if not reason:
        raise UserError(
            "gpu clear needs a --reason: what was done about the fault, e.g. "
            '--reason "reseated the card"'
        )
    if len(reason) > CLEAR_REASON_MAX:
        raise UserError(f"--reason is {len(reason)} characters; at most {CLEAR_REASON_MAX}")
    return reason


def _gpu_clear_here(args: argparse.Namespace) -> int:
    reason = _clear_reason(args)
    store = existing_store(args)
    try:
        status = explain.latest_status(store, time.time())
        known = {g["uuid"] for g in status.payload.get("gpus", [])} if status else set()
        if status is not None and args.uuid not in known:
            raise UserError(
                f"no GPU {args.uuid} on the running broker; its GPUs: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        store.request_gpu_clear(
            args.uuid, now=time.time(), by=f"local:{getpass.getuser()}", reason=reason
        )
    finally:
        store.close()
    out.print(
        f"asked the broker to clear the fault on {args.uuid}; `gpuwarden status` shows it",
        markup=False,
    )
    return 0


def _gpu_clear_http(args: argparse.Namespace, client: Client) -> int:
    client.clear_gpu(args.uuid, reason=_clear_reason(args))
    out.print(
        f"asked the broker at {client.url} to clear the fault on {args.uuid}; "
        "`gpuwarden status` shows it",
        markup=False,
    )
    return 0


# -- types --------------------------------------------------------------------------


def cmd_types(args: argparse.Namespace) -> int:
    return local_or_http(args, _types_here, _types_http)


def _types_http(args: argparse.Namespace, client: Client) -> int:
    # /v1/types: the rows `types --json` gives here, as that host has them
    described = client.types()
    if args.json:
        print(json.dumps({"types": described}, indent=2))
        return 0
    _print_types(described)
    return 0


def _types_here(args: argparse.Namespace) -> int:
    config = config_of(args)
    registry = Registry.load(config.module_paths, config.launch_rules)
    rules = registry.rules
    described = registry.describe()
    profiles = _profiles_here(config, registry)
    for d in described:
        d["profile"] = profiles.get(d["type"])
    summary = rules.unsandboxed_summary(registry.types.values())
    if args.json:
        doc = {
            "container_runtime": config.container_runtime.value,
            "container_runtime_auto": config.container_runtime_auto or None,
            "types": described,
            "unsandboxed": summary,
            "passed_over": list(registry.passed_over),
        }
        print(json.dumps(doc, indent=2))
        return 0
    out.print(f"container runtime: {config.runtime_shown}", markup=False)
    _print_types(described)
    if summary:
        out.print(summary, markup=False)
    for line in registry.passed_over:
        out.print(f"not used: module {line}", markup=False)
    sources = sorted({str(registry.modules[m].source) for m in registry.modules})
    out.print(f"modules from: {'; '.join(sources) or 'nowhere'}", markup=False)
    return 0


def _profiles_here(config: Config, registry: Registry) -> dict[str, dict[str, Any]]:
    """Each type's measured profile, from the state directory's store; none where
    no broker has made one yet (``types`` works on a fresh machine)."""
    if not config.database and not config.db_path.exists():
        return {}
    store = checked_store(config, writes=False)
    try:
        return type_profiles(store, registry.types.values())
    finally:
        store.close()


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 10 else span(s)


def _measured(profile: dict[str, Any] | None) -> str:
    """A type's profile in the table: what its runs showed, or ``-``."""
    if not profile:
        return "-"
    lines = []
    if profile.get("vram_measured_bytes"):
        lines.append(f"VRAM {format_bytes(profile['vram_measured_bytes'])}")
    if profile.get("ram_peak_bytes"):
        lines.append(f"RAM {format_bytes(profile['ram_peak_bytes'])}")
    if wall := profile.get("wall"):
        runs = f"{wall['runs']} run{'s' if wall['runs'] != 1 else ''}"
        lines.append(f"{_seconds(wall['median_s'])} median, {_seconds(wall['p90_s'])} p90 ({runs})")
    return "\n".join(lines) or "-"


def vram_cell(nbytes: int, gpus: int) -> str:
    """A type's declared VRAM: ``8.0 GiB``, or ``8.0 GiB on each of 2 GPUs``."""
    if not nbytes:
        return "-"
    return format_bytes(nbytes) + (f" on each of {gpus} GPUs" if gpus > 1 else "")


def preemption_cell(keys: dict[str, Any] | None) -> str:
    """A preemptible type's keys, on a line of their own under its lane."""
    if not keys:
        return ""
    return (
        f"\npreemptible ({keys['checkpoint_signal']}, grace {keys['checkpoint_grace_s']:g} s, "
        f"min run {keys['min_run_s']:g} s)"
    )


def _print_types(described: list[dict[str, Any]]) -> None:
    """The table of ``types`` and its refusals, from :meth:`Registry.describe` rows
    (the API's ``/v1/types`` rows are the same)."""
    table = Table(
        "type", "lane, launch", "VRAM", "runs here", "from", "measured", "what it does; parameters"
    )
    for d in described:
        params = ", ".join(
            f"{p['name']}:{p['type']}{'' if p['required'] else '?'}" for p in d["params"]
        )
        source = d.get("source") or {"kind": "?"}
        shown_from = {"built-in": "built-in", "module_paths": "module_paths"}.get(
            source["kind"], f"pip {source.get('dist', '')}".strip()
        )
        runs = (d.get("runs_as") or "runs") if d["runs_here"] else "[red]REFUSED[/]"
        if d.get("unsandboxed"):
            runs = "[yellow]UNSANDBOXED[/]"
        what = escape(d["description"] or "-") + (f"\n[dim]{escape(params)}[/]" if params else "")
        table.add_row(
            escape(d["type"]),
            f"{d['lane']}, {d['launch']}" + preemption_cell(d.get("preemption")),
            vram_cell(d["vram_bytes"], d.get("gpus", 1)),
            runs,
            escape(shown_from),
            _measured(d.get("profile")),
            what,
        )
    out.print(table)
    refused: dict[str, list[str]] = {}  # one line per reason: they differ only in the name
    for d in described:
        if d.get("refused"):
            refused.setdefault(d["refused"].replace(d["type"], "\0"), []).append(d["type"])
    for why, names in refused.items():
        shown = why.replace("\0", "each" if names[1:] else names[0])
        out.print(f"REFUSED here: {', '.join(names)}: {shown}", markup=False)
