"""Acceptance: sandboxed command jobs on a cluster (SPEC.md, "Command jobs over
HTTP, bundles and agents"). A coordinator (its own SQLite, a queue root,
``[commands] roles = ["submitter"]`` and ``bundles = true``) and one agent
with a simulated GPU and bubblewrap (``[commands] roles`` set: it takes command
jobs), each a process of its own:

* a command submitted over HTTP to the coordinator is leased to the agent, runs
  there in its sandbox (a file of the host's is not there), and its output file
  comes back through the coordinator;
* a bundle's command job, with an input file, runs on the agent (it fetched the
  file) and ends in outbox/ with its output;
* a host command over HTTP and an operator's command (its role not in the
  coordinator's ``[commands] roles``) are refused, naming the rule.

Needs bubblewrap: skipped without it, failed where GPUWARDEN_REQUIRE_CONTAINERS=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from gpuwarden.client import Client, Forbidden, Invalid
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.model import JobSpec
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle
from tests.acceptance.test_cluster import _config, _healthy, free_port, wait_for
from tests.acceptance.test_coordinator_queue import _stop
from tests.conftest import need_tool

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


class Site:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        self.modules = [str(REPO / "src" / "gpuwarden" / p) for p in ("modules",)]
        self.modules.append(str(REPO / "tests" / "modules"))
        self.queue = tmp / "queue"
        self.cfg = _config(
            tmp / "coordinator.toml",
            {
                "state_dir": str(tmp / "coordinator"),
                "module_paths": self.modules,
                "broker": {"poll_interval_s": 0.1},
                "cluster": {"sweep_every_s": 0.5},
                "commands": {"roles": ["submitter"], "bundles": True},
            },
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def gw(self, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
        e = {**self.env, "GPUWARDEN_TOKEN": token} if token else self.env
        return subprocess.run(
            [sys.executable, "-m", "gpuwarden", "--config", str(self.cfg), *args],
            env=e, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def token(self, name: str, role: str) -> str:
        made = self.gw("token", "create", name, "--role", role, "--json")
        assert made.returncode == 0, made.stderr
        return str(json.loads(made.stdout)["token"])

    def start(self, owner: str) -> None:
        with (self.tmp / "coordinator.stderr").open("ab") as err:
            self.procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--config", str(self.cfg)),
                        *("coordinator", "--bind", f"127.0.0.1:{self.port}"),
                        *("--queue", str(self.queue)),
                    ],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        wait_for("the coordinator", lambda: _healthy(self.url), timeout=60)
        agent_cfg = _config(
            self.tmp / "agent.toml",
            {
                "state_dir": str(self.tmp / "agent"),
                "module_paths": self.modules,
                "container_runtime": "bubblewrap",
                "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
                "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
                "cluster": {"claim_every_s": 0.3, "max_jobs": 4},
                "commands": {"roles": ["submitter"]},
            },
        )
        invited = self.gw("node", "invite", "a1", "--url", self.url, "--json", token=owner)
        assert invited.returncode == 0, invited.stderr
        enroll = json.loads(invited.stdout)["token"]
        with (self.tmp / "agent.stderr").open("ab") as err:
            self.procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--mock-gpu"),
                        *("--config", str(agent_cfg), "agent", "--coordinator", self.url),
                    ],
                    env={**self.env, "GPUWARDEN_ENROLL_TOKEN": enroll},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )


def test_an_agent_runs_sandboxed_command_jobs(tmp_path: Path) -> None:
    need_tool("bwrap")
    s = Site(tmp_path)
    owner = s.token("admin", "owner")
    alice = s.token("alice", "submitter")
    ops = s.token("ops", "operator")
    secret = tmp_path / "host-secret.txt"
    secret.write_text("not for jobs")
    assert secret.exists()  # the attack's target is there on the host
    try:
        s.start(owner)
        with Client(s.url, alice) as c:
            job = c.submit_command(
                [
                    "sh", "-c",
                    f"echo agent-out; if cat {secret}; then echo LEAKED; fi; "
                    'echo "$GREETING" > result.txt',
                ],
                env={"GREETING": "from the agent"},
                outputs=["result.txt"],
            )  # fmt: skip
            assert job["type"] == "command:sh[sandbox]"
            ended = c.wait(job["id"], timeout=120)
            assert ended["state"] == "done", ended
            assert ended["attempts_detail"][-1]["node"] == "a1"
            with c.logs(job["id"]) as stream:
                stdout = b"".join(stream.chunks).decode()
            assert "agent-out" in stdout and "LEAKED" not in stdout and "not for" not in stdout
            got = c.download(job["id"], "result.txt", tmp_path / "fetched.txt")
            assert got.read_text() == "from the agent\n"
            # a host command is never taken over HTTP, on a coordinator neither
            with pytest.raises(Invalid, match="local socket"):
                c.request_json("POST", "/v1/jobs", json={"command": ["id"], "cwd": "/tmp"})
        with Client(s.url, ops) as c, pytest.raises(Forbidden, match=r"\[commands\] roles"):
            c.submit_command(["id"])

        given = tmp_path / "data.txt"
        given.write_text("shout\n")
        bundle = write_bundle(
            s.queue / "inbox",
            [
                JobSpec(
                    id="cq-cmd",
                    type="command:tr[sandbox]",
                    inputs=("data.txt",),
                    outputs=("upper.txt",),
                    command=CommandSpec(
                        ("sh", "-c", 'tr a-z A-Z < "$GPUWARDEN_INPUT_DIR/data.txt" > upper.txt')
                    ),
                )
            ],
            {"data.txt": given},
            now=time.time(),
        )
        manifest = json.loads(zipfile.ZipFile(bundle).read("manifest.json"))
        assert "command" in manifest["jobs"][0] and "type" not in manifest["jobs"][0]
        ran = s.queue / "outbox" / bundle.name
        wait_for("the command bundle in outbox/", ran.exists, timeout=120)
        r = read_result_bundle(ran)["cq-cmd"]
        assert r["status"] == "done" and r["node"] == "a1", r
        with zipfile.ZipFile(ran) as zf:
            assert zf.read("cq-cmd/outputs/upper.txt") == b"SHOUT\n"
        assert (tmp_path / "agent" / "inputs" / "cq-cmd" / "data.txt").is_file()
    finally:
        _stop(s.procs)
    for name in ("coordinator.stderr", "agent.stderr"):
        text = (tmp_path / name).read_text()
        assert "Traceback" not in text, text
