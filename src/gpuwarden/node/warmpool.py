"""The warm servers of one node: which type's model is loaded where, and in what
state. Owned by the broker loop; worker threads only drive the processes.

A server's life: ``loading`` (its first job waits for it) -> ``busy`` (a job
runs on it) <-> ``idle`` -> ``stopping`` (evicted, or it failed) -> gone. While it
exists its memory is a ``warm`` holding in the VRAM ledger; once its process is
confirmed gone the holding goes through the reclaim gate like an attempt's.

The data only (a server and its state, the pool of them); driving them is
:mod:`gpuwarden.node.warm`'s. It stays apart so that a running attempt
(:mod:`gpuwarden.node.running`) can name its server without importing what
drives it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from gpuwarden.core.model import JobType
from gpuwarden.core.policy import WarmView
from gpuwarden.launch.warmproc import WarmProcess
from gpuwarden.node.status import WarmStatus


class ServerState(StrEnum):
    LOADING = "loading"
    BUSY = "busy"
    IDLE = "idle"
    STOPPING = "stopping"


@dataclass
class WarmServer:
    type: JobType
    gpu: str
    epoch: int
    worker: WarmProcess
    footprint: int
    idle_grace_s: float
    state: ServerState = ServerState.LOADING
    started_at: float = 0.0
    load_s: float | None = None
    pid: int | None = None
    idle_since: float | None = None
    jobs_served: int = 0
    priority: int = 0
    stop_reason: str = ""
    #: a record for the next broker is on disk (:mod:`gpuwarden.node.warmrecord`)
    kept: bool = False

    @property
    def holder(self) -> str:
        """Its name in the VRAM ledger."""
        return f"warm:{self.type.name}:{self.epoch}"

    def job_done(self, now: float) -> None:
        """Its job ended and it goes on serving: idle from ``now``."""
        self.state = ServerState.IDLE
        self.idle_since = now
        self.jobs_served += 1

    def view(self) -> WarmView:
        return WarmView(
            type=self.type.name,
            gpu_uuid=self.gpu,
            holder=self.holder,
            busy=self.state is not ServerState.IDLE,
            idle_since=self.idle_since if self.state is ServerState.IDLE else None,
            keep_warm=self.type.keep_warm,
            load_s=self.load_s or 0.0,
            idle_grace_s=self.idle_grace_s,
            priority=self.priority,
            stopping=self.state is ServerState.STOPPING,
        )

    def status(self, now: float) -> WarmStatus:
        idle_since = self.idle_since if self.state is ServerState.IDLE else None
        return WarmStatus(
            type=self.type.name,
            gpu=self.gpu,
            epoch=self.epoch,
            state=self.state.value,
            footprint_bytes=self.footprint,
            jobs_served=self.jobs_served,
            load_s=self.load_s,
            idle_s=round(now - idle_since, 1) if idle_since is not None else None,
            pid=self.pid,
            keep_warm=self.type.keep_warm,
        )


class WarmPool:
    """At most one server per job type on a node."""

    def __init__(self) -> None:
        self.by_type: dict[str, WarmServer] = {}
        # epochs only grow, across restarts too: a report from any earlier worker
        # (of this run or the last) carries an epoch no current server has. They
        # are names, not times: they start from the host's wall clock, never from
        # the loop's clock, which a test may set back or hold still
        self._epochs = itertools.count(time.time_ns() // 1_000_000)
        self._floor = 0

    def next_epoch(self) -> int:
        epoch = next(self._epochs)
        if epoch <= self._floor:  # an adopted server's epoch (a clock set back)
            self._epochs = itertools.count(self._floor + 1)
            epoch = next(self._epochs)
        return epoch

    def taken(self, epoch: int) -> None:
        """An adopted server has ``epoch``: no new server gets it, or one below."""
        self._floor = max(self._floor, epoch)

    def add(self, server: WarmServer) -> None:
        if server.type.name in self.by_type:
            raise ValueError(f"{server.type.name} already has a warm server")
        self.by_type[server.type.name] = server

    def get(self, type_name: str, epoch: int | None = None) -> WarmServer | None:
        server = self.by_type.get(type_name)
        if server is None or (epoch is not None and server.epoch != epoch):
            return None
        return server

    def remove(self, server: WarmServer) -> None:
        if self.by_type.get(server.type.name) is server:
            del self.by_type[server.type.name]

    def views(self) -> tuple[WarmView, ...]:
        return tuple(s.view() for s in self.by_type.values())

    def __iter__(self) -> Iterator[WarmServer]:
        return iter(list(self.by_type.values()))

    def __len__(self) -> int:
        return len(self.by_type)
