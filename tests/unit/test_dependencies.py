"""The dependency rule (core/dependencies.py): parsing, judging, cycles, the cascade."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.dependencies import (
    Dependency,
    DependencyError,
    DepKind,
    Standing,
    cascade,
    check_graph,
    find_cycle,
    initial,
    judge,
    parse,
    parse_all,
    standing,
)
from gpuwarden.core.states import JobState

OK, ANY, NOTOK = DepKind.AFTEROK, DepKind.AFTERANY, DepKind.AFTERNOTOK
ENDS = (JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.QUARANTINED)


def test_parse_reads_each_kind() -> None:
    assert parse("afterok:prep-1") == Dependency(OK, "prep-1")
    assert parse("afterany:a.b_c") == Dependency(ANY, "a.b_c")
    assert parse("afternotok:x") == Dependency(NOTOK, "x")
    assert str(Dependency(OK, "prep-1")) == "afterok:prep-1"


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("prep-1", "is not KIND:ID"),
        ("afterwards:prep-1", "unknown kind 'afterwards'"),
        ("afterok:", "is not a valid job id"),
        ("afterok:-x", "is not a valid job id"),
        ("afterok:a b", "is not a valid job id"),
        (3, "must be a string"),
    ],
)
def test_parse_refuses_a_malformed_entry_naming_it(entry: object, says: str) -> None:
    with pytest.raises(DependencyError, match=says):
        parse(entry)


def test_parse_all_refuses_repeats_and_too_many() -> None:
    with pytest.raises(DependencyError, match="named twice"):
        parse_all(["afterok:a", "afterok:a"])
    with pytest.raises(DependencyError, match="at most 64"):
        parse_all([f"afterok:j{i}" for i in range(65)])
    assert parse_all(["afterok:a", "afterany:a"]) == (Dependency(OK, "a"), Dependency(ANY, "a"))


@pytest.mark.parametrize(
    ("kind", "state", "expected"),
    [
        (OK, JobState.QUEUED, Standing.WAITING),
        (OK, JobState.RUNNING, Standing.WAITING),
        (OK, JobState.DONE, Standing.HOLDS),
        (OK, JobState.FAILED, Standing.NEVER),
        (OK, JobState.CANCELLED, Standing.NEVER),
        (OK, JobState.QUARANTINED, Standing.NEVER),
        (NOTOK, JobState.RUNNING, Standing.WAITING),
        (NOTOK, JobState.DONE, Standing.NEVER),
        (NOTOK, JobState.FAILED, Standing.HOLDS),
        (NOTOK, JobState.CANCELLED, Standing.HOLDS),
        (NOTOK, JobState.QUARANTINED, Standing.HOLDS),
        (ANY, JobState.QUEUED, Standing.WAITING),
        (ANY, JobState.DONE, Standing.HOLDS),
        (ANY, JobState.FAILED, Standing.HOLDS),
        (ANY, JobState.CANCELLED, Standing.HOLDS),
    ],
)
def test_standing_by_kind_and_state(kind: DepKind, state: JobState, expected: Standing) -> None:
    assert standing(Dependency(kind, "x"), state) is expected


def test_judge_reasons() -> None:
    a, b = Dependency(OK, "a"), Dependency(ANY, "b")
    assert judge([]).standing is Standing.HOLDS
    w = judge([(a, JobState.RUNNING), (b, JobState.QUEUED)])
    assert (w.standing, w.reason) == (Standing.WAITING, "waits for job a (running) and 1 more")
    assert judge([(a, JobState.DONE), (b, JobState.QUEUED)]).reason == "waits for job b (queued)"
    never = judge([(b, JobState.RUNNING), (a, JobState.FAILED)])
    assert (never.standing, never.reason) == (
        Standing.NEVER,
        "dependency afterok:a can never hold: a failed",
    )
    assert judge([(a, JobState.DONE), (b, JobState.FAILED)]).standing is Standing.HOLDS


def test_check_graph_refuses_unknown_self_and_cycles() -> None:
    def known(i: str) -> bool:
        return i == "old"

    check_graph({"a": [Dependency(OK, "old")], "b": [Dependency(OK, "a")]}, known)
    with pytest.raises(DependencyError, match="no job with id ghost"):
        check_graph({"a": [Dependency(OK, "ghost")]}, known)
    with pytest.raises(DependencyError, match="cannot depend on itself"):
        check_graph({"a": [Dependency(OK, "a")]}, known)
    with pytest.raises(DependencyError, match="cycle: a -> b -> c -> a"):
        check_graph(
            {
                "a": [Dependency(OK, "b")],
                "b": [Dependency(ANY, "c")],
                "c": [Dependency(NOTOK, "a")],
            },
            known,
        )


def test_a_long_chain_is_no_recursion_problem() -> None:
    n = 20_000
    chain = {f"j{i}": [f"j{i - 1}"] if i else [] for i in range(n)}
    assert find_cycle(chain) is None
    chain["j0"] = [f"j{n - 1}"]
    cycle = find_cycle(chain)
    assert cycle is not None and len(cycle) == n + 1


def test_initial_within_one_submission() -> None:
    new = {
        "b": [Dependency(OK, "a")],
        "a": [Dependency(OK, "old-failed")],
        "c": [Dependency(NOTOK, "a")],
        "d": [Dependency(OK, "old-done")],
    }
    out = initial(new, {"old-failed": JobState.FAILED, "old-done": JobState.DONE})
    assert out["a"].reason == "dependency afterok:old-failed can never hold: old-failed failed"
    assert out["b"].reason == "dependency afterok:a can never hold: a failed"
    # a job of the submission that fails at once is an end: afternotok on it holds
    assert out["c"].standing is Standing.HOLDS
    assert out["d"].standing is Standing.HOLDS


def test_cascade_fails_down_the_chain_and_releases_the_rest() -> None:
    deps = {
        "b": [Dependency(OK, "a")],
        "c": [Dependency(OK, "b")],
        "d": [Dependency(NOTOK, "b")],
        "e": [Dependency(ANY, "a"), Dependency(OK, "z")],
    }
    stored = {"a": JobState.RUNNING, "z": JobState.RUNNING} | dict.fromkeys(deps, JobState.QUEUED)

    def dependents(j: str) -> list[str]:
        return [k for k, ds in deps.items() if any(d.job_id == j for d in ds)]

    def deps_of(j: str) -> list[tuple[Dependency, JobState]]:
        return [(d, stored[d.job_id]) for d in deps[j]]

    out = dict(cascade("a", JobState.FAILED, dependents, deps_of))
    assert out["b"].reason == "dependency afterok:a can never hold: a failed"
    assert out["c"].reason == "dependency afterok:b can never hold: b failed"
    assert out["d"].standing is Standing.HOLDS
    assert "e" not in out  # z still runs


# -- properties -------------------------------------------------------------


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, list[str]]:
    n = draw(st.integers(1, 8))
    ids = [f"j{i}" for i in range(n)]
    return {i: draw(st.lists(st.sampled_from(ids), max_size=3, unique=True)) for i in ids}


def _reaches(graph: dict[str, list[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph[start])
    while todo:
        x = todo.pop()
        if x == goal:
            return True
        if x not in seen:
            seen.add(x)
            todo.extend(graph[x])
    return False


@given(graphs())
def test_no_cycle_is_accepted(graph: dict[str, list[str]]) -> None:
    has_cycle = any(_reaches(graph, j, j) for j in graph)
    new = {j: [Dependency(OK, d) for d in ds] for j, ds in graph.items()}
    if has_cycle:
        with pytest.raises(DependencyError):
            check_graph(new, lambda _: False)
    else:
        check_graph(new, lambda _: False)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[dict[str, list[Dependency]], dict[str, JobState]]:
    """A DAG of jobs (each depends on earlier ones) and how each would end if it ran."""
    n = draw(st.integers(1, 12))
    deps: dict[str, list[Dependency]] = {}
    ends: dict[str, JobState] = {}
    for i in range(n):
        earlier = [f"j{k}" for k in range(i)]
        targets = draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True)) if i else []
        deps[f"j{i}"] = [Dependency(draw(st.sampled_from(list(DepKind))), t) for t in targets]
        ends[f"j{i}"] = draw(st.sampled_from(ENDS))
    return deps, ends


def _run(
    deps: dict[str, list[Dependency]], ends: dict[str, JobState], picks: Sequence[int]
) -> tuple[dict[str, JobState], dict[str, str], list[str]]:
    """Submit the DAG, then run runnable jobs in the order ``picks`` chooses, each
    ending as ``ends`` says; return the final states, the cascade's reasons and the
    order in which jobs started. Checks at each start that its dependencies hold."""
    states = dict.fromkeys(deps, JobState.QUEUED)
    reasons: dict[str, str] = {}
    held = set()
    for j, v in initial(deps, {}).items():
        if v.standing is Standing.NEVER:
            states[j], reasons[j] = JobState.FAILED, v.reason
        elif v.standing is Standing.WAITING:
            held.add(j)
    started: list[str] = []
    step = 0
    while True:
        runnable = [j for j in deps if states[j] is JobState.QUEUED and j not in held]
        if not runnable:
            break
        job = runnable[picks[step % len(picks)] % len(runnable)] if picks else runnable[0]
        step += 1
        for d in deps[job]:  # the property: it never starts before its conditions
            assert standing(d, states[d.job_id]) is Standing.HOLDS
        started.append(job)
        states[job] = ends[job]
        for j, v in cascade(
            job,
            ends[job],
            lambda x: [k for k in held if any(d.job_id == x for d in deps[k])],
            lambda k: [(d, states[d.job_id]) for d in deps[k]],
        ):
            held.discard(j)
            if v.standing is Standing.NEVER:
                states[j], reasons[j] = JobState.FAILED, v.reason
    return states, reasons, started


@settings(max_examples=300)
@given(pipelines(), st.lists(st.integers(0, 100), max_size=20))
def test_dependencies_never_run_before_their_condition_and_failures_cascade(
    pipeline: tuple[dict[str, list[Dependency]], dict[str, JobState]], picks: list[int]
) -> None:
    deps, ends = pipeline
    states, reasons, started = _run(deps, ends, picks)
    # nothing is left waiting: every job ended, ran or was failed by the rule
    assert all(s.terminal for s in states.values())
    for j in deps:
        verdict = judge([(d, states[d.job_id]) for d in deps[j]])
        if j in started:
            assert verdict.standing is Standing.HOLDS
        else:  # failed by the cascade: one dependency can never hold, named in the reason
            assert verdict.standing is Standing.NEVER
            assert states[j] is JobState.FAILED
            assert reasons[j].startswith("dependency ") and "can never hold" in reasons[j]
