"""A running service as the proxy at ``/run/<name>/`` sees it (SPEC.md, section 15,
"Services at /run/"): where its forwarder listens, the credential the forwarder
demands, who may reach it, and how it is doing. Values in, values out: the node
publishes :class:`ServiceRoute` values, the API reads them per request.

The rules here are pure: :func:`may_reach` (who may use a service) and
:func:`availability` (whether a request goes through, or what the unavailable
page says)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

from gpuwarden.core.model import Role

#: a service's states, as the node reports them
STARTING: Final = "starting"
HEALTHY: Final = "healthy"
UNHEALTHY: Final = "unhealthy"
STOPPED: Final = "stopped"
STATES: Final = frozenset({STARTING, HEALTHY, UNHEALTHY, STOPPED})
#: a coordinator's word for a route whose node has not reported it within its
#: heartbeat window (or is offline): never forwarded
UNAVAILABLE: Final = "unavailable"
#: what a client is told to wait before it asks a starting service again (seconds)
STARTING_RETRY_S: Final = 2
#: how long an ended service's route is kept as ``stopped`` (seconds), by a broker
#: and by a coordinator: ``/run/<name>/`` answers "unavailable, last seen N s ago"
#: to those who may reach it (not a 404), then the name is one nobody has
STOPPED_KEEP_S: Final = 600.0

#: a forwarder's proof that it holds a route's credential (SPEC.md section 16,
#: "Services across hosts"): a coordinator asks it of a route that points at the
#: coordinator's own host before it keeps the route. The request is
#: ``GPUWARDEN-PROOF / HTTP/1.1`` with the route header and :data:`NONCE_HEADER`;
#: the forwarder answers it itself (never its service), ``204`` with
#: :data:`PROOF_HEADER`: :func:`route_proof` of the credential and the nonce. Any
#: other server a route might name (another API on that host) answers otherwise.
PROOF_METHOD: Final = "GPUWARDEN-PROOF"
NONCE_HEADER: Final = "X-Gpuwarden-Nonce"
PROOF_HEADER: Final = "X-Gpuwarden-Proof"


def route_proof(credential: str, nonce: str) -> str:
    """The answer a forwarder holding ``credential`` gives to ``nonce``."""
    message = f"gpuwarden route proof {nonce}".encode()
    return hmac.new(credential.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class ServiceRoute:
    """One service, by the name it is served under (``/run/<name>/``).

    ``owner``: the token id that submitted the job (None: a job of the host's
    owner, submitted on the host). ``share``: token ids and role names that may
    use it too. ``upstream``: ``http://127.0.0.1:PORT``, the node's forwarder,
    which demands ``X-Gpuwarden-Route: <credential>`` on each new connection.
    ``since``: when it entered ``state``; ``last_ok``: when it last answered its
    health check (None: never)."""

    name: str
    job_id: str
    owner: str | None
    share: tuple[str, ...]
    state: str
    upstream: str
    credential: str
    since: float
    last_ok: float | None


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why a request to a service is not forwarded: a sentence for a person, and
    ``retry_after_s`` when it is worth asking again soon (a starting service)."""

    message: str
    state: str
    last_seen_s: int | None
    retry_after_s: int | None = None


def may_reach(route: ServiceRoute, *, token_id: str, role: Role) -> bool:
    """Whether the token ``token_id`` with ``role`` may use ``route``: an owner
    token always; the token that submitted the job; a token or a role named in its
    ``share``; for a job of the host's owner (no owning token), an operator too.
    Node and enrolment tokens never (whatever ``share`` says)."""
    if role in (Role.NODE, Role.ENROLL):
        return False
    if role is Role.OWNER:
        return True
    if route.owner is None and role is Role.OPERATOR:
        return True
    if route.owner is not None and token_id == route.owner:
        return True
    return token_id in route.share or role.value in route.share


def last_seen(route: ServiceRoute, now: float) -> int | None:
    """Whole seconds since the service last answered its health check (None: never)."""
    if route.last_ok is None:
        return None
    return max(0, int(now - route.last_ok))


def availability(route: ServiceRoute, now: float) -> Unavailable | None:
    """None when a request to ``route`` is forwarded (healthy); else why not."""
    if route.state == HEALTHY:
        return None
    if route.state == STARTING:
        waited = max(0, int(now - route.since))
        return Unavailable(
            f"{route.name} is starting (for {waited} s): try again in a moment",
            STARTING,
            last_seen(route, now),
            STARTING_RETRY_S,
        )
    known = route.state in STATES or route.state == UNAVAILABLE
    return unreachable(route, now, route.state if known else "unknown")


def unreachable(route: ServiceRoute, now: float, state: str) -> Unavailable:
    """The unavailable page's words: ``NAME is unavailable, last seen N s ago``."""
    seen = last_seen(route, now)
    when = "never seen healthy" if seen is None else f"last seen {seen} s ago"
    why = "its node has not reported it lately" if state == UNAVAILABLE else f"it is {state}"
    return Unavailable(f"{route.name} is unavailable, {when} ({why})", state, seen)
