"""Placement of jobs from a pinned commit (core/placement.py, core/sources.py): a
job whose module comes from a commit is offered only to a node that says it runs
jobs from commits of its repository; what a node says of it is hostile input."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.core.model import Lane
from gpuwarden.core.placement import NodeView, Offerable, never_placeable, offers_for
from gpuwarden.core.sources import MAX_ALLOW, MAX_URL, SourceAbility, reported_ability

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "https://git.example.org/team/mymod"
PODMAN = LaunchRules(Runtime.PODMAN)


def src_job(i: int = 1, repo: str = REPO) -> Offerable:
    return Offerable(
        id=f"s{i}",
        type=f"mymod.train@{SHA}",
        lane=Lane.CPU,
        vram_bytes=0,
        priority=0,
        seq=i,
        submitted_at=100.0,
        source_repo=repo,
    )


def node(name: str, sources: SourceAbility | None, rules: LaunchRules = PODMAN) -> NodeView:
    # its types and modules never hold m.t@<commit>: a commit's type is no module's
    return NodeView(
        name, types=frozenset({"echo.echo"}), modules=frozenset({"echo.echo"}), rules=rules,
        sources=sources,
    )  # fmt: skip


RUNS = SourceAbility(runs=True, allow=("https://git.example.org/team/*",))


def test_a_job_from_a_commit_goes_only_to_a_node_that_runs_its_repository() -> None:
    job = src_job()
    assert offers_for(node("yes", RUNS), [job], [], now=100) == ["s1"]
    others = [
        node("silent", None),
        node("local", SourceAbility(runs=False, allow=RUNS.allow)),
        node("empty", SourceAbility(runs=True)),
        node("elsewhere", SourceAbility(runs=True, allow=("https://other.org/*",))),
    ]
    for n in others:
        assert offers_for(n, [job], [], now=100) == [], n.name


def test_never_placeable_says_no_node_runs_jobs_from_commits_of_the_repository() -> None:
    nodes = [
        node("a", SourceAbility(runs=False)),
        node("b", SourceAbility(runs=True, allow=("https://other.org/*",))),
    ]
    why = never_placeable(src_job(), nodes)
    assert why is not None
    assert why.startswith(f"no node runs jobs from commits of {REPO}: ")
    assert "a: runs no jobs from commits (its container_runtime is not podman or docker)" in why
    assert "b: does not run jobs from commits of" in why and "https://other.org/*" in why
    assert never_placeable(src_job(), [*nodes, node("c", RUNS)]) is None
    # at submission the nodes' [sources] do not count (a config edit away): it waits
    assert never_placeable(src_job(), nodes, sources=False) is None


def test_a_node_whose_launch_rules_refuse_containers_never_takes_one() -> None:
    local = node("l", RUNS, LaunchRules(Runtime.LOCAL))
    assert offers_for(local, [src_job()], [], now=100) == []
    why = never_placeable(src_job(), [local])
    assert why is not None and "container" in why
    # not at submission: it waits for a node that runs it
    assert never_placeable(src_job(), [local], sources=False) is None


def test_a_plain_job_is_judged_as_before() -> None:
    plain = Offerable(
        id="p", type="echo.echo", lane=Lane.CPU, vram_bytes=0, priority=0, seq=1,
        submitted_at=100.0,
    )  # fmt: skip
    assert offers_for(node("n", None), [plain], [], now=100) == ["p"]


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "yes",
        [],
        {"runs": "true", "allow": []},
        {"runs": 1, "allow": []},
        {"runs": True},
        {"runs": True, "allow": "https://*"},
        {"runs": True, "allow": [3]},
        {"runs": True, "allow": [""]},
        {"runs": True, "allow": ["http://insecure/*"]},
        {"runs": True, "allow": ["https://x/\n*"]},
        {"runs": True, "allow": ["https://" + "a" * MAX_URL]},
        {"runs": True, "allow": [f"https://h{i}/*" for i in range(MAX_ALLOW + 1)]},
    ],
)
def test_a_malformed_report_runs_no_job_from_a_commit(raw: Any) -> None:
    assert reported_ability(raw) is None


def test_a_well_formed_report_is_taken() -> None:
    got = reported_ability({"runs": True, "allow": ["file:///srv/*", "ssh://git@h/*"], "x": 1})
    assert got == SourceAbility(True, ("file:///srv/*", "ssh://git@h/*"))
    assert got.refusal("file:///srv/repo") is None
    assert reported_ability({"runs": False, "allow": []}) == SourceAbility(False)
