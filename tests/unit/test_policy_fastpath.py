"""The pass's shortcuts decide exactly as the straightforward pass: best fit by
bisect of the GPUs ordered by free memory (core/bestfit.py) instead of a scan of
every GPU, evictions looked for only on GPUs with a warm server (and not again
for a job no easier to make room for than one no eviction helped), the held-back
job's fit time kept until the GPU changes, a sized lineup's shelves looked at in
their owners' order of use, and wait reasons written from the GPUs' stamps
instead of a copy of every GPU per waiting job. Each is compared, on random small
inputs, with the plain version of itself (patched in): the same decisions, GPUs
and reasons, word for word."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.core import policy
from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    Evict,
    GpuView,
    QueuedJob,
    RangeWait,
    SizedLineup,
    Snapshot,
    Wait,
    WarmView,
    plan,
    plan_pass,
)
from gpuwarden.core.queueindex import NONE, QueueIndex
from gpuwarden.node.queue import Shelves
from tests.unit.test_policy_sized import NOW, snapshots


def _scan_tightest(self: Any, job: QueuedJob, among: Any) -> Any:
    """Every GPU judged, the tightest taken (the pass as it was)."""
    gpus = self.gpus if among is None else among
    fitting = [(g, how) for g in gpus if (how := policy._can_start(job, g, self.now)) is not None]
    if not fitting:
        return None
    return min(fitting, key=lambda gh: (gh[0].free - job.vram_bytes, gh[0].view.uuid))


def _scan_next(self: Any) -> Any:
    """Every shelf's first open bucket found again, every time."""
    best = None
    for i, s in enumerate(self.lu.shelves):
        leaf = self._first(i)
        if leaf is not NONE and leaf[2] >= 0 and (best is None or (s.usage, leaf) < best[:2]):
            best = (s.usage, leaf, i)
    if best is None:
        return None
    _, (seq, tie, pos), i = best
    s = self.lu.shelves[i]
    head = self.head.get((i, pos))
    job_id = s.heads[pos] if head is None else head[1]
    job = dataclasses.replace(
        self.lu.job, id=job_id, seq=seq, vram_bytes=s.sizes[pos], owner=s.owner, usage=s.usage
    )
    return (policy._rank(job), tie, self.n, job, (self.run_no, i, pos))


@contextmanager
def plain() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy._Step, "tightest", _scan_tightest)
        mp.setattr(policy._Step, "with_warm", lambda self, gpus: gpus)
        mp.setattr(
            policy._Gpu,
            "head_fits_at",
            lambda self, now: policy.head_fits_at(
                self.reserved_for, self.capacity, self.holdings, now
            ),
        )
        mp.setattr(policy._SizedRun, "next", _scan_next)
        mp.setattr(
            policy._Step,
            "evict_for",
            lambda self, job, blocked, room: policy._evict_for(job, blocked, room, self.warm),
        )
        yield


def _decisions(s: Snapshot) -> list[Any]:
    """Every decision, a wait with its reason written out."""
    return [
        (d.job_id, d.reason, d.reserved_gpu) if isinstance(d, Wait) else d for d in plan(s, NOW)
    ]


@st.composite
def varied(draw: st.DrawFn) -> Snapshot:
    """The sized lineups' snapshots, with owners' use and a pin here and there."""
    s = draw(snapshots())
    uses = {"": 0.0, "ann": draw(st.sampled_from([0.0, 2.0]))}
    jobs = tuple(
        dataclasses.replace(
            j,
            usage=uses[j.owner],
            gpu=draw(st.sampled_from(["", "", "", "", "G0", "G9"])) if j.gpus == 1 else "",
        )
        for j in s.queued
    )
    return dataclasses.replace(s, queued=jobs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=varied())
def test_the_shortcuts_decide_as_the_plain_pass(s: Snapshot) -> None:
    mine = _decisions(s)
    with plain():
        theirs = _decisions(s)
    assert mine == theirs


def _shelved(seed: int) -> tuple[list[SizedLineup], Snapshot]:
    """Sized lineups with a shelf per owner (as the loop builds them, node/queue.py)."""
    rng = random.Random(seed)
    index: QueueIndex[tuple[str, int, int, str]] = QueueIndex()
    for seq in range(rng.randint(1, 60)):
        owner = rng.choice(["a", "b", "c"])
        index.add(f"j{seq}", seq, ("cmd", rng.choice([0, 5]), rng.randint(1, 30) * GIB, owner))
    use = {"a": rng.choice([0.0, 1.0]), "b": 1.0, "c": rng.choice([0.5, 3.0])}
    shelves = Shelves(index)
    out = []
    for sized, owners in shelves.groups().items():
        proto = QueuedJob("", sized[0], Lane.VRAM, 0, sized[1], 0, coresident=True)
        shelf_list = [shelves.shelf(sized, o, use[o], int, None) for o in sorted(owners)]

        def size_of(job_id: str) -> int:
            key = index.key_of(job_id)
            return 0 if key is None else key[2]

        out.append(SizedLineup(sized, proto, shelf_list, lambda own, s=sized: (*s, own), size_of))
    gpus = tuple(
        GpuView(
            f"G{i}",
            rng.choice([16, 24, 40]) * GIB,
            holdings=tuple(
                Holding(f"h{i}{k}", "x", rng.randint(1, 12) * GIB, True, job_id=f"r{i}{k}")
                for k in range(rng.randint(0, 3))
            ),
        )
        for i in range(rng.randint(1, 4))
    )
    return out, Snapshot(queued=(), gpus=gpus, max_reservations=rng.choice([0, 1]))


def _summary(done: policy.Pass) -> list[Any]:
    waits = []
    for w in done.waits:
        if isinstance(w, RangeWait):
            waits.append((w.signature(), [r[0] for r in w.ranges]))
        else:
            waits.append((w.signature(), w.reason, w.member_reason))
    return [done.starts, done.refusals, done.evictions, waits]


@pytest.mark.parametrize("seed", range(60))
def test_shelves_in_their_owners_order_of_use(seed: int) -> None:
    lineups, snapshot = _shelved(seed)
    mine = _summary(plan_pass(lineups, snapshot, NOW))
    with plain():
        theirs = _summary(plan_pass(lineups, snapshot, NOW))
    assert mine == theirs


def test_a_reason_is_the_gpu_as_the_job_was_judged() -> None:
    """A job judged before later starts and a GPU held back for it: its reason
    names neither (the GPU is read at the job's stamp, not as the pass left it)."""
    gpus = (
        GpuView("G0", 24 * GIB, holdings=(Holding("h", "x", 10 * GIB, True, job_id="r"),)),
        GpuView("G1", 24 * GIB, holdings=(Holding("k", "x", 8 * GIB, True, job_id="q"),)),
    )
    big = QueuedJob("big", "cmd:a", Lane.VRAM, 20 * GIB, 5, 0, coresident=True)
    small = QueuedJob("small", "cmd:b", Lane.VRAM, 4 * GIB, 0, 1, coresident=True)
    by_id = {d.job_id: d for d in plan(Snapshot(queued=(big, small), gpus=gpus), NOW)}
    wait = by_id["big"]
    assert isinstance(wait, Wait) and wait.reserved_gpu == "G1"
    assert by_id["small"] == policy.Start("small", "G0")  # (tightest: G0, 14 GiB free)
    assert "small" not in wait.reason  # started after big was judged
    assert "G0 has 14.0 GiB free" in wait.reason
    assert "held back for job big" not in wait.reason
    assert "G1 is held back for it until it fits" in wait.reason


def test_member_is_replace() -> None:
    """The pass's copy of a class's job for one member is ``dataclasses.replace``."""
    proto = QueuedJob(
        "p", "t", Lane.VRAM, 3, 4, 5, True, True, 6.0, True, "rt", "m", "o", 7.0, 2, gpu="G"
    )
    made = policy._member(proto, "j", 9, vram_bytes=11, owner="x", usage=1.5)
    assert made == dataclasses.replace(proto, id="j", seq=9, vram_bytes=11, owner="x", usage=1.5)


def test_an_eviction_that_failed_for_a_bigger_job_is_still_tried_for_a_smaller_one() -> None:
    """The pass remembers a job no eviction made room for and skips the search for a
    job no easier to place, never for an easier one: here the first (20 GiB, ahead
    by priority) cannot fit beside the running 12 GiB even with the idle server
    gone; the second (6 GiB) can, once the server goes."""
    warm = Holding("warm:m:1", "m", 8 * GIB, True, HoldState.WARM)
    running = Holding("run/1", "x", 12 * GIB, True, job_id="run")
    snap = Snapshot(
        queued=(
            QueuedJob("big", "b", Lane.VRAM, 20 * GIB, 5, 0, coresident=True),
            QueuedJob("small", "s", Lane.VRAM, 6 * GIB, 0, 1, coresident=True),
        ),
        gpus=(GpuView("G0", 24 * GIB, holdings=(warm, running)),),
        warm=(WarmView("m", "G0", "warm:m:1", busy=False, idle_since=0.0, idle_grace_s=1e9),),
        max_reservations=0,
    )
    decisions = plan(snap, NOW)
    assert [d for d in decisions if isinstance(d, Evict)] == [
        Evict("warm:m:1", "m", "G0", "its memory is needed by job small (6.0 GiB)")
    ], decisions
    with plain():
        assert _decisions(snap) == [
            (d.job_id, d.reason, d.reserved_gpu) if isinstance(d, Wait) else d for d in decisions
        ]
