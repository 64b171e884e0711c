"""Browser sessions of the dashboard: a cookie instead of a bearer header.

Signing in (``POST /v1/session``) checks a token the way the bearer path does and
makes a session: a random id (256 bits) kept **in this API process only**, mapped
to the token's id, with an expiry (:data:`SESSION_TTL_S`) and a CSRF secret of its
own. The browser holds the id in the cookie :data:`SESSION_COOKIE` (``HttpOnly``,
``SameSite=Strict``, ``Path=/``, ``Secure`` over https) and the CSRF secret in
:data:`CSRF_COOKIE` (readable by the page's script, which sends it back in the
header :data:`CSRF_HEADER`). The token itself never reaches the browser's cookie
jar: a stolen cookie dies with sign-out, with its expiry and with a restart of
the API, and the token behind it is checked on every request (a revoked or expired
token ends its sessions at once).

Cookies are not kept apart by port: every web server the browser reaches under
the same host name receives this one. So a session also remembers the client
address it was signed in from, and its cookie from any other address is refused
(401: sign in again). Serve the dashboard under a host name of its own where the
same name also serves other web applications.

A request authenticated by the cookie that would change something (every action
in ``auth.MUTATING``) must also come from the API's own origin (:func:`same_origin`)
and carry the CSRF header (:func:`csrf_refusal`): two checks, either of which stops
a cross-site request. Bearer-token requests are not affected.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwarden.api.expiring import Expiring

#: the cookie holding the session id (HttpOnly)
SESSION_COOKIE = "gw_session"
#: the cookie holding the session's CSRF secret (readable by the page)
CSRF_COOKIE = "gw_csrf"
#: the header a mutating request by cookie carries, equal to the CSRF secret
CSRF_HEADER = "x-gpuwarden-csrf"
#: how long a session lasts after sign-in
SESSION_TTL_S = 12 * 3600.0
#: at most this many sessions at once; the oldest go first
MAX_SESSIONS = 10_000


@dataclass(frozen=True, slots=True)
class Session:
    """One signed-in browser."""

    id: str
    token_id: str
    csrf: str
    created_at: float
    expires_at: float
    #: the client address it was signed in from: a cookie replayed from elsewhere
    #: (another web server on this host name receives it too) is refused
    client: str = ""


class Sessions:
    """The sessions of one API process, in memory, thread-safe."""

    def __init__(
        self, *, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_id: Expiring[Session] = Expiring(MAX_SESSIONS, clock)

    def create(self, token_id: str, client: str = "") -> Session:
        now = self.clock()
        session = Session(
            id=secrets.token_urlsafe(32),
            token_id=token_id,
            csrf=secrets.token_urlsafe(32),
            created_at=now,
            expires_at=now + self.ttl_s,
            client=client,
        )
        self._by_id.add(session.id, session)
        return session

    def get(self, session_id: str) -> Session | None:
        """The live session of this id, or None (unknown, ended or expired)."""
        return self._by_id.get(session_id)

    def end(self, session_id: str) -> bool:
        return self._by_id.pop(session_id)

    def __len__(self) -> int:
        return len(self._by_id)


def cookie_value(cookie_header: str | None, name: str) -> str | None:
    """The value of cookie ``name`` in a ``Cookie`` header (None when absent). Split
    as browsers write it (``a=1; b=2``), not with :mod:`http.cookies`, which gives
    up on the whole header at one cookie it finds malformed (another application on
    the same host may have set any)."""
    if not cookie_header:
        return None
    for part in cookie_header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key.strip() == name:
            value = value.strip().strip('"')
            return value or None
    return None


def own_origin(scheme: str, host: str | None) -> str | None:
    """``scheme://host[:port]`` of this API as the request addressed it (its ``Host``
    header), or None without one."""
    if not host:
        return None
    return f"{scheme}://{host.strip().lower()}"


def same_origin(
    *,
    scheme: str,
    host: str | None,
    origin: str | None,
    fetch_site: str | None,
    referer: str | None,
) -> str | None:
    """None when the request comes from the API's own origin; else why not.

    ``Origin`` decides when the browser sent one; without it, ``Sec-Fetch-Site``
    must say ``same-origin``; without either, the ``Referer`` must be a page of
    this origin. A request with none of the three is refused: every browser that
    runs the dashboard sends at least one of them."""
    mine = own_origin(scheme, host)
    if mine is None:
        return "the request has no Host header"
    if origin is not None:
        if origin.strip().lower() == mine:
            return None
        return f"its Origin ({origin[:100]!r}) is not this API's ({mine})"
    if fetch_site is not None:
        if fetch_site.strip().lower() == "same-origin":
            return None
        return f"Sec-Fetch-Site says {fetch_site[:40]!r}, not same-origin"
    if referer is not None:
        if referer.lower().startswith(mine + "/") or referer.lower() == mine:
            return None
        return f"its Referer is not a page of this API ({mine})"
    return "it has no Origin, Sec-Fetch-Site or Referer header to show where it comes from"


def csrf_refusal(session: Session, presented: str | None) -> str | None:
    """None when the CSRF header matches the session's secret; else why not."""
    if not presented:
        return (
            f"the request has no {CSRF_HEADER} header (the dashboard sends it; its value is "
            f"the {CSRF_COOKIE} cookie or the csrf of GET /v1/session)"
        )
    if not hmac.compare_digest(presented.encode(), session.csrf.encode()):
        return f"its {CSRF_HEADER} header does not match this session's"
    return None


def set_cookie_headers(session: Session, *, secure: bool) -> list[str]:
    """The ``Set-Cookie`` values that sign a browser in."""
    max_age = max(0, int(session.expires_at - session.created_at))
    tail = f"; Path=/; Max-Age={max_age}; SameSite=Strict" + ("; Secure" if secure else "")
    return [
        f"{SESSION_COOKIE}={session.id}{tail}; HttpOnly",
        f"{CSRF_COOKIE}={session.csrf}{tail}",
    ]


def clear_cookie_headers(*, secure: bool) -> list[str]:
    """The ``Set-Cookie`` values that sign a browser out."""
    tail = "; Path=/; Max-Age=0; SameSite=Strict" + ("; Secure" if secure else "")
    return [f"{SESSION_COOKIE}={tail}; HttpOnly", f"{CSRF_COOKIE}={tail}"]
