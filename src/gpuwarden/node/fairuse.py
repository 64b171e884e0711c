"""Fair share as the broker loop keeps it: each owner's decayed use in VRAM GiB-hours.

The table is small (one entry per owner) and lives in the loop
(:class:`gpuwarden.core.fairshare.Usage`): it is read once at start from the
store's ``fair_share`` table and added to as each attempt ends (its holding's
bytes times its run time), in the store in the same batch as the end and in the
loop's table once that batch is committed. A planning pass reads each owner's
use once (:meth:`FairUse.table`, with what the running attempts have held so
far: a long job counts before it ends), so the hot path costs a dict lookup per
class and one sum over the running attempts.

A stored table rather than the attempts' history: what an attempt held is known
only to the loop's ledger (the attempts table does not keep it), and the table
is O(owners) to load however long the history, where reading 5 half-lives of
attempts back would cost a scan that grows with the job rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gpuwarden.core.fairshare import Usage, gib_hours, share_rows
from gpuwarden.core.model import Lane
from gpuwarden.node.measured import Footprints
from gpuwarden.node.running import RunningAttempt
from gpuwarden.node.vram import VramBook
from gpuwarden.store.base import Store

#: how ``share`` names the owner of jobs no API token submitted
LOCAL_NAME = "local (CLI and bundles)"

#: the most ended attempts whose holding is kept for an agent's reports
MAX_ENDS_KEPT = 10_000


class FairUse:
    """The owners' use, in the store and in the loop."""

    def __init__(
        self, store: Store, half_life_s: float, vram: VramBook, footprints: Footprints
    ) -> None:
        self.store = store
        self.vram = vram
        self.footprints = footprints
        self.usage = Usage(half_life_s)
        self._pending: list[tuple[str | None, float, float]] = []
        #: what each ended attempt held, by (job id, attempt number), for an agent's
        #: finish reports (:meth:`keep_ends`; None: not kept)
        self.ends: dict[tuple[str, int], int] | None = None
        self._pending_ends: list[tuple[tuple[str, int], int]] = []
        if self.usage.enabled:
            self.usage.load(store.fair_share())

    def table(self, now: float, running: Iterable[RunningAttempt] = ()) -> dict[str, float]:
        """Each owner's use now (owner "" is local), with what its ``running``
        attempts have held so far (counted for good when they end)."""
        if not self.usage.enabled:
            return {}
        use = self.usage.table(now)
        for run in running:
            so_far = gib_hours(self.held(run), run.attempt.started_at, now)
            if so_far > 0:
                owner = run.job.owner or ""
                use[owner] = use.get(owner, 0.0) + so_far
        return use

    def held(self, run: RunningAttempt) -> int:
        """The VRAM an attempt holds: its holding (a multi-GPU job's on all its GPUs),
        or, on a warm server, its type's footprint; 0 for a ``cpu`` job."""
        if self.vram.ledger.get(run.holder) is not None:
            return self.vram.held_bytes(run.holder)
        if run.jobtype.lane is Lane.VRAM:
            return self.footprints.of(run.jobtype, run.job.vram_bytes)
        return 0

    def keep_ends(self) -> None:
        """Keep what each ended attempt held (an agent: the coordinator charges its
        owner from the finish report, :meth:`take_end`)."""
        if self.ends is None:
            self.ends = {}

    def take_end(self, job_id: str, number: int) -> int | None:
        """The bytes attempt ``number`` of the job held, once it ended and its end
        was committed (taken once; None: not known)."""
        return None if self.ends is None else self.ends.pop((job_id, number), None)

    def charge(self, run: RunningAttempt, now: float) -> None:
        """The attempt ended at ``now``: count what it held (written in the open
        batch; the loop's table follows at :meth:`committed`)."""
        held = self.held(run)
        if self.ends is not None:
            self._pending_ends.append(((run.job.id, run.attempt.number), held))
        if not self.usage.enabled:
            return
        used = gib_hours(held, run.attempt.started_at, now)
        if used <= 0:
            return
        self.store.add_fair_share(run.job.owner, used, now=now, half_life_s=self.usage.half_life_s)
        self._pending.append((run.job.owner, used, now))

    def committed(self) -> None:
        for owner, used, at in self._pending:
            self.usage.add(owner, used, at)
        self._pending.clear()
        if self.ends is not None:
            self.ends.update(self._pending_ends)
            while len(self.ends) > MAX_ENDS_KEPT:  # never taken (not a leased job)
                del self.ends[next(iter(self.ends))]
        self._pending_ends.clear()

    def dropped(self) -> None:
        """The batch was not committed: its ends are drained again."""
        self._pending.clear()
        self._pending_ends.clear()


def share_report(
    store: Store, half_life_s: float, now: float, name_of: Callable[[str], str]
) -> list[dict[str, Any]]:
    """Each owner's use, jobs and standing (``gpuwarden share``, ``GET /v1/share``),
    from the store: its table decayed to ``now``; ``name_of`` names an owner id
    ("" for local) for people."""
    usage = Usage(half_life_s)
    if usage.enabled:
        usage.load(store.fair_share())
    counts = {o or "": n for o, n in store.owner_counts().items()}
    rows = share_rows(usage.table(now), counts)
    for row in rows:
        row["name"] = name_of(row["owner"])
        row["owner"] = row["owner"] or None
    return rows
