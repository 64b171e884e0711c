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


# -- container_runtime = "auto" --------------------------------------------------------

FOUND = "bubblewrap 0.8.0 works (/usr/bin/bwrap)"
MISSING = "bwrap is not on PATH; install bubblewrap 0.8.0 or later: sudo apt-get install bubblewrap"


def test_auto_without_a_sandbox_refuses_what_needs_one_and_says_what_auto_found() -> None:
    rules = LaunchRules(runtime=Runtime.LOCAL, auto=MISSING)
    assert runs(rules) == {CPU_HOST.name}  # the same rules as "local": nothing by surprise
    why = rules.refusal(VRAM_CONTAINER)
    assert why == (
        'm.vram_container is a container type and container_runtime = "auto" found no '
        f"sandbox here: {MISSING}. Or set allow_unsandboxed_containers = true to run it as "
        "a plain host process"
    )
    assert rules.unsandboxed_summary(ALL) is None  # nothing runs unsandboxed
    assert {t.name: rules.where(t) for t in ALL} == {
        CPU_HOST.name: "host process",
        CPU_CONTAINER.name: "refused",
        VRAM_HOST.name: "refused",
        VRAM_CONTAINER.name: "refused",
        VRAM_SERVE.name: "refused",
    }


def test_auto_without_a_sandbox_but_allowed_runs_them_unsandboxed_and_says_so_once() -> None:
    rules = LaunchRules(runtime=Runtime.LOCAL, allow_unsandboxed_containers=True, auto=MISSING)
    assert runs(rules) == {CPU_HOST.name, CPU_CONTAINER.name, VRAM_CONTAINER.name, VRAM_SERVE.name}
    reason = (
        'container and serve types; container_runtime = "auto" found no sandbox here '
        f"({MISSING}), and allow_unsandboxed_containers = true"
    )
    assert rules.unsandboxed_reason(VRAM_SERVE) == reason
    assert rules.unsandboxed_reason(CPU_HOST) is None  # nothing here is sandboxed
    assert rules.unsandboxed_reason(VRAM_HOST) is None  # refused, so it does not run
    assert rules.unsandboxed_summary(ALL) == (
        "UNSANDBOXED on this node, as plain host processes with the broker's user: "
        f"m.cpu_container, m.vram_container, m.vram_serve ({reason}). Host types run as "
        "host processes too: nothing is sandboxed on this node. Each unsandboxed attempt "
        "is marked 'unsandboxed' in the event log."
    )
    warning = rules.unsandboxed_warning(VRAM_CONTAINER) or ""
    assert warning.startswith("UNSANDBOXED: m.vram_container is a container type") and (
        MISSING in warning
    )
    assert rules.where(VRAM_SERVE) == "UNSANDBOXED"


def test_auto_with_bubblewrap_sandboxes_and_names_the_host_types_beside_it() -> None:
    rules = LaunchRules(runtime=Runtime.BUBBLEWRAP, allow_host_jobs=True, auto=FOUND)
    assert runs(rules) == {t.name for t in ALL}
    assert rules.where(VRAM_CONTAINER) == "sandboxed: bubblewrap"
    assert rules.where(CPU_HOST) == "UNSANDBOXED"
    assert rules.unsandboxed_summary(ALL) == (
        "UNSANDBOXED on this node, as plain host processes with the broker's user: "
        "m.cpu_host, m.vram_host (host types beside the bubblewrap sandbox; "
        "allow_host_jobs = true). Every other type that runs here is sandboxed in "
        'bubblewrap (chosen by container_runtime = "auto"). Each unsandboxed attempt is '
        "marked 'unsandboxed' in the event log."
    )
    strict = LaunchRules(runtime=Runtime.BUBBLEWRAP, auto=FOUND)
    assert strict.refusal(CPU_HOST) == (
        "m.cpu_host is a host type (no sandbox) and this node runs jobs in bubblewrap "
        '(chosen by container_runtime = "auto"): run a container type instead, or set '
        "allow_host_jobs = true"
    )
    assert strict.unsandboxed_summary(ALL) is None


def test_a_named_runtime_summary_does_not_mention_auto() -> None:
    rules = LaunchRules(runtime=Runtime.PODMAN, allow_host_jobs=True)
    summary = rules.unsandboxed_summary([CPU_HOST, VRAM_SERVE]) or ""
    assert "m.cpu_host (host types beside the podman sandbox" in summary
    assert "sandboxed in podman." in summary and "auto" not in summary
    assert LaunchRules().unsandboxed_summary(ALL) is None


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
