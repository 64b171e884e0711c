"""``gpuwarden runtimes``: the managed runtimes of the config, as they are now.

For each ``[[runtimes]]`` table: what its API says it can do (probed now), whether
it works, what it says it has loaded, and what its process tree holds on each GPU
as the device shows it (from the running broker's last reading). Read only: it
asks nothing of a runtime but its state.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden.app import runtime_spec
from gpuwarden.cli.common import Commands, config_of, existing_store, out
from gpuwarden.config import RuntimeSettings
from gpuwarden.core.model import format_bytes
from gpuwarden.errors import UserError
from gpuwarden.node import explain
from gpuwarden.node.runtimes import client_for
from gpuwarden.node.status import BrokerStatus, GpuStatus
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.tree import holdings, listener_pid, process_tree


def _add_runtimes(sub: Commands) -> None:
    sp = sub.add_parser(
        "runtimes",
        help="list the managed runtimes ([[runtimes]]): state, memory, capabilities",
        description="For each [[runtimes]] table of the config: what its API can do (busy "
        "signal, what a release does), whether it works now, the models it says it has "
        "loaded, and what its process tree holds on each GPU as the device shows it "
        "(the running broker's last reading). It asks nothing of a runtime but its state.",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_runtimes)


#: the commands of this module, each with what adds its parser
PARSERS = {"runtimes": _add_runtimes}


def cmd_runtimes(args: argparse.Namespace) -> int:
    config = config_of(args)
    gpus, source = _device(args)
    rows = [_describe(r, gpus) for r in config.runtimes]
    if args.json:
        print(json.dumps({"runtimes": rows, "memory_from": source}, indent=2))
        return 0
    if not rows:
        out.print(
            "no managed runtimes: add [[runtimes]] tables to the config (SPEC.md section 8)",
            markup=False,
        )
        return 0
    table = Table("runtime", "kind, url", "state", "memory (device)", "says loaded", "can")
    for row in rows:
        memory = row["memory"]
        shown = (
            "unknown"
            if memory is None
            else ", ".join(f"{format_bytes(b)} on {u}" for u, b in memory.items()) or "none"
        )
        loaded = ", ".join(
            m["name"] + (f" ({format_bytes(m['vram_bytes'])})" if m["vram_bytes"] else "")
            for m in row["loaded"]
        )
        caps = row["capabilities"]
        can = (
            "-"
            if caps is None
            else f"busy signal: {caps['busy_signal']}; release: {caps['release']}"
        )
        state = row["state"] + (f": {row['detail']}" if row["detail"] else "")
        table.add_row(
            escape(row["name"]),
            escape(f"{row['kind']}, {row['url']}"),
            escape(state),
            escape(shown),
            escape(loaded or "-"),
            escape(can),
        )
    out.print(table)
    out.print(f"[dim]memory: {escape(source)}[/]")
    return 0


def _device(args: argparse.Namespace) -> tuple[tuple[GpuStatus, ...] | None, str]:
    """The GPUs with their processes, as the running broker last read them."""
    try:
        store = existing_store(args, writes=False)
    except UserError:
        return None, "unknown: no broker has run on this state directory"
    try:
        status = explain.latest_status(store, time.time())
    finally:
        store.close()
    if status is None:
        return None, "unknown: no broker is running (its reading would say)"
    age = time.time() - status.updated_at
    published = BrokerStatus.from_json(status.payload)
    return published.gpus, f"the broker on {status.node}, {age:.0f} s ago"


def _describe(runtime: RuntimeSettings, gpus: tuple[GpuStatus, ...] | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": runtime.name,
        "kind": runtime.kind.value,
        "url": runtime.url,
        "idle_grace_s": runtime.idle_grace_s,
        "state": "",
        "detail": "",
        "capabilities": None,
        "loaded": [],
        "pid": None,
        "memory": None,
    }
    try:
        client = client_for(runtime_spec(runtime))
    except RuntimeApiError as exc:
        row.update(state="unsupported", detail=str(exc))
        return row
    try:
        caps = client.probe()
        reading = client.read()
    except RuntimeApiError as exc:
        row.update(state="unreachable", detail=str(exc))
    else:
        row["capabilities"] = {
            "busy_signal": caps.busy_signal.value,
            "release": caps.release.value,
            "releasable": caps.releasable,
            "notes": list(caps.notes),
        }
        row.update(state=reading.activity.value, detail=reading.detail)
        row["loaded"] = [
            {"name": m.name, "size_bytes": m.size_bytes, "vram_bytes": m.vram_bytes}
            for m in reading.loaded
        ]
    finally:
        client.close()
    pid = listener_pid(runtime.url)
    row["pid"] = pid
    if pid is not None and gpus is not None:
        row["memory"] = holdings(process_tree(pid), gpus)
    return row
