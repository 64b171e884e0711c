"""Acceptance: a sandboxed command job through HTTP (SPEC.md, "Command jobs over
HTTP, bundles and agents") behind a real ``serve --api`` with bubblewrap: the
Python client's ``submit_command`` runs to done, its output file fetched, and
it ran in the sandbox (a file of the host's is not there); ``gpuwarden run
--url -- CMD`` streams the command's output and exits with its status;
``submit --url --wait --results-dir`` fetches its files; a host command over
HTTP and a role ``[commands] roles`` does not name are refused, saying the rule.

Needs bubblewrap: skipped without it, failed where GPUWARDEN_REQUIRE_CONTAINERS=1."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.client import Client, Forbidden, Invalid
from gpuwarden.core.model import Role
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_cli import write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env
from tests.conftest import need_tool

pytestmark = pytest.mark.timeout(240)

HOST = Principal(token_id="local", name="tester", role=Role.OWNER)
COMMANDS = '\n[commands]\nroles = ["submitter"]\n'


def with_commands(config: Path, text: str = COMMANDS) -> Path:
    config.write_text(config.read_text() + text)
    return config


def token_of(state: Path, name: str, role: str) -> str:
    store = SqliteStore(state / "gpuwarden.db")
    try:
        _, secret = issue_token(store, name=name, role=Role(role), by=HOST, now=time.time())
    finally:
        store.close()
    return secret


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[ApiBroker, Path]]:
    need_tool("bwrap")
    config = write_config(tmp_path, grace=5, extra='container_runtime = "bubblewrap"\n')
    broker = ApiBroker(with_commands(config))
    yield broker, tmp_path
    if broker.proc.poll() is None:
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(10)


def test_a_sandboxed_command_runs_through_http(site: tuple[ApiBroker, Path]) -> None:
    broker, tmp = site
    state = tmp / "state"
    secret = tmp / "host-secret.txt"
    secret.write_text("not for jobs")
    assert secret.exists()  # the attack's target is there on the host
    script = (
        f"echo on-stdout; echo on-stderr >&2; "
        f"if cat {secret} 2>/dev/null; then echo LEAKED; fi; "
        'echo "$GREETING from $(pwd)" > result.txt'
    )
    alice = token_of(state, "alice", "submitter")
    with Client(broker.url, alice) as c:
        job = c.submit_command(
            ["sh", "-c", script], name="hello", env={"GREETING": "hi"}, outputs=["result.txt"]
        )
        assert job["type"] == "command:hello[sandbox]"
        ended = c.wait(job["id"], timeout=120)
        assert ended["state"] == "done", ended
        with c.logs(job["id"]) as s:
            stdout = b"".join(s.chunks).decode()
        with c.logs(job["id"], "stderr") as s:
            stderr = b"".join(s.chunks).decode()
        assert "on-stdout" in stdout and "on-stderr" in stderr
        assert "not for jobs" not in stdout and "LEAKED" not in stdout  # the sandbox hid it
        got = c.download(job["id"], "result.txt", tmp / "fetched" / "result.txt")
        assert got.read_text().startswith("hi from /")
        # a host command and a role [commands] roles does not name: refused, saying why
        with pytest.raises(Invalid, match="local socket"):
            c.request_json("POST", "/v1/jobs", json={"command": ["id"], "uid": 0, "cwd": "/"})
    ops = token_of(state, "ops", "operator")
    with Client(broker.url, ops) as c, pytest.raises(Forbidden, match=r"\[commands\] roles"):
        c.submit_command(["id"])
    r = httpx.post(
        f"{broker.url}/v1/jobs",
        json={"type": "command:sh", "command": None},
        headers={"Authorization": f"Bearer {alice}"},
    )
    assert r.status_code == 422 and "local socket" in r.text


def test_run_and_submit_url_through_http(site: tuple[ApiBroker, Path]) -> None:
    broker, tmp = site
    alice = token_of(tmp / "state", "alice", "submitter")
    r = run_env(
        "run", "--url", broker.url, "--", "sh", "-c", "echo streamed; exit 3",
        token=alice, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    assert "streamed" in r.stdout
    assert run_env("run", "--url", broker.url, "--", "true", token=alice).returncode == 0
    out = tmp / "results"
    r = run_env(
        "submit", "--url", broker.url, "--want", "made.txt", "--wait", "--results-dir", out,
        "--", "sh", "-c", "echo made > made.txt",
        token=alice, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "made.txt").read_text() == "made\n"
    # a role the node does not allow: the rule, and how to change it
    ops = token_of(tmp / "state", "ops", "operator")
    r = run_env("run", "--url", broker.url, "--", "true", token=ops)
    assert r.returncode != 0
    assert "[commands] roles" in r.stderr and "operator" in r.stderr
