"""Acceptance: `serve --api` in a subprocess, a token made locally, and the CLI
talking to the broker through HTTP (submit --wait, jobs, show, status, cancel)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.acceptance.test_cli import GW, env, run, wait_for, write_config


class ApiBroker:
    """``gpuwarden serve --api 127.0.0.1:0`` in a subprocess; ``url`` is where it listens."""

    def __init__(self, config: Path) -> None:
        self.stderr = config.parent / "serve.stderr"
        self.proc = subprocess.Popen(
            [*GW, "--config", str(config), "serve", "--api", "127.0.0.1:0",
             "--log", str(config.parent / "events.jsonl")],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr.open("w"),
            env=env(),
            start_new_session=True,
        )  # fmt: skip
        found: list[str] = []

        def listening() -> bool:
            m = re.search(r"api\s+(http://127\.0\.0\.1:\d+)", self.stderr.read_text())
            if m:
                found.append(m.group(1))
            return bool(m) or self.proc.poll() is not None

        wait_for(listening, "serve --api")
        assert self.proc.poll() is None, self.stderr.read_text()
        self.url = found[0]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ApiBroker]]:
    config = write_config(tmp_path, extra="[api]\nmax_body_mib = 0.01\n")
    b = ApiBroker(config)
    yield config, b
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)


def run_env(
    *args: str | Path, token: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    e = env()
    if token is not None:
        e["GPUWARDEN_TOKEN"] = token
    return subprocess.run(
        [*GW, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=e
    )


def test_submit_and_list_through_http(served: tuple[Path, ApiBroker], tmp_path: Path) -> None:
    config, broker = served
    made = run("--config", config, "token", "create", "admin", "--role", "owner", "--json")
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)["token"]
    assert token.startswith("gw_")

    r = run_env(
        "submit", "--url", broker.url, "echo.echo", "--id", "http-1", "--text", "hello",
        "--wait", "--wait-timeout", "60", token=token,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"submitted http-1 (echo.echo) to {broker.url}" in r.stdout
    assert re.search(r"status\s+done", r.stdout)
    assert re.search(r"content\s+hello", r.stdout)

    r = run_env("jobs", "--url", broker.url, token=token)
    assert r.returncode == 0 and "http-1" in r.stdout and "done" in r.stdout
    r = run_env("jobs", "--url", broker.url, "--json", token=token)
    [job] = json.loads(r.stdout)
    assert job["id"] == "http-1" and job["owner"] == token[3:15]
    r = run_env("show", "--url", broker.url, "http-1", token=token)
    assert r.returncode == 0 and "http-1" in r.stdout and "succeeded" in r.stdout
    r = run_env("status", "--url", broker.url, token=token)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "node accept" in r.stdout

    # a results dir gets the outputs through the API
    out = tmp_path / "results"
    r = run_env(
        "submit", "--url", broker.url, "echo.echo", "--text", "again", "--output", "d/x.txt",
        "--wait", "--results-dir", out, token=token,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "d" / "x.txt").read_text() == "again"

    # cancel a job that runs until released (never: the cancel ends it), through HTTP
    r = run_env(
        "submit", "--url", broker.url, "testmods.hold", "--id", "sleepy",
        "--until", tmp_path / "never", token=token,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = run_env("cancel", "--url", broker.url, "sleepy", token=token)
    assert r.returncode == 0 and "sleepy" in r.stdout
    r = run_env("cancel", "--url", broker.url, "nope", token=token)
    assert r.returncode == 2 and "no job with id 'nope'" in r.stderr

    # the audit log has it all, made locally and through HTTP
    r = run("--config", config, "audit", "--json")
    actions = [(row["action"], row["outcome"]) for row in json.loads(r.stdout)]
    assert ("token.create", "ok") in actions
    assert actions.count(("job.submit", "ok")) == 3
    assert ("job.cancel", "ok") in actions
    assert broker.stop() == 0


def test_token_file_revocation_and_limits(served: tuple[Path, ApiBroker], tmp_path: Path) -> None:
    config, broker = served
    token_file = tmp_path / "token"
    made = run(
        "--config", config, "token", "create", "ci", "--role", "submitter", "--save", token_file
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token_file.read_text().strip() == token
    assert token_file.stat().st_mode & 0o777 == 0o600

    r = run_env("jobs", "--url", broker.url, "--token-file", token_file)
    assert r.returncode == 0, r.stderr
    os.chmod(token_file, 0o644)
    r = run_env("jobs", "--url", broker.url, "--token-file", token_file)
    assert r.returncode == 2 and "chmod 600" in r.stderr
    os.chmod(token_file, 0o600)
    r = run_env("jobs", "--url", broker.url, "--token-file", tmp_path / "missing")
    assert r.returncode == 2 and "no token" in r.stderr

    # a submitter may not read the audit log through HTTP
    h = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{broker.url}/v1/audit", headers=h).status_code == 403

    # a chunked body over api.max_body_mib (10 KiB here) is refused by the real server
    def chunks() -> Iterator[bytes]:
        yield b'{"type": "echo.echo", "params": {"text": "'
        for _ in range(200):
            yield b"x" * 4096
        yield b'"}}'

    r2 = httpx.post(
        f"{broker.url}/v1/jobs",
        content=chunks(),
        headers={**h, "Content-Type": "application/json"},
        timeout=30,
    )
    assert r2.status_code == 413 and "larger than the API accepts" in r2.json()["error"]

    listed = run("--config", config, "token", "list", "--json")
    ci = next(t for t in json.loads(listed.stdout) if t["name"] == "ci")
    r = run("--config", config, "token", "revoke", ci["id"])
    assert r.returncode == 0 and "revoked" in r.stdout
    deadline = time.monotonic() + 5
    r = run_env("jobs", "--url", broker.url, "--token-file", token_file)
    while r.returncode == 0 and time.monotonic() < deadline:  # pragma: no cover - no cache
        r = run_env("jobs", "--url", broker.url, "--token-file", token_file)
    assert r.returncode == 2 and "revoked" in r.stderr
    r = run("--config", config, "audit")
    assert r.returncode == 0 and "token.revoke" in r.stdout
    assert broker.stop() == 0
