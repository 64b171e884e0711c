"""The command line for several hosts: ``coordinator``, ``agent`` and ``node``.

Registered by :func:`add_parsers` from ``gpuwarden.cli.build_parser``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden.errors import UserError

#: as ``gpuwarden.cluster.agent.ENROLL_ENV`` (not imported here: the CLI starts fast)
ENROLL_ENV = "GPUWARDEN_ENROLL_TOKEN"


def _local_flags(sp: argparse.ArgumentParser) -> None:
    """``--config`` and ``--mock-gpu`` also after the sub-command."""
    sp.add_argument(
        "--config", type=Path, default=argparse.SUPPRESS, help="TOML config file (as before it)"
    )
    sp.add_argument(
        "--mock-gpu",
        action="store_true",
        default=argparse.SUPPRESS,
        help="use the simulated GPU (as before the sub-command)",
    )


def add_parsers(sub: Any, remote_args: Callable[[argparse.ArgumentParser], None]) -> None:
    sp = sub.add_parser(
        "coordinator",
        help="serve the HTTP API for agents on several hosts (over PostgreSQL)",
        description="The coordinator: the HTTP API (clients and agents) over a store that "
        "several coordinators may share. It runs no jobs itself; `gpuwarden agent` on each "
        "GPU host does. One of the coordinators sweeps expired leases and stale agents.",
        allow_abbrev=False,
    )
    sp.add_argument(
        "--db",
        help="postgresql://USER@HOST:PORT/DBNAME, or a SQLite file for one host "
        "(default: the config's database, else the state directory's SQLite)",
    )
    sp.add_argument(
        "--bind",
        default="127.0.0.1:8765",
        metavar="HOST:PORT",
        help="where to listen (default 127.0.0.1:8765; port 0: any free port)",
    )
    sp.add_argument(
        "--queue",
        dest="queues",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="a queue root to read bundles from, besides the config's queue_roots (repeatable)",
    )
    _local_flags(sp)
    sp.set_defaults(func=cmd_coordinator)

    sp = sub.add_parser(
        "agent",
        help="run this GPU host's jobs for a coordinator",
        description="Enrol once with the one-time token from `gpuwarden node invite NAME`, "
        "then run the broker loop on this host's GPUs, taking jobs the coordinator leases to "
        "it. The token is read from a file (--enroll-file FILE, mode 600), from standard "
        f"input (--enroll -) or from {ENROLL_ENV}; never from the command line, where every "
        "user of the host can read it. The credential is kept in the state directory (mode "
        "600); later runs need no token.",
        allow_abbrev=False,
    )
    sp.add_argument(
        "--coordinator", metavar="URL", help="the coordinator, e.g. http://10.0.0.1:8765"
    )
    how = sp.add_mutually_exclusive_group()
    how.add_argument(
        "--enroll",
        metavar="-",
        help="enrol with the token read from standard input (only '-' is taken: a token on "
        "the command line is refused)",
    )
    how.add_argument(
        "--enroll-file",
        type=Path,
        metavar="FILE",
        help=f"enrol with the token in FILE (mode 600; or set {ENROLL_ENV})",
    )
    how.add_argument(
        "--credential",
        type=Path,
        metavar="FILE",
        help="the node credential (default: node-credential in the state directory)",
    )
    sp.add_argument("--labels", metavar="K=V,...", help="labels for job constraints")
    sp.add_argument("--max-jobs", type=int, help="the most jobs held at once (default 4)")
    sp.add_argument("--log", type=Path, help="append JSON events to this file (default stdout)")
    _local_flags(sp)
    sp.set_defaults(func=cmd_agent)

    sp = sub.add_parser(
        "node", help="the nodes of a coordinator: invite, list, drain, resume, revoke"
    )
    node_sub = sp.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    ni = node_sub.add_parser(
        "invite", help="a one-time enrolment token for a new node (valid 15 minutes)"
    )
    ni.add_argument("name", help="the node's name (letters, digits, . _ -)")
    ni.add_argument("--json", action="store_true")
    remote_args(ni)
    ni.set_defaults(func=cmd_node_invite)
    nl = node_sub.add_parser("list", help="every node: state, last heartbeat, leases, GPUs")
    nl.add_argument("--json", action="store_true")
    remote_args(nl)
    nl.set_defaults(func=cmd_node_list)
    nd = node_sub.add_parser("drain", help="no new work for the node; running jobs finish")
    nd.add_argument("name")
    remote_args(nd)
    nd.set_defaults(func=cmd_node_drain)
    nu = node_sub.add_parser("resume", help="a draining node takes new work again")
    nu.add_argument("name")
    remote_args(nu)
    nu.set_defaults(func=cmd_node_resume)
    nr = node_sub.add_parser(
        "revoke", help="refuse the node's credential now; its jobs go back to the queue"
    )
    nr.add_argument("name")
    remote_args(nr)
    nr.set_defaults(func=cmd_node_revoke)


# -- coordinator --------------------------------------------------------------------


def cmd_coordinator(args: argparse.Namespace) -> int:
    import uvicorn

    from gpuwarden import cli
    from gpuwarden.api import create_app
    from gpuwarden.api.routers.nodes import install_coordinator, set_coordinator_url
    from gpuwarden.app import open_store
    from gpuwarden.cluster.queues import QueueWatcher
    from gpuwarden.config import DATABASE_URL_PREFIXES
    from gpuwarden.core.launchrules import LaunchRules
    from gpuwarden.intake.queueroot import QueueRoot
    from gpuwarden.registry import Registry
    from gpuwarden.store.base import Store
    from gpuwarden.store.sqlite import SqliteStore

    if args.db and args.db.startswith(("postgresql://", "postgres://")):
        _refuse_a_password_on_the_command_line(args.db)
    config = cli._config(args)
    host, port = cli._parse_address(args.bind)
    roots = [
        QueueRoot.open(p, create=config.create_queue_roots)
        for p in dict.fromkeys([*config.queue_roots, *(q.resolve() for q in args.queues)])
    ]
    store: Store
    if args.db and args.db.startswith(DATABASE_URL_PREFIXES):
        from gpuwarden.store.postgres import PostgresStore, redact_url

        store = PostgresStore(args.db)
        where = redact_url(args.db)
    elif args.db:
        store = SqliteStore(Path(args.db).expanduser().resolve())
        where = str(Path(args.db).expanduser().resolve())
    else:
        store = open_store(config)
        where = config.database or str(config.db_path)
    watcher: QueueWatcher | None = None
    try:
        # the coordinator runs nothing: each agent's own launch rules decide what its
        # node runs, and placement and submission judge by what the agents report
        registry = Registry.load(config.module_paths, LaunchRules.unchecked())
        app = create_app(store, registry, config)
        install_coordinator(app)
        server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        )
        stop = threading.Event()

        def on_signal(_signum: int, _frame: Any) -> None:
            stop.set()
            server.should_exit = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        thread = threading.Thread(target=server.run, name="gpuwarden-coordinator", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                raise UserError(
                    f"the coordinator cannot listen on {host}:{port} (in use, or not an "
                    "address of this host?)"
                )
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        c = config.cluster
        url = c.coordinator_url or advertised_url(bound[0], bound[1])
        set_coordinator_url(app, url)
        cli.err.print(
            f"gpuwarden coordinator (PID {os.getpid()}) listening on http://{shown}:{bound[1]}\n"
            f"  agents use  {url}"
            + (
                ""
                if c.coordinator_url
                else escape("  (set [cluster] coordinator_url to say another)")
            )
            + f"\n  store       {where}\n"
            f"  job types   {', '.join(sorted(registry.types)) or 'none'} (each node runs what "
            "its own launch rules allow)\n"
            f"  leases      {c.lease_s:g} s; offline after {c.offline_after_s:g} s; "
            f"sweep every {c.sweep_every_s:g} s\n"
            f"  queue roots {', '.join(str(r.path) for r in roots) or 'none'}"
        )
        if ignored := _launch_keys_set(config):
            verb = "mean" if len(ignored) > 1 else "means"
            cli.err.print(
                f"note: {', '.join(ignored)} in this config {verb} nothing here: the "
                "coordinator runs no job; each agent's own config decides which types its "
                "node runs"
            )
        if bound[0] not in ("127.0.0.1", "::1"):
            cli.err.print(
                "[yellow]warning:[/] the API speaks plain HTTP: tokens cross the network in "
                "clear text; put it behind a TLS proxy on untrusted networks"
            )
        if roots:
            # bundles in, result bundles out; agents run the jobs
            watcher = QueueWatcher(store, registry, config, roots)
            watcher.start()
        while thread.is_alive():
            thread.join(0.5)
    finally:
        if watcher is not None:
            watcher.stop()
        store.close()
    return 0


def advertised_url(host: str, port: int) -> str:
    """The URL to give agents when ``[cluster] coordinator_url`` is not set: the
    address listened on, or this host's name when that is every address."""
    import socket

    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - reading the bind, not binding
        host = socket.getfqdn()
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _launch_keys_set(config: Any) -> list[str]:
    """The launch-rule keys a coordinator's config sets (none of them applies there)."""
    from gpuwarden.core.launchrules import Runtime

    keys = []
    if config.container_runtime is not Runtime.LOCAL:
        keys.append(f"container_runtime = {config.container_runtime.value!r}")
    for key in ("allow_unsandboxed_containers", "allow_host_jobs"):
        if getattr(config, key):
            keys.append(f"{key} = true")
    return keys


def _refuse_a_password_on_the_command_line(url: str) -> None:
    """``--db`` is on the command line, which every user of the host can read."""
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
        password = ":" in userinfo or any(
            k == "password" for k, _ in parse_qsl(parts.query, keep_blank_values=True)
        )
    except ValueError:
        password = False
    if password:
        raise UserError(
            "--db holds a password, and the command line can be read by every user of this "
            "host (ps, /proc/PID/cmdline) for as long as the coordinator runs: leave the "
            "password out of the URL and give it to libpq in ~/.pgpass (mode 600) or "
            "PGPASSWORD, or put the whole URL in the config file's database key"
        )


# -- agent --------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.cluster.agent import enrolment_token, parse_labels, run_agent
    from gpuwarden.eventlog import EventLog

    # first of all: the variable leaves this process's environment, and a token on
    # the command line is refused before anything else happens
    token = enrolment_token(
        enroll=args.enroll, enroll_file=args.enroll_file, environ=os.environ, stdin=sys.stdin
    )
    config = cli._config(args)
    if args.max_jobs is not None and args.max_jobs < 1:
        raise UserError("--max-jobs must be at least 1")
    if token is not None and args.credential:
        raise UserError(
            f"an enrolment token ({ENROLL_ENV}) and --credential do not go together: "
            "enrol, or run with a credential"
        )
    events = EventLog(args.log) if args.log else EventLog(stream=sys.stdout)
    stop = threading.Event()
    force = threading.Event()
    brokers: list[Any] = []

    def on_signal(_signum: int, _frame: Any) -> None:
        for b in brokers:
            b.wake()
        if stop.is_set():
            force.set()
            cli.err.print("second signal: stopping running jobs now")
        else:
            stop.set()
            cli.err.print(
                f"stopping: no new jobs; running jobs get up to "
                f"{config.broker.shutdown_grace_s:g} s (signal again to stop them now)"
            )

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return run_agent(
            config,
            coordinator_url=args.coordinator,
            enroll_token=token,
            credential_path=args.credential,
            mock_gpu=args.mock_gpu,
            labels=parse_labels(args.labels) if args.labels is not None else None,
            max_jobs=args.max_jobs,
            events=events,
            stop=stop,
            force=force,
            say=lambda text: cli.err.print(escape(text)),
            on_broker=brokers.append,
        )
    finally:
        events.close()


# -- node ----------------------------------------------------------------------------


def _local(args: argparse.Namespace) -> Any:
    from gpuwarden import cli

    store = cli._existing_store(args)
    from gpuwarden.store.cluster import ClusterStore

    if not isinstance(store, ClusterStore):  # pragma: no cover - both stores are
        store.close()
        raise UserError("this store keeps no nodes")
    return store


def _audit(store: Any, action: str, target: str, detail: dict[str, Any]) -> None:
    from gpuwarden import cli

    store.add_audit(cli._local_actor().audit(action, now=time.time(), target=target, detail=detail))


def cmd_node_invite(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.api.auth import issue_token
    from gpuwarden.api.routers.nodes import INVITE_TTL_S
    from gpuwarden.cluster.coordinator import NODE_NAME
    from gpuwarden.core.model import Role

    if (client := cli._remote(args)) is not None:
        with client:
            got: dict[str, Any] = client._json("POST", "/v1/nodes/invite", json={"name": args.name})
    else:
        if not NODE_NAME.fullmatch(args.name):
            raise UserError(
                f"node name {args.name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        store = _local(args)
        try:
            now = time.time()
            record, token = issue_token(
                store,
                name=f"enroll {args.name}",
                role=Role.ENROLL,
                by=cli._local_actor(),
                now=now,
                expires_at=now + INVITE_TTL_S,
                node=args.name,
            )
            _audit(store, "node.invite", args.name, {"token": record.id})
        finally:
            store.close()
        got = {
            "node": args.name,
            "token": token,
            "token_id": record.id,
            "expires_at": now + INVITE_TTL_S,
        }
    if args.json:
        print(json.dumps(got))
        return 0
    url, note = _agent_url(got.get("coordinator_url"), getattr(args, "url", None), args)
    cli.err.print(
        f"enrolment token for node {escape(str(got['node']))}, valid 15 minutes, once. On that "
        "host, write it to a file only root can read (chmod 600) and run\n"
        f"  gpuwarden agent --coordinator {escape(url)} --enroll-file FILE\n"
        f"(or pipe it in with --enroll -, or set {ENROLL_ENV}; never put it on a command "
        "line: every user of the host can read that)" + (f"\n{escape(note)}" if note else "")
    )
    print(got["token"])
    return 0


def _agent_url(advertised: Any, given: str | None, args: argparse.Namespace) -> tuple[str, str]:
    """The coordinator's URL for the command an invite prints, and a note when it may
    not be one the GPU host reaches: what the coordinator says agents use (``[cluster]
    coordinator_url``, else its address), else ``--url``, else the local config's
    ``coordinator_url``, else a placeholder."""
    from urllib.parse import urlsplit

    from gpuwarden import cli

    url = str(advertised or given or "")
    if not url:
        try:
            url = cli._config(args).cluster.coordinator_url
        except UserError:
            url = ""
    if not url:
        return "URL", (
            "URL: the coordinator's address as the GPU host reaches it (set [cluster] "
            "coordinator_url in the coordinator's config to have it printed here)"
        )
    host = urlsplit(url).hostname or ""
    if host in ("localhost", "::1") or host.startswith("127."):
        return url, (
            f"{url} is a loopback address: it reaches the coordinator only from its own "
            "host; on another GPU host use an address that host reaches it at"
        )
    return url, ""


def cmd_node_list(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.cluster.report import node_json

    if (client := cli._remote(args)) is not None:
        with client:
            nodes: list[dict[str, Any]] = client._json("GET", "/v1/nodes")
    else:
        store = _local(args)
        try:
            now = time.time()
            leases = store.leases()
            nodes = [node_json(r, leases, now) for r in store.list_nodes()]
        finally:
            store.close()
    if args.json:
        cli.out.print_json(json.dumps(nodes))
        return 0
    if not nodes:
        cli.out.print("no nodes: `gpuwarden node invite NAME` makes an enrolment token")
        return 0
    table = Table("node", "state", "last seen", "leases", "running", "GPUs", "warm")
    for n in nodes:
        seen = n.get("seen_s_ago")
        gpus = ", ".join(
            f"{g.get('name', '?')} {int(g.get('total_bytes', 0)) / 1024**3:.0f} GiB"
            for g in n.get("gpus", [])
        )
        state = str(n["state"])
        if n.get("condition"):
            shown = str(n["condition"])
            state = shown if state == "active" else f"{state}, {shown}"
        table.add_row(
            escape(n["name"]),
            escape(state),
            f"{seen:.0f} s ago" if seen is not None else "never",
            str(n.get("leases", 0)),
            str(n.get("running", 0)),
            escape(gpus or "-"),
            escape(", ".join(n.get("warm", [])) or "-"),
        )
    cli.out.print(table)
    return 0


def cmd_node_drain(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.cluster import coordinator as co

    if (client := cli._remote(args)) is not None:
        with client:
            client._json("POST", f"/v1/nodes/{args.name}/drain")
    else:
        store = _local(args)
        try:
            co.drain(store, args.name, now=time.time())
            _audit(store, "node.drain", args.name, {})
        finally:
            store.close()
    cli.err.print(f"node {args.name} is draining: its running jobs finish, it gets no new ones")
    return 0


def cmd_node_resume(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.cluster import coordinator as co

    if (client := cli._remote(args)) is not None:
        with client:
            got: dict[str, Any] = client._json("POST", f"/v1/nodes/{args.name}/resume")
        changed = bool(got.get("resumed"))
        state = str(got.get("state"))
    else:
        store = _local(args)
        try:
            record, changed = co.resume(store, args.name, now=time.time())
            _audit(store, "node.resume", args.name, {"resumed": changed})
            state = record.state.value
        finally:
            store.close()
    if changed:
        cli.err.print(f"node {escape(args.name)} takes new work again")
    else:
        cli.err.print(
            f"node {escape(args.name)} was not draining (it is {state}): nothing to resume"
        )
    return 0


def cmd_node_revoke(args: argparse.Namespace) -> int:
    from gpuwarden import cli
    from gpuwarden.cluster import coordinator as co
    from gpuwarden.registry import Registry

    if (client := cli._remote(args)) is not None:
        with client:
            got: dict[str, Any] = client._json("POST", f"/v1/nodes/{args.name}/revoke")
    else:
        config = cli._config(args)
        store = _local(args)
        try:
            registry = Registry.load(config.module_paths, config.launch_rules)
            got = co.revoke(store, registry, args.name, now=time.time())
            _audit(store, "node.revoke", args.name, got)
        finally:
            store.close()
    cli.err.print(
        f"node {args.name} is revoked: its credential is refused from now on; "
        f"{got['requeued']} leased job(s) went back to the queue, {got['interrupted']} "
        "running one(s) ended as infrastructure failures and run elsewhere"
    )
    return 0
