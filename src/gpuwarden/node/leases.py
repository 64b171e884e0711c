"""VRAM leases on a node: the files that carry a granted lease's deadline, its
end and the PIDs its app registered, and the attribution of those PIDs' memory
to the lease (SPEC.md, "VRAM leases"; the rules are :mod:`gpuwarden.core.lease`).

A lease is a job of the built-in ``lease`` type; its attempt is a holder process
under the attempt's supervisor. In the attempt's folder:

- ``supervisor/lease``: the deadline (:func:`gpuwarden.launch.supervisor.write_lease`),
  written at the grant (:func:`grant`, by the node before the supervisor starts)
  and at each renewal (:func:`renew`, by the CLI on this host or the API); the
  supervisor stops the holder once it passes;
- ``lease-end``: why its holder ended it (:func:`end`), written before a
  deadline already passed; without it an end at the deadline is an expiry;
- ``lease-pids``: the PIDs whose memory on the device is the lease's (a
  command's main process, or what the app registered), one a line.

The writers are the lease's holder's tools, never the loop; the loop reads
``lease-pids`` (:class:`LeasePids`) and judges the end (:func:`end_of`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuwarden.core.lease import ENDED_BY_HOLDER, expired_reason, is_lease, ttl_of
from gpuwarden.core.model import Attempt, Job
from gpuwarden.launch.supervisor import (
    folder_of,
    read_lease,
    read_small,
    write_atomic,
    write_lease,
)
from gpuwarden.node.running import RunningAttempt
from gpuwarden.node.vram import VramBook

__all__ = [
    "END_FILE",
    "PIDS_FILE",
    "attempt_dir_of",
    "attribute_lease_pids",
    "deadline",
    "end",
    "end_of",
    "grant",
    "lease_json",
    "read_pids",
    "register_pids",
    "renew",
]

END_FILE = "lease-end"
PIDS_FILE = "lease-pids"
#: the most PIDs one lease may name
MAX_PIDS = 256


def attempt_dir_of(state_dir: Path, job_id: str, number: int) -> Path:
    """Where the node lays out attempt ``number`` of job ``job_id``
    (:meth:`gpuwarden.node.attempts.Launching.attempt_dir`)."""
    return state_dir / "jobs" / job_id / f"attempt-{number}"


def grant(attempt_dir: Path, ttl_s: float, now: float) -> None:
    """The lease is granted: it may hold its GPU for ``ttl_s`` without a renewal."""
    write_lease(str(attempt_dir), now + ttl_s)


def renew(attempt_dir: Path, ttl_s: float, now: float) -> float | None:
    """Move the deadline to ``now + ttl_s``; the new deadline, or None when the
    attempt is not laid out yet (its grant will write one) or it was ended."""
    if not Path(folder_of(str(attempt_dir))).is_dir() or _ended(attempt_dir):
        return None
    until = now + ttl_s
    write_lease(str(attempt_dir), until)
    return until


def end(attempt_dir: Path, reason: str = ENDED_BY_HOLDER) -> bool:
    """End a granted lease now: its supervisor stops the holder within a second.
    False when its attempt is not laid out yet (then cancel the job instead)."""
    if not Path(folder_of(str(attempt_dir))).is_dir():
        return False
    write_atomic(str(attempt_dir / END_FILE), reason[:500] + "\n")
    write_lease(str(attempt_dir), 0.0)
    return True


def deadline(attempt_dir: Path) -> float | None:
    """The lease's deadline now (None: not written yet)."""
    return read_lease(str(attempt_dir))


def register_pids(attempt_dir: Path, pids: Iterable[int]) -> list[int]:
    """Add ``pids`` to the lease's: their memory on the device is the lease's
    from the next reading on. Returns all of them."""
    if not attempt_dir.is_dir():
        raise FileNotFoundError(f"{attempt_dir}: the lease's attempt is not laid out yet")
    have = read_pids(attempt_dir) | {int(p) for p in pids}
    if len(have) > MAX_PIDS:
        raise ValueError(f"a lease may name at most {MAX_PIDS} PIDs")
    write_atomic(str(attempt_dir / PIDS_FILE), "".join(f"{p}\n" for p in sorted(have)))
    return sorted(have)


def read_pids(attempt_dir: Path) -> set[int]:
    raw = read_small(str(attempt_dir / PIDS_FILE), 16 * MAX_PIDS)
    if raw is None:
        return set()
    return {int(w) for w in raw.split()[:MAX_PIDS] if w.isdigit() and 0 < int(w) < 1 << 22}


def _ended(attempt_dir: Path) -> str | None:
    raw = read_small(str(attempt_dir / END_FILE), 1024)
    return None if raw is None else raw.decode("utf-8", "replace").strip() or ENDED_BY_HOLDER


def end_of(run: RunningAttempt, fenced: bool) -> tuple[str | None, bool]:
    """A lease attempt's end, for its verdict: (why, expired). (None, False) for
    an attempt that is no lease's or was not stopped at its deadline."""
    if not is_lease(run.job.type) or not fenced:
        return None, False
    why = _ended(run.attempt_dir)
    if why is not None:
        return why, False
    return expired_reason(ttl_of(run.job.params)), True


def attribute_lease_pids(runs: Iterable[RunningAttempt], vram: VramBook) -> None:
    """The loop's side, before each probe reading: the PIDs each running lease
    named are added to its holding's (their process trees' memory is the
    lease's, not foreign)."""
    for run in runs:
        if is_lease(run.job.type) and run.attempt.gpu_uuid is not None:
            pids = read_pids(run.attempt_dir)
            if pids:
                vram.add_roots(run.holder, pids)


def lease_json(job: Job, attempt: Attempt | None, state_dir: Path) -> dict[str, Any]:
    """What ``GET /v1/leases/{id}`` and ``gpuwarden lease show`` say of a lease."""
    out: dict[str, Any] = {
        "id": job.id,
        "state": job.state.value,
        "vram_bytes": job.vram_bytes,
        "ttl_s": ttl_of(job.params),
        "holder": job.params.get("holder") or job.owner or "",
        "owner": job.owner,
        "submitted_at": job.submitted_at,
        "gpu": None,
        "granted_at": None,
        "until": None,
        "reason": job.reason,
    }
    if attempt is not None:
        out["gpu"] = attempt.gpu_uuid
        out["granted_at"] = attempt.started_at
        if job.state.value == "running":
            out["until"] = deadline(attempt_dir_of(state_dir, job.id, attempt.number))
            out["pids"] = sorted(read_pids(attempt_dir_of(state_dir, job.id, attempt.number)))
    return out
