"""Acceptance: host RAM with a real ``gpuwarden serve`` and real job processes
(SPEC.md section 11, "Host RAM"): a job past its ``ram_gib`` is killed by the
kernel in its own memory cgroup, whose limit the test reads while the job runs,
and the result says so; a job under its cap ends done; a job whose
``ram_start_min_gib`` MemAvailable does not hold waits, and ``explain`` says why."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.launch.memcaps import find_memory_cgroups, why_no_memory_cgroups
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_admission import state_of, submit
from tests.acceptance.test_cli import Broker, run, wait_for, write_config

REQUIRE = "1" in (
    os.environ.get("GPUWARDEN_REQUIRE_MEMCAPS"),
    os.environ.get("GPUWARDEN_REQUIRE_CONTAINERS"),
)
MIB = 1 << 20


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


@pytest.fixture
def memory_cgroups() -> None:
    if find_memory_cgroups() is None:
        why = why_no_memory_cgroups()
        if REQUIRE:
            pytest.fail(f"memory caps are required here (CI) but cannot be enforced: {why}")
        pytest.skip(f"memory caps cannot be enforced on this host: {why}")


def _attempt_out(b: Broker, job: str, n: int = 1) -> Path:
    return b.config.parent / "state" / "jobs" / job / f"attempt-{n}" / "out"


def _memory_cgroup(cgroup_file: Path) -> Path:
    """The memory cgroup the job's /proc/self/cgroup names, under its mount."""
    cgroups = find_memory_cgroups()
    assert cgroups is not None
    for line in cgroup_file.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (cgroups.version == 1 and "memory" in controllers.split(",")) or (
            cgroups.version == 2 and controllers == ""
        ):
            return cgroups.root / path.lstrip("/")
    raise AssertionError(f"no memory cgroup in {cgroup_file.read_text()!r}")


def _attempts(b: Broker, job: str) -> list[tuple[str | None, str]]:
    store = SqliteStore(b.config.parent / "state" / "gpuwarden.db")
    try:
        return [(a.outcome, a.reason) for a in store.attempts(job)]
    finally:
        store.close()


@pytest.mark.usefixtures("memory_cgroups")
def test_a_job_past_its_ram_cap_is_killed_by_the_kernel(broker: Broker, tmp_path: Path) -> None:
    go = tmp_path / "go"
    submit(broker, "testmods.hog", "--id", "hog", "--go", str(go), "--mib", "512",
           "--ram-gib", "0.125")  # fmt: skip
    submit(broker, "testmods.hog", "--id", "small", "--go", str(go), "--mib", "16",
           "--ram-gib", "0.5")  # fmt: skip
    for job, cap in (("hog", 128 * MIB), ("small", 512 * MIB)):
        seen = _attempt_out(broker, job) / "cgroup"
        wait_for(seen.exists, f"{job} to say which cgroups it is in")
        group = _memory_cgroup(seen)
        assert group.name.startswith("gpuwarden-") and group.parent.name == "gpuwarden", group
        # the limit really is in place, swap off, before the job takes its memory
        if (group / "memory.limit_in_bytes").exists():
            assert int((group / "memory.limit_in_bytes").read_text()) == cap
            if (group / "memory.memsw.limit_in_bytes").exists():
                assert int((group / "memory.memsw.limit_in_bytes").read_text()) == cap
        else:
            assert int((group / "memory.max").read_text()) == cap
            assert (group / "memory.swap.max").read_text().strip() == "0"
    go.touch()
    wait_for(lambda: state_of(broker, "hog")["state"] == "failed", "the hog to be killed", 60)
    wait_for(lambda: state_of(broker, "small")["state"] == "done", "the small job to end", 60)
    reason = str(state_of(broker, "hog")["reason"])
    assert reason.startswith(
        "killed for memory: it passed its RAM cap of 0.12 GiB (ram_gib) and the kernel "
        "stopped it (OOM kill in its memory cgroup); raise ram_gib or use less memory"
    ), reason
    assert [o for o, _ in _attempts(broker, "hog")] == ["ram_cap_exceeded"]  # never retried
    assert [o for o, _ in _attempts(broker, "small")] == ["succeeded"]
    # each attempt's cgroup is gone with it
    wait_for(lambda: not _memory_cgroup(_attempt_out(broker, "hog") / "cgroup").exists(), "cleanup")


def test_a_job_waits_for_memavailable_and_explain_says_why(broker: Broker) -> None:
    # more than this host ever has available (the kernel and this suite hold some),
    # not more than it has in all: it may start some day, so it waits
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    asked = f"{total_gib * 0.995:.2f}"
    submit(broker, "testmods.sleep", "--id", "huge", "--ram-start-min-gib", asked)
    reason = ""

    def waits() -> bool:
        nonlocal reason
        r = run("--config", broker.config, "explain", "huge")
        reason = r.stdout
        return "ram_start_min_gib" in r.stdout

    wait_for(waits, "explain to name host RAM")
    assert "host RAM: " in reason and f"the job needs {asked} GiB to start" in reason, reason
    assert state_of(broker, "huge")["state"] == "queued"
    r = run("--config", broker.config, "status", "--json")
    ram = json.loads(r.stdout)["nodes"][0]["ram"]
    assert ram["available_bytes"] > 0 and ram["node_floor_bytes"] == 0
    assert ram["total_bytes"] == pytest.approx(total_gib * 2**30, rel=0.01)
    # more than the host has in all: refused at submission, never queued
    r = run("--config", broker.config, "submit", "testmods.sleep", "--id", "never",
            "--ram-start-min-gib", "60000")  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "needs 60000.00 GiB of RAM available to start (ram_start_min_gib)" in r.stderr
    assert "of RAM in all: ask for less" in r.stderr
