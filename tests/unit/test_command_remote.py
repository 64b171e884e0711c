"""Command jobs from HTTP, bundles and a coordinator (SPEC.md, "Command jobs over
HTTP, bundles and agents"): placement offers a sandboxed one only to a node that
says it runs them, never a host one; an agent refuses a host command whatever its
coordinator sends; a manifest's ``command`` makes a sandboxed command job and
never a host one; a node without a sandbox refuses them."""

from __future__ import annotations

import json

import pytest

from gpuwarden.cluster.nodeview import _commands
from gpuwarden.cluster.sync import command_ability, payload_command
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.core.model import Lane, LaunchMode
from gpuwarden.core.placement import NO_COMMANDS, NodeView, Offerable, type_refusal
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import manifest_doc, parse_manifest
from gpuwarden.registry import command_job_type

BWRAP = LaunchRules(runtime=Runtime.BUBBLEWRAP)


def offer(type_name: str, launch: LaunchMode) -> Offerable:
    return Offerable(
        id="j", type=type_name, lane=Lane.VRAM, vram_bytes=0, priority=0, seq=1,
        submitted_at=0.0, launch=launch,
    )  # fmt: skip


def test_placement_offers_command_jobs_only_where_a_node_runs_them() -> None:
    boxed = offer("command:x[sandbox]", LaunchMode.CONTAINER)
    runs = NodeView("a", rules=BWRAP, modules=frozenset({"m.t"}), commands=None)
    assert type_refusal(boxed, runs) is None
    silent = NodeView("b", rules=BWRAP, modules=frozenset({"m.t"}))  # an older agent
    assert type_refusal(boxed, silent) == NO_COMMANDS
    said = NodeView("c", rules=BWRAP, commands="runs no command jobs (no sandbox)")
    assert type_refusal(boxed, said) == "runs no command jobs (no sandbox)"
    host = offer("command:x", LaunchMode.HOST)
    assert "host command" in (type_refusal(host, runs) or "")


def test_what_an_agent_reports_of_command_jobs() -> None:
    assert command_ability(["submitter"], BWRAP) == ""
    assert "[commands] roles is empty" in command_ability([], BWRAP)
    local = LaunchRules(allow_unsandboxed_containers=True)
    assert "no sandbox" in command_ability(["owner"], local)
    assert _commands("") is None and _commands(None) == NO_COMMANDS
    assert _commands(7) == NO_COMMANDS and _commands("x" * 1000) == "x" * 300


def test_an_agent_refuses_a_host_command_whatever_the_coordinator_sends() -> None:
    boxed = {"type": "command:sh[sandbox]", "command": {"argv": ["sh"], "cwd": "", "env": {}}}
    assert payload_command(boxed, "") == (CommandSpec(("sh",)), "")
    attacks = [
        {"type": "command:sh", "command": {"argv": ["sh"], "cwd": "/", "uid": 0, "gid": 0}},
        {**boxed, "command": {"argv": ["sh"], "cwd": "", "uid": 0, "gid": 0}},
        {**boxed, "command": {"argv": ["sh"], "cwd": "/root"}},
    ]
    for payload in attacks:
        cmd, why = payload_command(payload, "")
        assert cmd is None and "host command never runs on an agent" in why
    cmd, why = payload_command(boxed, "runs no command jobs (x)")
    assert cmd is None and why == "this node runs no command jobs (x)"
    assert payload_command({"type": "m.t", "command": {"argv": ["sh"]}}, "")[1]
    assert payload_command({"type": "command:sh[sandbox]"}, "")[1]
    assert payload_command({"type": "m.t"}, "") == (None, "")


def test_a_node_without_a_sandbox_refuses_a_sandboxed_command() -> None:
    jobtype = command_job_type("command:x[sandbox]")
    local = LaunchRules(allow_unsandboxed_containers=True)  # modules' container types run
    assert "runs only in a sandbox" in (local.refusal(jobtype) or "")
    assert BWRAP.refusal(jobtype) is None
    assert local.refusal(command_job_type("command:x")) is None  # [commands] users decides


def manifest(job: dict[str, object]) -> bytes:
    return json.dumps({"version": 1, "jobs": [{"id": "c1", **job}]}).encode()


def test_a_manifest_command_is_a_sandboxed_command_job() -> None:
    [job] = parse_manifest(
        manifest(
            {"command": ["sh", "-c", "true"], "name": "t", "env": {"A": "1"},
             "share_gpu": True, "preempt": "SIGUSR1", "timeout_s": 60, "outputs": ["o"]}
        )
    )  # fmt: skip
    assert job.type == "command:t[share,preempt=SIGUSR1,timeout=60,sandbox]"
    assert job.command == CommandSpec(("sh", "-c", "true"), "", {"A": "1"})
    again = parse_manifest(json.dumps(manifest_doc([job])).encode())
    assert again == (job,)


@pytest.mark.parametrize(
    ("job", "words"),
    [
        ({"command": ["id"], "uid": 0}, "local socket"),
        ({"command": ["id"], "cwd": "/root"}, "local socket"),
        ({"command": ["id"], "type": "echo.echo"}, "not both"),
        ({"type": "echo.echo", "env": {"A": "1"}}, "cannot set environment"),
        ({"type": "echo.echo", "share_gpu": True}, "for a command job"),
        ({"command": []}, "empty"),
        ({"command": ["id"], "env": {"GPUWARDEN_X": "1"}}, "may not set"),
        ({"command": ["id"], "env": {"LD_PRELOAD": "/x.so"}}, "may not set"),
        ({"command": ["id"], "env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "may not set"),
        ({"command": ["id"], "preempt": "SIGKILL"}, "preempt"),
        ({"type": "command:sh"}, "module.type"),
    ],
)
def test_a_manifest_never_makes_a_host_command(job: dict[str, object], words: str) -> None:
    with pytest.raises(BundleError, match=words):
        parse_manifest(manifest(job))
