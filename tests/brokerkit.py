"""Helpers for tests that drive a broker in-process, tick by tick."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpuwarden.app import Node
from gpuwarden.core.model import JobSpec
from gpuwarden.intake.jobs import prepare


def submit(node: Node, *specs: JobSpec) -> None:
    """Submit straight into the store, validated the way every intake path does."""
    node.store.submit([prepare(node.broker.registry, s) for s in specs], now=time.time())


def run_until(node: Node, done: Callable[[], bool], timeout: float = 60.0) -> None:
    """Tick the broker until ``done()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for the broker\n{_story(node)}"
        node.broker.tick()
        time.sleep(0.02)


def _story(node: Node) -> str:
    """What the store says happened: each job's state and reason, then the last
    events, so a timeout shows whether a job failed, waited or never started."""
    jobs = [f"  {j.id}: {j.state.value} {j.reason!r}" for j in node.store.list_jobs(limit=20)]
    last = node.store.last_event_id()
    events = [
        f"  {e.ts:.2f} {e.kind} {e.job_id or ''} {e.detail}"
        for e in node.store.events(after_id=max(0, last - 30))
    ]
    return "\n".join(["jobs:", *jobs, "last events:", *events])
