"""Job dependencies (``after``): what they mean, checked and judged. Pure.

A job may name other jobs it must wait for, each as ``KIND:ID``:

* ``afterok:ID`` holds once job ID ended ``done``;
* ``afternotok:ID`` holds once job ID ended ``failed``, ``cancelled`` or
  ``quarantined`` (every end but ``done``);
* ``afterany:ID`` holds once job ID ended, whatever the end.

All of a job's dependencies must hold before it may be planned. While one of
them waits (its job has not ended yet) the job waits, with the reason ``waits
for job X (running)``; as soon as one can never hold (``afterok`` on a job that
did not end ``done``, ``afternotok`` on one that did) the job fails, with the
reason ``dependency afterok:X can never hold: X failed``, and so on down its
own dependents (:func:`cascade`).

Since the jobs a job depends on exist before it does (or arrive with it, in one
submission), a cycle can only be made within one submission: :func:`check_graph`
refuses it, and a dependency on a job that does not exist, before anything is
stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError

__all__ = [
    "MAX_AFTER",
    "DepKind",
    "Dependency",
    "DependencyError",
    "Standing",
    "Verdict",
    "cascade",
    "check_graph",
    "find_cycle",
    "initial",
    "judge",
    "parse",
    "parse_all",
    "standing",
]

#: the most dependencies one job may name
MAX_AFTER = 64

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class DependencyError(ValidationError):
    """A job's dependencies are not valid (malformed, unknown, a cycle)."""


class DepKind(StrEnum):
    AFTEROK = "afterok"
    AFTERANY = "afterany"
    AFTERNOTOK = "afternotok"


class Standing(StrEnum):
    WAITING = "waiting"  # its job has not ended yet
    HOLDS = "holds"
    NEVER = "never"  # its job ended the wrong way: it can never hold


@dataclass(frozen=True, slots=True, order=True)
class Dependency:
    kind: DepKind
    job_id: str

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.job_id}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where a job's dependencies stand together, and the reason a person reads."""

    standing: Standing
    reason: str = ""


def parse(entry: object) -> Dependency:
    """``"afterok:prep-1"`` -> ``Dependency(AFTEROK, "prep-1")``; a
    :class:`DependencyError` that names the problem otherwise."""
    if not isinstance(entry, str):
        raise DependencyError(f"a dependency must be a string like 'afterok:ID', got {entry!r}")
    kind, sep, job_id = entry.partition(":")
    kinds = ", ".join(k.value for k in DepKind)
    if not sep:
        raise DependencyError(
            f"dependency {entry!r} is not KIND:ID (KIND one of {kinds}), e.g. 'afterok:prep-1'"
        )
    try:
        dep_kind = DepKind(kind)
    except ValueError:
        raise DependencyError(
            f"dependency {entry!r}: unknown kind {kind!r} (use one of {kinds})"
        ) from None
    if not _JOB_ID.fullmatch(job_id):
        raise DependencyError(f"dependency {entry!r}: {job_id!r} is not a valid job id")
    return Dependency(dep_kind, job_id)


def parse_all(entries: Iterable[object]) -> tuple[Dependency, ...]:
    """Every entry parsed, in order; a repeat or more than :data:`MAX_AFTER` is refused."""
    out: list[Dependency] = []
    for entry in entries:
        dep = parse(entry)
        if dep in out:
            raise DependencyError(f"dependency {dep} is named twice")
        out.append(dep)
    if len(out) > MAX_AFTER:
        raise DependencyError(f"a job may name at most {MAX_AFTER} dependencies, got {len(out)}")
    return tuple(out)


def standing(dep: Dependency, state: JobState) -> Standing:
    """Where one dependency stands, given the current state of its job."""
    if not state.terminal:
        return Standing.WAITING
    if dep.kind is DepKind.AFTERANY:
        return Standing.HOLDS
    ok = state is JobState.DONE
    return Standing.HOLDS if ok == (dep.kind is DepKind.AFTEROK) else Standing.NEVER


def judge(deps: Sequence[tuple[Dependency, JobState]]) -> Verdict:
    """All of a job's dependencies together: never as soon as one can never hold,
    waiting while one waits, else holds (also when there are none)."""
    waiting: list[tuple[Dependency, JobState]] = []
    for dep, state in deps:
        s = standing(dep, state)
        if s is Standing.NEVER:
            return Verdict(
                Standing.NEVER,
                f"dependency {dep} can never hold: {dep.job_id} {state.value}",
            )
        if s is Standing.WAITING:
            waiting.append((dep, state))
    if not waiting:
        return Verdict(Standing.HOLDS)
    first, state = waiting[0]
    more = f" and {len(waiting) - 1} more" if len(waiting) > 1 else ""
    return Verdict(Standing.WAITING, f"waits for job {first.job_id} ({state.value}){more}")


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of ``graph`` (job -> the jobs it depends on) as a path that starts and
    ends with the same job, or None. Iterative: a chain of any length is fine."""
    done: set[str] = set()
    for root in graph:
        if root in done:
            continue
        path: list[str] = [root]
        on_path = {root}
        stack = [iter(graph.get(root, ()))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                gone = path.pop()
                on_path.discard(gone)
                done.add(gone)
                continue
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done or nxt not in graph:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(graph[nxt]))
    return None


def check_graph(new: Mapping[str, Sequence[Dependency]], exists: Callable[[str], bool]) -> None:
    """Refuse a submission's dependencies (``new``: each new job's, by id) that name
    a job neither in the submission nor stored (``exists``), or make a cycle."""
    for job_id, deps in new.items():
        for dep in deps:
            if dep.job_id == job_id:
                raise DependencyError(f"job {job_id} cannot depend on itself ({dep})")
            if dep.job_id not in new and not exists(dep.job_id):
                raise DependencyError(
                    f"job {job_id}: dependency {dep}: no job with id {dep.job_id}"
                )
    cycle = find_cycle({j: [d.job_id for d in deps] for j, deps in new.items()})
    if cycle is not None:
        raise DependencyError(f"dependencies make a cycle: {' -> '.join(cycle)}")


def initial(
    new: Mapping[str, Sequence[Dependency]], state_of: Mapping[str, JobState]
) -> dict[str, Verdict]:
    """Where each new job of a submission stands when it is stored: its
    dependencies on stored jobs judged by their states (``state_of``), on jobs of
    the same submission as queued ones (or failed, when that one can never run
    either). ``new`` must have passed :func:`check_graph`."""
    out: dict[str, Verdict] = {}
    states = dict(state_of)
    for job_id in _in_order(new):
        deps = new[job_id]
        verdict = judge([(d, states.get(d.job_id, JobState.QUEUED)) for d in deps])
        out[job_id] = verdict
        states[job_id] = JobState.FAILED if verdict.standing is Standing.NEVER else JobState.QUEUED
    return out


def _in_order(new: Mapping[str, Sequence[Dependency]]) -> list[str]:
    """The new jobs, each after the new jobs it depends on (no cycle)."""
    order: list[str] = []
    seen: set[str] = set()
    for root in new:
        stack = [(root, False)]
        while stack:
            job_id, expanded = stack.pop()
            if expanded:
                order.append(job_id)
                continue
            if job_id in seen:
                continue
            seen.add(job_id)
            stack.append((job_id, True))
            stack.extend((d.job_id, False) for d in new[job_id] if d.job_id in new)
    return order


def cascade(
    ended: str,
    state: JobState,
    dependents: Callable[[str], Iterable[str]],
    deps_of: Callable[[str], Sequence[tuple[Dependency, JobState]]],
) -> list[tuple[str, Verdict]]:
    """What follows from job ``ended`` reaching the terminal ``state``: each waiting
    dependent (``dependents``: the jobs still held that name a job) whose
    dependencies now hold (to be released) or can never hold (to fail, and so on
    down its own dependents), in the order decided. ``deps_of`` gives a job's
    dependencies with their jobs' states as stored; those decided here win."""
    decided: dict[str, Verdict] = {}
    states: dict[str, JobState] = {ended: state}
    work = [ended]
    while work:
        for dependent in dependents(work.pop()):
            if dependent in decided:
                continue
            verdict = judge([(d, states.get(d.job_id, s)) for d, s in deps_of(dependent)])
            if verdict.standing is Standing.WAITING:
                continue
            decided[dependent] = verdict
            if verdict.standing is Standing.NEVER:
                states[dependent] = JobState.FAILED
                work.append(dependent)
    return list(decided.items())
