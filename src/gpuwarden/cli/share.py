"""``gpuwarden share``: each owner's fair share, from the state directory's store
(or with ``--url`` through the API, where a submitter sees only its own row): the
VRAM GiB-hours it used (decayed with ``[broker] fair_share_half_life_s``), its
jobs queued and running, and its standing (1 goes first among equal priority)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.table import Table

from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    checked_store,
    config_of,
    local_or_http,
    out,
)
from gpuwarden.client import Client
from gpuwarden.node.fairuse import LOCAL_NAME, share_report


def _add_share(sub: Commands) -> None:
    sp = sub.add_parser(
        "share",
        help="fair share: each owner's VRAM GiB-hours, jobs and standing",
        description="Each submitter's (token's) recent use in GiB-hours of VRAM held, "
        "decaying with [broker] fair_share_half_life_s; among jobs of equal priority the "
        "owner who used least goes first (standing 1).",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_share)


#: the commands of this module, each with what adds its parser
PARSERS = {"share": _add_share}


def cmd_share(args: argparse.Namespace) -> int:
    return local_or_http(args, _share_here, _share_http)


def _share_http(args: argparse.Namespace, client: Client) -> int:
    return _report(args, client.share(), None)


def _share_here(args: argparse.Namespace) -> int:
    config = config_of(args)
    half_life = config.broker.fair_share_half_life_s
    if not config.database and not config.db_path.exists():
        return _report(args, [], half_life)  # no broker has run here yet
    store = checked_store(config, writes=False)
    try:

        def name_of(owner: str) -> str:
            token = store.get_token(owner) if owner else None
            return LOCAL_NAME if not owner else token.name if token else owner

        rows = share_report(store, half_life, time.time(), name_of)
    finally:
        store.close()
    return _report(args, rows, half_life)


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], half_life: float | None) -> int:
    if args.json:
        print(json.dumps({"half_life_s": half_life, "owners": rows}, indent=2))
        return 0
    if half_life == 0:
        out.print("fair share is off ([broker] fair_share_half_life_s = 0)", markup=False)
    if not rows:
        out.print("no owner has used a GPU or has jobs queued", markup=False)
        return 0
    table = Table("standing", "owner", "GiB-h used", "queued", "running")
    for r in rows:
        table.add_row(
            str(r["standing"]),
            r["name"] if r["owner"] is None else f"{r['name']} ({r['owner']})",
            f"{r['gib_h']:.2f}",
            str(r["queued"]),
            str(r["running"]),
        )
    out.print(table)
    return 0
