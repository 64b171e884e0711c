"""The launch rules: which types run on a node, and the job-spec keys that could
widen a sandbox."""

from __future__ import annotations

import pytest

from gpuwarden.core.launchrules import LaunchRules, Runtime, image_is_pinned, widening_refusal
from gpuwarden.core.model import JobType, Lane, LaunchMode


def jt(lane: Lane, launch: LaunchMode) -> JobType:
    return JobType(
        name=f"m.{lane.value}_{launch.value}",
        module="m",
        module_dir="/m",
        lane=lane,
        launch=launch,
        command=("x",),
        vram_bytes=1 if lane is Lane.VRAM else 0,
    )


CPU_HOST = jt(Lane.CPU, LaunchMode.HOST)
CPU_CONTAINER = jt(Lane.CPU, LaunchMode.CONTAINER)
VRAM_HOST = jt(Lane.VRAM, LaunchMode.HOST)
VRAM_CONTAINER = jt(Lane.VRAM, LaunchMode.CONTAINER)
VRAM_SERVE = jt(Lane.VRAM, LaunchMode.SERVE)
ALL = (CPU_HOST, CPU_CONTAINER, VRAM_HOST, VRAM_CONTAINER, VRAM_SERVE)


def runs(rules: LaunchRules) -> set[str]:
    return {t.name for t in ALL if rules.refusal(t) is None}


def test_local_without_allowances_runs_only_cpu_host_types() -> None:
    assert runs(LaunchRules()) == {CPU_HOST.name}


def test_local_with_unsandboxed_containers_runs_container_and_serve_types_but_not_vram_host() -> (
    None
):
    rules = LaunchRules(allow_unsandboxed_containers=True)
    assert runs(rules) == {CPU_HOST.name, CPU_CONTAINER.name, VRAM_CONTAINER.name, VRAM_SERVE.name}
    assert not rules.sandboxed(CPU_CONTAINER)
    assert "UNSANDBOXED" in (rules.unsandboxed_warning(VRAM_SERVE) or "")
    assert rules.unsandboxed_warning(CPU_HOST) is None


def test_vram_host_type_refusal_says_what_to_change() -> None:
    why = LaunchRules(allow_unsandboxed_containers=True).refusal(VRAM_HOST)
    assert why is not None and 'launch = "container"' in why


def test_container_type_refusal_on_local_names_both_ways_out() -> None:
    why = LaunchRules().refusal(CPU_CONTAINER)
    assert why is not None
    assert "allow_unsandboxed_containers = true" in why and "bubblewrap" in why


@pytest.mark.parametrize("runtime", [Runtime.PODMAN, Runtime.DOCKER, Runtime.BUBBLEWRAP])
def test_a_real_runtime_refuses_host_types_unless_allowed(runtime: Runtime) -> None:
    strict = LaunchRules(runtime=runtime)
    assert runs(strict) == {CPU_CONTAINER.name, VRAM_CONTAINER.name, VRAM_SERVE.name}
    assert "allow_host_jobs = true" in (strict.refusal(CPU_HOST) or "")
    assert strict.sandboxed(VRAM_SERVE) and strict.sandboxed(CPU_CONTAINER)
    assert not strict.sandboxed(CPU_HOST)
    assert runs(LaunchRules(runtime=runtime, allow_host_jobs=True)) == {t.name for t in ALL}


@pytest.mark.parametrize("runtime", [Runtime.PODMAN, Runtime.DOCKER, Runtime.BUBBLEWRAP])
def test_a_host_type_beside_a_sandbox_runtime_is_marked_unsandboxed(runtime: Runtime) -> None:
    rules = LaunchRules(runtime=runtime, allow_host_jobs=True)
    warning = rules.unsandboxed_warning(CPU_HOST)
    assert warning is not None and warning.startswith("UNSANDBOXED: m.cpu_host is a host type")
    assert runtime.value in warning and "allow_host_jobs = true" in warning
    # sandboxed types beside it are not
    for sandboxed in (CPU_CONTAINER, VRAM_CONTAINER, VRAM_SERVE):
        assert rules.unsandboxed_warning(sandboxed) is None


def test_unchecked_rules_refuse_nothing() -> None:
    assert runs(LaunchRules.unchecked()) == {t.name for t in ALL}


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        ("localhost/gpuwarden-sandbox@sha256:" + "a" * 64, True),
        ("sha256:" + "0123456789ab" * 4 + "0" * 16, True),
        ("3c10cb1bc1d9", True),
        ("3c10cb1bc1d9c8a65d689857cbf5420d2cb3ac9cd279e436017a4f427210945f", True),
        ("python:3.11-slim", False),
        ("localhost/gpuwarden-sandbox:latest", False),
        ("localhost/x@sha256:short", False),
        ("3C10CB1BC1D9", False),
        ("", False),
    ],
)
def test_image_is_pinned(image: str, pinned: bool) -> None:
    assert image_is_pinned(image) is pinned


def test_widening_keys_are_refused_and_ld_preload_is_named() -> None:
    why = widening_refusal(
        "env", {"LD_PRELOAD": "/tmp/x.so", "FOO": "1", "NVIDIA_VISIBLE_DEVICES": "all"}
    )
    assert why is not None
    assert "LD_PRELOAD" in why and "NVIDIA_VISIBLE_DEVICES" in why and "FOO" not in why
    for key in ("mounts", "volumes", "devices", "privileged", "cap_add", "network", "image"):
        assert widening_refusal(key, []) is not None, key
    assert widening_refusal("params", {}) is None
    assert widening_refusal("priority", 1) is None


def test_a_nodes_short_refusal_says_which_types_and_why() -> None:
    assert LaunchRules().node_refusal(LaunchMode.CONTAINER, Lane.CPU) == (
        "refuses container types (its runtime is local)"
    )
    assert LaunchRules().node_refusal(LaunchMode.SERVE, Lane.VRAM) == (
        "refuses serve types (its runtime is local)"
    )
    assert LaunchRules(runtime=Runtime.PODMAN).node_refusal(LaunchMode.HOST, Lane.CPU) == (
        "refuses host types (its runtime is podman)"
    )
    assert "vram lane" in (LaunchRules().node_refusal(LaunchMode.HOST, Lane.VRAM) or "")
    # the short reason refuses exactly what the long one does
    for rules in (
        LaunchRules(),
        LaunchRules(allow_unsandboxed_containers=True),
        LaunchRules(runtime=Runtime.BUBBLEWRAP),
        LaunchRules(runtime=Runtime.DOCKER, allow_host_jobs=True),
    ):
        for t in ALL:
            assert (rules.node_refusal(t.launch, t.lane) is None) == (rules.refusal(t) is None)


def test_rules_go_through_json_and_garbage_is_no_rules() -> None:
    for rules in (LaunchRules(), LaunchRules(runtime=Runtime.BUBBLEWRAP, allow_host_jobs=True)):
        assert LaunchRules.from_json(rules.to_json()) == rules
    assert LaunchRules.from_json(None) is None
    assert LaunchRules.from_json("local") is None
    assert LaunchRules.from_json({"runtime": "chroot"}) is None
    bad_flag = {**LaunchRules().to_json(), "allow_host_jobs": "yes"}
    assert LaunchRules.from_json(bad_flag) is None
