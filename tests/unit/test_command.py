"""Command jobs' pure rules (SPEC.md, "Command jobs"): the type's grammar, the
name, the command's checks, who may run one, human units, ``--array``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.cli.run import parse_array
from gpuwarden.core import command
from gpuwarden.core.command import CommandOptions, CommandSpec, LocalUser
from gpuwarden.core.policy import GpuView
from gpuwarden.core.units import parse_bytes, parse_duration
from gpuwarden.node.measured import Footprints, RunTimes
from gpuwarden.registry import Registry, command_job_type
from gpuwarden.store.sqlite import SqliteStore

GIB = 1 << 30


def test_the_type_names_its_options_and_reads_back() -> None:
    options = CommandOptions(share=True, preempt="SIGUSR2", timeout_s=7200, sandbox=False)
    name = command.type_name("train", options)
    assert name == "command:train[share,preempt=SIGUSR2,timeout=7200]"
    assert command.parse_type(name) == ("train", options)
    assert command.type_name("train") == "command:train"
    assert command.profile_key(name) == "command:train"
    assert command.profile_key("burn.llm") == "burn.llm"


@given(
    share=st.booleans(),
    preempt=st.sampled_from([None, *command.SIGNALS]),
    timeout=st.one_of(st.none(), st.floats(min_value=0.5, max_value=1e8)),
    sandbox=st.booleans(),
)
def test_every_type_reads_back_as_written(
    share: bool, preempt: str | None, timeout: float | None, sandbox: bool
) -> None:
    options = CommandOptions(share, preempt, timeout, sandbox)
    name = command.type_name("x", options)
    assert command.parse_type(name) == ("x", options)


@pytest.mark.parametrize(
    "text",
    [
        "command:",
        "command:bad name",
        "command:x[share",
        "command:x[bogus]",
        "command:x[timeout=-1]",
        "command:x[preempt=SIGKILL]",
        "command:x[sandbox,share]",  # not in the one order: two names for one type
        "burn.llm",
    ],
)
def test_a_bad_type_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        command.parse_type(text)


def test_the_default_name_is_the_programs() -> None:
    assert command.default_name(["/usr/bin/python3", "train.py"]) == "python3"
    assert command.default_name(["./my script.sh"]) == "my-script.sh"
    assert command.default_name(["..."]) == "command"


def test_the_registry_makes_a_command_type_when_asked() -> None:
    registry = Registry.load([], builtin=False, installed=False)
    jobtype = registry.types["command:train[share,timeout=60]"]
    assert (jobtype.coresident, jobtype.timeout_s, jobtype.launch.value) == (True, 60.0, "host")
    assert "command:train" in registry.types
    assert registry.types.get("command:bad name") is None
    assert "nope.nope" not in registry.types
    sandboxed = command_job_type("command:train[sandbox]")
    assert sandboxed.launch.value == "container"
    # a host command is not judged by the launch rules (its user is)
    assert registry.rules.refusal(jobtype) is None


def test_the_command_is_checked() -> None:
    argv, env, cwd = command.check_command(["echo", "hi"], {"A": "1"}, "/tmp", sandboxed=False)
    assert (argv, env, cwd) == (("echo", "hi"), {"A": "1"}, "/tmp")
    for bad_argv in ([], "echo hi", ["a\0b"], [""], [1]):
        with pytest.raises(ValueError):
            command.check_command(bad_argv, {}, "/tmp", sandboxed=False)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        command.check_command(["x"], {"CUDA_VISIBLE_DEVICES": "0"}, "/tmp", sandboxed=False)
    with pytest.raises(ValueError, match="GPUWARDEN_JOB_ID"):
        command.check_command(["x"], {"GPUWARDEN_JOB_ID": "y"}, "/tmp", sandboxed=False)
    with pytest.raises(ValueError, match="absolute"):
        command.check_command(["x"], {}, "relative", sandboxed=False)
    with pytest.raises(ValueError, match="output folder"):
        command.check_command(["x"], {}, "/tmp", sandboxed=True)


def test_a_command_spec_round_trips() -> None:
    spec = CommandSpec(("a", "b"), "/w", {"K": "V"}, 1000, 1000, (27, 1000), 3)
    assert CommandSpec.from_json(spec.to_json()) == spec
    sandboxed = CommandSpec(("a",))
    assert CommandSpec.from_json(sandboxed.to_json()) == sandboxed


ALICE = LocalUser(1001, 1001, "alice", (1001, 44), ("alice", "video"))


def test_who_may_run_commands() -> None:
    def refusal(user: LocalUser, users: tuple[str, ...] = (), groups: tuple[str, ...] = ()):
        return command.user_refusal(user, users=users, groups=groups, state_owner=1500)

    assert refusal(LocalUser(0, 0, "root")) is None
    assert refusal(LocalUser(1500, 1500, "owner")) is None
    why = refusal(ALICE)
    assert why is not None and "[commands] users" in why and "alice" in why
    assert refusal(ALICE, users=("alice",)) is None
    assert refusal(ALICE, users=("1001",)) is None
    assert refusal(ALICE, groups=("video",)) is None
    assert refusal(ALICE, groups=("44",)) is None
    # once the lists are set, the state directory's owner is one user among others
    assert refusal(LocalUser(1500, 1500, "owner"), users=("alice",)) is not None


def test_human_units() -> None:
    assert parse_bytes("10G") == 10 * GIB
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1.5g") == int(1.5 * GIB)
    assert parse_bytes("24GiB") == 24 * GIB
    assert parse_duration("90s") == 90
    assert parse_duration("10m") == 600
    assert parse_duration("2h") == 7200
    assert parse_duration("45") == 45
    with pytest.raises(ValueError, match="--vram 10X: write it as a number with G or M"):
        parse_bytes("10X")
    with pytest.raises(ValueError, match="--est 5y"):
        parse_duration("5y", option="--est")


def test_array_specs() -> None:
    assert parse_array("0-3") == {"indices": [0, 1, 2, 3], "limit": 0}
    assert parse_array("1,3,5%2") == {"indices": [1, 3, 5], "limit": 2}
    assert parse_array("0-2,7") == {"indices": [0, 1, 2, 7], "limit": 0}
    for bad in ("", "a-b", "3-1", "0-3%0", "0-3%x", "1,1", "0-100000"):
        with pytest.raises(ValueError):
            parse_array(bad)


def test_what_a_command_measured_sizes_the_next_run_of_its_name(tmp_path: Path) -> None:
    """Measured under ``command:NAME`` whatever the options: a run with
    ``--share-gpu`` raises the footprint the next plain run is admitted with."""
    store = SqliteStore(tmp_path / "s.db")
    try:
        footprints = Footprints(store, step_bytes=64 << 20)
        registry = Registry.load([], builtin=False, installed=False)
        shared = registry.types["command:train[share]"]
        plain = registry.types["command:train"]
        other = registry.types["command:eval"]
        gpus = [GpuView("GPU-0", 24 * GIB)]
        assert footprints.of(plain, 2 * GIB) == 2 * GIB
        footprints.measure(shared, 5 * GIB, override=2 * GIB, source="a", gpus=gpus, now=1.0)
        assert footprints.of(plain, 2 * GIB) == 5 * GIB  # sized by what train used
        assert footprints.of(other, 2 * GIB) == 2 * GIB  # another name is not
        # kept in the store: a restarted broker reads it back
        assert Footprints(store, step_bytes=64 << 20).of(plain, None) == 5 * GIB
        times = RunTimes([("command:train[share]", 30.0), ("command:train", 50.0)])
        assert times.times("command:train[timeout=60]") == [50.0, 30.0]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--queue", "/tmp/q"], "--queue is not taken by a command job"),
        (["--want", "out.txt"], "--want is not taken by a command job on the host"),
        (["--constraint", "node=a"], "--constraint is not taken by a command job"),
        (["--epochs", "3"], "unexpected '--epochs' before --"),
        (["--array", "0-3%0"], "after % give how many may run at once"),
        (["--vram", "10X"], "--vram 10X: write it as a number with G or M"),
        (["--env", "CUDA_VISIBLE_DEVICES=0"], "a command may not set it"),
    ],
)
def test_submit_says_what_a_command_job_does_not_take(
    words: list[str], said: str, tmp_path: Path
) -> None:
    """Said at once, before anything is asked of a broker (none runs here)."""
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "--state-dir", str(tmp_path / "none"), "submit",
         *words, "--", "true"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and said in " ".join(done.stderr.split()), done.stderr
