"""Acceptance (issue 29, VRAM leases): ``gpuwarden lease`` through the real CLI
against ``gpuwarden serve`` on one simulated 24 GiB GPU (SQLite store).

- a lease that must evict an idle warm server and ask a managed runtime (the
  ComfyUI stand-in) to release before it is granted;
- a lease whose holder stops renewing it expires, with the reason;
- a lease with a command: the command sees CUDA_VISIBLE_DEVICES, its exit
  status is the CLI's, and the lease ends with it;
- a typed job waits behind a lease, and ``explain`` says so.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_cli import GW, Broker, env
from tests.acceptance.test_runtimes_serve import (
    MODEL_GIB,
    Stack,
    comfy_holds,
    comfy_prompt,
    comfy_runtime,
    until,
)

GIB = 1024**3
EXIT_3 = ("sh", "-c", 'echo "cvd=$CUDA_VISIBLE_DEVICES"; exit 3')


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def lease_proc(s: Stack, *args: str) -> subprocess.Popen[str]:
    """``gpuwarden lease ARGS`` in the background (its output read at the end)."""
    return subprocess.Popen(
        [*GW, "--config", str(s.config), "lease", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )


def lease_id(s: Stack, state: str = "running") -> str:
    """The one lease in ``state``, from ``lease list``."""

    def look() -> str:
        r = s.cli("lease", "list")
        m = re.search(rf"^(lease-[0-9a-f]+)\s+{state}\b", r.stdout, re.M)
        return m.group(1) if m else ""

    return str(until(look, f"a lease {state}"))


def serve_plain(s: Stack) -> Broker:
    s.broker = Broker(s.config, s.log)
    return s.broker


def run_lease(s: Stack, vram: str) -> tuple[str, str]:
    """``lease --vram VRAM -- python3 -c PRINT-CUDA_VISIBLE_DEVICES``; its id and stderr."""
    script = 'import os; print("cvd=" + os.environ["CUDA_VISIBLE_DEVICES"])'
    p = lease_proc(s, "--vram", vram, "--", "python3", "-c", script)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stdout + stderr
    assert f"cvd={s.gpu}" in stdout, stdout
    m = re.search(r"lease (lease-[0-9a-f]+): granted on (GPU-\S+)", stdout)
    assert m and m.group(2) == s.gpu, stdout
    assert s.job(m.group(1))["state"] == "done"
    return m.group(1), stderr


def test_leases_ask_a_runtime_to_release_and_evict_an_idle_warm_server_before_their_grant(
    stack: Stack,
) -> None:
    """24 GiB less 512 MiB reserve: a 12 GiB lease fits beside the runtime's
    16 GiB only once the runtime released it; then a 20 GiB lease fits only once
    an idle warm server (6 GiB, not co-resident) is evicted."""
    s = stack
    comfy = s.standin("comfyui")
    comfy_prompt(comfy, MODEL_GIB, 0)
    until(lambda: comfy_holds(comfy) == MODEL_GIB * GIB, "the ComfyUI model loaded")
    s.serve(comfy_runtime(comfy, grace_s=0))
    first, _ = run_lease(s, "12G")
    # the fault happened first: the runtime was asked, and only then granted
    [asked] = s.events("runtime_release_requested")
    assert asked["job"] == first, asked
    [granted] = [
        e for e in s.events("transition") if e.get("job") == first and e["to"] == "running"
    ]
    assert granted["ts"] >= asked["ts"]
    r = s.cli("submit", "testmods.warm", "--id", "w1", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    until(lambda: [w for w in s.node()["warm"] if w["state"] == "idle"], "an idle warm server")
    second, stderr = run_lease(s, "20G")
    [evicted] = s.events("warm_server_stopping")
    assert evicted["type"] == "testmods.warm" and f"needed by job {second}" in evicted["reason"]
    [started] = [
        e for e in s.events("transition") if e.get("job") == second and e["to"] == "running"
    ]
    assert started["ts"] >= evicted["ts"]
    assert "waiting for its grant" in stderr or "queued" in stderr, stderr
    s.assert_alive()


def test_an_unrenewed_lease_expires_with_its_reason(stack: Stack) -> None:
    s = stack
    serve_plain(s)
    # a ttl long enough that a CLI call on a loaded machine reads it before it runs out
    p = lease_proc(s, "--vram", "2G", "--ttl", "15s")
    lid = lease_id(s)
    until(lambda: "renewed every" in (p.stderr.readline() if p.stderr else ""), "holding")
    os.kill(p.pid, signal.SIGKILL)  # its holder is gone: nobody renews it
    assert p.wait(10) == -signal.SIGKILL
    assert s.job(lid)["state"] == "running"  # not ended by its holder's death: by its ttl
    job = until(lambda: (j := s.job(lid))["state"] != "running" and j, "the lease's end", 45)
    assert job["state"] == "failed", job
    assert job["reason"] == "lease expired: not renewed within its ttl of 15 s", job


def test_a_lease_with_a_command_ends_with_it_and_keeps_its_exit_status(stack: Stack) -> None:
    s = stack
    serve_plain(s)
    r = subprocess.run(
        [*GW, "--config", str(s.config), "lease", "--vram", "512M", "--", *EXIT_3],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"cvd={s.gpu}" in r.stdout, r.stdout
    m = re.search(r"lease (lease-[0-9a-f]+): granted on (GPU-\S+)", r.stdout)
    assert m and m.group(2) == s.gpu, r.stdout
    job = s.job(m.group(1))
    assert job["state"] == "done", job
    assert job["reason"] == "ended by its holder: its command exited with 3", job


def test_a_typed_job_waits_behind_a_lease_and_says_so(stack: Stack) -> None:
    s = stack
    serve_plain(s)
    p = lease_proc(s, "--vram", "20G", "--for", "60s")
    try:
        lid = lease_id(s)
        s.submit("behind-1")

        def says() -> str:
            said = s.cli("explain", "behind-1").stdout
            return said if f"lease {lid}" in said else ""

        said = until(says, "explain to name the lease")
        assert "it waits:" in said and f"lease {lid} of 20.0 GiB" in said, said
        assert s.job("behind-1")["state"] == "queued"
        r = s.cli("lease", "end", lid)
        assert r.returncode == 0, r.stderr
        job = until(lambda: (j := s.job("behind-1"))["state"] == "done" and j, "the job ran")
        assert job["state"] == "done"
        assert s.job(lid)["reason"].startswith("ended by its holder"), s.job(lid)
    finally:
        p.terminate()
        p.wait(10)


def test_a_lease_over_http_runs_its_command_on_this_host_and_ends_with_it(
    tmp_path: Path,
) -> None:
    """``lease --url`` through a real ``serve --api``: granted, renewed (the command
    outlasts the 6 s ttl), the
    command's status kept; a URL of another host is refused for a command."""
    from tests.acceptance.test_cli import run, write_config
    from tests.acceptance.test_cli_api import ApiBroker, run_env

    config = write_config(tmp_path)
    b = ApiBroker(config)
    try:
        made = run("--config", config, "token", "create", "me", "--role", "submitter", "--json")
        token = __import__("json").loads(made.stdout)["token"]
        r = run_env(
            "--config", config, "lease", "--url", b.url, "--vram", "1G", "--ttl", "6s",
            "--", "sh", "-c", 'sleep 8; echo "cvd=$CUDA_VISIBLE_DEVICES"; exit 3',
            token=token,
        )  # fmt: skip
        assert r.returncode == 3, r.stdout + r.stderr
        m = re.search(r"lease (\S+): granted on (GPU-\S+)", r.stdout)
        assert m and f"cvd={m.group(2)}" in r.stdout, r.stdout
        shown = run_env("show", "--url", b.url, m.group(1), "--json", token=token)
        job = __import__("json").loads(shown.stdout)
        assert job["state"] == "done", job
        assert job["reason"] == "ended by its holder: its command exited with 3", job
        r = run_env(
            "lease", "--url", "http://gpu-box.invalid:8765", "--vram", "1G", "--", "true",
            token=token,
        )  # fmt: skip
        assert r.returncode != 0 and "another host" in r.stderr, r.stderr
    finally:
        b.stop()
