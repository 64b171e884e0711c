"""The queue a coordinator offers from, in fair-share order, read a page at a time.

Queued jobs are offered highest priority first, then the job whose owner used
least (each owner's decayed VRAM GiB-hours, :mod:`gpuwarden.core.fairshare`), then
in arrival order: :func:`gpuwarden.core.fairshare.claim_rank`. An owner's use is
one number for all its jobs, so each owner's own jobs keep the store's
(priority, arrival) order; :class:`ClaimQueue` reads each owner's claimable jobs
in that order (``ClusterStore.claimable_jobs_of``, an index range per owner) and
merges the owners by rank, refilling an owner only when the merge has used up
what was read of it. A page costs what it returns plus a small read per owner
with queued jobs, whatever the queue's length.

When the owners of queued jobs have all used the same (no one has used anything,
fair share is off, or one owner has the whole queue), the order is the plain
(priority, arrival) order: read in one range (``ClusterStore.claimable_jobs``),
as before fair share.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from gpuwarden.core.fairshare import Usage, claim_rank, gib_hours, why_behind
from gpuwarden.core.model import Job
from gpuwarden.store.cluster import Claimable, ClusterStore

#: the fewest jobs read of one owner at a time
MIN_CHUNK = 16


class ClaimQueue:
    """The claimable jobs in offer order (:meth:`take` the next ones). ``use``:
    each owner's use now (owner ``""`` is local; an owner not in it used nothing)."""

    def __init__(self, store: ClusterStore, *, now: float, use: Mapping[str, float]) -> None:
        self.store = store
        self.now = now
        self.use = dict(use)
        self._owners: list[str] | None = None
        if any(v > 0 for v in self.use.values()):
            owners = store.queued_owners()
            if len({self.usage(o) for o in owners}) > 1:
                self._owners = owners
        self._after: tuple[int, int] | None = None
        self._done = False
        # the merge: what was read of each owner and not taken yet, and the heads
        self._buffers: dict[str, list[Claimable]] = {}
        self._next: dict[str, int] = {}
        self._more: dict[str, bool] = {}
        self._heap: list[tuple[tuple[int, float, int], str]] = []
        self._started = False

    def usage(self, owner: str | None) -> float:
        """The owner's use, as the order counts it."""
        return self.use.get(owner or "", 0.0)

    @property
    def merged(self) -> bool:
        """Whether owners are merged by their use (False: plain arrival order)."""
        return self._owners is not None

    def take(self, n: int) -> list[Claimable]:
        """The next ``n`` claimable jobs in offer order (fewer: the queue ends)."""
        if n <= 0 or self._done:
            return []
        if self._owners is None:
            found = self.store.claimable_jobs(now=self.now, limit=n, after=self._after)
            if len(found) < n:
                self._done = True
            if found:
                self._after = (found[-1].priority, found[-1].seq)
            return found
        if not self._started:
            self._start(max(MIN_CHUNK, -(-n // max(1, len(self._owners)))))
        out: list[Claimable] = []
        while len(out) < n and self._heap:
            _, owner = heapq.heappop(self._heap)
            out.append(self._pop(owner))
        if not self._heap:
            self._done = True
        return out

    def _start(self, chunk: int) -> None:
        self._started = True
        for owner in self._owners or ():
            self._fill(owner, chunk, after=None)

    def _fill(self, owner: str, chunk: int, after: tuple[int, int] | None) -> None:
        found = self.store.claimable_jobs_of(owner, now=self.now, limit=chunk, after=after)
        self._buffers[owner] = found
        self._next[owner] = 0
        self._more[owner] = len(found) >= chunk
        if found:
            self._push(owner, found[0])

    def _push(self, owner: str, head: Claimable) -> None:
        heapq.heappush(self._heap, (claim_rank(head.priority, self.usage(owner), head.seq), owner))

    def _pop(self, owner: str) -> Claimable:
        buf = self._buffers[owner]
        i = self._next[owner]
        job = buf[i]
        self._next[owner] = i + 1
        if i + 1 < len(buf):
            self._push(owner, buf[i + 1])
        elif self._more[owner]:  # read the owner's next jobs, twice as many
            self._fill(owner, 2 * len(buf), after=(job.priority, job.seq))
        return job


def owners_use(
    store: ClusterStore,
    now: float,
    half_life_s: float,
    held_of: Callable[[str, int | None, int | None], int] | None = None,
) -> dict[str, float]:
    """Each owner's fair-share use at ``now``: the coordinator's table (what the
    nodes reported of ended attempts) decayed to ``now``, and, with ``held_of``
    (a running job's type, declared VRAM and own ``gpus`` to the bytes it
    holds: its footprint on each of its GPUs), what each running job has held so
    far; empty when fair share is off."""
    usage = Usage(half_life_s)
    if not usage.enabled:
        return {}
    usage.load(store.fair_share())
    use = usage.table(now)
    if held_of is not None:
        for run in store.running_attempts():
            held = held_of(run.type, run.vram_bytes, run.gpus)
            so_far = gib_hours(held, run.started_at, now)
            if so_far > 0:
                owner = run.owner or ""
                use[owner] = use.get(owner, 0.0) + so_far
    return use


def fair_share_wait(
    store: ClusterStore, job: Job | Claimable, *, now: float, use: Mapping[str, float]
) -> str | None:
    """Why a claimable ``job`` is offered after another owner's job of the same
    priority (fair share: that owner used less), naming the owner who used least
    of those with such a job not leased yet; None when fair share is not why."""
    mine = job.owner or ""
    others = []
    for owner in store.queued_owners():
        if owner == mine:
            continue
        first = store.claimable_jobs_of(owner, now=now, limit=1, after=(job.priority, -1))
        if first and first[0].priority == job.priority:
            others.append(owner)
    if not others:
        return None
    least = min(others, key=lambda o: (use.get(o, 0.0), o))
    return why_behind(mine, use.get(mine, 0.0), least, use.get(least, 0.0))
