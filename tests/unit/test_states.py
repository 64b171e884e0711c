"""The job state transition table: every (source, target) pair, checked one by one."""

from __future__ import annotations

import itertools

import pytest

from gpuwarden.core.states import TERMINAL, JobState, allowed, check, sources
from gpuwarden.errors import GpuwardenError, TransitionError

Q = JobState.QUEUED
R = JobState.RUNNING
D = JobState.DONE
F = JobState.FAILED
C = JobState.CANCELLED
X = JobState.QUARANTINED

# Written out by hand from DESIGN.md and the state docs, not derived from TRANSITIONS.
ALLOWED: frozenset[tuple[JobState, JobState]] = frozenset(
    {
        (Q, R),  # started
        (R, Q),  # retried, or interrupted by a broker restart
        (R, D),  # succeeded
        (Q, F),  # failed before it ever ran
        (R, F),  # failed while running
        (Q, C),  # cancelled while queued
        (R, C),  # cancelled while running
        (R, X),  # quarantined when an attempt's infrastructure failure used the last retry
    }
)

ALL_PAIRS = list(itertools.product(list(JobState), repeat=2))
FORBIDDEN = [pair for pair in ALL_PAIRS if pair not in ALLOWED]


def _pair_id(pair: tuple[JobState, JobState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def test_the_states_are_exactly_these() -> None:
    # If a state is added, this file's literal table must be extended by hand.
    assert {s.value for s in JobState} == {
        "queued",
        "running",
        "done",
        "failed",
        "cancelled",
        "quarantined",
    }
    assert len(ALL_PAIRS) == 36


def test_allowed_table_only_names_real_pairs() -> None:
    assert ALLOWED.issubset(ALL_PAIRS)
    assert len(ALLOWED) == 8
    assert len(FORBIDDEN) == 28


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_pair_id)
def test_every_pair(pair: tuple[JobState, JobState]) -> None:
    source, target = pair
    if pair in ALLOWED:
        assert allowed(source, target) is True
        check(source, target)  # does not raise
    else:
        assert allowed(source, target) is False
        with pytest.raises(TransitionError) as info:
            check(source, target)
        message = str(info.value)
        assert f"from {source.value} to {target.value}" in message
        assert source.value in message
        assert target.value in message


@pytest.mark.parametrize("pair", FORBIDDEN, ids=_pair_id)
def test_forbidden_message_lists_the_legal_sources(pair: tuple[JobState, JobState]) -> None:
    source, target = pair
    legal = sorted(s.value for s, t in ALLOWED if t is target)
    with pytest.raises(TransitionError) as info:
        check(source, target)
    assert str(info.value) == (
        f"a job cannot go from {source.value} to {target.value}; "
        f"it can go to {target.value} only from {', '.join(legal)}"
    )


def test_transition_error_is_not_a_user_error() -> None:
    # A forbidden transition is a bug or a lost race, not a user's mistake.
    with pytest.raises(GpuwardenError) as info:
        check(D, R)
    assert isinstance(info.value, TransitionError)
    assert info.value.message == str(info.value)


def test_terminal_states() -> None:
    assert frozenset({D, F, C, X}) == TERMINAL
    assert {s for s in JobState if s.terminal} == {D, F, C, X}
    assert not Q.terminal
    assert not R.terminal


@pytest.mark.parametrize("source", [D, F, C], ids=lambda s: s.value)
def test_terminal_states_have_no_way_out(source: JobState) -> None:
    for target in JobState:
        assert not allowed(source, target)
        with pytest.raises(TransitionError):
            check(source, target)


@pytest.mark.parametrize("state", list(JobState), ids=lambda s: s.value)
def test_no_state_moves_to_itself(state: JobState) -> None:
    assert not allowed(state, state)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (Q, frozenset({R})),
        (R, frozenset({Q})),
        (D, frozenset({R})),
        (F, frozenset({Q, R})),
        (C, frozenset({Q, R})),
    ],
    ids=lambda v: v.value if isinstance(v, JobState) else "",
)
def test_sources(target: JobState, expected: frozenset[JobState]) -> None:
    assert sources(target) == expected
    assert expected == frozenset(s for s, t in ALLOWED if t is target)


def test_every_non_terminal_state_reaches_a_terminal_state() -> None:
    for start in (Q, R):
        seen = {start}
        frontier = [start]
        while frontier:
            s = frontier.pop()
            for t in JobState:
                if allowed(s, t) and t not in seen:
                    seen.add(t)
                    frontier.append(t)
        assert seen >= TERMINAL, start
