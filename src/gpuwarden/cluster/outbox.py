"""The agent's durable outbox: its reports to the coordinator, kept on disk until
the coordinator has answered them.

Each report (a job's start or an attempt's end, with the job's coordinator id,
local id and lease) is one file in ``<state_dir>/agent-outbox/``, named by a
sequence number, written at once (:func:`gpuwarden.safefs.write_file`: a fresh
file, flushed, renamed into place) before it is sent, and removed once the
coordinator answered it (taken, or refused for good). Beside them ``cursor``
keeps the id of the last local event turned into reports, written after the
reports it produced. So an agent killed at any moment, started again, sends
what it had not got answered and turns into reports the events it had not read
yet: a finished attempt's end is never lost (a report made twice is answered
alike or refused as a repeat). The folder is the agent's own (mode 700).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden import safefs

log = logging.getLogger("gpuwarden.agent")

#: the outbox folder's name in the agent's state directory
OUTBOX_DIR = "agent-outbox"
#: the file that keeps the last local event id turned into reports
CURSOR = "cursor"
_SUFFIX = ".json"


@dataclass
class Saved:
    """One report as the outbox keeps it."""

    seq: int
    kind: str  # "start" | "finish"
    job_id: str
    local_id: str
    lease_id: str
    body: dict[str, Any] = field(default_factory=dict)
    attempt: int | None = None
    uploaded: list[str] = field(default_factory=list)
    not_uploaded: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "job": self.job_id,
            "local": self.local_id,
            "lease_id": self.lease_id,
            "body": self.body,
            "attempt": self.attempt,
            "uploaded": self.uploaded,
            "not_uploaded": self.not_uploaded,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Saved:
        attempt = raw.get("attempt")
        return cls(
            seq=int(raw["seq"]),
            kind=str(raw["kind"]),
            job_id=str(raw["job"]),
            local_id=str(raw["local"]),
            lease_id=str(raw["lease_id"]),
            body=dict(raw.get("body") or {}),
            attempt=attempt if isinstance(attempt, int) else None,
            uploaded=[str(p) for p in raw.get("uploaded") or ()],
            not_uploaded=[dict(x) for x in raw.get("not_uploaded") or ()],
        )


class Outbox:
    """The report files in ``folder`` (made if missing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # past every report file's number, read or not (one left damaged stays as it is)
        numbers = (p.name.removesuffix(_SUFFIX) for p in folder.iterdir())
        self._next = max((int(n) for n in numbers if n.isdigit()), default=0) + 1

    def _path(self, seq: int) -> Path:
        return self.folder / f"{seq:012d}{_SUFFIX}"

    def put(self, saved: Saved) -> int:
        """Keep ``saved`` (its ``seq`` is given here); returns its sequence number.
        Raises OSError when it could not be written."""
        saved.seq = self._next
        self._next += 1
        self.update(saved)
        return saved.seq

    def update(self, saved: Saved) -> None:
        """Write ``saved`` again (what it uploaded already, a field taken out)."""
        data = json.dumps(saved.to_json(), separators=(",", ":")).encode()
        safefs.write_file(self._path(saved.seq), data)

    def done(self, seq: int) -> None:
        """The coordinator answered report ``seq``: it goes."""
        try:
            self._path(seq).unlink(missing_ok=True)
        except OSError as exc:  # it is sent again after a restart: answered alike
            log.warning("the answered report %s could not be removed: %s", self._path(seq), exc)

    def load(self) -> list[Saved]:
        """Every report kept, in order (one that cannot be read is logged and left)."""
        out: list[Saved] = []
        for path in sorted(self.folder.iterdir()):
            name = path.name
            if not name.endswith(_SUFFIX) or name.startswith("."):
                continue
            try:
                out.append(Saved.from_json(json.loads(path.read_bytes())))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.error("the kept report %s could not be read (%s): left there", name, exc)
        return sorted(out, key=lambda s: s.seq)

    def cursor(self) -> int | None:
        """The last local event id turned into reports (None: none kept)."""
        try:
            return int((self.folder / CURSOR).read_text().strip())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("the outbox cursor could not be read (%s): ignored", exc)
            return None

    def save_cursor(self, event_id: int) -> None:
        safefs.write_file(self.folder / CURSOR, f"{event_id}\n".encode())

    def clear(self) -> None:
        """Forget every report (the node's credential was refused)."""
        for s in self.load():
            self.done(s.seq)
