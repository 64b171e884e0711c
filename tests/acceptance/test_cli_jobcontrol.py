"""Acceptance: job control through the real CLI, on the host and with ``--url``
through `serve --api` (SPEC.md section 1, "Job control"): hold, release, requeue,
priority, with a real broker and real job processes."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_cli import run, wait_for, write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ApiBroker]]:
    config = write_config(tmp_path)
    b = ApiBroker(config)
    yield config, b
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)


def job(config: Path, job_id: str) -> dict[str, Any]:
    r = run("--config", config, "show", job_id, "--json")
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def test_hold_release_requeue_priority(served: tuple[Path, ApiBroker], tmp_path: Path) -> None:
    config, broker = served
    url = broker.url
    owner = json.loads(run("--config", config, "token", "create", "o", "--role", "owner",
                           "--json").stdout)["token"]  # fmt: skip
    sub = json.loads(run("--config", config, "token", "create", "s", "--role", "submitter",
                         "--json").stdout)["token"]  # fmt: skip

    # b waits for gate (its dependency) and for a person's hold: two holds apart
    gate_file = tmp_path / "gate"
    r = run("--config", config, "submit", "testmods.hold", "--until", gate_file, "--id", "gate")
    assert r.returncode == 0, r.stderr
    r = run("--config", config, "submit", "echo.echo", "--text", "b", "--id", "b",
            "--after", "afterok:gate")  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = run("--config", config, "hold", "b")
    assert r.returncode == 0 and "b is held by" in r.stdout and "(on the host)" in r.stdout
    r = run("--config", config, "explain", "b")
    assert re.search(r"held by .+ \(on the host\): release with `gpuwarden release b`", r.stdout)
    r = run("--config", config, "requeue", "b")
    assert r.returncode == 2 and "only a done, failed or cancelled job" in r.stderr

    gate_file.touch()  # gate ends done: its dependency holds, the person's hold stays
    wait_for(lambda: job(config, "gate")["state"] == "done", "gate done")
    r = run("--config", config, "submit", "echo.echo", "--text", "c", "--id", "c", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr  # the broker ran what came after b
    b = job(config, "b")
    assert b["state"] == "queued" and b["attempts"] == 0 and not b["held"] and b["hold_by"]

    r = run_env("release", "--url", url, "b", token=owner)
    assert r.returncode == 0 and "b is released" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: job(config, "b")["state"] == "done", "b done once released")
    r = run("--config", config, "hold", "b")
    assert r.returncode == 2 and "only a queued job can be held" in r.stderr
    assert "gpuwarden requeue b" in r.stderr
    r = run("--config", config, "release", "b")
    assert r.returncode == 2 and "nothing to release" in r.stderr

    r = run_env("requeue", "--url", url, "b", token=owner)
    assert r.returncode == 0 and "b is queued again" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: job(config, "b")["attempts"] == 2 and job(config, "b")["state"] == "done",
             "b's second run")  # fmt: skip
    b = job(config, "b")
    assert [a["number"] for a in b["attempts_detail"]] == [1, 2]
    assert [e["event"] for e in b["events"]].count("requeued") == 1
    r = run("--config", config, "requeue", "nope")
    assert r.returncode == 2 and "no job with id 'nope'" in r.stderr

    # a submitter's priority goes only down; a queued job of its own (waits for p-gate)
    p_file = tmp_path / "p-gate"
    r = run_env("submit", "--url", url, "testmods.hold", "--until", p_file, "--id", "pgate",
                token=sub)  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = run_env("submit", "--url", url, "echo.echo", "--text", "p", "--id", "p",
                "--priority", "5", "--after", "afterok:pgate", token=sub)  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = run_env("priority", "--url", url, "p", "9", token=sub)
    assert r.returncode == 2 and "a submitter may only lower the priority" in r.stderr
    r = run_env("priority", "--url", url, "p", "high", token=sub)
    assert r.returncode == 2 and "priority must be an integer" in r.stderr
    r = run_env("priority", "--url", url, "p", "-1", token=sub)
    assert r.returncode == 0 and "has priority -1" in r.stdout, r.stdout + r.stderr
    r = run("--config", config, "priority", "c", "3")
    assert r.returncode == 2 and "only a queued job's priority" in r.stderr
    p_file.touch()

    rows = json.loads(run("--config", config, "audit", "--json").stdout)
    actions = [(row["action"], row["outcome"]) for row in rows]
    assert ("job.release", "ok") in actions and ("job.requeue", "ok") in actions
    assert ("job.priority", "ok") in actions
    assert any(a == "job.priority" and o != "ok" for a, o in actions)
    assert broker.stop() == 0
