"""The shipped examples: the configs load and mean what their comments say, and
the systemd units name commands and flags that exist, never a secret on a command
line (`systemd-analyze verify` where it is installed, and a parse of ExecStart by
gpuwarden's own argument parser everywhere)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpuwarden.cli import build_parser
from gpuwarden.cluster.enrolment import ENROLL_ENV
from gpuwarden.config import load_config
from gpuwarden.core.launchrules import LaunchRules, Runtime

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
UNITS = sorted((EXAMPLES / "systemd").glob("*.service"))


def unit(path: Path) -> dict[str, list[str]]:
    """A unit file's keys (a key may repeat) with their values, section by section
    as ``Section.Key``."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {raw!r}"
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def test_the_example_configs_load() -> None:
    coordinator = load_config(EXAMPLES / "coordinator.toml")
    agent = load_config(EXAMPLES / "agent.toml")
    assert load_config(EXAMPLES / "local.toml").database == ""
    # the coordinator runs nothing: no launch rule of its own
    raw = tomllib.loads((EXAMPLES / "coordinator.toml").read_text())
    rule_keys = {"container_runtime", "allow_unsandboxed_containers", "allow_host_jobs"}
    assert not rule_keys & raw.keys()
    assert coordinator.launch_rules == LaunchRules()
    assert coordinator.database.startswith("postgresql://")
    assert urlsplit(coordinator.database).password is None  # libpq's pgpass holds it
    assert coordinator.cluster.coordinator_url.startswith("http")
    # the agent has launch rules of its own and its own store; it knows the coordinator
    assert agent.database == ""
    assert agent.launch_rules == LaunchRules(runtime=Runtime.BUBBLEWRAP)
    assert agent.cluster.coordinator_url == coordinator.cluster.coordinator_url
    assert agent.cluster.labels == {"rack": "a"}


def test_there_is_a_unit_for_serve_coordinator_and_agent() -> None:
    names = {p.name for p in UNITS}
    assert names == {
        "gpuwarden-serve.service",
        "gpuwarden-coordinator.service",
        "gpuwarden-agent.service",
    }


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_unit_starts_a_command_that_exists_with_flags_that_exist(path: Path) -> None:
    keys = unit(path)
    [exec_start] = keys["Service.ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "gpuwarden"
    args = build_parser().parse_args(argv[1:])  # an unknown flag exits here
    command = path.stem.removeprefix("gpuwarden-")
    assert args.command == command
    config = Path(argv[argv.index("--config") + 1])
    assert config.parent == Path("/etc/gpuwarden")
    if command != "serve":  # serve's config is examples/local.toml, made one's own
        assert (EXAMPLES / config.name).is_file(), f"{config.name} is not in examples/"
    # no secret on the command line: every user of the host can read it
    assert not [a for a in argv if a.startswith("gw_")]
    assert "--enroll" not in argv and "--db" not in argv
    assert keys["Install.WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("name", ["serve", "agent"])
def test_a_stop_of_a_unit_that_runs_jobs_kills_no_job(name: str) -> None:
    # every job runs under its own supervisor in the unit's cgroup: only the broker
    # may be signalled (KillMode=process), or `systemctl restart` stops every job
    keys = unit(EXAMPLES / "systemd" / f"gpuwarden-{name}.service")
    assert keys["Service.KillMode"] == ["process"]
    config = load_config(EXAMPLES / ("local.toml" if name == "serve" else "agent.toml"))
    assert config.broker.on_stop == "leave"


def test_the_agent_unit_takes_its_enrolment_token_from_a_file_only() -> None:
    keys = unit(EXAMPLES / "systemd" / "gpuwarden-agent.service")
    [env_file] = keys["Service.EnvironmentFile"]
    assert env_file.startswith("-/etc/gpuwarden/")  # optional: later starts need none
    text = (EXAMPLES / "systemd" / "gpuwarden-agent.service").read_text()
    assert f"{ENROLL_ENV}=gw_" in text and "mode 600" in text
    assert "Service.Environment" not in keys  # never in the unit itself (systemctl show)
    assert keys["Service.RestartPreventExitStatus"] == ["3"]  # revoked


def test_the_coordinator_unit_keeps_its_state_where_its_config_says() -> None:
    keys = unit(EXAMPLES / "systemd" / "gpuwarden-coordinator.service")
    coordinator = load_config(EXAMPLES / "coordinator.toml")
    [state] = keys["Service.StateDirectory"]
    assert coordinator.state_dir == Path("/var/lib") / state
    assert keys["Service.Environment"] == ["PGPASSFILE=%d/pgpass"]
    [cred] = keys["Service.LoadCredential"]
    assert cred.startswith("pgpass:")


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed; the units were parsed above")
    exe = Path(sys.executable).with_name("gpuwarden")
    assert exe.is_file(), exe
    for path in UNITS:
        # the installed path of the examples, here the one this checkout's venv has
        text = path.read_text().replace("/usr/local/bin/gpuwarden", str(exe))
        (tmp_path / path.name).write_text(text)
    done = subprocess.run(
        [analyze, "verify", *(str(tmp_path / p.name) for p in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpuwarden" not in done.stderr, done.stderr
