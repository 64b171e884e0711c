"""The host launcher: runs an attempt as a plain process on this host, no isolation.

The attempt's process starts in its own session (so its own process group), with
exactly the request's environment plus ``ATTEMPT_ENV=<job_id>/<attempt>``, and its
stdout and stderr go to ``stdout.log`` and ``stderr.log`` in the attempt
directory (files, never pipes: a job that prints a lot cannot block on a full
pipe).

An attempt ends only when every process of it is gone. At the end (normal exit,
timeout or stop) the launcher stops, and confirms gone:

- every process in the attempt's process group;
- every descendant of the main process, from snapshots taken while the job runs
  (a grandchild may have left the group with ``setsid``);
- every process whose environment carries the attempt's marker, which catches
  processes that left both the group and the parent chain (double fork).

Only a process that both leaves the group and replaces its environment (for
example ``env -i``) right after a double fork can escape all three.

A job with a RAM cap (``LaunchRequest.ram_cap_bytes``) runs in a memory cgroup
of its attempt's own (:mod:`gpuwarden.launch.memcaps`): the root-side starter
(:mod:`gpuwarden.launch.enter`, run with ``python -I -S``) joins it and then
executes the job's command with the job's environment, so the main pid is the
job's and every descendant is in the cgroup, which no process can leave. At the
end its OOM kills are read (``LaunchResult.oom_killed``), what is left in it is
killed, and it is removed. A starter that fails (exit 1, one
``gpuwarden-sandbox:`` line) is a launch error. Without a cap the job starts
directly, as it always did.

A zombie counts as gone: it holds no memory, only a process-table entry, and
reaping it is its parent's (or init's) job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import psutil

from gpuwarden import safefs
from gpuwarden.core.clip import join_clipped
from gpuwarden.launch import enter, reaper, supervisor
from gpuwarden.launch.base import (
    ATTEMPT_ENV,
    LaunchRequest,
    LaunchResult,
    MemoryCapSupport,
    RunAs,
    attempt_name,
)
from gpuwarden.launch.memcaps import (
    MemoryCgroups,
    cap_text,
    find_memory_cgroups,
    memory_caps_of,
)
from gpuwarden.launch.reaper import quick_leftovers

__all__ = [
    "KILL_CONFIRM_S",
    "HostLauncher",
    "find_attempt_processes",
    "read_clipped",
    "starter_argv",
    "stop_processes",
]

log = logging.getLogger(__name__)

#: how often the launcher checks the main process, the stop event and the deadline
POLL_S = 0.01
#: first and longest interval between snapshots of the process tree while a job
#: runs; the interval doubles from the first to the longest (trees form early)
SNAPSHOT_FIRST_S = 0.1
SNAPSHOT_MAX_S = 1.0
#: how often the process table is rescanned while stopping (new forks)
RESCAN_S = 0.2
#: longest wait, after SIGKILL, for every process to be confirmed gone
KILL_CONFIRM_S = 10.0
#: the broker stops an attempt itself only this long after its supervisor should
#: have (its timeout and grace): a backstop for a supervisor that hangs
BACKSTOP_MARGIN_S = 10.0

_ProcSet = set[psutil.Process]

#: the main processes this process started and has not reaped (any thread's): the
#: reaper's look for an attempt's leftovers skips their trees
_live_mains: set[int] = set()
_live_lock = threading.Lock()


# ---------------------------------------------------------------------------
# reading clipped output


def read_clipped(path: Path, limit: int) -> str:
    """Return the text of the file at ``path``, clipped to at most ``limit``
    characters (plus the clip marker) the way :func:`gpuwarden.core.clip.clip`
    clips: the first half and the last half with a marker between that says how
    many bytes were cut (bytes: the part skipped is never decoded).

    Only the head and the tail of the file are read (at most ``4 * limit``
    bytes, enough for ``limit`` UTF-8 characters), never the whole file. Bytes
    that are not valid UTF-8 become U+FFFD. A missing file reads as ``""``; one
    that is a link or not a regular file is not read (a note says so).
    """
    if limit < 0:
        raise ValueError("limit must be >= 0")
    head_n = limit // 2
    tail_n = limit - head_n
    # every UTF-8 character is at most 4 bytes: these windows hold enough characters
    head_window = 4 * head_n
    tail_window = 4 * tail_n
    try:
        # through safefs: never a link, never anything but a regular file
        f = os.fdopen(safefs.open_file(path), "rb")
    except FileNotFoundError:
        return ""
    except safefs.UnsafePathError as exc:
        return f"[not read: {exc.why}]"
    with f:
        size = os.fstat(f.fileno()).st_size
        if size <= head_window + tail_window:
            data = f.read(head_window + tail_window)
            text = data.decode("utf-8", errors="surrogateescape")
            if len(text) <= limit:
                return _readable(text)
            head = text[:head_n]
            tail = text[len(text) - tail_n :]
            size = len(data)
        else:
            head_text = f.read(head_window).decode("utf-8", errors="surrogateescape")
            f.seek(size - tail_window)
            tail_text = f.read(tail_window).decode("utf-8", errors="surrogateescape")
            head = head_text[:head_n]
            tail = tail_text[len(tail_text) - tail_n :]
    omitted = size - _nbytes(head) - _nbytes(tail)
    return join_clipped(_readable(head), _readable(tail), omitted)


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogateescape"))


def _readable(text: str) -> str:
    """Turn the bytes that surrogateescape kept into U+FFFD."""
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------
# finding and stopping processes


def _is_gone(proc: psutil.Process) -> bool:
    """True if ``proc`` has exited: no such process (or its pid was reused), or a zombie."""
    try:
        if not proc.is_running():
            return True
        return bool(proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def _carries_marker(proc: psutil.Process, marker: str) -> bool:
    try:
        return proc.environ().get(ATTEMPT_ENV) == marker
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False


def _marker_of(proc: psutil.Process) -> str | None:
    """The attempt marker of ``proc``: in its environment (a job's process), or
    the one an attempt's supervisor was given on its command line (it does not
    carry it itself)."""
    try:
        marker = proc.environ().get(ATTEMPT_ENV)
        if marker is not None:
            return marker
        return supervised_marker(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def supervised_marker(cmdline: list[str]) -> str | None:
    """The attempt marker in an attempt supervisor's command line (as
    :func:`supervised_argv` makes it), or None: not a supervisor's."""
    if len(cmdline) > 8 and cmdline[3].endswith("/supervisor.py") and cmdline[8] == "--":
        return cmdline[7]
    return None


def find_instance_processes(instance: str, *, but: Iterable[str] = ()) -> list[psutil.Process]:
    """Every live process of any attempt or warm server of one broker instance
    (``ATTEMPT_ENV`` starting with ``instance/``): what a crashed run left; those
    of the attempt markers ``but`` (adopted attempts) are left out."""
    prefix, kept = f"{instance}/", set(but)
    return [
        p
        for p in _all_processes()
        if (m := _marker_of(p)) is not None
        and m.startswith(prefix)
        and m not in kept
        and not _is_gone(p)
    ]


def _all_processes() -> list[psutil.Process]:
    """Every process on the host except this one (no shared psutil cache: thread-safe)."""
    me = os.getpid()
    procs = []
    for pid in psutil.pids():
        if pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def find_attempt_processes(marker: str) -> list[psutil.Process]:
    """Return the live processes whose environment carries ``ATTEMPT_ENV=marker``.

    Processes whose environment cannot be read (another user's, or exited while
    looking) are skipped, and so are zombies. The broker can call this at a
    restart to find what is left of attempts it ran before.
    """
    return [p for p in _all_processes() if _carries_marker(p, marker) and not _is_gone(p)]


def _signal(procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for p in procs:
        # psutil checks that the pid was not reused before it signals
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            p.send_signal(sig)


def _killpg(pgid: int | None, sig: signal.Signals) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _pause(procs: Iterable[psutil.Process], seconds: float, keep: int | None) -> None:
    """Sleep ``seconds``, reaping those of ``procs`` that are this process's
    children (psutil.wait_procs) — except pid ``keep``, which a Popen owns."""
    waitable = [p for p in procs if p.pid != keep]
    if waitable:
        psutil.wait_procs(waitable, timeout=seconds)
    else:
        time.sleep(seconds)


def _terminate(
    collect: Callable[[], _ProcSet],
    grace_s: float,
    *,
    pgid: int | None = None,
    keep: int | None = None,
) -> tuple[list[int], list[int]]:
    """Stop every process ``collect()`` returns, and the group ``pgid``:
    SIGTERM, up to ``grace_s`` for them to exit, then SIGKILL, and wait until
    each is confirmed gone (or :data:`KILL_CONFIRM_S` passes). ``collect`` is
    called again while stopping, so processes forked in the meantime are stopped
    too. Return (reaped, survivors) as pids; reaped are those that were alive
    and are now gone. ``keep`` is a pid that must not be reaped here (a Popen's)."""
    seen: _ProcSet = {p for p in collect() if not _is_gone(p)}
    if not seen:
        return [], []
    _killpg(pgid, signal.SIGTERM)
    _signal(seen, signal.SIGTERM)

    # grace: wait for them to exit by themselves; SIGTERM newcomers
    end = time.monotonic() + max(grace_s, 0.0)
    next_scan = time.monotonic() + RESCAN_S
    while True:
        alive = {p for p in seen if not _is_gone(p)}
        now = time.monotonic()
        if now >= next_scan or not alive:
            fresh = {p for p in collect() if not _is_gone(p)} - seen
            if fresh:
                _killpg(pgid, signal.SIGTERM)
                _signal(fresh, signal.SIGTERM)
                seen |= fresh
                alive |= fresh
            next_scan = now + RESCAN_S
        if not alive or now >= end:
            break
        _pause(alive, min(POLL_S, end - now), keep)

    # kill: SIGKILL what is left until none is found alive
    ceiling = time.monotonic() + KILL_CONFIRM_S
    while True:
        alive = {p for p in seen | collect() if not _is_gone(p)}
        if not alive:
            break
        seen |= alive
        _killpg(pgid, signal.SIGKILL)
        _signal(alive, signal.SIGKILL)
        if time.monotonic() >= ceiling:
            break
        _pause(alive, POLL_S, keep)
        alive = {p for p in alive if not _is_gone(p)}
        if alive and time.monotonic() >= ceiling:
            break

    survivors = sorted(p.pid for p in seen if not _is_gone(p))
    reaped = sorted({p.pid for p in seen} - set(survivors))
    return reaped, survivors


def stop_processes(
    procs: Iterable[psutil.Process], grace_s: float, *, marker: str | None = None
) -> tuple[list[int], list[int]]:
    """Stop ``procs``: SIGTERM, wait up to ``grace_s``, SIGKILL, then wait until
    each is confirmed gone (a zombie counts as gone), for at most
    :data:`KILL_CONFIRM_S` after the SIGKILL.

    With ``marker``, processes carrying ``ATTEMPT_ENV=marker`` are looked up
    again while stopping and stopped too (they may fork while being stopped).
    Return ``(reaped, survivors)``: the pids that were alive and are now gone,
    and those still alive after SIGKILL (stuck in the kernel, for example).
    """
    given = set(procs)

    def collect() -> _ProcSet:
        found = {p for p in given if not _is_gone(p)}
        if marker is not None:
            found.update(find_attempt_processes(marker))
        return found

    return _terminate(collect, grace_s)


# ---------------------------------------------------------------------------
# the launcher


class _Tree:
    """What is known of one attempt's processes: the main process and the
    descendants seen in snapshots while it ran."""

    def __init__(self, main_pid: int, marker: str) -> None:
        self.main_pid = main_pid
        self.marker = marker
        self.descendants: _ProcSet = set()

    def snapshot(self) -> None:
        """Add every live descendant of the main process, and of the descendants
        seen before (whose parent may have exited), to ``descendants``."""
        parents: dict[int, list[psutil.Process]] = {}
        for p in _all_processes():
            with contextlib.suppress(psutil.Error):
                parents.setdefault(p.ppid(), []).append(p)
        roots = [self.main_pid] + [p.pid for p in self.descendants if not _is_gone(p)]
        todo = list(roots)
        found: set[int] = set(roots)
        while todo:
            for child in parents.get(todo.pop(), []):
                if child.pid not in found and child.pid != self.main_pid:
                    found.add(child.pid)
                    self.descendants.add(child)
                    todo.append(child.pid)

    def walk(self) -> None:
        """Remember the main process's descendants now, found by walking its tree
        (no scan of the process table): the snapshot of the reaper's path."""
        for pid in reaper.tree_pids(self.main_pid):
            if pid not in {p.pid for p in self.descendants}:
                with contextlib.suppress(psutil.Error):
                    self.descendants.add(psutil.Process(pid))

    def collect(self) -> _ProcSet:
        """Every live process of the attempt except the main one: remembered
        descendants, members of its process group, and marker carriers."""
        found = {p for p in self.descendants if not _is_gone(p)}
        for p in _all_processes():
            if p.pid == self.main_pid:
                continue
            try:
                in_group = os.getpgid(p.pid) == self.main_pid
            except OSError:
                continue
            if (in_group or _carries_marker(p, self.marker)) and not _is_gone(p):
                found.add(p)
        return found


def _main_exited(pid: int) -> bool:
    """True once the child ``pid`` has exited, without reaping it: the zombie keeps
    the pid, and with it the process-group id, from being reused until the end."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _describe_start_error(argv0: str, exc: BaseException) -> str:
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        if exc.filename not in (None, argv0):
            reason = f"{reason} ({exc.filename})"
    else:
        reason = str(exc)
    return f"cannot start {argv0!r}: {reason}"


def _not_started(
    req: LaunchRequest, started_at: float, launch_error: str | None, *, stopped: bool = False
) -> LaunchResult:
    """The result of an attempt whose process was never started."""
    return LaunchResult(
        job_id=req.job_id,
        attempt=req.attempt,
        exit_code=None,
        started_at=started_at,
        ended_at=time.time(),
        stopped=stopped,
        launch_error=launch_error,
    )


def starter_argv(
    cgroups: Iterable[Path],
    argv: Iterable[str],
    run_as: RunAs | None = None,
    cwd: str = "",
) -> list[str]:
    """The root-side starter that joins ``cgroups``, drops to ``run_as`` (then
    enters ``cwd`` as that user) and then executes ``argv``."""
    args = [sys.executable, "-I", "-S", str(Path(enter.__file__).resolve())]
    for path in cgroups:
        args += ["--cgroup", str(path)]
    if run_as is not None:
        args += ["--user", f"{run_as.uid}:{run_as.gid}"]
        if run_as.groups:
            args += ["--groups", ",".join(str(g) for g in run_as.groups)]
        args += ["--chdir", cwd]
    return [*args, "--", *argv]


class _Cap(NamedTuple):
    """An attempt's RAM cap and the memory cgroup that enforces it."""

    cgroups: MemoryCgroups
    path: Path
    limit_bytes: int


def backstop_s(req: LaunchRequest) -> float:
    """When the broker stops an attempt that its supervisor has not stopped at
    its timeout (inf: no timeout)."""
    t = req.timeout_s
    if not (math.isfinite(t) and t > 0):
        return math.inf
    return t + req.kill_grace_s + BACKSTOP_MARGIN_S


def supervised_argv(req: LaunchRequest, argv: Iterable[str]) -> list[str]:
    """``argv`` under the attempt's supervisor (:mod:`gpuwarden.launch.supervisor`):
    it enforces the timeout, the lease and a stop's grace even with no broker."""
    timeout = req.timeout_s if math.isfinite(req.timeout_s) and req.timeout_s > 0 else math.inf
    return [
        sys.executable,
        "-I",
        "-S",
        str(Path(supervisor.__file__).resolve()),
        supervisor.folder_of(req.attempt_dir),
        repr(timeout),
        repr(float(req.kill_grace_s)),
        req.marker,
        "--",
        *argv,
    ]


def _spawn(req: LaunchRequest, cap: _Cap | None = None) -> subprocess.Popen[bytes]:
    """Start the attempt's supervisor in a session of its own, with exactly the
    request's environment (the supervisor adds the attempt's marker to the
    job's), its output to the log files; the supervisor starts the job, with
    ``cap`` through the starter that puts it in the cap's cgroup first."""
    attempt_dir = Path(req.attempt_dir)
    env = dict(req.env)
    env.pop(ATTEMPT_ENV, None)
    run_as = req.run_as if req.run_as is not None and req.run_as.uid != 0 else None
    if cap is None and run_as is None:
        inner = list(req.argv)
    else:
        cgroups = [] if cap is None else [cap.path]
        inner = starter_argv(cgroups, req.argv, run_as, req.cwd)
    folder = Path(supervisor.folder_of(req.attempt_dir))
    folder.mkdir(mode=0o700, exist_ok=True)
    for name in (supervisor.STARTED, supervisor.EXIT):
        (folder / name).unlink(missing_ok=True)
    with (
        (attempt_dir / "stdout.log").open("wb") as out_f,
        (attempt_dir / "stderr.log").open("wb") as err_f,
        _live_lock,
    ):
        proc = subprocess.Popen(
            supervised_argv(req, inner),
            # a user's command enters its folder as that user (the starter's --chdir)
            cwd="/" if run_as is not None else req.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out_f,
            stderr=err_f,
            start_new_session=True,
            close_fds=True,
        )
        _live_mains.add(proc.pid)
        return proc


def live_mains() -> frozenset[int]:
    """The main processes this process started and has not reaped."""
    with _live_lock:
        return frozenset(_live_mains)


def reap_adopted() -> None:
    """Reap the zombies among this process's children that it adopted as their
    subreaper (a daemon a sandbox runtime double-forked, an orphan of an attempt
    that made a session of its own): a child that is no main process started
    here and is not in this process's session. Every other child of the broker
    is a main process of ``_spawn`` (in :data:`_live_mains`) or a command some
    module runs in the broker's own session and waits for itself. Call with
    ``_live_lock`` held, so that no main process is started meanwhile."""
    if not reaper.is_subreaper():
        return
    me, session = os.getpid(), os.getsid(0)
    for child in reaper.children(me):
        if child in _live_mains:
            continue
        st = reaper.stat(child)
        if st is not None and st[0] == "Z" and st[3] != session:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)


def _reap_main(proc: subprocess.Popen[bytes]) -> int:
    """Reap the main process (it has exited) and return its exit code."""
    code = proc.wait()
    with _live_lock:
        _live_mains.discard(proc.pid)
    return code


class SupervisorRecord(NamedTuple):
    """What an attempt's supervisor wrote in ``exit.json`` as it ended."""

    exit_code: int | None
    timed_out: bool
    stopped: bool
    fenced: bool
    launch_error: str | None
    #: the signals it passed on to the job (``SIGUSR1``...), in order
    signals: tuple[str, ...]
    started_at: float
    ended_at: float
    max_rss_kib: int


#: the most a supervisor's record may hold
_RECORD_MAX = 65536


def _record_json(attempt_dir: str, name: str) -> dict[str, Any] | None:
    """A supervisor's record ``name`` in the attempt's folder, read through
    :mod:`gpuwarden.safefs` (no link below the attempt's folder, a regular file,
    bounded), or None."""
    try:
        raw = safefs.read_bytes(Path(supervisor.FOLDER, name), _RECORD_MAX, under=attempt_dir)
        data = json.loads(raw)
    except (OSError, safefs.UnsafePathError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("v") == 1 else None


def _typed(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """``data[key]`` if it is of ``kind`` (a bool is no number here), else ``default``."""
    value = data.get(key, default)
    if isinstance(value, bool) != (kind is bool):
        return default
    return value if isinstance(value, kind) else default


def recorded_end(attempt_dir: str) -> SupervisorRecord | None:
    """The exit record of the attempt in ``attempt_dir``'s supervisor, or None (it
    has not ended, or the file is missing, a link, too large or not a record:
    the file is the broker's, but a job may have reached it, so nothing in it is
    trusted beyond its types)."""
    data = _record_json(attempt_dir, supervisor.EXIT)
    if data is None:
        return None
    code = _typed(data, "exit_code", int, None)
    signals = _typed(data, "signals", list, [])
    error = _typed(data, "launch_error", str, None)
    return SupervisorRecord(
        exit_code=code,
        timed_out=_typed(data, "timed_out", bool, False),
        stopped=_typed(data, "stopped", bool, False),
        fenced=_typed(data, "fenced", bool, False),
        launch_error=None if error is None else error[:2000],
        signals=tuple(str(x)[:16] for x in signals[:64] if isinstance(x, str)),
        started_at=float(_typed(data, "started_at", (int, float), 0.0)),
        ended_at=float(_typed(data, "ended_at", (int, float), 0.0)),
        max_rss_kib=_typed(data, "max_rss_kib", int, 0),
    )


class LiveSupervisor(NamedTuple):
    """A running supervisor, as its ``started.json`` and ``/proc`` agree."""

    pid: int
    marker: str


def live_supervisor(attempt_dir: str, marker: str) -> LiveSupervisor | None:
    """The supervisor of the attempt in ``attempt_dir`` if it still runs: the
    process its ``started.json`` names has the same start time and boot id (a
    reused pid does not), its command line carries ``marker``, and it has not
    written its exit record. None otherwise."""
    data = _record_json(attempt_dir, supervisor.STARTED)
    if data is None or data.get("marker") != marker:
        return None
    pid, ticks = _typed(data, "pid", int, 0), _typed(data, "start_ticks", int, None)
    if pid <= 1 or ticks is None or data.get("boot_id") != supervisor.boot_id():
        return None
    if supervisor.start_ticks(pid) != ticks:
        return None
    cmdline = supervisor.read_small(f"/proc/{pid}/cmdline", 1 << 20) or b""
    args = cmdline.split(b"\0")
    if marker.encode() not in args or not any(a.endswith(b"/supervisor.py") for a in args):
        return None
    st = reaper.stat(pid)
    if st is None or st[0] in "ZX":
        return None
    return LiveSupervisor(pid, marker)


def _with_record(req: LaunchRequest, ending: _Ending) -> tuple[_Ending, SupervisorRecord | None]:
    """``ending`` as the supervisor's exit record tells it: the job's own exit
    code (the supervisor's is its copy), and a timeout or a fence it enforced."""
    record = recorded_end(req.attempt_dir)
    if record is None:
        return ending, None
    return (
        ending._replace(
            exit_code=record.exit_code,
            timed_out=ending.timed_out or record.timed_out,
        ),
        record,
    )


def _result(
    req: LaunchRequest, pid: int, started_at: float, ending: _Ending, cap: _Cap | None = None
) -> LaunchResult:
    """The result of an attempt whose processes are all gone (with ``cap``: its
    memory cgroup's OOM kills are read, what is left there killed, and it removed)."""
    attempt_dir = Path(req.attempt_dir)
    stderr = read_clipped(attempt_dir / "stderr.log", req.clip_chars)
    oom_killed: bool | None = None
    ending, record = _with_record(req, ending)
    launch_error = None if record is None else record.launch_error
    lost: str | None = None
    if record is None and not (ending.stopped or ending.timed_out):
        lost = f"its supervisor (PID {pid}) ended, {_how(ending.exit_code)}, before the job did"
    if cap is not None:
        kills, left = cap.cgroups.finish(cap.path)
        oom_killed = kills > 0
        ending = ending._replace(survivors=sorted({*ending.survivors, *left}))
        said = stderr.strip()
        if ending.exit_code == 1 and said.startswith(enter.PREFIX) and not oom_killed:
            launch_error = f"could not start the job in its memory cgroup: {said.splitlines()[0]}"
    if ending.survivors:
        log.error(
            "attempt %s: processes %s survived SIGKILL; not confirmed gone",
            req.marker,
            ending.survivors,
        )
        stderr += (
            f"\n[gpuwarden: processes {', '.join(map(str, ending.survivors))} survived "
            f"SIGKILL for {KILL_CONFIRM_S:g} s; the attempt is not confirmed gone]\n"
        )
    return LaunchResult(
        job_id=req.job_id,
        attempt=req.attempt,
        exit_code=ending.exit_code,
        started_at=started_at,
        ended_at=time.time(),
        pid=None if record is not None and record.launch_error is not None else pid,
        timed_out=ending.timed_out,
        stopped=ending.stopped,
        stdout=read_clipped(attempt_dir / "stdout.log", req.clip_chars),
        stderr=stderr,
        reaped=tuple(ending.reaped),
        survivors=tuple(ending.survivors),
        launch_error=launch_error,
        oom_killed=oom_killed,
        ram_cap_bytes=0 if cap is None else cap.limit_bytes,
        fenced=record is not None and record.fenced,
        supervisor_lost=lost,
        signals=() if record is None else record.signals,
    )


def _how(code: int | None) -> str:
    if code is None:
        return "its status unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"with code {code}"


class _Ending(NamedTuple):
    """How a started attempt ended, once every process of it is gone."""

    exit_code: int | None
    timed_out: bool
    stopped: bool
    reaped: list[int]
    survivors: list[int]


class HostLauncher:
    """Runs an attempt as a plain host process (launch mode ``host``).

    Thread-safe: several attempts may run at once, each on its own worker thread;
    the launcher holds no state between calls. ``memory_cgroups``: where an
    attempt with a RAM cap gets its memory cgroup (``"auto"``: found now; None:
    nowhere, and an attempt with a cap is refused as a launch error).
    """

    def __init__(self, memory_cgroups: MemoryCgroups | Literal["auto"] | None = "auto") -> None:
        self.memory_cgroups = find_memory_cgroups() if memory_cgroups == "auto" else memory_cgroups

    def memory_caps(self) -> MemoryCapSupport:
        """Whether a job's RAM cap is enforced here: a memory cgroup per attempt."""
        return memory_caps_of(self.memory_cgroups)

    def _cap(self, req: LaunchRequest) -> _Cap | None:
        """The attempt's memory cgroup, made with its limit in place (None without
        a cap). Raises OSError when a cap is asked and cannot be enforced."""
        if req.ram_cap_bytes <= 0:
            return None
        if self.memory_cgroups is None:
            raise OSError(
                f"a RAM cap of {cap_text(req.ram_cap_bytes)} was asked, but this host cannot "
                f"enforce memory caps ({self.memory_caps().how})"
            )
        cgroups = self.memory_cgroups
        try:
            path = cgroups.create(attempt_name(req), req.ram_cap_bytes)
        except (OSError, ValueError) as exc:
            raise OSError(f"could not make the attempt's memory cgroup: {exc}") from exc
        return _Cap(cgroups, path, req.ram_cap_bytes)

    def run(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None = None,
    ) -> LaunchResult:
        """Run ``req.argv`` to its end and return the result; blocks.

        The process starts in its own session, in ``req.cwd``, with exactly
        ``req.env`` plus ``ATTEMPT_ENV=req.marker``, stdin from ``/dev/null`` and
        stdout/stderr to ``stdout.log``/``stderr.log`` in ``req.attempt_dir``.
        When ``req.timeout_s`` passes (``timed_out``) or ``stop`` is set
        (``stopped``), the whole tree is stopped: SIGTERM, then SIGKILL after
        ``req.kill_grace_s``. A ``timeout_s`` that is not a positive finite number
        means no timeout. After a normal exit, processes the job left behind are
        stopped the same way. The call returns only once every process of the
        attempt is confirmed gone; ``reaped`` lists those that were stopped.

        ``exit_code`` is the main process's return code as :mod:`subprocess`
        gives it: ``-N`` when it was ended by signal ``N`` (``-9`` for SIGKILL).
        A process that cannot be started gives ``launch_error`` and no exit code;
        if ``stop`` is already set, nothing is started (``stopped``, no exit code).
        If a process survives SIGKILL for :data:`KILL_CONFIRM_S`, its pid is noted
        at the end of ``stderr`` and an error is logged.
        """
        started_at = time.time()
        attempt_dir = Path(req.attempt_dir)
        if not req.argv:
            return _not_started(req, started_at, "cannot start: the command is empty")
        if stop.is_set():
            return _not_started(req, started_at, None, stopped=True)
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = f"cannot create attempt directory {attempt_dir}: {exc}"
            return _not_started(req, started_at, why)
        try:
            cap = self._cap(req)
        except OSError as exc:
            return _not_started(req, started_at, str(exc))
        try:
            proc = _spawn(req, cap)
        except (OSError, ValueError, TypeError) as exc:
            _drop_cap(cap)
            return _not_started(req, started_at, _describe_start_error(req.argv[0], exc))

        if on_start is not None:
            try:
                on_start(proc.pid)
            except Exception:  # a caller's bug must not leave the process unwatched
                log.exception("on_start callback failed for %s", req.marker)
        ending = self._see_through(proc, req, stop)
        with _live_lock:
            reap_adopted()
        return _result(req, proc.pid, started_at, ending, cap)

    def start(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None,
        on_end: Callable[[LaunchResult], None],
    ) -> Ended:
        """What :meth:`run` does, without blocking: start the process here and
        hand it to the one :class:`~gpuwarden.launch.reaper.Reaper`; ``on_end``
        gets the result (on the reaper's thread, or on the thread that stops a
        tree with leftovers) exactly once. The returned handle's ``join()``
        waits for that."""
        started_at = time.time()
        ended = Ended(on_end)
        if not req.argv:
            ended.post(_not_started(req, started_at, "cannot start: the command is empty"))
            return ended
        if stop.is_set():
            ended.post(_not_started(req, started_at, None, stopped=True))
            return ended
        try:
            Path(req.attempt_dir).mkdir(parents=True, exist_ok=True)
            cap = self._cap(req)
        except OSError as exc:
            ended.post(_not_started(req, started_at, str(exc)))
            return ended
        try:
            proc = _spawn(req, cap)
        except (OSError, ValueError, TypeError) as exc:
            _drop_cap(cap)
            why = _describe_start_error(req.argv[0], exc)
            ended.post(_not_started(req, started_at, why))
            return ended
        if on_start is not None:
            try:
                on_start(proc.pid)
            except Exception:  # a caller's bug must not leave the process unwatched
                log.exception("on_start callback failed for %s", req.marker)
        _Watching(req, proc, stop, started_at, ended, cap=cap).begin()
        return ended

    def _see_through(
        self, proc: subprocess.Popen[bytes], req: LaunchRequest, stop: threading.Event
    ) -> _Ending:
        """Watch the started attempt to its end (exit, timeout or ``stop``), then stop
        every process of it that is left and reap the main one."""
        main = _main_proc(proc.pid)
        tree = _Tree(proc.pid, req.marker)
        timed_out = stopped = False
        try:
            timed_out, stopped = self._watch(proc, tree, backstop_s(req), stop)
        finally:
            # whatever happened above, the attempt's processes must not outlive it
            def collect() -> _ProcSet:
                found = tree.collect()
                if main is not None and not _is_gone(main):
                    found.add(main)
                return found

            reaped, survivors = _terminate(collect, req.kill_grace_s, pgid=proc.pid, keep=proc.pid)
            # the main process is reaped only now: until here its zombie held its
            # pid, so the process-group id could not be reused by another process
            exit_code = None if proc.pid in survivors else proc.wait()
        return _Ending(exit_code, timed_out, stopped, reaped, survivors)

    @staticmethod
    def _watch(
        proc: subprocess.Popen[bytes], tree: _Tree, timeout_s: float, stop: threading.Event
    ) -> tuple[bool, bool]:
        """Wait for the main process to exit, the deadline, or ``stop``; snapshot
        the tree meanwhile. Return (timed_out, stopped)."""
        start = time.monotonic()
        deadline = start + timeout_s if math.isfinite(timeout_s) and timeout_s > 0 else None
        interval = SNAPSHOT_FIRST_S
        next_snapshot = start
        while True:
            now = time.monotonic()
            if now >= next_snapshot:
                tree.snapshot()
                next_snapshot = now + interval
                interval = min(interval * 2, SNAPSHOT_MAX_S)
            if _main_exited(proc.pid):
                return False, False
            if stop.is_set():
                return False, True
            if deadline is not None and now >= deadline:
                return True, False
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - now))
            stop.wait(wait)


class Ended:
    """The end of an attempt :meth:`HostLauncher.start` started: posts its result
    once, and ``join()`` waits until it has (as a worker thread's would)."""

    def __init__(self, on_end: Callable[[LaunchResult], None]) -> None:
        self._on_end = on_end
        self._done = threading.Event()

    def post(self, result: LaunchResult) -> None:
        if self._done.is_set():
            return
        try:
            self._on_end(result)
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class _Watching:
    """One started attempt as the reaper sees it (its checks run on the reaper's
    thread): the main process's exit, the stop, the deadline, tree snapshots."""

    def __init__(
        self,
        req: LaunchRequest,
        proc: subprocess.Popen[bytes],
        stop: threading.Event,
        started_at: float,
        ended: Ended,
        *,
        cap: _Cap | None = None,
    ) -> None:
        self.req, self.proc, self.stop, self.started_at, self.ended = (
            req,
            proc,
            stop,
            started_at,
            ended,
        )
        self.cap = cap
        self.tree = _Tree(proc.pid, req.marker)
        start = time.monotonic()
        t = backstop_s(req)
        self.deadline = start + t if math.isfinite(t) and t > 0 else None
        self.interval = SNAPSHOT_FIRST_S
        self.next_snapshot = start + SNAPSHOT_FIRST_S
        self.watched = reaper.Watched(pid=proc.pid, check=self.check, stop=stop)

    def begin(self) -> None:
        self.watched.due = self._due()
        reaper.REAPER.watch(self.watched)

    def _due(self) -> float:
        if self.deadline is None:
            return self.next_snapshot
        return min(self.next_snapshot, self.deadline)

    def check(self, now: float, exited: bool) -> bool:
        if exited and _main_exited(self.proc.pid):
            self._end(timed_out=False, stopped=False)
        elif self.stop.is_set():
            self._end(timed_out=False, stopped=True)
        elif self.deadline is not None and now >= self.deadline:
            self._end(timed_out=True, stopped=False)
        else:
            if now >= self.next_snapshot:
                self.tree.walk()
                self.interval = min(self.interval * 2, SNAPSHOT_MAX_S)
                self.next_snapshot = now + self.interval
            self.watched.due = self._due()
            return False
        return True

    def _end(self, *, timed_out: bool, stopped: bool) -> None:
        """The normal end with nothing left over is finished here, at once; any
        other goes to a thread of its own that stops the tree first."""
        pid = self.proc.pid
        if not (timed_out or stopped):
            remembered = [p.pid for p in self.tree.descendants if not _is_gone(p)]
            with _live_lock:  # no main is started meanwhile: its zombie is not an orphan's
                left = quick_leftovers(pid, self.req.marker, remembered, _live_mains - {pid})
                reap_adopted()
            if left == []:
                try:
                    ending = _Ending(_reap_main(self.proc), False, False, [], [])
                    self.ended.post(_result(self.req, pid, self.started_at, ending, self.cap))
                except Exception as exc:
                    self.ended.post(self._failed(exc))
                return
        threading.Thread(
            target=self._stop_tree,
            args=(timed_out, stopped),
            name=f"stop-{self.req.marker}",
            daemon=True,
        ).start()

    def _stop_tree(self, timed_out: bool, stopped: bool) -> None:
        pid = self.proc.pid
        try:
            main = _main_proc(pid)

            def collect() -> _ProcSet:
                found = self.tree.collect()
                if main is not None and not _is_gone(main):
                    found.add(main)
                return found

            reaped, survivors = _terminate(collect, self.req.kill_grace_s, pgid=pid, keep=pid)
            exit_code = None if pid in survivors else _reap_main(self.proc)
            ending = _Ending(exit_code, timed_out, stopped, reaped, survivors)
            self.ended.post(_result(self.req, pid, self.started_at, ending, self.cap))
        except Exception as exc:
            self.ended.post(self._failed(exc))

    def _failed(self, exc: Exception) -> LaunchResult:
        log.exception("ending attempt %s failed", self.req.marker)
        with contextlib.suppress(Exception):
            _drop_cap(self.cap)
        return LaunchResult(
            job_id=self.req.job_id,
            attempt=self.req.attempt,
            exit_code=None,
            started_at=self.started_at,
            ended_at=time.time(),
            pid=self.proc.pid,
            launch_error=f"the launcher failed: {exc!r}",
        )


def _drop_cap(cap: _Cap | None) -> None:
    """Kill what is left in the cap's cgroup and remove it (an attempt that failed)."""
    if cap is not None:
        cap.cgroups.finish(cap.path)


def _main_proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# ---------------------------------------------------------------------------
# an adopted attempt


def watch_adopted(
    req: LaunchRequest,
    pid: int,
    stop: threading.Event,
    on_end: Callable[[LaunchResult], None],
    cleanup: Callable[[], None] | None = None,
) -> Ended:
    """Watch the main process ``pid`` of an attempt an earlier run of this broker
    started (no child of this process: the reaper waits on its pidfd, or polls
    it) until it exits or ``stop`` is set; then stop every process that carries
    its marker, run ``cleanup`` (a sandbox's container or cgroups go) and post
    its result once. Its exit status is not this process's to read: an end by
    itself is a ``worker_error``."""
    ended = Ended(on_end)
    _Adopted(req, pid, stop, ended, cleanup).begin()
    return ended


class _Adopted:
    """One adopted attempt as the reaper sees it."""

    def __init__(
        self,
        req: LaunchRequest,
        pid: int,
        stop: threading.Event,
        ended: Ended,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.req, self.pid, self.stop, self.ended = req, pid, stop, ended
        self.cleanup = cleanup
        self.started_at = time.time()
        self.main = _main_proc(pid)
        self.watched = reaper.Watched(pid=pid, check=self.check, stop=stop)

    def begin(self) -> None:
        reaper.REAPER.watch(self.watched)

    def check(self, now: float, exited: bool) -> bool:
        gone = self.main is None or _is_gone(self.main)
        if exited and gone:
            self._end(stopped=False)
        elif self.stop.is_set():
            self._end(stopped=True)
        else:
            if self.watched.pidfd is None:  # no pidfd: looked at now and then
                self.watched.due = now + 0.2
            return False
        return True

    def _end(self, *, stopped: bool) -> None:
        threading.Thread(
            target=self._finish, args=(stopped,), name=f"stop-{self.req.marker}", daemon=True
        ).start()

    def _finish(self, stopped: bool) -> None:
        main = self.main

        def collect() -> _ProcSet:
            found = set(find_attempt_processes(self.req.marker))
            if main is not None and not _is_gone(main):
                found.add(main)
            return found

        try:
            reaped, survivors = _terminate(collect, self.req.kill_grace_s)
        except Exception as exc:  # the end is posted whatever happens
            log.exception("stopping adopted attempt %s failed", self.req.marker)
            reaped, survivors = [], [self.pid]
            stopped = stopped or bool(exc)
        if self.cleanup is not None:
            try:
                self.cleanup()
            except Exception:  # the end is posted whatever happens
                log.exception("cleaning up after adopted attempt %s failed", self.req.marker)
        record = recorded_end(self.req.attempt_dir)
        if record is not None and not stopped:
            result = recorded_result(self.req, self.pid, record)
            self.ended.post(
                dataclasses.replace(result, reaped=tuple(reaped), survivors=tuple(survivors))
            )
            return
        attempt_dir = Path(self.req.attempt_dir)
        lost = (
            f"its supervisor (PID {self.pid}) ended before the job did "
            "(adopted from an earlier run)"
        )
        self.ended.post(
            LaunchResult(
                job_id=self.req.job_id,
                attempt=self.req.attempt,
                exit_code=None,
                started_at=self.started_at,
                ended_at=time.time(),
                pid=self.pid,
                stopped=stopped,
                stdout=read_clipped(attempt_dir / "stdout.log", self.req.clip_chars),
                stderr=read_clipped(attempt_dir / "stderr.log", self.req.clip_chars),
                reaped=tuple(reaped),
                survivors=tuple(survivors),
                supervisor_lost=None if stopped else lost,
            )
        )


def recorded_result(req: LaunchRequest, pid: int | None, record: SupervisorRecord) -> LaunchResult:
    """The result of an attempt whose end its supervisor recorded (``exit.json``),
    read by a broker that did not start it: as if it had seen the end itself."""
    attempt_dir = Path(req.attempt_dir)
    return LaunchResult(
        job_id=req.job_id,
        attempt=req.attempt,
        exit_code=None if record.launch_error is not None else record.exit_code,
        started_at=record.started_at,
        ended_at=record.ended_at,
        pid=pid,
        timed_out=record.timed_out,
        stopped=record.stopped,
        launch_error=record.launch_error,
        stdout=read_clipped(attempt_dir / "stdout.log", req.clip_chars),
        stderr=read_clipped(attempt_dir / "stderr.log", req.clip_chars),
        fenced=record.fenced,
        signals=record.signals,
    )
