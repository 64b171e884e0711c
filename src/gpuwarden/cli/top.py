"""``gpuwarden top``: the brokers' GPUs, holdings, warm servers, queue and recent
failures in the terminal, redrawn every second (full screen, ``rich.live``), for
a person on an SSH session; ``q`` quits. Read from the state directory's store
(what the brokers publish: no broker needs to run for ``top`` to start) or, with
``--url``, from the API. Piped, or with ``--once``, it prints one frame and exits.

What a frame shows is :func:`gpuwarden.cli.topview.render` of a
:class:`~gpuwarden.cli.topview.TopSnapshot`; this module reads snapshots and the
keyboard.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.live import Live

from gpuwarden.api.leasedesk import LeaseDesk
from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    checked_store,
    config_of,
    local_or_http,
    wait_note,
)
from gpuwarden.cli.topview import (
    FAILED_ROWS,
    QUEUED_ROWS,
    JobRow,
    NodeSnapshot,
    TopSnapshot,
    render,
)
from gpuwarden.client import ApiError, Client, RateLimited
from gpuwarden.cluster import report
from gpuwarden.config import Config
from gpuwarden.core.model import Job
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.node.measured import RunTimes
from gpuwarden.node.status import BrokerStatus
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Store
from gpuwarden.store.cluster import ClusterStore

#: the keys that quit
QUIT_KEYS = b"qQ"

#: how often the run-time estimates are read again (a read of the latest runs)
ESTIMATES_EVERY_S = 30.0
#: how often ``explain`` is asked again about a queued job whose reason no broker published
REASONS_EVERY_S = 5.0

Source = Callable[[], TopSnapshot]


def _add_top(sub: Commands) -> None:
    sp = sub.add_parser(
        "top",
        help="live view of GPUs, holdings, queue and failures (q quits)",
        description="The brokers' GPUs (ledger holdings against the device's reading), "
        "degraded and faulted GPUs, warm servers, running and queued jobs with why they "
        "wait, and recent failures, redrawn every --interval seconds. q quits. Piped "
        "(no terminal) or with --once: one frame on stdout.",
    )
    sp.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between redraws (default 1; 0.1 to 60)",
    )
    sp.add_argument("--once", action="store_true", help="print one frame and exit")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_top)


#: the commands of this module, each with what adds its parser
PARSERS = {"top": _add_top}


def cmd_top(args: argparse.Namespace) -> int:
    if not 0.1 <= args.interval <= 60:
        raise UserError(f"--interval {args.interval:g}: give 0.1 to 60 seconds")
    return local_or_http(args, _top_here, _top_http)


def _top_here(args: argparse.Namespace) -> int:
    with _LocalSource(config_of(args)) as source:
        return _show(args, source.snapshot)


def _top_http(args: argparse.Namespace, client: Client) -> int:
    reasons = Reasons(client.explain)

    def snapshot() -> TopSnapshot:
        snap = snapshot_http(client, time.time())
        return dataclasses.replace(snap, reasons=reasons.of(snap.unexplained()))

    return _show(args, snapshot)


def _show(args: argparse.Namespace, source: Source) -> int:
    """One frame (``--once``, or stdout is no terminal), else the live view."""
    if args.once or not sys.stdout.isatty():
        console = Console(highlight=False)
        frame = render(source(), console.width)
        if console.is_terminal:
            console.print(frame)
            return 0
        with console.capture() as captured:  # piped: plain lines, no padding after them
            console.print(frame)
        sys.stdout.write("".join(ln.rstrip() + "\n" for ln in captured.get().splitlines()))
        return 0
    return live_view(source, args.interval)


# -- where snapshots come from --------------------------------------------------------


class Reasons:
    """What ``explain`` says (:func:`~gpuwarden.cli.common.wait_note` of its lines)
    of each queued job whose wait reason no broker published: every job over a
    coordinator, a job submitted after the broker's last status. Asked again
    every ``REASONS_EVERY_S`` per job; a job it cannot explain gets no reason."""

    def __init__(self, ask: Callable[[str], Sequence[str]]) -> None:
        self._ask = ask
        self._known: dict[str, tuple[float, str]] = {}

    def of(self, job_ids: Sequence[str]) -> dict[str, str]:
        now = time.monotonic()
        self._known = {j: v for j, v in self._known.items() if j in job_ids}
        for job_id in job_ids:
            asked = self._known.get(job_id)
            if asked is None or now - asked[0] >= REASONS_EVERY_S:
                try:
                    note = wait_note(self._ask(job_id))
                except GpuwardenError:  # it left the queue, or the API refused
                    note = ""
                self._known[job_id] = (now, note)
        return {j: note for j, (_, note) in self._known.items() if note}


class _LocalSource:
    """Snapshots from the store of a state directory, opened once it exists (``top``
    may start before the first ``gpuwarden serve``) and kept open."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._store: Store | None = None
        self._estimates: dict[str, float] = {}
        self._estimated_at = -ESTIMATES_EVERY_S
        self._registry: Registry | None = None
        self._reasons = Reasons(self._explain)

    def __enter__(self) -> _LocalSource:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._store is not None:
            self._store.close()

    def snapshot(self) -> TopSnapshot:
        config, now = self._config, time.time()
        where = str(config.state_dir)
        if self._store is None:
            if not config.database and not config.db_path.exists():
                return TopSnapshot(where=where, now=now, no_state=True)
            self._store = checked_store(config, writes=False)
        if time.monotonic() - self._estimated_at >= ESTIMATES_EVERY_S:
            self._estimates = estimates(self._store)
            self._estimated_at = time.monotonic()
        snap = snapshot_store(
            self._store, where, now, offline_after_s=config.cluster.offline_after_s
        )
        reasons = self._reasons.of(snap.unexplained())
        if self._registry is None:
            self._registry = Registry.load(self._config.module_paths, self._config.launch_rules)
        desk = LeaseDesk(self._store, self._registry, self._config)
        leases = tuple(desk.info(j) for j in desk.listed())
        return dataclasses.replace(snap, expected_s=self._estimates, reasons=reasons, leases=leases)

    def _explain(self, job_id: str) -> list[str]:
        """``gpuwarden explain JOB``'s lines (the config's module paths and rules)."""
        assert self._store is not None
        job = self._store.get_job(job_id)
        if job is None:
            return []
        if self._registry is None:
            self._registry = Registry.load(self._config.module_paths, self._config.launch_rules)
        cpu_slots = self._config.broker.cpu_slots
        return report.explain(job, self._store, self._registry, cpu_slots, time.time())


def estimates(store: Store) -> dict[str, float]:
    """Per job type, the run-time estimate the broker plans with (``RunTimes``)."""
    recent = store.recent_run_times()
    run_times = RunTimes(recent)
    found = {t: run_times.estimate(t) for t, _ in recent}
    return {t: s for t, s in found.items() if s is not None}


def snapshot_store(
    store: Store, where: str, now: float, *, offline_after_s: float = 120.0
) -> TopSnapshot:
    """A frame's data from a store: what its brokers published, the first queued
    jobs in queue order, the latest failures; on a coordinator's store, its
    enrolled nodes as ``status`` shows them."""
    cluster = None
    if isinstance(store, ClusterStore) and store.list_nodes():
        cluster = tuple(report.cluster_status(store, now, offline_after_s=offline_after_s))
    failed = store.list_jobs(states=frozenset({JobState.FAILED}), limit=4 * FAILED_ROWS)
    return TopSnapshot(
        where=where,
        now=now,
        nodes=tuple(_node(s) for s in store.node_statuses()),
        counts={k.value: v for k, v in store.count_by_state().items()},
        queued=tuple(_row(j) for j in store.queued_jobs(limit=QUEUED_ROWS)),
        failures=_latest(tuple(_row(j) for j in failed)),
        cluster=cluster,
    )


def snapshot_http(client: Client, now: float) -> TopSnapshot:
    """A frame's data from the API: ``GET /v1/status`` and the job lists."""
    data = client.status()
    nodes = tuple(
        _node(
            NodeStatus(
                node=str(n["node"]),
                pid=n.get("pid"),
                updated_at=float(n["updated_at"]),
                payload={k: v for k, v in n.items() if k not in ("node", "pid", "updated_at")},
            )
        )
        for n in data.get("nodes", [])
    )
    queued = [_dict_row(r) for r in client.list(states=["queued"], limit=200)]
    order = {job: i for n in nodes for i, job in enumerate(n.status.waiting)}
    queued.sort(key=lambda j: (order.get(j.id, len(order)), j.submitted_at))
    failed = tuple(_dict_row(r) for r in client.list(states=["failed"], limit=4 * FAILED_ROWS))
    cluster = data.get("cluster")
    leases: list[dict[str, Any]] = []
    with contextlib.suppress(ApiError):  # a token that may not list them
        leases = list(client.leases())
    return TopSnapshot(
        where=client.url,
        leases=tuple(leases),
        now=now,
        nodes=nodes,
        counts={str(k): int(v) for k, v in data.get("jobs", {}).items()},
        queued=tuple(queued[:QUEUED_ROWS]),
        failures=_latest(failed),
        cluster=tuple(cluster) if isinstance(cluster, list) else None,
    )


def _node(s: NodeStatus) -> NodeSnapshot:
    return NodeSnapshot(s.node, s.pid, s.updated_at, BrokerStatus.from_json(s.payload))


def _row(j: Job) -> JobRow:
    return JobRow(j.id, j.type, j.submitted_at, j.updated_at, j.reason)


def _dict_row(r: dict[str, Any]) -> JobRow:
    return JobRow(
        str(r["id"]),
        str(r.get("type", "")),
        float(r.get("submitted_at") or 0),
        float(r.get("updated_at") or 0),
        str(r.get("reason") or ""),
    )


def _latest(rows: tuple[JobRow, ...]) -> tuple[JobRow, ...]:
    return tuple(sorted(rows, key=lambda j: -j.updated_at)[:FAILED_ROWS])


def guarded(source: Source) -> TopSnapshot:
    """A snapshot, or, while the API or the store does not answer, a frame that says
    so (the live view goes on and tries again); a refusal (a bad token) ends it,
    but not the rate limit (the next redraw asks again)."""
    try:
        return source()
    except RateLimited as exc:
        return TopSnapshot(where="", now=time.time(), error=str(exc))
    except UserError:
        raise
    except GpuwardenError as exc:
        return TopSnapshot(where="", now=time.time(), error=str(exc))


# -- the live view and the keyboard ---------------------------------------------------


@contextlib.contextmanager
def cbreak(fd: int | None) -> Iterator[None]:
    """Keys one at a time on terminal ``fd`` (no echo, no Enter needed); the
    terminal's mode is put back however the block ends (``q``, Ctrl-C, an error).
    None: no terminal to read, nothing changed."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def wait_for_quit(fd: int | None, seconds: float) -> bool:
    """Wait up to ``seconds`` for a key on ``fd``; True when it was a quit key (or
    the terminal went away)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if fd is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return False
        try:
            data = os.read(fd, 64)
        except OSError:
            return True
        if not data or any(k in data for k in QUIT_KEYS):
            return True
    return False


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (the SSH session went away) end the view as ``q`` does,
    through the blocks that put the terminal back, with 128 + the signal's number."""

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    saved = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def live_view(source: Source, interval: float) -> int:
    """Redraw every ``interval`` seconds on the alternate screen until ``q``."""
    console = Console(highlight=False)
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    footer = "q quits" if fd is not None else "Ctrl-C quits"
    footer += f"  ·  every {interval:g} s"
    live = Live(console=console, screen=True, auto_refresh=False)
    with exit_on_signals(), cbreak(fd), live:
        while True:
            live.update(render(guarded(source), console.width, footer=footer), refresh=True)
            if wait_for_quit(fd, interval):
                return 0
