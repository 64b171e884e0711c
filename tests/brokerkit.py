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


def run_until(node: Node, done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Tick the broker until ``done()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out waiting for the broker"
        node.broker.tick()
        time.sleep(0.02)
