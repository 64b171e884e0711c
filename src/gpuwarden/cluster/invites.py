"""Who holds a node's name, for invites and enrolments (SPEC.md section 16,
"Enrolment").

A node has one live invite, the newest (the store revokes the older ones when it
makes one). An invite does not take the name of a node that is enrolled and not
revoked, its credential still good: the enrolment is refused, unless the invite
was made with ``--replace`` (``gpuwarden node invite NAME --replace``), which is
audited, and then the node's credential is revoked and its jobs go back to the
queue before the new host is enrolled in its place.
"""

from __future__ import annotations

from gpuwarden.core.model import Role
from gpuwarden.store.cluster import ClusterStore, NodeRecord, NodeState


def live_node(store: ClusterStore, name: str, now: float) -> NodeRecord | None:
    """The node ``name`` when it is enrolled, not revoked and its credential is
    still good (an enrolment would take its name from an agent that may be
    running), else None."""
    record = store.get_node(name)
    if record is None or record.state is NodeState.REVOKED or not record.token_id:
        return None
    credential = store.get_token(record.token_id)
    if credential is None or not credential.active(now):
        return None
    return record


def open_invites(store: ClusterStore, name: str) -> list[str]:
    """The ids of the node's enroll tokens not revoked (the ones a new invite revokes)."""
    return [
        t.id
        for t in store.list_tokens()
        if t.role is Role.ENROLL and t.node == name and t.revoked_at is None
    ]


def _held(record: NodeRecord, now: float) -> str:
    seen = (
        f"last heard from {max(0.0, now - record.last_seen):.0f} s ago"
        if record.last_seen is not None
        else "never heard from"
    )
    return f"node {record.name} is enrolled ({record.state.value}, {seen})"


def _ways(name: str) -> str:
    return (
        f"to enrol another host in its place, make an invite that says so: "
        f"`gpuwarden node invite {name} --replace` (its credential is then revoked and "
        f"its jobs go back to the queue; audited), or revoke it first "
        f"(`gpuwarden node revoke {name}`)"
    )


def invite_refusal(record: NodeRecord, now: float) -> str:
    """Why an invite without ``--replace`` is refused for a live node."""
    return (
        f"{_held(record, now)}: an invite for it would take its name from the agent "
        f"running it; {_ways(record.name)}. An agent of that node that lost its "
        "credential needs the same"
    )


def enrol_refusal(record: NodeRecord, now: float, token_id: str) -> str:
    """Why an enrolment with an invite made without ``--replace`` is refused."""
    return (
        f"{_held(record, now)}, and enrolment token {token_id} was not made to replace "
        f"it: refused, and the token is revoked. {_ways(record.name)[0].upper()}"
        f"{_ways(record.name)[1:]}"
    )


def replaced_reason(name: str) -> str:
    """The reason a replaced node's running attempts end with."""
    return (
        f"its node {name} was enrolled again on another host with an invite made to "
        "replace it (`node invite --replace`)"
    )
