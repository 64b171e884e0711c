"""Preemption at a safe point: which running jobs yield to a waiting one. Pure.

A job type may declare ``preemptible = true`` (SPEC.md sections 6 and 11). When
a waiting job cannot start, and on some GPU it would fit were the holdings of
preemptible jobs of lower priority gone, those jobs are asked to checkpoint:
the broker sends each its ``checkpoint_signal``, and the job saves its state
and exits with :data:`CHECKPOINT_EXIT` ("checkpointed, resume later"). The
rule, :func:`choose`:

- only a :class:`Victim` may be chosen (the broker lists only attempts of
  preemptible types): any other holding stays where it is, always;
- a victim's priority is lower than the waiting job's, it has run at least its
  ``min_run_s``, and it is not being preempted already;
- the fewest victims that make room, then the cheapest: the lowest priorities,
  then the youngest runs (the least work lost should one ignore the signal);
- where victims already asked for this job leave room enough, nothing more is
  asked: the job waits for them (its GPU held back for it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gpuwarden.core.ledger import Holding, compatible

#: the exit code of a job that saved its state on the checkpoint signal
CHECKPOINT_EXIT = 6
#: the signals a type may name as its ``checkpoint_signal``
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGWINCH")
DEFAULT_SIGNAL: Final = "SIGUSR1"
DEFAULT_GRACE_S = 60.0
DEFAULT_MIN_RUN_S = 300.0
#: the most victims considered on one GPU (the search is over their subsets)
MAX_CANDIDATES = 8


@dataclass(frozen=True, slots=True)
class Victim:
    """A running attempt of a preemptible type, as the plan sees it."""

    job_id: str
    holder: str  # its name in the ledger
    gpu_uuid: str
    priority: int
    since: float  # when its attempt started
    min_run_s: float = DEFAULT_MIN_RUN_S
    signal: str = DEFAULT_SIGNAL
    grace_s: float = DEFAULT_GRACE_S
    #: the waiting job it was asked to checkpoint for, or None
    preempting_for: str | None = None
    #: what it holds on its GPU (an agent reports it; the node's plan reads its ledger)
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask the running job ``job_id`` to checkpoint and exit, for ``for_job``."""

    job_id: str
    for_job: str
    gpu_uuid: str
    signal: str
    grace_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a waiting job makes room: the GPU, the victims to ask now, and those
    already asked for it that it waits for."""

    gpu_uuid: str
    victims: tuple[Victim, ...]
    pending: tuple[Victim, ...] = ()


@dataclass(frozen=True, slots=True)
class Need:
    """What the waiting job needs of one GPU."""

    job_id: str
    bytes: int
    coresident: bool
    priority: int


def eligible(v: Victim, priority: int, now: float) -> bool:
    """May ``v`` be asked to checkpoint for a job of ``priority`` now?"""
    return v.preempting_for is None and priority > v.priority and now - v.since >= v.min_run_s


def fits(need: Need, capacity: int, holdings: Iterable[Holding]) -> bool:
    left = list(holdings)
    return compatible(need.coresident, left) and need.bytes + sum(h.bytes for h in left) <= capacity


def _cost(victims: Sequence[Victim]) -> tuple[int, int, float, tuple[str, ...]]:
    return (
        len(victims),
        sum(v.priority for v in victims),
        -sum(v.since for v in victims),
        tuple(sorted(v.job_id for v in victims)),
    )


def on_gpu(
    need: Need, gpu: tuple[str, int, Sequence[Holding]], victims: Iterable[Victim], now: float
) -> Choice | None:
    """The cheapest way to make room for ``need`` on one GPU (its uuid, capacity and
    holdings), or None."""
    uuid, capacity, holdings = gpu
    here = [v for v in victims if v.gpu_uuid == uuid]
    pending = tuple(v for v in here if v.preempting_for == need.job_id)
    gone = {v.holder for v in pending}
    base = [h for h in holdings if h.holder not in gone]
    if pending and fits(need, capacity, base):
        return Choice(uuid, (), pending)
    candidates = sorted(
        (v for v in here if eligible(v, need.priority, now)), key=lambda v: _cost([v])
    )[:MAX_CANDIDATES]
    for k in range(1, len(candidates) + 1):
        found = [
            combo
            for combo in itertools.combinations(candidates, k)
            if fits(need, capacity, [h for h in base if h.holder not in {v.holder for v in combo}])
        ]
        if found:
            return Choice(uuid, min(found, key=_cost), pending)
    return None


def choose(
    need: Need,
    gpus: Iterable[tuple[str, int, Sequence[Holding]]],
    victims: Sequence[Victim],
    now: float,
) -> Choice | None:
    """Over ``(uuid, capacity, holdings)`` of the GPUs the job may use: the GPU
    where it waits for victims already asked, else where the fewest and cheapest
    new victims make room (ties by UUID). None: no preemption makes room."""
    choices = [c for g in gpus if (c := on_gpu(need, g, victims, now)) is not None]
    if not choices:
        return None
    return min(choices, key=lambda c: (*_cost(c.victims), c.gpu_uuid))


def preempts(choice: Choice, for_job: str) -> list[Preempt]:
    """The decisions that carry out ``choice``."""
    return [
        Preempt(
            v.job_id,
            for_job,
            v.gpu_uuid,
            v.signal,
            v.grace_s,
            f"job {for_job}, of higher priority, needs its memory on {v.gpu_uuid}",
        )
        for v in choice.victims
    ]


def describe(choice: Choice, for_job: str) -> str:
    """What the waiting job's reason says of it: ``preempting X for Y``."""
    names = ", ".join(v.job_id for v in (*choice.pending, *choice.victims))
    return f"Preempting {names} for {for_job} on {choice.gpu_uuid} (held back for it meanwhile)"
