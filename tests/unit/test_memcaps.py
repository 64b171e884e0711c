"""Memory cgroups for RAM caps, without root: the OOM counter of both cgroup
versions, names that could leave the parent, how a cap is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.launch.base import LaunchRequest, attempt_name
from gpuwarden.launch.memcaps import MemoryCgroups, cap_text, oom_kills

V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n"


def test_the_oom_kill_count_of_both_versions() -> None:
    assert oom_kills(V1_OOM_CONTROL) == 3
    assert oom_kills(V2_EVENTS) == 2  # not oom_group_kill, not oom
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0  # an old kernel: no counter
    assert oom_kills("") == 0
    assert oom_kills("oom_kill many\n") == 0


def test_a_cgroup_name_cannot_leave_the_parent() -> None:
    cg = MemoryCgroups(Path("/sys/fs/cgroup/memory"), 1)
    assert cg.path("gpuwarden-abc-j1-1") == Path(
        "/sys/fs/cgroup/memory/gpuwarden/gpuwarden-abc-j1-1"
    )
    for bad in ("", "..", ".", "a/b", "/", "../x", "a\0b"):
        with pytest.raises(ValueError, match="not a cgroup name"):
            cg.path(bad)


def test_an_attempts_name_is_one_path_component_whatever_the_job_id() -> None:
    req = LaunchRequest("../../etc/x y", 2, (), "/", {}, "/", 1.0, instance="node:/state")
    name = attempt_name(req)
    assert "/" not in name and name.endswith("-2") and name.startswith("gpuwarden-")
    MemoryCgroups(Path("/sys/fs/cgroup/memory"), 1).path(name)  # accepted


def test_caps_are_written_in_gib_with_two_decimals() -> None:
    assert cap_text(2 * 2**30) == "2.00 GiB"
    assert cap_text(64 * 2**20) == "0.06 GiB"
