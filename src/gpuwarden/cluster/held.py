"""The jobs leased to an agent, as it stands here, kept across its restarts.

:class:`Held` is one job leased to this node (the coordinator's id, its id in the
local store, its lease). The agent keeps the mapping in its state directory
(:data:`HELD_FILE`, replaced at once through :func:`gpuwarden.safefs.write_file`
whenever it changes): an agent started again reads it back, and a service job its
broker adopted (:mod:`gpuwarden.node.adoption`) stays leased to the node under the
same lease (its heartbeat renews it) instead of being cancelled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuwarden import safefs

log = logging.getLogger("gpuwarden.agent")

#: the held-lease file's name in the agent's state directory (mode 600)
HELD_FILE = "agent-held.json"


@dataclass
class Held:
    """A job leased to this node, as it stands here."""

    job_id: str  # the coordinator's id
    local_id: str  # its id in the local store (the same unless that was taken)
    lease_id: str
    #: the lease is gone or about to go: stop it here, never report it
    lost: bool = False
    #: the coordinator knows it started (a start report got an answer)
    started: bool = False
    #: it ended here and its end was reported (or needs no report)
    ended: bool = False
    #: the coordinator asked it to yield to this job, and its broker was asked:
    #: never again until the attempt's end is reported (a later attempt is not asked)
    asked_for: str | None = None
    #: why it was lost (its end, if it ends here, is reported with this reason)
    lost_reason: str = ""
    #: the lease's end by this host's wall clock (what its supervisor is told)
    until: float | None = None


def held_rows(held: Iterable[Held]) -> tuple[tuple[str, str, str], ...]:
    """What the file keeps of ``held``: the leases still this node's."""
    return tuple(sorted((h.job_id, h.local_id, h.lease_id) for h in held if not h.lost))


def save_held(path: Path, node: str, rows: tuple[tuple[str, str, str], ...]) -> None:
    """Replace the file with ``rows`` (of :func:`held_rows`), for node ``node``."""
    body = {
        "node": node,
        "held": [{"job": j, "local": loc, "lease_id": lease} for j, loc, lease in rows],
    }
    safefs.write_file(path, json.dumps(body, indent=1).encode())


def load_held(path: Path, node: str) -> list[Held]:
    """The jobs an earlier run of node ``node`` held (none when the file is missing,
    unreadable, or another node's)."""
    try:
        body = json.loads(path.read_bytes())
        if body.get("node") != node:
            return []
        return [
            Held(job_id=str(r["job"]), local_id=str(r["local"]), lease_id=str(r["lease_id"]))
            for r in body.get("held", [])
        ]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("the held-lease file %s could not be read (%s): ignored", path, exc)
        return []
