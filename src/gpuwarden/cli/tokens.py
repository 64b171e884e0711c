"""The HTTP API's tokens (``token create``, ``token list``, ``token revoke``) and
the audit log (``audit``), in the store of the state directory or with ``--url``
through the API (an owner's token). The first owner token can only be made in the
store: whoever can write it owns the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden.api.auth import TOKEN_NAME, issue_token
from gpuwarden.cli.common import (
    URL_ENV,
    Commands,
    add_remote_options,
    age,
    checked_store,
    config_of,
    err,
    existing_store,
    local_actor,
    local_or_http,
    out,
    printable,
)
from gpuwarden.client import Client
from gpuwarden.core.model import Role
from gpuwarden.errors import UserError
from gpuwarden.store.base import TokenRecord


def _add_token(sub: Commands) -> None:
    sp = sub.add_parser(
        "token",
        help="API tokens: create, list, revoke (in the store, or with --url through the API)",
        description="Manage the HTTP API's tokens in the store of the state directory, or "
        "with --url through the API (an owner token). Whoever can write that store owns "
        "the machine: the first owner token is made here "
        "(`gpuwarden token create admin --role owner`).",
    )
    token_sub = sp.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    tc = token_sub.add_parser("create", help="make a token; it is printed once", allow_abbrev=False)
    tc.add_argument("name", help="who or what holds it (letters, digits, space, . _ @ -)")
    tc.add_argument("--role", required=True, choices=[r.value for r in Role])
    tc.add_argument("--expires-days", type=float, help="it expires after this many days")
    tc.add_argument("--node", help="the node a node or enroll token is bound to")
    tc.add_argument(
        "--save",
        type=Path,
        metavar="FILE",
        help="also write the token to FILE (mode 600); refused when FILE exists",
    )
    tc.add_argument("--force", action="store_true", help="with --save: replace FILE when it exists")
    tc.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_options(tc)
    tc.set_defaults(func=cmd_token_create)
    tl = token_sub.add_parser("list", help="every token (never a secret)")
    tl.add_argument("--json", action="store_true")
    add_remote_options(tl)
    tl.set_defaults(func=cmd_token_list)
    tr = token_sub.add_parser("revoke", help="revoke a token: every request with it is refused")
    tr.add_argument("id", help="the token's id (12 hex digits, `token list` shows it)")
    add_remote_options(tr)
    tr.set_defaults(func=cmd_token_revoke)


def _add_audit(sub: Commands) -> None:
    sp = sub.add_parser("audit", help="the audit log: who did what through the API and the CLI")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--limit", type=int, default=100, help="most rows (default 100)")
    sp.add_argument("--after", type=int, default=0, metavar="ID", help="rows after this id")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_audit)


#: the commands of this module, each with what adds its parser
PARSERS = {"token": _add_token, "audit": _add_audit}


# -- token create -------------------------------------------------------------------

#: a token made: its id, name, role, the secret, and a note on where it is
_Made = tuple[str, str, str, str, str]


def cmd_token_create(args: argparse.Namespace) -> int:
    if not TOKEN_NAME.fullmatch(args.name):
        raise UserError(
            f"token name {args.name!r}: use 1-64 letters, digits, spaces, '.', '_', '@' or "
            "'-', starting with a letter or digit"
        )
    if args.expires_days is not None and not 0 < args.expires_days <= 3660:
        raise UserError("--expires-days must be more than 0 and at most 3660")
    if args.save is not None and not args.force and os.path.lexists(args.save.expanduser()):
        # before the token is made: a refusal after would leave one nobody holds
        raise UserError(
            f"--save {args.save}: the file exists (it may hold another token, lost once "
            "replaced): choose another file, or add --force to replace it"
        )
    token_id, name, role, token, new_store = local_or_http(
        args,
        _create_here,
        _create_http,
        # the first token cannot come through the API
        hint="the first token is made in the store, without --url "
        f"(unset {URL_ENV}): `gpuwarden token create NAME --role owner`",
    )
    unsaved = None if args.save is None else _save_token(args.save.expanduser(), token)
    if unsaved is not None:  # made all the same: it is printed, never lost
        err.print(f"error: {unsaved}", markup=False)
    if args.json:
        print(json.dumps({"id": token_id, "name": name, "role": role, "token": token}))
        return 0 if unsaved is None else 1
    err.print(
        f"token {token_id} for {name} (role {role}); it is shown once, keep it secret"
        + (f"; saved to {args.save}" if args.save and unsaved is None else "")
        + new_store,
        markup=False,
    )
    print(token)
    return 0 if unsaved is None else 1


def _create_http(args: argparse.Namespace, client: Client) -> _Made:
    made = client.create_token(
        args.name,
        args.role,
        expires_in_s=args.expires_days * 86400 if args.expires_days is not None else None,
        node=args.node,
    )
    return made["id"], made["name"], made["role"], made["token"], ""


def _create_here(args: argparse.Namespace) -> _Made:
    now = time.time()
    expires_at = now + args.expires_days * 86400 if args.expires_days is not None else None
    config = config_of(args)
    new_store = ""
    if not config.database and not config.db_path.exists():
        new_store = (
            f"; it is in a new store in {config.state_dir}: start `gpuwarden serve` "
            "with this state directory for the API to know it"
        )
    store = checked_store(config, writes=True)  # the first token may come before the first `serve`
    try:
        record, token = issue_token(
            store,
            name=args.name,
            role=Role(args.role),
            by=local_actor(),
            now=now,
            expires_at=expires_at,
            node=args.node,
        )
    finally:
        store.close()
    return record.id, record.name, record.role.value, token, new_store


def _save_token(path: Path, token: str) -> str | None:
    """Write the token to ``path`` (mode 600, never through a link: this may run
    as root); why not, when it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        return (
            f"--save {path}: the token could not be written there ({exc.strerror}); it "
            "was made all the same: keep the one printed below"
        )
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return None


# -- token list, token revoke ---------------------------------------------------------


def _token_json(t: TokenRecord, now: float) -> dict[str, Any]:
    """A token record as the API shows it (``GET /v1/tokens``)."""
    return {
        "id": t.id,
        "name": t.name,
        "role": t.role.value,
        "created_at": t.created_at,
        "created_by": t.created_by,
        "expires_at": t.expires_at,
        "revoked_at": t.revoked_at,
        "node": t.node,
        "active": t.active(now),
    }


def cmd_token_list(args: argparse.Namespace) -> int:
    rows = local_or_http(args, _token_rows_here, lambda _a, client: client.tokens())
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table("id", "name", "role", "created", "by", "expires", "state")
    for t in rows:
        if t.get("revoked_at") is not None:
            state = f"revoked {age(t['revoked_at'])} ago"
        elif not t.get("active"):
            state = "expired"
        else:
            state = "active"
        expires = t.get("expires_at")
        table.add_row(
            escape(str(t["id"])),
            escape(printable(str(t["name"]))),
            escape(str(t["role"])),
            age(t["created_at"]) + " ago",
            escape(printable(str(t["created_by"]))),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(expires)) if expires else "-",
            state,
        )
    out.print(table if rows else "no tokens (make one: gpuwarden token create NAME --role ROLE)")
    return 0


def _token_rows_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    store = existing_store(args, writes=False)
    try:
        tokens = store.list_tokens()
    finally:
        store.close()
    now = time.time()
    return [_token_json(t, now) for t in tokens]


def cmd_token_revoke(args: argparse.Namespace) -> int:
    token_id, name = local_or_http(args, _revoke_here, _revoke_http)
    out.print(
        f"revoked token {token_id} ({name}); requests with it are refused now",
        markup=False,
    )
    return 0


def _revoke_http(args: argparse.Namespace, client: Client) -> tuple[str, str]:
    revoked = client.revoke_token(args.id)
    return revoked["id"], revoked["name"]


def _revoke_here(args: argparse.Namespace) -> tuple[str, str]:
    store = existing_store(args)
    try:
        record = store.get_token(args.id)
        actor = local_actor()
        now = time.time()
        if record is None:
            raise UserError(f"no token with id {args.id!r} (see `gpuwarden token list`)")
        if not store.revoke_token(record.id, now=now):
            raise UserError(f"token {record.id} ({record.name}) was revoked already")
        store.add_audit(
            actor.audit(
                "token.revoke",
                now=now,
                target=record.id,
                detail={"name": record.name, "role": record.role.value},
            )
        )
    finally:
        store.close()
    return record.id, record.name


# -- audit ----------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    rows = local_or_http(
        args,
        _audit_rows_here,
        lambda a, client: client.audit(after_id=a.after, limit=a.limit),
    )
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table("id", "when", "actor", "role", "action", "target", "outcome")
    for r in rows:
        name = str(r["actor_name"])
        actor = name if r["actor"] in ("-", "local") else f"{name} ({r['actor']})"
        table.add_row(
            str(r["id"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])),
            escape(printable(actor)),
            escape(str(r["role"])),
            escape(str(r["action"])),
            escape(printable(str(r["target"]))),
            escape(printable(str(r["outcome"]))),
        )
    out.print(table if rows else "no audit rows")
    return 0


def _audit_rows_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The audit rows as the API shows them (``GET /v1/audit``)."""
    store = existing_store(args, writes=False)
    try:
        found = store.audit_rows(after_id=args.after, limit=args.limit)
    finally:
        store.close()
    return [
        {
            "id": r.id,
            "ts": r.ts,
            "actor": r.actor,
            "actor_name": r.actor_name,
            "role": r.role,
            "action": r.action,
            "target": r.target,
            "outcome": r.outcome,
            "detail": r.detail,
        }
        for r in found
    ]
