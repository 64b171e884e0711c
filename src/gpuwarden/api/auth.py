"""API tokens and roles: the token format, its hash, and who may do what.

A token is ``gw_<id>_<secret>``: ``id`` is 12 hex digits, the part the store is
searched by; ``secret`` is ``secrets.token_urlsafe(32)`` (256 random bits). The
store keeps only ``sha256(secret)`` in hex, and a presented secret is compared
with :func:`hmac.compare_digest`. The whole token is shown once, when it is made.

:data:`MATRIX` is the one permission table: for every action, what each role may
do: ``ALL`` (every job), ``OWN`` (only the jobs its token submitted) or nothing.
Every API route names its action (``gpuwarden.api.app.action``); a route with no
row here is refused to everyone.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

from gpuwarden.cluster import invites
from gpuwarden.cluster.coordinator import NODE_NAME
from gpuwarden.config import PriorityLimits
from gpuwarden.core.model import Role
from gpuwarden.errors import GpuwardenError, NotAllowedError, UserError
from gpuwarden.store.base import AuditRow, Store, TokenRecord
from gpuwarden.store.cluster import ClusterStore

__all__ = [
    "MATRIX",
    "MUTATING",
    "PUBLIC",
    "SESSION_ROLES",
    "AuthFailed",
    "Invite",
    "NodeHeld",
    "Principal",
    "Role",
    "Scope",
    "allowed",
    "authenticate",
    "authenticate_session",
    "hash_secret",
    "issue_invite",
    "issue_token",
    "needed_roles",
    "new_token",
    "parse_token",
]

TOKEN_PREFIX = "gw_"  # noqa: S105 - a prefix, not a secret
_TOKEN = re.compile(r"^gw_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
#: the actor of what the machine's owner does through the CLI on the host
LOCAL = "local"
#: how long an enrolment token from ``node invite`` is valid
INVITE_TTL_S = 15 * 60.0


class Scope(StrEnum):
    ALL = "all"  # every job
    OWN = "own"  # only the jobs its own token submitted


ALL, OWN = Scope.ALL, Scope.OWN

# fmt: off
#: action -> what (owner, operator, submitter, node, enroll) may do. None: refused.
MATRIX: dict[str, tuple[Scope | None, Scope | None, Scope | None, Scope | None, Scope | None]] = {
    #                 owner operator submitter node  enroll
    "job.submit":    (ALL,  ALL,     OWN,      None, None),
    "job.list":      (ALL,  ALL,     OWN,      None, None),
    "job.read":      (ALL,  ALL,     OWN,      None, None),
    "job.cancel":    (ALL,  ALL,     OWN,      None, None),
    "job.stop":      (ALL,  ALL,     OWN,      None, None),
    # job control (SPEC.md section 1, "Job control"); a submitter's priority may
    # only go down (core/jobcontrol.py: may_raise_priority)
    "job.hold":      (ALL,  ALL,     OWN,      None, None),
    "job.release":   (ALL,  ALL,     OWN,      None, None),
    "job.requeue":   (ALL,  ALL,     OWN,      None, None),
    "job.priority":  (ALL,  ALL,     OWN,      None, None),
    # VRAM leases (SPEC.md section 11, "VRAM leases"): a submitter its own
    "lease.create":  (ALL,  ALL,     OWN,      None, None),
    "lease.list":    (ALL,  ALL,     OWN,      None, None),
    "lease.read":    (ALL,  ALL,     OWN,      None, None),
    "lease.renew":   (ALL,  ALL,     OWN,      None, None),
    "lease.end":     (ALL,  ALL,     OWN,      None, None),
    "lease.pids":    (ALL,  ALL,     OWN,      None, None),
    "types.read":    (ALL,  ALL,     ALL,      None, None),
    # GET /v1/preview: what would become of one more job (counts, no other's ids)
    "job.preview":   (ALL,  ALL,     OWN,      None, None),
    "status.read":   (ALL,  ALL,     ALL,      None, None),
    "share.read":    (ALL,  ALL,     OWN,      None, None),
    "audit.read":    (ALL,  ALL,     None,     None, None),
    "token.create":  (ALL,  None,    None,     None, None),
    "token.list":    (ALL,  None,    None,     None, None),
    "token.revoke":  (ALL,  None,    None,     None, None),
    "node.invite":   (ALL,  None,    None,     None, None),
    "node.enroll":   (None, None,    None,     None, ALL),
    "node.heartbeat": (None, None,   None,     ALL,  None),
    "node.claim":    (None, None,    None,     ALL,  None),
    "node.start":    (None, None,    None,     ALL,  None),
    "node.finish":   (None, None,    None,     ALL,  None),
    "node.report":   (None, None,    None,     ALL,  None),
    "node.upload":   (None, None,    None,     ALL,  None),
    "node.fetch":    (None, None,    None,     ALL,  None),
    # a running attempt's streams, chunk by chunk: not audited (one a second a stream)
    "node.logs":     (None, None,    None,     ALL,  None),
    "node.list":     (ALL,  ALL,     None,     None, None),
    "node.drain":    (ALL,  ALL,     None,     None, None),
    "node.resume":   (ALL,  ALL,     None,     None, None),
    "node.revoke":   (ALL,  None,    None,     None, None),
    "node.diagnostic": (ALL, None,   None,     None, None),
    "gpu.clear":     (ALL,  None,    None,     None, None),
    # GET /metrics; public too with [api] metrics_public = true (api/routers/metrics.py)
    "metrics.read":  (ALL,  ALL,     None,     None, None),
    "events.read":   (ALL,  ALL,     OWN,      None, None),
    # the dashboard (api/session.py, api/routers/dashboard.py)
    "session.read":  (ALL,  ALL,     ALL,      None, None),
    "session.delete": (ALL, ALL,     ALL,      None, None),
    "dashboard.read": (ALL, ALL,     OWN,      None, None),
    # /run/<name>/: who passes the gate; which service each may use is
    # core/serviceroute.py: may_reach (its owner, its share; else the same 404)
    "service.use":   (ALL,  OWN,     OWN,      None, None),
}
# fmt: on
_COLUMNS = (Role.OWNER, Role.OPERATOR, Role.SUBMITTER, Role.NODE, Role.ENROLL)

#: actions that change something: each call writes an audit row, refused ones too
MUTATING = frozenset(
    {"job.submit", "job.cancel", "job.stop", "token.create", "token.revoke"}
    | {"node.invite", "node.enroll", "node.heartbeat", "node.claim", "node.start"}
    | {"node.finish", "node.report", "node.upload", "node.drain", "node.resume", "node.revoke"}
    | {"node.diagnostic"}
    | {"job.hold", "job.release", "job.requeue", "job.priority"}
    # a lease's renewal is not audited: its holder renews every third of its ttl
    | {"lease.create", "lease.end", "lease.pids"}
    | {"gpu.clear", "session.create", "session.delete"}
)
#: actions that need no token (``session.create`` checks the token it is given itself)
PUBLIC = frozenset({"health.read", "dashboard.page", "session.create"})
#: the roles that may sign in to the dashboard (a node's credential may not)
SESSION_ROLES = frozenset({Role.OWNER, Role.OPERATOR, Role.SUBMITTER})


def allowed(role: Role, action: str) -> Scope | None:
    """What ``role`` may do for ``action`` (None: refused, also for unknown actions)."""
    row = MATRIX.get(action)
    return None if row is None else row[_COLUMNS.index(role)]


def needed_roles(action: str) -> list[Role]:
    """The roles that may do ``action`` (for a 403 that says which one is needed)."""
    row = MATRIX.get(action, (None,) * len(_COLUMNS))
    return [role for role, scope in zip(_COLUMNS, row, strict=True) if scope is not None]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who makes a request: a verified token (or the machine's owner on the CLI)."""

    token_id: str
    name: str
    role: Role

    def audit(
        self,
        action: str,
        *,
        now: float,
        target: str = "",
        outcome: str = "ok",
        detail: dict[str, object] | None = None,
    ) -> AuditRow:
        return AuditRow(
            ts=now,
            actor=self.token_id,
            actor_name=self.name,
            role=self.role.value if self.token_id != LOCAL else LOCAL,
            action=action,
            target=target,
            outcome=outcome,
            detail=dict(detail or {}),
        )


def check_priority_bound(limits: PriorityLimits, who: Principal, priority: int, what: str) -> None:
    """Refuse (:class:`NotAllowedError`, HTTP 403) a priority above the highest
    ``who``'s role may ask for (``[api.max_priority]``); ``what``: "job" or
    "lease", for the message."""
    bound = getattr(limits, who.role.value, None)
    if bound is None or priority <= bound:
        return
    raise NotAllowedError(
        f"priority {priority} is above the highest a {who.role.value} may give a {what} "
        f"({bound}, [api.max_priority] {who.role.value}): ask for {bound} or less, or ask "
        "an operator to raise the job's priority",
    )


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_token() -> tuple[str, str, str]:
    """``(token_id, secret, token)``: a fresh random token and its parts."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return token_id, secret, f"{TOKEN_PREFIX}{token_id}_{secret}"


def parse_token(token: str) -> tuple[str, str] | None:
    """``(token_id, secret)`` of a well-formed token, else None."""
    m = _TOKEN.fullmatch(token.strip())
    return (m.group(1), m.group(2)) if m else None


class AuthFailed(GpuwardenError):
    """A request's token is missing or not valid (401): the message says which."""

    def __init__(self, message: str, token_id: str | None = None) -> None:
        super().__init__(message)
        self.token_id = token_id


_NOT_VALID = (
    "the token is not valid (unknown, or a wrong secret): check GPUWARDEN_TOKEN or the "
    "token file, or ask the owner for a new token (`gpuwarden token create NAME --role ROLE`)"
)
_DUMMY_HASH = hash_secret("not a secret")


def authenticate(store: Store, authorization: str | None, *, now: float) -> Principal:
    """The principal of an ``Authorization: Bearer gw_...`` header, or :class:`AuthFailed`."""
    if not authorization:
        raise AuthFailed(
            "no token: send the header 'Authorization: Bearer gw_...' (the CLI reads "
            "GPUWARDEN_TOKEN or ~/.config/gpuwarden/token)"
        )
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthFailed("the Authorization header must be 'Bearer gw_<id>_<secret>'")
    parts = parse_token(value)
    if parts is None:
        raise AuthFailed("malformed token: a token looks like gw_<12 hex digits>_<43 characters>")
    token_id, secret = parts
    record = store.get_token(token_id)
    presented = hash_secret(secret)
    # compare even when there is no such token, so both cases take the same time
    good = hmac.compare_digest(presented, record.secret_hash if record else _DUMMY_HASH)
    if record is None or not good:
        raise AuthFailed(_NOT_VALID, token_id)
    return _usable(record, token_id, now)


def authenticate_session(store: Store, token_id: str, *, now: float) -> Principal:
    """The principal of a browser session's token (checked at sign-in): refused,
    like a bearer token, once the token is gone, revoked or expired."""
    record = store.get_token(token_id)
    if record is None:
        raise AuthFailed("the token of this session no longer exists: sign in again", token_id)
    return _usable(record, token_id, now)


def _usable(record: TokenRecord, token_id: str, now: float) -> Principal:
    if record.revoked_at is not None:
        raise AuthFailed(
            f"token {token_id} ({record.name}) was revoked: ask the owner for a new one",
            token_id,
        )
    if record.expires_at is not None and now >= record.expires_at:
        raise AuthFailed(
            f"token {token_id} ({record.name}) has expired: ask the owner for a new one",
            token_id,
        )
    return Principal(token_id=record.id, name=record.name, role=record.role)


#: a token's name: what people call it in lists and the audit log
TOKEN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$")


def issue_token(
    store: Store,
    *,
    name: str,
    role: Role,
    by: Principal,
    now: float,
    expires_at: float | None = None,
    node: str | None = None,
    replace: bool = False,
) -> tuple[TokenRecord, str]:
    """Make a token, store its hash and an audit row; return the record and the token
    (the only time the secret exists outside the client). An enroll token must be
    bound to a node (:class:`UserError` otherwise: it could enrol nothing), and it
    revokes that node's older enroll tokens (one live invite a node, the store's
    ``create_token``); ``replace``: it may enrol a host in the place of a live node
    of that name (``node invite NAME --replace``)."""
    if role is Role.ENROLL and not node:
        raise UserError(
            "an enroll token must be bound to a node: give the node's name (`gpuwarden "
            "token create NAME --role enroll --node NODE`), or make it with "
            "`gpuwarden node invite NODE`"
        )
    if replace and role is not Role.ENROLL:
        raise UserError("only an enroll token (an invite) may replace a node")
    token_id, secret, token = new_token()
    record = store.create_token(
        token_id=token_id,
        name=name,
        role=role,
        secret_hash=hash_secret(secret),
        now=now,
        created_by=by.token_id,
        expires_at=expires_at,
        node=node,
        replace=replace,
    )
    detail: dict[str, object] = {
        "name": name,
        "role": role.value,
        "expires_at": expires_at,
        "node": node,
    }
    if replace:
        detail["replace"] = True
    store.add_audit(by.audit("token.create", now=now, target=token_id, detail=detail))
    return record, token


def local_principal(user: str) -> Principal:
    """The machine's owner at the CLI (direct store access)."""
    return Principal(token_id=LOCAL, name=user, role=Role.OWNER)


class NodeHeld(UserError):
    """An invite without ``replace`` for a node that is enrolled and not revoked (409)."""


@dataclass(frozen=True, slots=True)
class Invite:
    """An enrolment token made by :func:`issue_invite`."""

    record: TokenRecord
    token: str
    #: the node's earlier invites, revoked by this one
    superseded: list[str]
    #: the live node this invite may replace (``replace``), else None
    replaces: str | None


def issue_invite(
    store: ClusterStore, name: str, *, by: Principal, now: float, replace: bool = False
) -> Invite:
    """A one-time enrolment token for node ``name`` (`node invite NAME`), valid
    :data:`INVITE_TTL_S`: the node's earlier invites stop working (one live invite
    a node). Refused (:class:`NodeHeld`) while a node of that name is enrolled and
    not revoked, unless ``replace``: then enrolling with it revokes that node's
    credential and gives its jobs back to the queue (SPEC.md section 16,
    "Enrolment")."""
    if not NODE_NAME.fullmatch(name):
        raise UserError(
            f"node name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    live = invites.live_node(store, name, now)
    if live is not None and not replace:
        raise NodeHeld(invites.invite_refusal(live, now))
    superseded = invites.open_invites(store, name)
    record, token = issue_token(
        store,
        name=f"enroll {name}",
        role=Role.ENROLL,
        by=by,
        now=now,
        expires_at=now + INVITE_TTL_S,
        node=name,
        replace=replace,
    )
    return Invite(
        record=record,
        token=token,
        superseded=superseded,
        replaces=name if live is not None else None,
    )
