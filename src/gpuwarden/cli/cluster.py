"""The command line for several hosts: ``coordinator`` (the HTTP API over a store
several coordinators may share), ``agent`` (runs a GPU host's jobs for one) and
``node`` (the nodes enrolled with a coordinator: invite, list, drain, resume,
revoke; in its store, or with ``--url`` through its API).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rich.markup import escape
from rich.table import Table

from gpuwarden.api.auth import issue_invite
from gpuwarden.app import coordinator_source_cache
from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    checked_store,
    config_of,
    err,
    existing_store,
    local_actor,
    local_or_http,
    out,
    parse_address,
    stop_signals,
    with_stop_jobs,
)
from gpuwarden.cli.httpserver import ApiThread, listen
from gpuwarden.client import Client
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import report
from gpuwarden.cluster.agent import run_agent
from gpuwarden.cluster.enrolment import ENROLL_ENV, enrolment_token, parse_labels
from gpuwarden.cluster.queues import QueueWatcher
from gpuwarden.cluster.routes import RouteBook
from gpuwarden.config import DATABASE_URL_PREFIXES, Config
from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.errors import UserError
from gpuwarden.eventlog import EventLog
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore


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


def _add_coordinator(sub: Commands) -> None:
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
    sp.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes serving the API on the one address (default 1; more need PostgreSQL): "
        "each has its own connections, and one of them sweeps",
    )
    _local_flags(sp)
    sp.set_defaults(func=cmd_coordinator)


def _add_agent(sub: Commands) -> None:
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
    sp.add_argument(
        "--stop-jobs",
        action="store_true",
        help='stop the running jobs when stopped (as [broker] on_stop = "stop-jobs"); by '
        "default a stop leaves them running under their supervisors, and an agent started "
        "again within their lease takes them back",
    )
    _local_flags(sp)
    sp.set_defaults(func=cmd_agent)


def _add_node(sub: Commands) -> None:
    sp = sub.add_parser(
        "node", help="the nodes of a coordinator: invite, list, drain, resume, revoke"
    )
    node_sub = sp.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    ni = node_sub.add_parser(
        "invite", help="a one-time enrolment token for a new node (valid 15 minutes)"
    )
    ni.add_argument("name", help="the node's name (letters, digits, . _ -)")
    ni.add_argument(
        "--replace",
        action="store_true",
        help="enrol another host in the place of a node of that name that is enrolled and "
        "not revoked: its credential is revoked and its jobs go back to the queue when the "
        "new host enrols (audited); without it, an invite for such a node is refused",
    )
    ni.add_argument("--json", action="store_true")
    add_remote_options(ni)
    ni.set_defaults(func=cmd_node_invite)
    nl = node_sub.add_parser("list", help="every node: state, last heartbeat, leases, GPUs")
    nl.add_argument("--json", action="store_true")
    add_remote_options(nl)
    nl.set_defaults(func=cmd_node_list)
    nd = node_sub.add_parser("drain", help="no new work for the node; running jobs finish")
    nd.add_argument("name")
    add_remote_options(nd)
    nd.set_defaults(func=cmd_node_drain)
    nu = node_sub.add_parser("resume", help="a draining node takes new work again")
    nu.add_argument("name")
    add_remote_options(nu)
    nu.set_defaults(func=cmd_node_resume)
    ng = node_sub.add_parser(
        "diagnostic", help="let one queued job start once on a draining node (Owner)"
    )
    ng.add_argument("name")
    ng.add_argument("job")
    ng.add_argument("--reason", required=True, help="why (kept in the grant and the audit log)")
    ng.add_argument("--json", action="store_true")
    add_remote_options(ng)
    ng.set_defaults(func=cmd_node_diagnostic)
    nr = node_sub.add_parser(
        "revoke", help="refuse the node's credential now; its jobs go back to the queue"
    )
    nr.add_argument("name")
    add_remote_options(nr)
    nr.set_defaults(func=cmd_node_revoke)


#: the commands of this module, each with what adds its parser
PARSERS = {"coordinator": _add_coordinator, "agent": _add_agent, "node": _add_node}


# -- coordinator --------------------------------------------------------------------


def cmd_coordinator(args: argparse.Namespace) -> int:
    if args.db and args.db.startswith(("postgresql://", "postgres://")):
        _refuse_a_password_on_the_command_line(args.db)
    config = config_of(args)
    host, port = parse_address(args.bind)
    workers = int(getattr(args, "workers", 1))
    if workers < 1:
        raise UserError("--workers must be at least 1")
    db = args.db or config.database
    if workers > 1 and not (db and db.startswith(DATABASE_URL_PREFIXES)):
        raise UserError(
            "--workers above 1 needs a PostgreSQL store (--db postgresql://..., or the "
            "config's database): the processes share it"
        )
    roots = [
        QueueRoot.open(p, create=config.create_queue_roots)
        for p in dict.fromkeys([*config.queue_roots, *(q.resolve() for q in args.queues)])
    ]
    if workers == 1:
        return _serve_coordinator(args, config, host, port, roots=roots)
    try:
        sock = listen(host, port)
    except OSError as exc:
        raise UserError(f"the coordinator cannot listen on {host}:{port}: {exc}") from None
    # the other workers are forked before any store, pool or thread exists here;
    # each opens its own store and serves the API on the shared socket
    children = [_fork_worker(args, config, sock) for _ in range(workers - 1)]
    try:
        return _serve_coordinator(args, config, host, port, roots=roots, sock=sock)
    finally:
        _stop_workers(children)
        sock.close()


def _fork_worker(args: argparse.Namespace, config: Config, sock: socket.socket) -> int:
    """A worker process serving the API on a socket of its own bound to the
    address of ``sock`` (``SO_REUSEPORT``); its PID. It reads no queue root (the
    first process does) and exits when told to (SIGTERM)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        host, port = sock.getsockname()[:2]
        sock.close()  # the first process's; this one listens on its own
        own = listen(host, port)
        code = _serve_coordinator(args, config, host, port, roots=[], sock=own, quiet=True)
    except BaseException:  # a worker never returns into the parent's code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # pragma: no cover - unreachable


def _stop_workers(pids: list[int], wait_s: float = 15.0) -> None:
    """SIGTERM to each worker; SIGKILL to one still there after ``wait_s``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for pid in pids:
        try:
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.05)
        except ChildProcessError:
            pass  # reaped already


def _serve_coordinator(
    args: argparse.Namespace,
    config: Config,
    host: str,
    port: int,
    *,
    roots: list[QueueRoot],
    sock: socket.socket | None = None,
    quiet: bool = False,
) -> int:
    """One process of the coordinator: its store, the API (on ``sock`` when the
    socket is shared), the queue roots' watcher, until SIGTERM or SIGINT."""
    store, where = _coordinator_store(args.db, config)
    watcher: QueueWatcher | None = None
    try:
        # the coordinator runs nothing: each agent's own launch rules decide what its
        # node runs, and placement and submission judge by what the agents report
        registry = Registry.load(config.module_paths, LaunchRules.unchecked())
        # jobs from a commit: their module.toml read under its own [sources] allow
        registry.sources = coordinator_source_cache(config)
        api = ApiThread(
            store,
            registry,
            config,
            host,
            port,
            name="gpuwarden-coordinator",
            coordinator=True,
            sock=sock,
            # the running services of every node, at /run/<name>/, from the store
            service_routes=RouteBook(store) if isinstance(store, ClusterStore) else None,
        )

        def on_signal(_signum: int, _frame: Any) -> None:
            api.server.should_exit = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if not api.start():
            raise UserError(
                f"the coordinator cannot listen on {host}:{port} (in use, or not an "
                "address of this host?)"
            )
        url = config.cluster.coordinator_url or advertised_url(*api.bound)
        api.advertise(url)
        if not quiet:
            _say_listening(
                api,
                url=url,
                config=config,
                where=where,
                registry=registry,
                roots=roots,
                workers=int(getattr(args, "workers", 1)),
            )
        if roots:
            # bundles in, result bundles out; agents run the jobs
            watcher = QueueWatcher(store, registry, config, roots)
            watcher.start()
        while api.thread.is_alive():
            api.thread.join(0.5)
    finally:
        if watcher is not None:
            watcher.stop()
        store.close()
    return 0


def _coordinator_store(db: str | None, config: Config) -> tuple[Store, str]:
    """The store ``--db`` names (else the config's), and where it is, as shown."""
    if db and db.startswith(DATABASE_URL_PREFIXES):
        # psycopg (PostgreSQL only) loads when it is used, as in app.open_store:
        # every other command starts without it
        from gpuwarden.store.postgres import PostgresStore, redact_url  # noqa: PLC0415

        return PostgresStore(db), redact_url(db)
    if db:
        path = Path(db).expanduser().resolve()
        return SqliteStore(path), str(path)
    return checked_store(config, writes=True), config.database or str(config.db_path)


def _say_listening(
    api: ApiThread,
    *,
    url: str,
    config: Config,
    where: str,
    registry: Registry,
    roots: list[QueueRoot],
    workers: int = 1,
) -> None:
    """What the coordinator tells its operator once it listens."""
    c = config.cluster
    err.print(
        f"gpuwarden coordinator (PID {os.getpid()}) listening on {api.url}\n"
        f"  agents use  {url}"
        + ("" if c.coordinator_url else escape("  (set [cluster] coordinator_url to say another)"))
        + f"\n  store       {where}\n"
        f"  job types   {', '.join(sorted(registry.types)) or 'none'} (each node runs what "
        "its own launch rules allow)\n"
        f"  leases      {c.lease_s:g} s; offline after {c.offline_after_s:g} s; "
        f"sweep every {c.sweep_every_s:g} s\n"
        f"  queue roots {', '.join(str(r.path) for r in roots) or 'none'}"
        + (f"\n  workers     {workers} processes on the one address" if workers > 1 else "")
    )
    if ignored := _launch_keys_set(config):
        verb = "mean" if len(ignored) > 1 else "means"
        err.print(
            f"note: {', '.join(ignored)} in this config {verb} nothing here: the "
            "coordinator runs no job; each agent's own config decides which types its "
            "node runs"
        )
    if api.bound[0] not in ("127.0.0.1", "::1"):
        err.print(
            "[yellow]warning:[/] the API speaks plain HTTP: tokens cross the network in "
            "clear text; put it behind a TLS proxy on untrusted networks"
        )


def advertised_url(host: str, port: int) -> str:
    """The URL to give agents when ``[cluster] coordinator_url`` is not set: the
    address listened on, or this host's name when that is every address."""
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - reading the bind, not binding
        host = socket.getfqdn()
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _launch_keys_set(config: Config) -> list[str]:
    """The launch-rule keys a coordinator's config sets (none of them applies there)."""
    keys = []
    if config.container_runtime is not Runtime.LOCAL:
        keys.append(f"container_runtime = {config.container_runtime.value!r}")
    for key in ("allow_unsandboxed_containers", "allow_host_jobs"):
        if getattr(config, key):
            keys.append(f"{key} = true")
    return keys


def _refuse_a_password_on_the_command_line(url: str) -> None:
    """``--db`` is on the command line, which every user of the host can read."""
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
    # first of all: the variable leaves this process's environment, and a token on
    # the command line is refused before anything else happens
    token = enrolment_token(
        enroll=args.enroll, enroll_file=args.enroll_file, environ=os.environ, stdin=sys.stdin
    )
    config = with_stop_jobs(config_of(args), args.stop_jobs)
    if args.max_jobs is not None and args.max_jobs < 1:
        raise UserError("--max-jobs must be at least 1")
    if token is not None and args.credential:
        raise UserError(
            f"an enrolment token ({ENROLL_ENV}) and --credential do not go together: "
            "enrol, or run with a credential"
        )
    events = EventLog(args.log) if args.log else EventLog(stream=sys.stdout)
    signals = stop_signals(config)
    signals.install()
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
            stop=signals.stop,
            force=signals.force,
            say=lambda text: err.print(escape(text)),
            on_broker=signals.add,
        )
    finally:
        events.close()


# -- node ----------------------------------------------------------------------------


def _cluster_store(args: argparse.Namespace) -> ClusterStore:
    """The store of the state directory, as a store that keeps nodes."""
    store = existing_store(args)
    if not isinstance(store, ClusterStore):  # pragma: no cover - both stores are
        store.close()
        raise UserError("this store keeps no nodes")
    return store


def _audit(store: Store, action: str, target: str, detail: dict[str, Any]) -> None:
    store.add_audit(local_actor().audit(action, now=time.time(), target=target, detail=detail))


def cmd_node_invite(args: argparse.Namespace) -> int:
    got = local_or_http(
        args,
        _invite_here,
        lambda a, client: client.request_json(
            "POST", "/v1/nodes/invite", json={"name": a.name, "replace": a.replace}
        ),
    )
    if args.json:
        print(json.dumps(got))
        return 0
    url, note = _agent_url(got.get("coordinator_url"), getattr(args, "url", None), args)
    err.print(
        f"enrolment token for node {escape(str(got['node']))}, valid 15 minutes, once. On that "
        "host, write it to a file only root can read (chmod 600) and run\n"
        f"  gpuwarden agent --coordinator {escape(url)} --enroll-file FILE\n"
        f"(or pipe it in with --enroll -, or set {ENROLL_ENV}; never put it on a command "
        "line: every user of the host can read that)" + (f"\n{escape(note)}" if note else "")
    )
    if got.get("superseded"):
        err.print(
            f"the earlier invite(s) of {escape(str(got['node']))} no longer work: "
            + escape(", ".join(str(t) for t in got["superseded"]))
        )
    if got.get("replaces"):
        err.print(
            f"[yellow]note:[/] node {escape(str(got['replaces']))} is enrolled now: when this "
            "token is used, its credential is revoked, its agent stops, and its jobs go back "
            "to the queue"
        )
    print(got["token"])
    return 0


def _invite_here(args: argparse.Namespace) -> dict[str, Any]:
    store = _cluster_store(args)
    try:
        now = time.time()
        made = issue_invite(store, args.name, by=local_actor(), now=now, replace=args.replace)
        detail: dict[str, Any] = {"token": made.record.id, "superseded": made.superseded}
        if args.replace:
            detail.update(replace=True, replaces=made.replaces)
        _audit(store, "node.invite", args.name, detail)
    finally:
        store.close()
    return {
        "node": args.name,
        "token": made.token,
        "token_id": made.record.id,
        "expires_at": made.record.expires_at,
        "replace": args.replace,
        "replaces": made.replaces,
        "superseded": made.superseded,
    }


def _agent_url(advertised: Any, given: str | None, args: argparse.Namespace) -> tuple[str, str]:
    """The coordinator's URL for the command an invite prints, and a note when it may
    not be one the GPU host reaches: what the coordinator says agents use (``[cluster]
    coordinator_url``, else its address), else ``--url``, else the local config's
    ``coordinator_url``, else a placeholder."""
    url = str(advertised or given or "")
    if not url:
        try:
            url = config_of(args).cluster.coordinator_url
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
    nodes = local_or_http(
        args, _nodes_here, lambda _a, client: client.request_json("GET", "/v1/nodes")
    )
    if args.json:
        out.print_json(json.dumps(nodes))
        return 0
    if not nodes:
        out.print("no nodes: `gpuwarden node invite NAME` makes an enrolment token")
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
    out.print(table)
    return 0


def _nodes_here(args: argparse.Namespace) -> list[dict[str, Any]]:
    store = _cluster_store(args)
    try:
        now = time.time()
        leases = store.leases()
        grants = {g.node: g for g in store.open_grants()}
        return [report.node_json(r, leases, now, grants) for r in store.list_nodes()]
    finally:
        store.close()


def cmd_node_drain(args: argparse.Namespace) -> int:
    local_or_http(args, _drain_here, _drain_http)
    err.print(f"node {args.name} is draining: its running jobs finish, it gets no new ones")
    return 0


def _drain_here(args: argparse.Namespace) -> None:
    store = _cluster_store(args)
    try:
        co.drain(store, args.name, now=time.time())
        _audit(store, "node.drain", args.name, {})
    finally:
        store.close()


def _drain_http(args: argparse.Namespace, client: Client) -> None:
    client.request_json("POST", f"/v1/nodes/{args.name}/drain")


def cmd_node_diagnostic(args: argparse.Namespace) -> int:
    got = local_or_http(args, _diagnostic_here, _diagnostic_http)
    if args.json:
        print(json.dumps(got))
        return 0
    err.print(
        f"job {escape(args.job)} may start once on draining node {escape(args.name)}; "
        "the node stays closed to everything else"
    )
    return 0


def _diagnostic_here(args: argparse.Namespace) -> dict[str, Any]:
    store = _cluster_store(args)
    try:
        grant = co.diagnostic(
            store, args.name, args.job, by="local", reason=args.reason, now=time.time()
        )
        _audit(store, "node.diagnostic", args.name, {"job": args.job, "reason": grant.reason})
        return report.grant_json(grant)
    finally:
        store.close()


def _diagnostic_http(args: argparse.Namespace, client: Client) -> dict[str, Any]:
    body = {"job": args.job, "reason": args.reason}
    return dict(client.request_json("POST", f"/v1/nodes/{args.name}/diagnostic", json=body))


def cmd_node_resume(args: argparse.Namespace) -> int:
    changed, state = local_or_http(args, _resume_here, _resume_http)
    if changed:
        err.print(f"node {escape(args.name)} takes new work again")
    else:
        err.print(f"node {escape(args.name)} was not draining (it is {state}): nothing to resume")
    return 0


def _resume_here(args: argparse.Namespace) -> tuple[bool, str]:
    store = _cluster_store(args)
    try:
        record, changed = co.resume(store, args.name, now=time.time())
        _audit(store, "node.resume", args.name, {"resumed": changed})
        return changed, record.state.value
    finally:
        store.close()


def _resume_http(args: argparse.Namespace, client: Client) -> tuple[bool, str]:
    got = client.request_json("POST", f"/v1/nodes/{args.name}/resume")
    return bool(got.get("resumed")), str(got.get("state"))


def cmd_node_revoke(args: argparse.Namespace) -> int:
    got = local_or_http(
        args,
        _revoke_here,
        lambda a, client: client.request_json("POST", f"/v1/nodes/{a.name}/revoke"),
    )
    err.print(
        f"node {args.name} is revoked: its credential is refused from now on; "
        f"{got['requeued']} leased job(s) went back to the queue, {got['interrupted']} "
        "running one(s) ended as infrastructure failures and run elsewhere"
    )
    return 0


def _revoke_here(args: argparse.Namespace) -> dict[str, Any]:
    config = config_of(args)
    store = _cluster_store(args)
    try:
        registry = Registry.load(config.module_paths, config.launch_rules)
        got = co.revoke(store, registry, args.name, now=time.time())
        _audit(store, "node.revoke", args.name, got)
        return got
    finally:
        store.close()
