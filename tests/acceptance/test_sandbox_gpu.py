"""Acceptance (issue 12): a real ``gpuwarden serve --mock-gpu`` runs a job in each
sandbox; ``gpuwarden status`` shows its simulated VRAM used by the job's host
pid while it runs, as NVML would, and its measured footprint is raised by what
it really used. The in-process cases (CUDA out-of-memory beside another job,
the unsandboxed baseline) are in tests/integration/test_sim_sandbox.py."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.gpu.sim import find_host_pids
from tests.acceptance.test_cli import GW, env, run, wait_for
from tests.conftest import REPO, need_tool

GIB = 1024**3
HOLD = "testmods.vramhold"

pytestmark = pytest.mark.timeout(900)


class Served:
    """``gpuwarden --mock-gpu serve`` in a subprocess, with one sandbox runtime."""

    def __init__(self, tmp: Path, runtime: str, image: str) -> None:
        self.config = tmp / "gpuwarden.toml"
        self.state = tmp / "state"
        self.log = tmp / "events.jsonl"
        self.config.write_text(
            f"""
state_dir = "{self.state}"
node_name = "sandboxcli"
module_paths = ["{REPO / "tests" / "modules"}"]
container_runtime = "{runtime}"
sandbox_image = "{image}"

[sim_gpu]
count = 1
vram_gib = 24
release_delay_s = 0

[vram]
reserve_gib = 0

[broker]
poll_interval_s = 0.05
status_interval_s = 0.2
kill_grace_s = 1
"""
        )
        self.stderr = tmp / "serve.stderr"
        self.proc = subprocess.Popen(
            [*GW, "--config", str(self.config), "--mock-gpu", "serve", "--log", str(self.log)],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr.open("w"),
            env=env(),
            start_new_session=True,
        )
        wait_for(
            lambda: bool(self.events("broker_started")) or self.proc.poll() is not None, "serve"
        )
        assert self.proc.poll() is None, self.stderr.read_text()

    def started_or_ended(self) -> bool:
        return bool(self.events("broker_started")) or self.proc.poll() is not None

    def events(self, kind: str) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        rows = [json.loads(ln) for ln in self.log.read_text().splitlines() if ln.strip()]
        return [r for r in rows if r["event"] == kind]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run("--config", self.config, *args)

    def status(self) -> dict[str, Any]:
        r = self.cli("status", "--json")
        assert r.returncode in (0, 1), r.stderr
        node: dict[str, Any] = json.loads(r.stdout)["nodes"][0]
        return node

    def state_of(self, job: str) -> str:
        r = self.cli("show", job, "--json")
        assert r.returncode == 0, r.stderr
        return str(json.loads(r.stdout)["state"])

    def out(self, job: str) -> Path:
        return self.state / "jobs" / job / "attempt-1" / "out"


@pytest.fixture(params=["bubblewrap", "podman"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    if request.param == "bubblewrap":
        need_tool("bwrap")
        image = ""
    else:
        image = request.getfixturevalue("podman_image")
    s = Served(tmp_path, request.param, image)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(10)


def test_status_shows_a_sandboxed_jobs_vram_under_its_host_pid_and_it_is_measured(
    served: Served,
) -> None:
    r = served.cli("submit", HOLD, "--gib", "5", "-p", "wait_for=go", "--id", "c1")
    assert r.returncode == 0, r.stdout + r.stderr
    held_file = served.out("c1") / "held.json"
    wait_for(held_file.exists, "the job to hold its memory", timeout=90)
    held = json.loads(held_file.read_text())
    # the job really runs in a PID namespace of its own: it sees another pid
    assert held["pidns"] != Path("/proc/self/ns/pid").stat().st_ino
    host_pid = find_host_pids({(held["pidns"], held["pid"])})[(held["pidns"], held["pid"])]
    assert host_pid != held["pid"]

    def shown() -> bool:
        (gpu,) = served.status()["gpus"]
        return [h["bytes"] for h in gpu["holdings"] if h["job_id"] == "c1"] == [5 * GIB]

    wait_for(shown, "status to count the job's 5 GiB")
    (gpu,) = served.status()["gpus"]
    assert gpu["processes"] == [{"pid": host_pid, "used_bytes": 5 * GIB}]
    assert gpu["used_bytes"] == 5 * GIB and gpu["foreign_bytes"] == 0
    table = served.cli("status").stdout
    assert "5.0 GiB" in table, table

    (served.out("c1") / "go").write_text("go")
    wait_for(lambda: served.state_of("c1") == "done", "c1 to finish", timeout=60)
    raised = served.events("footprint_raised")
    assert [(e["type"], e["bytes"]) for e in raised] == [(HOLD, 5 * GIB)]
    wait_for(lambda: served.status()["footprints"][HOLD]["measured_bytes"] > 0, "the status")
    assert served.status()["footprints"][HOLD] == {
        "declared_bytes": GIB,
        "measured_bytes": 5 * GIB,
        "effective_bytes": 5 * GIB,
    }
    wait_for(lambda: served.status()["gpus"][0]["holdings"] == [], "the memory to be reclaimed")
    assert served.status()["gpus"][0]["used_bytes"] == 0
