"""``gpuwarden doctor``'s sandbox check on what issue 11 added: user namespaces,
mount, the seccomp filter, the size of /tmp and how processes are limited, under
bubblewrap and podman for real (GPUWARDEN_REQUIRE_CONTAINERS=1 in CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.config import load_config
from gpuwarden.tools.doctor import Host, Status, check_sandbox, judge
from tests.conftest import need_tool
from tests.integration.test_doctor import MODULES, doctor_json, env, write_config


def test_judge_flags_a_probe_without_namespace_blocking_seccomp_or_tmp_limit(
    tmp_path: Path,
) -> None:
    """The probe as a plain host process (root, no sandbox): everything the
    sandbox adds is missing, and the judgement says so."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    subprocess.run(
        [sys.executable, str(MODULES / "probe" / "src" / "probe.py")],
        env=env(GPUWARDEN_OUTPUT_DIR=str(out), GPUWARDEN_SCRATCH_DIR=str(scratch)),
        capture_output=True,
        timeout=60,
        check=True,
    )
    report = json.loads((out / "report.json").read_text())
    assert report["userns"]["ok"] is True  # on the host it can: the check can fail
    problems, _, _ = judge(report, "127.0.0.1:9", tmp_bytes=2**20)
    text = "; ".join(problems)
    assert "can make a user namespace" in text
    assert "no seccomp filter is loaded" in text
    assert "/tmp holds" in text and "more than [sandbox] tmp_mib (1 MiB)" in text


@pytest.mark.parametrize("runtime", ["bubblewrap", "podman"])
def test_the_sandbox_check_shows_what_the_sandbox_refuses(
    runtime: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    body = f'gpu = "sim"\ncontainer_runtime = "{runtime}"\n'
    if runtime == "podman":
        body += f'sandbox_image = "{request.getfixturevalue("podman_image")}"\n'
    else:
        need_tool("bwrap")
    cfg = write_config(tmp_path, body + "[sandbox]\ntmp_mib = 32\n")
    rc, data, checks = doctor_json(cfg)
    sandbox = checks["sandbox"]
    assert sandbox["status"] == "OK", sandbox
    detail = sandbox["detail"]
    assert "user namespace refused (EPERM)" in detail
    assert "seccomp filter (keyctl EPERM)" in detail
    assert "/tmp 32 MiB" in detail
    if runtime == "podman":
        assert "pids 512 per container (--pids-limit)" in detail
    else:
        assert "pids 512 per sandbox: a pids cgroup per sandbox under" in detail
    assert rc == 0, data


def test_without_a_pids_cgroup_the_shared_nproc_limit_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_tool("bwrap")
    cfg = write_config(tmp_path, 'gpu = "sim"\ncontainer_runtime = "bubblewrap"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpuwarden.launch.sandbox.find_pids_cgroups", lambda: None)
    config = load_config(cfg)
    host = Host(config_path=cfg, config=config, config_ok=True, runtime_ok=True)
    check = check_sandbox(host)
    assert check.status is Status.WARN, check
    assert "RLIMIT_NPROC 512" in check.detail and "all sandboxes together" in check.detail
    assert "pids cgroup controller" in check.fix
