"""``gpuwarden events``: the event log, one line per event, from the store of the
state directory or, with ``--url``, from the API's event stream (``GET
/v1/events``, read with :meth:`gpuwarden.client.Client.events`, which reconnects
with ``Last-Event-ID`` when the connection drops). ``--follow`` goes on with the
events as they come until Ctrl-C, which ends it quietly (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from gpuwarden.api.eventfeed import TYPE_NAME, EventFeed, EventFilter
from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    err,
    existing_store,
    local_or_http,
    printable,
)
from gpuwarden.client import Client
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import JOB_ID

#: how often ``--follow`` on the host looks at the store for new events
POLL_S = 0.25
#: the longest value of a detail key that a line shows (``--json`` shows all)
_VALUE_CHARS = 160


def _add_events(sub: Commands) -> None:
    sp = sub.add_parser(
        "events",
        help="the event log: what happened to jobs, GPUs and the broker",
        description="Print the event log, one line per event, from the store of the state "
        "directory, or with --url from the API's event stream. Without --follow: the events "
        "after --after (default: all of them), then exit. With --follow: then each event as "
        "it comes, until Ctrl-C; without --after it starts with the events from now on.",
        allow_abbrev=False,
    )
    sp.add_argument("-f", "--follow", action="store_true", help="go on with new events")
    sp.add_argument("--job", metavar="ID", help="only the events of this job")
    sp.add_argument(
        "--type", dest="type_name", metavar="T", help="only the events of jobs of this type"
    )
    sp.add_argument(
        "--after",
        type=int,
        metavar="ID",
        help="start after this event id (0: the whole history)",
    )
    sp.add_argument("--json", action="store_true", help="one JSON object per line")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_events)


#: the commands of this module, each with what adds its parser
PARSERS = {"events": _add_events}


def cmd_events(args: argparse.Namespace) -> int:
    if args.after is not None and args.after < 0:
        raise UserError(f"--after {args.after}: event ids start at 1 (0: the whole history)")
    if args.type_name is not None and not TYPE_NAME.fullmatch(args.type_name):
        raise UserError(f"--type {args.type_name!r}: give a job type, module.type")
    if args.job is not None and not JOB_ID.fullmatch(args.job):
        raise UserError(f"--job {args.job!r} is not a job id")
    try:
        local_or_http(args, _events_here, _events_http)
    except KeyboardInterrupt:  # how a --follow is ended: quietly
        return 0
    except BrokenPipeError:  # `gpuwarden events | head`: the reader has had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


def _start(args: argparse.Namespace) -> int | None:
    """Where to start: ``--after``; else the whole history, or with ``--follow``
    only what comes from now on (None)."""
    if args.after is not None:
        return int(args.after)
    return None if args.follow else 0


def _events_here(args: argparse.Namespace) -> None:
    store = existing_store(args, writes=False)
    try:
        if args.job is not None and store.get_job(args.job) is None:
            raise UserError(f"no job with id {args.job!r} (see `gpuwarden jobs`)")
        start = _start(args)
        feed = EventFeed(
            store,
            EventFilter(job=args.job, type=args.type_name),
            cursor=store.last_event_id() if start is None else start,
        )
        _show(_local(feed, follow=args.follow), as_json=args.json)
    finally:
        store.close()


def _local(feed: EventFeed, *, follow: bool) -> Iterator[dict[str, Any]]:
    while True:
        yield from feed.read()
        if feed.full:
            continue
        if not follow:
            return
        time.sleep(POLL_S)


def _events_http(args: argparse.Namespace, client: Client) -> None:
    def dropped(why: str) -> None:
        err.print(f"event stream: {why}", markup=False, highlight=False)

    events = client.events(
        after=_start(args),
        job=args.job,
        type_name=args.type_name,
        follow=args.follow,
        on_drop=dropped,
    )
    _show(events, as_json=args.json)


def _show(events: Iterable[dict[str, Any]], *, as_json: bool) -> None:
    for event in events:
        if as_json:
            line = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        else:
            line = event_line(event)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def event_line(event: dict[str, Any]) -> str:
    """One event for a person: time, kind, job, then what it says, on one line
    with control characters escaped (a job's reason is not the terminal's)."""
    ts = event.get("ts")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"
    parts = [when, str(event.get("kind", "?")), str(event.get("job") or "-")]
    if event.get("from") or event.get("to"):
        parts.append(f"{event.get('from') or ''}->{event.get('to') or ''}")
    detail = event.get("detail") or {}
    if isinstance(detail, dict):
        parts += [f"{k}={_value(v)}" for k, v in detail.items()]
    return printable(" ".join(parts)).replace("\n", "\\n").replace("\t", " ")


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if isinstance(value, str) and (not text or any(c in text for c in " =\"'")):
        text = json.dumps(text, ensure_ascii=False)
    if len(text) > _VALUE_CHARS:
        text = text[: _VALUE_CHARS - 1] + "…"
    return text
