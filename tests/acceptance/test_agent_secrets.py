"""The agent's secrets stay off the command line and out of its jobs, for real: a
coordinator process (SQLite) and agent processes with simulated GPUs.

An enrolment token given as ``--enroll TOKEN`` is refused before anything is
done with it. One given in ``GPUWARDEN_ENROLL_TOKEN`` enrols the agent, and then
neither the agent's command line nor any process it starts (the job included)
holds it, nor the node credential it got in exchange. One given on standard input
(``--enroll -``) enrols too. And ``coordinator --db`` with a password in it is
refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.client import Client
from tests.acceptance.test_cluster import _config, _healthy, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
GW = [sys.executable, "-m", "gpuwarden"]

pytestmark = pytest.mark.timeout(240)


@dataclass
class Site:
    tmp: Path
    env: dict[str, str]
    coord_cfg: Path
    url: str
    owner: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def gw(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*GW, "--config", str(self.coord_cfg), *args],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def invite(self, name: str) -> str:
        got = self.gw("node", "invite", name, "--json")
        assert got.returncode == 0, got.stderr
        token: str = json.loads(got.stdout)["token"]
        return token

    def agent_cfg(self, name: str) -> Path:
        return _config(
            self.tmp / f"{name}.toml",
            {
                "state_dir": str(self.tmp / name),
                "module_paths": [
                    str(REPO / "src" / "gpuwarden" / "modules"),
                    str(REPO / "tests" / "modules"),
                ],
                "allow_unsandboxed_containers": True,
                "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
                "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 1},
                "cluster": {"claim_every_s": 0.3, "max_jobs": 2},
            },
        )

    def nodes(self) -> dict[str, dict[str, Any]]:
        with Client(self.url, self.owner, timeout=10) as c:
            return {n["name"]: n for n in c.request_json("GET", "/v1/nodes")}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("secrets")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    coord_cfg = _config(
        tmp / "coordinator.toml",
        {
            "state_dir": str(tmp / "coordinator"),
            "module_paths": [
                str(REPO / "src" / "gpuwarden" / "modules"),
                str(REPO / "tests" / "modules"),
            ],
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        },
    )
    port = free_port()
    s = Site(tmp=tmp, env=env, coord_cfg=coord_cfg, url=f"http://127.0.0.1:{port}", owner="")
    made = s.gw("token", "create", "admin", "--role", "owner", "--json")
    assert made.returncode == 0, made.stderr
    s.owner = json.loads(made.stdout)["token"]
    with (tmp / "coordinator.stderr").open("ab") as err:
        s.procs.append(
            subprocess.Popen(
                [*GW, "--config", str(coord_cfg), "coordinator", "--bind", f"127.0.0.1:{port}"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        )
    try:
        wait_for("the coordinator", lambda: _healthy(s.url), timeout=60)
        yield s
    finally:
        for proc in s.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in s.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _holds(proc: psutil.Process, secrets: list[str]) -> list[str]:
    """Where in the process's command line or environment any of ``secrets`` is."""
    found: list[str] = []
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        environ = proc.environ()
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return found
    for s in secrets:
        if s.encode() in cmdline:
            found.append(f"{proc.pid} cmdline")
        if any(s in v for v in environ.values()):
            found.append(f"{proc.pid} environ")
    return found


def test_a_token_on_the_command_line_is_refused_before_it_is_used(site: Site) -> None:
    token = site.invite("argv")
    got = subprocess.run(
        [
            *(*GW, "--mock-gpu", "--config", str(site.agent_cfg("argv"))),
            *("agent", "--coordinator", site.url, "--enroll", token),
        ],
        env=site.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert got.returncode == 2, got.stdout + got.stderr
    err = " ".join(got.stderr.split())
    assert "--enroll-file FILE" in err and "--enroll -" in err and "GPUWARDEN_ENROLL_TOKEN" in err
    assert token not in got.stderr + got.stdout  # never echoed
    assert "argv" not in site.nodes()  # not enrolled: nothing was done with it
    # and the refusal did not use it up: from a file it enrols (checked below for the
    # environment and standard input)
    token_file = site.tmp / "argv.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, token.encode())
    os.close(fd)
    assert token_file.stat().st_mode & 0o077  # readable by others: refused
    got = subprocess.run(
        [
            *(*GW, "--mock-gpu", "--config", str(site.agent_cfg("argv"))),
            *("agent", "--coordinator", site.url, "--enroll-file", str(token_file)),
        ],
        env=site.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert got.returncode == 2 and "chmod 600" in got.stderr, got.stderr
    assert "argv" not in site.nodes()


def test_the_token_and_the_credential_are_in_no_command_line_and_no_job(site: Site) -> None:
    token = site.invite("envnode")
    cfg = site.agent_cfg("envnode")
    with (site.tmp / "envnode.stderr").open("ab") as err:
        agent = subprocess.Popen(
            [*GW, "--mock-gpu", "--config", str(cfg), "agent", "--coordinator", site.url],
            env={**site.env, "GPUWARDEN_ENROLL_TOKEN": token},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    site.procs.append(agent)
    wait_for("envnode enrolled", lambda: "envnode" in site.nodes(), timeout=60)
    credential_file = site.tmp / "envnode" / "node-credential"
    wait_for("its credential", credential_file.exists, timeout=30)
    assert credential_file.stat().st_mode & 0o777 == 0o600
    credential = json.loads(credential_file.read_text())["token"]
    secret = credential.rsplit("_", 1)[1]  # the credential's secret part
    # a job that runs a while on that node
    with Client(site.url, site.owner, timeout=10) as c:
        job = c.submit(
            "testmods.gpu",
            {"gib": 1, "seconds": 20, "leak": False},
            constraints={"node": "envnode"},
        )
        wait_for("the job running", lambda: c.get(job["id"])["state"] == "running", timeout=60)
        me = psutil.Process(agent.pid)
        children = me.children(recursive=True)
        # the attack is in place: the job's process is there, a child of the agent, and
        # the agent was started with the token in its environment
        marked = [p for p in children if "GPUWARDEN_ATTEMPT" in _environ(p)]
        assert marked, [p.cmdline() for p in children]
        # (the agent's own first environment block keeps it: the kernel shows that to
        # its user and root only; the agent removed it from the environment it passes on)
        assert token.encode() in Path(f"/proc/{agent.pid}/environ").read_bytes()
        # the agent's command line holds neither; no child holds either anywhere
        cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline and secret.encode() not in cmdline
        leaks = [w for p in children for w in _holds(p, [token, secret])]
        assert leaks == []
        c.cancel(job["id"])
        wait_for("the job ended", lambda: c.get(job["id"])["state"] == "cancelled", timeout=60)
        # the agent is up and runs the next job
        done = c.submit("echo.echo", {"text": "after"}, constraints={"node": "envnode"})
        assert c.wait(done["id"], timeout=60)["state"] == "done"
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return dict(p.environ())
    except psutil.NoSuchProcess:
        return {}


def test_the_token_from_standard_input_enrols(site: Site) -> None:
    token = site.invite("stdin")
    with (site.tmp / "stdin.stderr").open("ab") as err:
        agent = subprocess.Popen(
            [
                *(*GW, "--mock-gpu", "--config", str(site.agent_cfg("stdin"))),
                *("agent", "--coordinator", site.url, "--enroll", "-"),
            ],
            env=site.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    site.procs.append(agent)
    assert agent.stdin is not None
    agent.stdin.write(token.encode() + b"\n")
    agent.stdin.close()
    wait_for("stdin enrolled", lambda: "stdin" in site.nodes(), timeout=60)
    assert token.encode() not in Path(f"/proc/{agent.pid}/cmdline").read_bytes()
    assert token.encode() not in Path(f"/proc/{agent.pid}/environ").read_bytes()
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0


def test_node_invite_prints_a_command_without_the_token(site: Site) -> None:
    got = site.gw("node", "invite", "printed", "--url", site.url, env={
        **site.env, "GPUWARDEN_TOKEN": site.owner
    })  # fmt: skip
    assert got.returncode == 0, got.stderr
    token = got.stdout.strip()
    assert token.startswith("gw_")
    err = " ".join(got.stderr.split())
    assert f"gpuwarden agent --coordinator {site.url} --enroll-file FILE" in err
    assert "--enroll -" in err and "GPUWARDEN_ENROLL_TOKEN" in err
    assert token not in got.stderr


def test_a_database_password_on_the_coordinators_command_line_is_refused(site: Site) -> None:
    got = site.gw("coordinator", "--db", "postgresql://gw:hunter2@127.0.0.1:1/x", "--bind", "x:1")
    assert got.returncode == 2, got.stderr
    err = " ".join(got.stderr.split())
    assert "--db holds a password" in err and "~/.pgpass" in err and "hunter2" not in err
