"""Acceptance: preemption at a safe point on the simulated GPU (24 GiB), with a real
broker, real job processes and the real CLI. A training stand-in
(``tests/modules/trainmods``) holds 16 GiB; an urgent job of higher priority
needs 12 GiB, so it can start only once the training run has yielded."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_cli import Broker, run, wait_for, write_config


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    cfg = write_config(tmp_path, extra="[vram]\nreserve_gib = 0\nreclaim_timeout_s = 5\n")
    b = Broker(cfg, tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def submit(b: Broker, *args: str) -> None:
    r = run("--config", b.config, "submit", *args)
    assert r.returncode == 0, r.stdout + r.stderr


def show(b: Broker, job: str) -> dict[str, Any]:
    r = run("--config", b.config, "show", job, "--json")
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def out_file(b: Broker, job: str, attempt: int, name: str) -> Path:
    return b.config.parent / "state" / "jobs" / job / f"attempt-{attempt}" / "out" / name


def running(b: Broker, job: str) -> bool:
    """The job runs and has logged its start (its process holds its memory)."""
    return show(b, job)["state"] == "running" and out_file(b, job, 1, "log.txt").exists()


def status(b: Broker) -> dict[str, Any]:
    r = run("--config", b.config, "status", "--json")
    assert r.returncode == 0, r.stderr
    node: dict[str, Any] = json.loads(r.stdout)["nodes"][0]
    return node


def ended(b: Broker, *jobs: str) -> bool:
    return all(show(b, j)["state"] in ("done", "failed", "cancelled", "quarantined") for j in jobs)


def test_a_training_run_checkpoints_yields_and_resumes(broker: Broker) -> None:
    submit(broker, "trainmods.train", "--steps", "200", "--step-s", "0.03", "--id", "train")
    wait_for(lambda: running(broker, "train"), "train running")
    submit(broker, "trainmods.urgent", "--priority", "5", "--id", "urgent")
    wait_for(lambda: ended(broker, "train", "urgent"), "both ended", timeout=60)

    asked = broker.events("preemption_requested")
    assert [(e["job"], e["for_job"], e["signal"], e["sent"]) for e in asked] == [
        ("train", "urgent", "SIGUSR1", True)
    ]
    (done,) = broker.events("checkpointed")
    assert done["job"] == "train" and done["for_job"] == "urgent" and done["target"] == "queued"

    urgent, train = show(broker, "urgent"), show(broker, "train")
    assert urgent["state"] == "done" and train["state"] == "done"
    first, second = train["attempts_detail"]
    assert (first["outcome"], first["exit_code"]) == ("checkpointed", 6)
    assert "yielding to job urgent" in first["reason"] and "retry" in first["reason"]
    assert second["outcome"] == "succeeded"
    # the urgent job started only once the training run had yielded, and before it resumed
    (u,) = urgent["attempts_detail"]
    assert first["ended_at"] <= u["started_at"] <= second["started_at"]
    # the resumed attempt got the first one's output folder and GPUWARDEN_RESUME=1
    step = int(out_file(broker, "train", 1, "step.txt").read_text())
    assert 0 < step < 200
    log = out_file(broker, "train", 2, "log.txt").read_text().splitlines()
    assert log == [
        "attempt 1: start at step 0 resume=0",
        f"attempt 1: checkpointed at step {step}",
        f"attempt 2: start at step {step} resume=1",
        "attempt 2: finished at step 200",
    ]
    assert out_file(broker, "train", 2, "done.txt").read_text() == "200"


@pytest.mark.timeout(240)  # a grace of 20 s, then its 45 s again from step 0
def test_a_job_that_ignores_the_signal_is_stopped_and_requeued_as_preempted(
    broker: Broker,
) -> None:
    # 3000 steps of 15 ms (45 s): it runs well past its grace (20 s) ignoring the signal
    submit(
        broker, "trainmods.stubborn_long", "--steps", "3000", "--step-s", "0.015", "--id", "stub"
    )
    wait_for(lambda: running(broker, "stub"), "stub running")
    submit(broker, "trainmods.urgent", "--priority", "5", "--id", "urgent")

    def says_so() -> bool:  # during its grace (20 s), status says who yields to whom
        node = status(broker)
        running = {r["job"]: r.get("preempting_for") for r in node["running"]}
        why = node["waiting"].get("urgent", "")
        return running.get("stub") == "urgent" and "Preempting stub for urgent" in why

    wait_for(says_so, "status: preempting stub for urgent", timeout=15)
    text = run("--config", broker.config, "status").stdout
    assert "stub (preempting for urgent)" in text
    said = run("--config", broker.config, "explain", "stub").stdout
    assert "preempting stub for urgent" in said, said
    said = run("--config", broker.config, "explain", "urgent").stdout
    assert "Preempting stub for urgent" in said, said
    wait_for(lambda: ended(broker, "stub", "urgent"), "both ended", timeout=150)

    assert [e["job"] for e in broker.events("preemption_requested")] == ["stub"]
    assert [e["for_job"] for e in broker.events("preemption_grace_ended")] == ["urgent"]
    (gone,) = broker.events("preempted")
    assert gone["job"] == "stub" and gone["for_job"] == "urgent"

    stub = show(broker, "stub")
    assert stub["state"] == "done"
    first, second = stub["attempts_detail"]
    assert first["outcome"] == "preempted" and "interruption 1/2" in first["reason"]
    assert second["outcome"] == "succeeded"
    assert show(broker, "urgent")["state"] == "done"
    # it wrote no checkpoint: it started over (still told it resumes), and finished
    log = out_file(broker, "stub", 2, "log.txt").read_text().splitlines()
    assert log[0] == "attempt 1: start at step 0 resume=0"
    assert "attempt 2: start at step 0 resume=1" in log
    assert log[-1] == "attempt 2: finished at step 3000"
