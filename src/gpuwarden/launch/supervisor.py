"""The supervisor of one attempt: the job's only parent, outside the broker.

    python -I -S supervisor.py FOLDER TIMEOUT_S GRACE_S MARKER -- ARGV...

The host launcher starts every attempt's command (a host job, a sandbox's
bubblewrap or podman client, with or without the memory-cap starter) through
this script, in a session of its own. It is what outlives the broker: a broker
that stops, restarts or dies leaves it running, and the next one finds it by
its record and takes the attempt back (:mod:`gpuwarden.node.adoption`).

It:

1. writes ``FOLDER/started.json`` (its pid, its start time in clock ticks and
   the boot id: a marker no reused pid can fake; the attempt's ``MARKER``);
2. becomes a child subreaper, and starts ``ARGV`` in a process group of its own
   with ``GPUWARDEN_ATTEMPT=MARKER`` added to its environment (the supervisor
   itself does not carry it);
3. waits, with every signal it cares about blocked and taken one at a time
   (``sigtimedwait``: no handler runs in the middle of anything):

   - SIGCHLD: reaps every child (orphans of the job come to it);
   - SIGTERM: stops the job: SIGTERM to its group, SIGKILL after ``GRACE_S``;
   - SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH: passed on to the
     job's group (a checkpoint signal among them is noted in the record);
   - ``TIMEOUT_S`` passing (``inf``: none): stops the job the same way;
   - the lease (``FOLDER/lease``, written by a cluster agent,
     :func:`write_lease`) passing without renewal: stops the job the same way
     (self-fencing: a dead agent's job never runs beside its retry);

4. once the job's main process has exited (after a stop, what is left of its
   group is killed while the main's zombie still holds the group's id), writes
   ``FOLDER/exit.json`` (renamed into place) and exits with the job's status.

Standard library only, ``-I -S``, and few imports (no json: its ``re`` costs
milliseconds on every start): it must start fast and use little memory.
The helpers at the end are what the broker uses on these files.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

#: the supervisor's folder inside an attempt's folder
FOLDER = "supervisor"
STARTED = "started.json"
EXIT = "exit.json"
#: the lease file: the wall-clock time (seconds since the epoch, as text) until
#: which the job may run; a supervisor past it stops its job (self-fencing)
LEASE = "lease"
ATTEMPT_ENV = "GPUWARDEN_ATTEMPT"
#: how often the lease file is read
LEASE_LOOK_S = 1.0
#: the signals passed on to the job
FORWARDED = (
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
_WAITED = frozenset((signal.SIGCHLD, signal.SIGTERM, *FORWARDED))
#: what the job starts with at its default action: what it waits for here, and
#: what Python ignores (as :mod:`subprocess`'s ``restore_signals``)
_DEFAULTED = (*_WAITED, signal.SIGPIPE, signal.SIGXFSZ)
_PR_SET_CHILD_SUBREAPER = 36
_RECORD_MAX = 65536


# -- records (no json module) --------------------------------------------------


def to_json(value: object) -> str:
    """``value`` (None, bool, int, float, str, list, dict of those) as JSON."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else "null"
    if isinstance(value, str):
        out = []
        for ch in value:
            code = ord(ch)
            if ch in '"\\':
                out.append("\\" + ch)
            elif code < 0x20 or code > 0x7E:
                if code > 0xFFFF:
                    code -= 0x10000
                    high, low = 0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)
                    out.append(f"\\u{high:04x}\\u{low:04x}")
                else:
                    out.append(f"\\u{code:04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(to_json(str(k)) + ":" + to_json(v) for k, v in value.items()) + "}"
    raise TypeError(type(value).__name__)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place (a
    reader sees the whole file or none). Not fsynced: the record must survive
    the broker, not the host."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_small(path: str, limit: int = _RECORD_MAX) -> bytes | None:
    """The bytes of the regular file ``path`` (not followed if a link), at most
    ``limit``; None when it is missing, not a regular file, or larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``
    field 22), or None when it is gone."""
    raw = read_small(f"/proc/{pid}/stat", 4096)
    if raw is None:
        return None
    try:
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def boot_id() -> str:
    raw = read_small("/proc/sys/kernel/random/boot_id", 128)
    return "" if raw is None else raw.decode("ascii", "replace").strip()


# -- the supervisor --------------------------------------------------------------


class _Run:
    """The state of one supervised job."""

    def __init__(self, folder: str, timeout_s: float, grace_s: float) -> None:
        self.folder = folder
        self.grace_s = grace_s
        now = time.monotonic()
        self.deadline = now + timeout_s if 0 < timeout_s < float("inf") else None
        self.next_lease_look = now
        self.job = 0
        self.status: int | None = None
        self.why = ""  # "stopped", "timed_out" or "fenced" once a stop began
        self.kill_at: float | None = None
        self.signals: list[str] = []

    def begin_stop(self, why: str) -> None:
        if self.why:
            return
        self.why = why
        self.kill_at = time.monotonic() + self.grace_s
        _killpg(self.job, signal.SIGTERM)

    def lease_passed(self) -> bool:
        raw = read_small(os.path.join(self.folder, LEASE), 64)
        if raw is None:
            return False
        try:
            return time.time() > float(raw.decode("ascii", "replace").strip())
        except ValueError:
            return False

    def look(self, now: float) -> None:
        """The deadline, the lease and the kill after the grace."""
        if self.deadline is not None and now >= self.deadline:
            self.begin_stop("timed_out")
        if now >= self.next_lease_look:
            self.next_lease_look = now + LEASE_LOOK_S
            if self.lease_passed():
                self.begin_stop("fenced")
        if self.kill_at is not None and now >= self.kill_at:
            _killpg(self.job, signal.SIGKILL)
            self.kill_at = None

    def wait_s(self, now: float) -> float:
        due = [self.next_lease_look]
        if self.deadline is not None and not self.why:
            due.append(self.deadline)
        if self.kill_at is not None:
            due.append(self.kill_at)
        return max(0.001, min(due) - now)

    def reap(self) -> None:
        """Reap every child that has exited; the job's main last of its group."""
        if self.status is None and self.why:
            # after a stop, nothing of the group may outlive its main: its zombie,
            # not reaped yet, still holds the group's id
            try:
                done = os.waitid(os.P_PID, self.job, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                done = None
            if done is not None:
                _killpg(self.job, signal.SIGKILL)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.job:
                self.status = status


def _environ() -> dict[bytes, bytes]:
    """The environment this process was started with (Python's own changes to
    ``os.environ``, such as the C locale's coercion, are not the job's)."""
    raw = read_small("/proc/self/environ", 1 << 24)
    if raw is None:
        return dict(os.environb)
    env: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq and key:
            env[key] = value
    return env


def _killpg(pgid: int, sig: int) -> None:
    try:  # noqa: SIM105 - contextlib (collections, operator) costs 10 ms a start
        os.killpg(pgid, sig)
    except OSError:
        pass


def _subreaper() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError, ImportError):
        pass


def _exit_code(status: int) -> int:
    """As :mod:`subprocess` gives it: ``-N`` for an end by signal ``N``."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _start_error(argv0: str, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.filename not in (None, argv0):
        reason = f"{reason} ({exc.filename})"
    return f"cannot start {argv0!r}: {reason}"


def _record_exit(run: _Run, started_at: float, **extra: object) -> None:
    import resource

    record: dict[str, object] = {
        "v": 1,
        "exit_code": None if run.status is None else _exit_code(run.status),
        "timed_out": run.why == "timed_out",
        "stopped": run.why == "stopped",
        "fenced": run.why == "fenced",
        "signals": run.signals,
        "started_at": started_at,
        "ended_at": time.time(),
        "max_rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        **extra,
    }
    write_atomic(os.path.join(run.folder, EXIT), to_json(record) + "\n")


def main(args: list[str]) -> int:
    if len(args) < 6 or args[4] != "--":
        sys.stderr.write("usage: supervisor.py FOLDER TIMEOUT_S GRACE_S MARKER -- ARGV...\n")
        return 2
    folder, timeout_s, grace_s, marker, argv = (
        args[0],
        float(args[1]),
        float(args[2]),
        args[3],
        args[5:],
    )
    started_at = time.time()
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    me = os.getpid()
    write_atomic(
        os.path.join(folder, STARTED),
        to_json(
            {
                "v": 1,
                "pid": me,
                "start_ticks": start_ticks(me),
                "boot_id": boot_id(),
                "marker": marker,
                "started_at": started_at,
            }
        )
        + "\n",
    )
    _subreaper()
    run = _Run(folder, timeout_s, grace_s)
    env = _environ()
    env[ATTEMPT_ENV.encode()] = os.fsencode(marker)
    try:
        run.job = os.posix_spawnp(
            argv[0], argv, env, setpgroup=0, setsigmask=(), setsigdef=_DEFAULTED
        )
    except OSError as exc:
        _record_exit(run, started_at, launch_error=_start_error(argv[0], exc))
        return 127
    while run.status is None:
        now = time.monotonic()
        run.look(now)
        info = signal.sigtimedwait(_WAITED, run.wait_s(time.monotonic()))
        if info is not None:
            sig = info.si_signo
            if sig == signal.SIGTERM:
                run.begin_stop("stopped")
            elif sig != signal.SIGCHLD:
                run.signals.append(signal.Signals(sig).name)
                _killpg(run.job, sig)
        run.reap()
    _record_exit(run, started_at)
    code = _exit_code(run.status)
    return code if code >= 0 else 128 - code


# -- what the broker uses on these files -------------------------------------------


def folder_of(attempt_dir: str) -> str:
    return os.path.join(attempt_dir, FOLDER)


def write_lease(attempt_dir: str, until: float) -> None:
    """Tell the supervisor of the attempt in ``attempt_dir`` that its job may run
    until ``until`` (wall-clock seconds since the epoch)."""
    folder = folder_of(attempt_dir)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    write_atomic(os.path.join(folder, LEASE), f"{until:.3f}\n")


def read_lease(attempt_dir: str) -> float | None:
    """The lease end written by :func:`write_lease`, or None (none, or unreadable)."""
    raw = read_small(os.path.join(folder_of(attempt_dir), LEASE), 64)
    if raw is None:
        return None
    try:
        return float(raw.decode("ascii", "replace").strip())
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
