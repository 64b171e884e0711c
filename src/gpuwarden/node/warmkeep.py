"""Warm servers across a restart of the broker (SPEC.md, "Attempts outlive the
broker", "Warm servers across a restart").

Two entry points, each called once by the broker:

- :func:`leave_idle`, at a routine stop (``[broker] on_stop = "leave"``): every
  idle warm server with a record is left running with its model loaded; it
  waits for the next broker on its socket path for ``GPUWARDEN_SERVE_WAIT_S``
  (300 s by default), then exits by itself. A killed broker leaves its servers
  the same way (their records were written when they loaded).
- :func:`adopt_left`, at start, before anything is planned and before recovery
  stops what an earlier run left: each record (:mod:`gpuwarden.node.warmrecord`)
  is read as hostile and its process verified (pid, start ticks, boot id,
  marker, the supervisor's own record: never a bare pid); a server that passes
  is taken over (:meth:`gpuwarden.node.warm.WarmServers.adopt`: its ledger
  holding restored, and it serves its type's next job without loading
  anything once it has come back). Every other record is removed, and what it
  names is left to recovery, which stops the processes of this instance that
  no one took back (by their marker: a process that is not this node's is
  never signalled).

Why the worker connects again rather than listening itself: the broker then
never connects to a path a job's process could have made or swapped (a
listening worker in a sandbox would own its socket's folder), the socket stays
in the broker's own folder, mode 0700, and the kernel names the process that
connects (``SO_PEERCRED``), which must carry the server's marker.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwarden.core.model import JobType, LaunchMode
from gpuwarden.launch.base import attempt_marker
from gpuwarden.node import warmrecord
from gpuwarden.node.running import Emit
from gpuwarden.node.warm import WarmServers
from gpuwarden.node.warmrecord import ServerRecord

__all__ = ["adopt_left", "leave_idle"]


def leave_idle(warm: WarmServers) -> int:
    """A routine stop: leave the idle warm servers running for the next broker
    (each ``warm_server_left``); how many were left. Call before the broker
    stops its other servers."""
    return len(warm.leave_idle())


def adopt_left(
    warm: WarmServers,
    types: Mapping[str, JobType],
    *,
    instance: str,
    emit: Emit,
    now: float,
) -> list[str]:
    """Take over the warm servers an earlier run of ``instance`` left; the markers
    of those taken over (recovery leaves their processes alone). Each record that
    is not taken over is removed (``warm_record_refused`` with the reason)."""
    state_dir = warm.settings.state_dir
    kept: list[str] = []
    for name, record in warmrecord.read_all(state_dir):
        why = "it is not a record" if record is None else _refusal(warm, types, instance, record)
        if why is None and record is not None:
            try:
                warm.adopt(record, types[record.type], now)
            except ValueError as exc:  # a second record for one type
                why = str(exc)
            else:
                kept.append(record.marker)
                continue
        warmrecord.remove(state_dir, name)
        emit("warm_record_refused", record=name[:64], reason=why)
    return kept


def _refusal(
    warm: WarmServers, types: Mapping[str, JobType], instance: str, record: ServerRecord
) -> str | None:
    """Why ``record`` names no server this broker may take over, or None."""
    jobtype = types.get(record.type)
    if jobtype is None or jobtype.launch is not LaunchMode.SERVE:
        return f"{record.type} is no serve type here"
    if warm.launching.sandbox_for(jobtype) is not None:
        return f"{record.type} runs sandboxed here: its servers are not taken over"
    if record.marker != attempt_marker(instance, f"warm-{record.type}", record.epoch):
        return "its marker is not this node's"
    if record.socket != str(warm.socket_dir() / f"{record.epoch}.sock") or not warm.stable_sockets:
        return "its socket is not in this node's folder"
    log_dir = warm.settings.state_dir / "warm" / f"{record.type}-{record.epoch}"
    return warmrecord.verify(record, log_dir)
