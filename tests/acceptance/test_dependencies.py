"""Acceptance: job dependencies with the real CLI, a real broker and real job
processes. A pipeline whose middle step fails: the first step ends done, the
second fails, the step after it (afterok) fails at once with the reason, and so on
down the chain, and the step that waits for the failure (afternotok) runs."""

from __future__ import annotations

import json
import os
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_cli import Broker, run, wait_for, write_config


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def _job(cfg: Path, job_id: str) -> dict[str, Any]:
    r = run("--config", cfg, "show", job_id, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def _submit(cfg: Path, *args: str) -> None:
    r = run("--config", cfg, "submit", *args)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_pipeline_through_the_cli_with_a_failing_middle_step(
    broker: Broker, tmp_path: Path
) -> None:
    cfg = broker.config
    release = tmp_path / "release-s1"
    _submit(cfg, "testmods.hold", "--until", str(release), "--id", "s1")
    _submit(cfg, "echo.echo", "--text", "two", "--exit_code", "1", "--id", "s2",
            "--after", "afterok:s1")  # fmt: skip
    _submit(cfg, "echo.echo", "--text", "three", "--id", "s3", "--after", "afterok:s2")
    _submit(cfg, "echo.echo", "--text", "four", "--id", "s4", "--after", "afternotok:s2")
    _submit(cfg, "echo.echo", "--text", "five", "--id", "s5", "--after", "afterok:s3",
            "--after", "afterany:s1")  # fmt: skip

    wait_for(lambda: _job(cfg, "s1")["state"] == "running", "s1 to run")
    # the dependents wait, each saying for what
    explain = run("--config", cfg, "explain", "s2")
    assert explain.returncode == 0, explain.stdout + explain.stderr
    assert "it waits: waits for job s1 (running)" in explain.stdout
    assert "afterok:s1: s1 is running (waiting)" in explain.stdout
    jobs = run("--config", cfg, "jobs")
    assert "waits for job s1 (running)" in jobs.stdout
    assert "waits for job s2 (queued)" in jobs.stdout
    show = run("--config", cfg, "show", "s3")
    assert "after: afterok:s2 (waiting)" in show.stdout, show.stdout
    s2 = _job(cfg, "s2")
    assert s2["state"] == "queued" and s2["held"] and s2["attempts"] == 0

    release.touch()
    wait_for(
        lambda: _job(cfg, "s4")["state"] == "done",
        "s4 (afternotok:s2) to run once s2 failed",
    )
    s1, s2, s3, s5 = (_job(cfg, i) for i in ("s1", "s2", "s3", "s5"))
    assert s1["state"] == "done"
    assert s2["state"] == "failed" and s2["attempts"] == 1
    assert s3["state"] == "failed" and s3["attempts"] == 0
    assert s3["reason"] == "dependency afterok:s2 can never hold: s2 failed"
    assert s5["state"] == "failed" and s5["attempts"] == 0
    assert s5["reason"] == "dependency afterok:s3 can never hold: s3 failed"
    # s2's end and the cascade went together: s3 failed in the same commit as s2
    s2_end = next(e["ts"] for e in s2["events"] if e.get("to") == "failed")
    s3_end = next(e["ts"] for e in s3["events"] if e.get("to") == "failed")
    assert s3_end == s2_end

    # refused at submission, nothing stored
    for after, says in [
        ("afterok:ghost", "no job with id ghost"),
        ("after:s1", "unknown kind 'after'"),
        ("s1", "is not KIND:ID"),
    ]:
        r = run("--config", cfg, "submit", "echo.echo", "--text", "x", "--id", "bad",
                "--after", after)  # fmt: skip
        assert r.returncode == 2, r.stdout + r.stderr
        assert says in r.stderr + r.stdout
    assert run("--config", cfg, "show", "bad").returncode == 2


def _drop_bundle(inbox: Path, name: str, manifest: dict[str, Any]) -> None:
    staged = inbox.parent / f".{name}"
    with zipfile.ZipFile(staged, "w") as z:
        z.writestr("manifest.json", json.dumps(manifest))
    os.rename(staged, inbox / name)


def test_a_pipeline_in_one_bundle(broker: Broker, tmp_path: Path) -> None:
    cfg = broker.config
    queue = tmp_path / "queues" / "demo"
    _drop_bundle(
        queue / "inbox",
        "pipe.zip",
        {
            "version": 1,
            "jobs": [
                {"id": "p1", "type": "echo.echo", "params": {"text": "one"}},
                {
                    "id": "p2",
                    "type": "echo.echo",
                    "params": {"text": "two", "exit_code": 3},
                    "after": ["afterok:p1"],
                },
                {"id": "p3", "type": "echo.echo", "params": {"text": "3"}, "after": ["afterok:p2"]},
                {
                    "id": "p4",
                    "type": "echo.echo",
                    "params": {"text": "4"},
                    "after": ["afternotok:p2", "afterok:p1"],
                },
            ],
        },
    )
    wait_for(lambda: any((queue / "failed").glob("pipe*.zip")), "the bundle's result")
    states = {i: _job(cfg, i) for i in ("p1", "p2", "p3", "p4")}
    assert [states[i]["state"] for i in ("p1", "p2", "p3", "p4")] == [
        "done",
        "failed",
        "failed",
        "done",
    ]
    assert states["p3"]["reason"] == "dependency afterok:p2 can never hold: p2 failed"
    assert states["p3"]["attempts"] == 0
    assert states["p4"]["after"] == ["afternotok:p2", "afterok:p1"]

    # a cycle within a bundle is refused as a whole, nothing stored
    _drop_bundle(
        queue / "inbox",
        "loop.zip",
        {
            "version": 1,
            "jobs": [
                {"id": "c1", "type": "echo.echo", "params": {"text": "1"}, "after": ["afterok:c2"]},
                {"id": "c2", "type": "echo.echo", "params": {"text": "2"}, "after": ["afterok:c1"]},
            ],
        },
    )
    wait_for(lambda: any((queue / "failed").glob("loop*.zip")), "the refusal")
    refused = next((queue / "failed").glob("loop*.zip"))
    with zipfile.ZipFile(refused) as z:
        text = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".json"))
    assert "cycle: c1 -> c2 -> c1" in text
    assert run("--config", cfg, "show", "c1").returncode == 2
