"""Who may use a service at /run/<name>/, and what its unavailable page says
(core/serviceroute.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwarden.core.model import Role
from gpuwarden.core.serviceroute import ServiceRoute, availability, may_reach

ROUTE = ServiceRoute(
    name="nb",
    job_id="j1",
    owner="aaaaaaaaaaaa",
    share=("cccccccccccc", "operator"),
    state="healthy",
    upstream="http://127.0.0.1:1",
    credential="x",
    since=100.0,
    last_ok=190.0,
)


@pytest.mark.parametrize(
    ("token", "role", "ok"),
    [
        ("aaaaaaaaaaaa", Role.SUBMITTER, True),  # the job's owner
        ("bbbbbbbbbbbb", Role.SUBMITTER, False),
        ("cccccccccccc", Role.SUBMITTER, True),  # named in share
        ("dddddddddddd", Role.OPERATOR, True),  # its role is in share
        ("eeeeeeeeeeee", Role.OWNER, True),
        ("cccccccccccc", Role.NODE, False),  # a node token never, whatever share says
    ],
)
def test_may_reach(token: str, role: Role, ok: bool) -> None:
    assert may_reach(ROUTE, token_id=token, role=role) is ok


def test_a_job_of_the_hosts_owner_is_for_owners_and_operators() -> None:
    local = replace(ROUTE, owner=None, share=())
    assert may_reach(local, token_id="dddddddddddd", role=Role.OPERATOR)
    assert not may_reach(local, token_id="aaaaaaaaaaaa", role=Role.SUBMITTER)


def test_availability_words() -> None:
    assert availability(ROUTE, 200.0) is None
    stopped = availability(replace(ROUTE, state="stopped"), 200.0)
    assert stopped is not None
    assert stopped.message.startswith("nb is unavailable, last seen 10 s ago")
    never = availability(replace(ROUTE, state="unhealthy", last_ok=None), 200.0)
    assert never is not None and "nb is unavailable, never seen healthy" in never.message
    starting = availability(replace(ROUTE, state="starting"), 200.0)
    assert starting is not None and starting.retry_after_s == 2 and "starting" in starting.message
