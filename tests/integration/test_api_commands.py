"""Command jobs over HTTP (SPEC.md, "Command jobs over HTTP, bundles and agents"):
``POST /v1/jobs`` with ``command`` makes a sandboxed command job, only for a
token whose role ``[commands] roles`` names and only on a node with a sandbox; a
host command (a user, a folder, a type without ``sandbox``) is never taken over
HTTP, and each refusal names its rule. The real run is in
``tests/acceptance/test_command_remote.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.config import Config
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.model import Role
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_api import REPO, Api, Clock

RUN = {"command": ["python3", "-c", "print('hi')"]}


def build(tmp: Path, *, roles: list[str], runtime: str = "bubblewrap") -> Api:
    config = Config.model_validate(
        {
            "state_dir": tmp,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "container_runtime": runtime,
            "allow_unsandboxed_containers": True,
            "allow_host_jobs": True,  # echo.echo, a host type on the cpu lane
            "api": {"rate_per_s": 10_000, "burst": 10_000},
            "commands": {"roles": roles},
        }
    )
    store = SqliteStore(tmp / "gpuwarden.db")
    clock = Clock()
    registry = Registry.load(config.module_paths, config.launch_rules)
    client = TestClient(create_app(store, registry, config, monotonic=clock))
    a = Api(tmp=tmp, config=config, store=store, client=client, clock=clock)
    for role in Role:  # an enroll token is bound to a node (refused otherwise)
        a.token(role.value, role, **({"node": "n"} if role is Role.ENROLL else {}))
    return a


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path, roles=["submitter"])
    yield a
    a.store.close()


def post(a: Api, who: str, body: dict[str, Any]) -> Any:
    return a.client.post("/v1/jobs", json=body, headers=a.h(who))


def test_a_command_is_stored_sandboxed_with_its_options(api: Api) -> None:
    r = post(
        api,
        "submitter",
        {
            **RUN,
            "name": "hello",
            "env": {"GREETING": "hi"},
            "share_gpu": True,
            "preempt": "SIGUSR2",
            "timeout_s": 60,
            "outputs": ["out.txt"],
            "vram_gib": 1,
        },
    )
    assert r.status_code == 201, r.text
    job = api.store.get_job(r.json()["id"])
    assert job is not None
    assert job.type == "command:hello[share,preempt=SIGUSR2,timeout=60,sandbox]"
    assert job.id.startswith(f"{api.id_of('submitter')}-hello-")  # a submitter's own id
    # run as the sandbox's user, in its output folder: nothing of a host's user
    assert job.command == CommandSpec(("python3", "-c", "print('hi')"), "", {"GREETING": "hi"})
    assert job.outputs == ("out.txt",)
    # its name by default is the program's
    r = post(api, "submitter", RUN)
    assert r.status_code == 201, r.text
    assert r.json()["type"] == "command:python3[sandbox]"


@pytest.mark.parametrize("key", ["uid", "cwd", "groups", "user"])
def test_a_host_command_is_refused_over_http(api: Api, key: str) -> None:
    value: Any = {"uid": 0, "cwd": "/root", "groups": [0], "user": "root"}[key]
    r = post(api, "owner", {**RUN, key: value})
    assert r.status_code == 422
    assert "local socket" in r.json()["error"] and key in r.json()["error"]
    assert api.store.list_jobs() == []


@pytest.mark.parametrize("type_name", ["command:sh", "command:sh[sandbox]"])
def test_a_command_type_is_refused_over_http(api: Api, type_name: str) -> None:
    """A host command's type (which would run as... nobody the kernel named) and
    a sandboxed one's without its command: over HTTP only ``command`` makes one."""
    r = post(api, "owner", {"type": type_name})
    assert r.status_code == 422
    assert '"command": [...]' in r.json()["error"] and "local socket" in r.json()["error"]
    assert api.store.list_jobs() == []


def test_a_role_not_in_commands_roles_is_refused_with_the_rule(api: Api) -> None:
    r = post(api, "operator", RUN)
    assert r.status_code == 403
    message = r.json()["error"]
    assert "[commands] roles" in message and "operator" in message and "add" in message
    assert api.store.list_jobs() == []
    # the same token may submit a module's job: the rule is for commands only
    assert post(api, "operator", {"type": "echo.echo", "params": {"text": "x"}}).status_code == 201


def test_no_roles_refuses_every_token(tmp_path: Path) -> None:
    a = build(tmp_path, roles=[])
    try:
        r = post(a, "owner", RUN)
        assert r.status_code == 403 and "[commands] roles = []" in r.json()["error"]
    finally:
        a.store.close()


def test_a_node_without_a_sandbox_refuses_with_the_rule(tmp_path: Path) -> None:
    """allow_unsandboxed_containers runs a module's container type as a host
    process; a command from HTTP never runs unsandboxed."""
    a = build(tmp_path, roles=["owner"], runtime="local")
    try:
        assert post(a, "owner", {"type": "echo.echo", "params": {"text": "x"}}).status_code == 201
        r = post(a, "owner", RUN)
        assert r.status_code == 422
        message = r.json()["error"]
        assert "runs only in a sandbox" in message
        assert 'container_runtime to "bubblewrap"' in message
        assert [j.type for j in a.store.list_jobs()] == ["echo.echo"]
    finally:
        a.store.close()


@pytest.mark.parametrize(
    "body",
    [
        {**RUN, "type": "echo.echo"},
        {"command": []},
        {**RUN, "env": {"CUDA_VISIBLE_DEVICES": "1"}},
        {**RUN, "env": {"GPUWARDEN_JOB_ID": "x"}},
        {**RUN, "env": {"LD_PRELOAD": "/tmp/x.so"}},
        {**RUN, "preempt": "SIGKILL"},
        {**RUN, "name": "../x"},
        {**RUN, "params": {"text": "x"}},
        {**RUN, "service": "web"},
    ],
)
def test_a_bad_command_is_refused(api: Api, body: dict[str, Any]) -> None:
    r = post(api, "submitter", body)
    assert r.status_code == 422, r.text
    assert api.store.list_jobs() == []
