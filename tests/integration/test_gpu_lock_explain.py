"""A GPU lock's holder, as submitters and operators see it (issue 30, item 10).

Before the fix every submitter was shown the full command line of whoever held
a GPU's lock file (``GPU locked by PID N (cmd)``) in ``explain``, ``status`` and
a waiting job's reason. Now a wait reason names the PID alone; the command line
is in the ``gpu_locked`` event, which owners and operators read and submitters
never see. A broker in-process with the API over the same database, and a real
process holding the lock with a command line that says something private.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import Role
from gpuwarden.gpu.lockfile import LOCK_MODE, LockTemplate
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
#: what the holder's command line says, that no submitter may read
PRIVATE = "--api-key=hunter2-private-notebook"

HOLD = """
import fcntl, os, signal, sys
signal.alarm(120)
fd = os.open(sys.argv[2], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def make_config(tmp_path: Path) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "locknode",
            "gpu": "sim",
            "gpu_lock": f"{tmp_path}/locks/<uuid>.lock",
            "allow_unsandboxed_containers": True,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.05, "kill_grace_s": 0.3, "status_interval_s": 0.2},
            "vram": {"reserve_gib": 0},
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )


@dataclass
class Served:
    node: Node
    config: Config
    http: TestClient
    tokens: dict[str, str]

    def h(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def get(self, who: str, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params, headers=self.h(who))
        assert r.status_code == 200, r.text
        return r


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as node:
        broker = node.broker
        broker.recover()
        stop = threading.Event()
        loop = threading.Thread(target=broker.run, args=(stop,), daemon=True)
        loop.start()
        api = SqliteStore(config.state_dir / "gpuwarden.db")
        tokens = {
            name: issue_token(api, name=name, role=role, by=ADMIN, now=time.time())[1]
            for name, role in (
                ("alice", Role.SUBMITTER),
                ("boss", Role.OWNER),
                ("ops", Role.OPERATOR),
            )
        }
        app = create_app(api, broker.registry, config, wake=broker.wake, ends=broker.ends)
        try:
            yield Served(node, config, TestClient(app), tokens)
        finally:
            stop.set()
            broker.wake()
            loop.join(60)
            api.close()


def wait_for(what: str, done: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_submitter_sees_the_lock_holders_pid_never_its_command_line(
    served: Served, tmp_path: Path
) -> None:
    gpu = served.node.probe.device.uuids()[0]  # type: ignore[attr-defined]
    template = LockTemplate(served.config.gpu_lock)
    path = template.path(gpu)
    wait_for("the broker's look at the lock file", path.exists)
    assert path.stat().st_mode & 0o777 == LOCK_MODE  # who may open it: the broker's user, group
    script = tmp_path / "hold.py"  # a short command line: it is shown up to 200 characters
    script.write_text(HOLD)
    holder = subprocess.Popen(
        [sys.executable, str(script), PRIVATE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # the lock is really held, by a process whose command line says PRIVATE
        assert PRIVATE in Path(f"/proc/{holder.pid}/cmdline").read_text()
        r = served.http.post(
            "/v1/jobs",
            json={"type": "testmods.gpu", "params": {"gib": 1, "seconds": 0.2}},
            headers=served.h("alice"),
        )
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        said = f"GPU locked by PID {holder.pid}"

        def explained() -> str:
            return json.dumps(served.get("alice", f"/v1/jobs/{job}/explain").json())

        wait_for("the lock named in the submitter's explain", lambda: said in explained())
        shown = {
            "explain": explained(),
            "job": served.get("alice", f"/v1/jobs/{job}").text,
            "status": served.get("alice", "/v1/status").text,
            "events": served.get("alice", "/v1/events", follow="false", after=0).text,
        }
        for where, text in shown.items():
            assert PRIVATE not in text and "python" not in text, (where, text)
        assert said in shown["status"]
        # an owner and an operator still learn the command line: the gpu_locked event
        for who in ("boss", "ops"):
            events = served.get(who, "/v1/events", follow="false", after=0).text
            assert "gpu_locked" in events and PRIVATE in events, who
            assert PRIVATE not in served.get(who, f"/v1/jobs/{job}/explain").text
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    # let go of: the job runs
    wait_for(
        "the job to end",
        lambda: served.get("alice", f"/v1/jobs/{job}").json()["state"] == "done",
    )
    assert os.path.exists(path)
