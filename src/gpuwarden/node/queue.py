"""The node's queue as its loop keeps it between ticks.

The loop does not read every queued job from the store on every tick (a queue of
100,000 jobs would cost more than the rest of the tick together). It keeps a
:class:`gpuwarden.core.queueindex.QueueIndex` of the queued jobs, keyed by class
``(type, priority, per-job footprint, declared run time, GPUs, RAM, owner)``, loaded once at
start and then followed through the store's events: every change of a job's state is
an event written in the same transaction, so the events after the cursor name
exactly the jobs that entered or left ``queued`` (a submission from the CLI, the API
or an agent's sync, a retry, a cancel), or were released when their dependencies
came to hold (``dependencies_held``: a job held for them is queued but never
indexed, so the plan never looks at it), or a person held, released or
reprioritised them (``held``, ``released``, ``priority_changed``). Those jobs are
read again, and only they.

Where event ids could become visible out of order (PostgreSQL sequences commit
in any order), a cheap count of the store's queued jobs is compared with the
index every few seconds and a difference reloads it, with a line in the log.
A job is read in full only when it starts.
"""

from __future__ import annotations

import gc
import heapq
import logging
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any, Generic, TypeVar, cast

from gpuwarden.core.policy import Member, Shelf
from gpuwarden.core.profile import est_class
from gpuwarden.core.queueindex import MinTree, QueueIndex
from gpuwarden.core.ramadmit import RamNeed
from gpuwarden.core.sources import split_type
from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError
from gpuwarden.registry import Registry
from gpuwarden.store.base import QueueEntry, Store

log = logging.getLogger("gpuwarden.node.loop")

#: events read per store call while catching up, and at most per tick
_EVENT_BATCH = 5000
_EVENTS_PER_TICK = 50_000
#: how often the index's size is checked against the store's count
_CHECK_EVERY_S = 5.0
#: ids per ``queue_entries`` call
_ID_BATCH = 900
#: events of a queued job that change whether or how it is planned, though it stays
#: queued: its dependencies came to hold; a person held or released it, or set its
#: priority (SPEC.md section 1, "Job control")
_REREAD = frozenset({"dependencies_held", "held", "released", "priority_changed"})

#: a class of the index: job type, priority, the job's own footprint (or None), and
#: the run time it declared as the planner rounds it (``core.profile.est_class``;
#: None for a job that declares none, as most do: their classes are not split), the
#: GPUs it asked for itself (None: its type's count), what it asks of the host's RAM
#: (``core.ramadmit.RamNeed``; nothing, for most jobs), the one GPU it is pinned to
#: ("" for most; its ``gpu`` constraint), and its owner ("" for local,
#: always last): fair share orders owners apart (``core.fairshare``)
ClassKey = tuple[str, int, int | None, float | None, int | None, RamNeed, str, str]
#: a class as the plan sees it: the index's classes but for their owner. The jobs
#: of one need the same, whoever owns them, so a pass decides for each such class
#: once; its owners' jobs are merged in queue order (:meth:`QueueBook.members`)
PlanKey = tuple[str, int, int | None, float | None, int | None, RamNeed, str]
#: a lineup of the plan (:class:`gpuwarden.core.policy.SizedLineup`): the plan's
#: classes but for the job's own footprint (command jobs each give their own), so
#: a pass over 100,000 of them, each its own size, looks at a few lineups, not at
#: thousands of classes
SizedKey = tuple[str, int, float | None, int | None, RamNeed, str]


class QueueBook:
    """The queued jobs of this node, by class, kept in step with the store."""

    def __init__(self, store: Store, registry: Registry, clock: Callable[[], float]) -> None:
        self.store = store
        self.registry = registry
        self.clock = clock
        self.index: QueueIndex[ClassKey] = QueueIndex()
        self.shelves: Shelves[ClassKey] = Shelves(self.index)
        self._cursor = 0
        self._checked_at = float("-inf")
        self._loaded = False

    def __len__(self) -> int:
        return len(self.index)

    def refresh(self, now: float) -> bool:
        """Take in what changed since the last call. True if the queue changed."""
        if not self._loaded:
            self.reload(now)
            return True
        changed = self._follow(now)
        if now - self._checked_at >= _CHECK_EVERY_S:
            self._checked_at = now
            queued = self.store.queued_count()
            if queued != len(self.index):
                log.info(
                    "the queue index holds %d jobs, the store %d queued: reloading it",
                    len(self.index),
                    queued,
                )
                self.reload(now)
                changed = True
        return changed

    def reload(self, now: float) -> None:
        """Read every queued job again (at start, and when the count disagrees)."""
        cursor = self.store.last_event_id()  # first: what happens meanwhile is replayed
        self.index.clear()
        self._take(self.store.queue_entries(), now)
        self._cursor = max(self._cursor, cursor)
        self._checked_at = now
        if not self._loaded:
            settle_memory()  # once, at the broker's start: what it read lives on
        self._loaded = True

    def _follow(self, now: float) -> bool:
        touched: set[str] = set()
        read = 0
        while read < _EVENTS_PER_TICK:
            batch = self.store.events(after_id=self._cursor, limit=_EVENT_BATCH)
            if not batch:
                break
            read += len(batch)
            self._cursor = batch[-1].id or self._cursor
            touched.update(
                e.job_id
                for e in batch
                if e.job_id is not None
                and ("queued" in (e.to_state, e.from_state) or e.kind in _REREAD)
            )
            if len(batch) < _EVENT_BATCH:
                break
        if not touched:
            return False
        for job_id in touched:
            self.index.remove(job_id)
        ids = sorted(touched)
        for i in range(0, len(ids), _ID_BATCH):
            self._take(self.store.queue_entries(ids[i : i + _ID_BATCH]), now)
        return True

    def _take(self, entries: Iterable[QueueEntry], now: float) -> None:
        """Index queued jobs; end at once those that must never run."""
        for e in entries:
            if e.cancel_requested:  # asked while it ran; it must never run again
                self.store.transition(
                    e.id, JobState.CANCELLED, now=now, reason="cancelled before it ran again"
                )
            elif (missing := self._unknown(e)) is not None:
                self.store.transition(e.id, JobState.FAILED, now=now, reason=missing)
            else:
                key = (
                    e.type,
                    e.priority,
                    e.vram_bytes,
                    est_class(e.est_s),
                    e.gpus,
                    e.ram,
                    e.gpu,  # a job pinned to one GPU (``lease --gpu``) is a class apart
                    e.owner or "",
                )
                self.index.add(e.id, e.seq, key)

    def _unknown(self, e: QueueEntry) -> str | None:
        """Why the job's type is not known here; None when it is. A type from a
        commit that another process fetched (the CLI, the API) or that the broker
        knew before a restart is read from the source cache now."""
        if e.type in self.registry.types:
            return None
        name, commit = split_type(e.type)
        job = self.store.get_job(e.id) if commit is not None else None
        if job is None or job.source is None:
            return f"job type {e.type} is not known to this broker (module removed?)"
        try:
            self.registry.from_source(job.source, name)
        except ValidationError as exc:
            return f"job type {e.type}: {exc}"
        return None

    def classes(self) -> list[ClassKey]:
        return self.index.classes()

    def by_type(self) -> dict[str, int]:
        """How many jobs of each type are queued (the metrics' queue depth)."""
        out: dict[str, int] = {}
        for key in self.index.classes():
            out[key[0]] = out.get(key[0], 0) + self.index.size(key)
        return out

    def groups(self) -> dict[PlanKey, list[ClassKey]]:
        """The index's classes by the plan's class (the same but for the owner)."""
        out: dict[PlanKey, list[ClassKey]] = {}
        for key in self.index.classes():
            out.setdefault(key[:-1], []).append(key)
        return out

    def head(
        self, keys: list[ClassKey], use: Mapping[str, float]
    ) -> tuple[ClassKey, tuple[int, str]] | None:
        return owners_head(self.index, keys, use)

    def members(self, keys: list[ClassKey], use: Mapping[str, float]) -> Iterator[Member]:
        return owners_members(self.index, keys, use)

    def first(
        self, order: Iterable[Hashable], limit: int, use: Mapping[str, float]
    ) -> list[tuple[Hashable, str]]:
        """Up to ``limit`` queued jobs, plan class by class in ``order``: ``(class, id)``.
        A sized lineup's key (:data:`SizedKey`) stands for its classes not in ``order``."""
        groups = self.groups()
        decided = set(order)
        out: list[tuple[Hashable, str]] = []
        for key in order:
            if key in groups:
                keys = groups[key]
            else:  # a sized lineup: its classes that no pass looked at
                plan_keys = self.shelves.plan_keys(cast(SizedKey, key))
                keys = [k for pk in plan_keys if pk not in decided for k in groups.get(pk, [])]
            for member in self.members(keys, use):
                if len(out) >= limit:
                    return out
                out.append((key, member[1]))
        return out


#: an index's class whose last field is its owner
OK = TypeVar("OK", bound=tuple[Any, ...])


def owners_head(
    index: QueueIndex[OK], keys: list[OK], use: Mapping[str, float]
) -> tuple[OK, tuple[int, str]] | None:
    """The first job of these classes (the same but for their owner, the key's last
    field) in queue order: its owner's use (fair share), then arrival."""
    best: tuple[float, int, OK, tuple[int, str]] | None = None
    for key in keys:
        head = index.head(key)
        if head is not None and (best is None or (use.get(key[-1], 0.0), head[0]) < best[:2]):
            best = (use.get(key[-1], 0.0), head[0], key, head)
    return None if best is None else (best[2], best[3])


def owners_members(
    index: QueueIndex[OK], keys: list[OK], use: Mapping[str, float]
) -> Iterator[Member]:
    """The jobs of these classes, lazily, in queue order: the owner who used least
    first, arrival order within an owner. One owner: ``(seq, id)``; several:
    ``(seq, id, owner, use)`` (the plan ranks each by its owner's use)."""
    if len(keys) <= 1:
        yield from (index.members(keys[0]) if keys else ())
        return
    # an owner's use is the same for all its jobs: the owners one after the other,
    # least use first, merged by arrival only where their use is the same (lazily:
    # an owner's jobs are walked only once the pass gets to them)
    by_use: dict[float, list[OK]] = {}
    for k in keys:
        by_use.setdefault(use.get(k[-1], 0.0), []).append(k)
    for used in sorted(by_use):
        tied = by_use[used]
        streams = [((seq, job_id, str(k[-1])) for seq, job_id in index.members(k)) for k in tied]
        for seq, job_id, owner in streams[0] if len(streams) == 1 else heapq.merge(*streams):
            yield (seq, job_id, owner, used)


class Shelves(Generic[OK]):
    """The index's classes grouped for sized lineups, kept between passes: for each
    plan class but for the footprint (the key less its third field, the job's own
    footprint, and its last, the owner), each owner's classes by footprint, and
    their :class:`gpuwarden.core.policy.Shelf`, built again only when a class of
    it changed (or its sizes did)."""

    def __init__(self, index: QueueIndex[OK]) -> None:
        self.index = index
        self._groups: dict[Any, dict[str, dict[Any, OK]]] = {}
        self._built: dict[tuple[Any, str], tuple[Any, Shelf]] = {}

    def groups(self) -> dict[Any, dict[str, dict[Any, OK]]]:
        """The lineups: sized key -> owner -> own footprint -> the index's class."""
        for key in self.index.take_touched():
            sized, owner = key[:2] + key[3:-1], key[-1]
            classes = self._groups.setdefault(sized, {}).setdefault(owner, {})
            head = self.index.head(key)
            if head is not None:
                if key[2] not in classes:
                    self._built.pop((sized, owner), None)  # a new size: built again
                classes[key[2]] = key
                self._new_head(sized, owner, key[2], head)
                continue
            self._built.pop((sized, owner), None)
            classes.pop(key[2], None)
            if not classes:
                del self._groups[sized][owner]
                if not self._groups[sized]:
                    del self._groups[sized]
        return self._groups

    def _new_head(self, sized: Any, owner: str, ident: Any, head: tuple[int, str]) -> None:
        """A class's head changed (a job came or went): its shelf's leaf follows."""
        built = self._built.get((sized, owner))
        if built is not None:
            shelf = built[1]
            pos = shelf.pos_of[ident]
            shelf.heads[pos] = head[1]
            shelf.tree.set(pos, (head[0], 0, pos))

    def plan_keys(self, sized: Any) -> list[Any]:
        """The plan classes (the key less its owner) of a sized lineup."""
        idents = {i for by in self.groups().get(sized, {}).values() for i in by}
        return [(*sized[:2], i, *sized[2:]) for i in idents]

    def shelf(
        self, sized: Any, owner: str, usage: float, size: Callable[[Any], int], stamp: Any
    ) -> Shelf:
        """One owner's shelf of a sized lineup; ``size`` gives a class's footprint
        (``stamp`` changes when it does: a measurement raised it)."""
        groups = self.groups()  # first: what changed in the index
        built = self._built.get((sized, owner))
        if built is None or built[0] != stamp:
            classes = groups[sized][owner]
            idents = sorted(classes, key=lambda i: (size(i), i is None, i or 0))
            keys = [classes[i] for i in idents]
            heads = [self.index.head(k) or (0, "") for k in keys]
            shelf = Shelf(
                owner=owner,
                usage=0.0,
                sizes=[size(i) for i in idents],
                idents=list(idents),
                heads=[h[1] for h in heads],
                tree=MinTree([(h[0], 0, pos) for pos, h in enumerate(heads)]),
                pos_of={i: pos for pos, i in enumerate(idents)},
                members=lambda pos, keys=keys: self.index.members(keys[pos]),  # type: ignore[misc]
            )
            built = self._built[(sized, owner)] = (stamp, shelf)
        if built[1].usage != usage:  # kept with the owner's use, as long as it lasts
            built = self._built[(sized, owner)] = (stamp, replace(built[1], usage=usage))
        return built[1]


def settle_memory() -> None:
    """Once the broker has started and read its queue in (100,000 jobs are some
    10^6 objects that live as long as their jobs queue): move everything alive now
    out of the garbage collector's view (``gc.freeze``), so that its full
    collections, which a planning pass's short-lived objects set off now and then,
    do not walk them again each time (they made a pass's p99 ten times its p50).
    Frozen objects are still freed by reference counting when they go; a cycle
    among them is never collected, which is why this happens once, at the start,
    when what is alive is the broker's own lasting state."""
    gc.freeze()
