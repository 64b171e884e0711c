"""A coordinator whose store was unreachable gives every lease a full period once
it is back, as after its start: the agents' renewals and end reports were
answered 503 meanwhile, so no lease is swept for the coordinator's own outage."""

from __future__ import annotations

from typing import Any

from gpuwarden.cluster.sweeper import Sweeper
from gpuwarden.config import ClusterSettings


class Gone(Exception):
    """The store cannot be reached (what ``unavailable`` says yes to)."""


class Leases:
    """What the sweeper asks of the store, with a switch that cuts it."""

    def __init__(self) -> None:
        self.down = False
        #: every expiry ``extend_leases`` was asked for, in order
        self.extended: list[float] = []
        #: how many sweeps reached the store's leases
        self.swept = 0

    def _reach(self) -> None:
        if self.down:
            raise Gone("connection refused")

    def unavailable(self, exc: BaseException) -> bool:
        return isinstance(exc, Gone)

    def extend_leases(self, expires_at: float) -> int:
        self._reach()
        self.extended.append(expires_at)
        return 1

    def try_maintenance_lock(self) -> bool:
        self._reach()
        return True

    def expired_leases(self, now: float) -> list[Any]:
        self._reach()
        self.swept += 1
        return []

    def list_nodes(self) -> list[Any]:
        return []

    def queued_cancel_requests(self, now: float) -> list[str]:
        return []

    def drop_stopped_routes(self, before: float) -> int:
        return 0


def test_a_store_that_comes_back_gives_every_lease_a_full_period_first() -> None:
    store = Leases()
    now = [1000.0]
    settings = ClusterSettings(lease_s=30, fence_grace_s=10)
    sweeper = Sweeper(store, None, settings, clock=lambda: now[0])  # type: ignore[arg-type]
    sweeper.tick()
    assert store.extended == [1040.0] and store.swept == 1  # the start's full period
    now[0] = 1005.0
    sweeper.tick()
    assert store.extended == [1040.0] and store.swept == 2  # a plain sweep: no more
    store.down = True
    now[0] = 1010.0
    sweeper.tick()  # logged, not raised
    assert store.swept == 2 and sweeper.started_at is None  # the outage is seen
    now[0] = 1100.0  # every lease lapsed by the clock while the store was away
    sweeper.tick()
    assert store.swept == 2  # still away: nothing swept, no period given yet
    store.down = False
    now[0] = 1200.0
    sweeper.tick()
    # back: each lease gets a full period from now before the sweep may end one
    assert store.extended == [1040.0, 1240.0] and store.swept == 3
    assert sweeper.started_at == 1200.0


def test_a_failure_that_is_not_the_store_being_away_gives_no_period() -> None:
    """A bug in a sweep must not keep every lease alive for ever."""
    store = Leases()
    sweeper = Sweeper(store, None, ClusterSettings(), clock=lambda: 1000.0)  # type: ignore[arg-type]
    sweeper.tick()
    store.expired_leases = lambda now: 1 / 0  # type: ignore[assignment,method-assign,misc]
    sweeper.tick()
    assert sweeper.started_at == 1000.0 and len(store.extended) == 1
