"""The VRAM ledger: per GPU, who holds how much memory. Pure, one writer.

A holding is taken when an attempt starts (its footprint), grows when the probe
measures more, turns ``reclaiming`` when the attempt ends, and is released only
once the probe shows its memory free (the reclaim gate). Releasing twice, or
holding twice under one name, is a bug and raises :class:`LedgerError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpuwarden.errors import GpuwardenError


class LedgerError(GpuwardenError):
    """The ledger was asked to do something impossible (a bug, never a user's mistake)."""


class HoldState(StrEnum):
    RUNNING = "running"  # an attempt is running
    RECLAIMING = "reclaiming"  # the attempt ended; its memory is not shown free yet
    WARM = "warm"  # a warm model server (serve launch mode)


@dataclass(frozen=True, slots=True)
class Holding:
    holder: str  # "JOB/ATTEMPT" for an attempt
    type: str
    bytes: int
    coresident: bool = False
    state: HoldState = HoldState.RUNNING
    job_id: str | None = None
    since: float = 0.0
    #: when it is expected to end (its type's run-time estimate), None if unknown
    expected_end: float | None = None
    #: the waiting job whose held-back GPU it was started on beside (co-resident)
    backfill_for: str | None = None

    def evolve(self, **changes: Any) -> Holding:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "type": self.type,
            "bytes": self.bytes,
            "coresident": self.coresident,
            "state": self.state.value,
            "job_id": self.job_id,
            "since": self.since,
            "expected_end": self.expected_end,
            "backfill_for": self.backfill_for,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Holding:
        return cls(
            holder=d["holder"],
            type=d["type"],
            bytes=int(d["bytes"]),
            coresident=bool(d["coresident"]),
            state=HoldState(d["state"]),
            job_id=d.get("job_id"),
            since=float(d.get("since", 0.0)),
            expected_end=d.get("expected_end"),
            backfill_for=d.get("backfill_for"),
        )


def parts_of(holder: str, count: int) -> tuple[str, ...]:
    """The names of an attempt's holdings on ``count`` GPUs (a multi-GPU job holds
    one on each): the holder itself, then ``HOLDER+1``, ``HOLDER+2``..."""
    return (holder, *(f"{holder}+{i}" for i in range(1, count)))


def compatible(coresident: bool, holdings: Iterable[Holding]) -> bool:
    """A newcomer shares a GPU only if it and every holder there opt in to co-residence."""
    held = list(holdings)
    return not held or (coresident and all(h.coresident for h in held))


class Ledger:
    """Holdings per GPU. Not thread-safe: owned by the broker loop (or a simulator)."""

    def __init__(self, gpus: Iterable[str] = ()) -> None:
        self._by_gpu: dict[str, dict[str, Holding]] = {g: {} for g in gpus}
        self._gpu_of: dict[str, str] = {}

    def add_gpu(self, gpu: str) -> None:
        self._by_gpu.setdefault(gpu, {})

    def hold(self, gpu: str, holding: Holding) -> None:
        if holding.holder in self._gpu_of:
            raise LedgerError(
                f"{holding.holder} already holds memory on {self._gpu_of[holding.holder]}"
            )
        if holding.bytes < 0:
            raise LedgerError(f"{holding.holder}: a holding cannot be negative")
        self._by_gpu.setdefault(gpu, {})[holding.holder] = holding
        self._gpu_of[holding.holder] = gpu

    def update(self, holder: str, **changes: Any) -> Holding:
        gpu = self._gpu_of.get(holder)
        if gpu is None:
            raise LedgerError(f"{holder} holds nothing")
        new = self._by_gpu[gpu][holder].evolve(**changes)
        self._by_gpu[gpu][holder] = new
        return new

    def release(self, holder: str) -> Holding:
        gpu = self._gpu_of.pop(holder, None)
        if gpu is None:
            raise LedgerError(f"{holder} holds nothing: released twice?")
        return self._by_gpu[gpu].pop(holder)

    def get(self, holder: str) -> Holding | None:
        gpu = self._gpu_of.get(holder)
        return None if gpu is None else self._by_gpu[gpu][holder]

    def gpu_of(self, holder: str) -> str | None:
        return self._gpu_of.get(holder)

    def holdings(self, gpu: str) -> tuple[Holding, ...]:
        return tuple(self._by_gpu.get(gpu, {}).values())

    def held_bytes(self, gpu: str) -> int:
        return sum(h.bytes for h in self._by_gpu.get(gpu, {}).values())

    def gpus(self) -> list[str]:
        return list(self._by_gpu)

    def __len__(self) -> int:
        return len(self._gpu_of)
