"""Services on a host of their own (SPEC.md section 15, "Services at /run/").

A service's pages run their own scripts. Served on the API's origin, a script
of a service could call the API as whoever views the page: the browser sends
that person's session cookie with every same-origin request, and a page can
read the CSRF cookie. So a browser is never served a service on the API's
host. It reaches services at ``[api] services_host``, a host name of their own
(the same server; another origin, another cookie jar), optionally one per
service (``{name}.run.example.org``, so that services are not each other's
origin either):

- a request to ``/run/NAME/`` on the API's host with the dashboard's session
  cookie is sent on: a one-time **handoff** (60 s, for that token, that service
  and that client address) in a redirect to the same path on the services
  host, which turns it into a **pass**: an HttpOnly cookie (``gw_run``, path
  ``/run/NAME/``) valid for that service only;
- a request with a bearer token (a script, ``curl``) carries no ambient
  credential and is served on either host;
- the services host serves nothing but ``/run/``: the API and the dashboard
  answer 404 there, and the dashboard's cookie is never taken there.

Without ``services_host`` a browser session gets a 403 that says so; tokens
still work. Handoffs and passes live in this process's memory only.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode

from starlette.datastructures import Headers

from gpuwarden.api.expiring import Expiring

__all__ = [
    "HANDOFF_PARAM",
    "RUN_COOKIE",
    "RunPasses",
    "host_of",
    "on_services_host",
    "run_cookie",
    "services_url",
    "without_handoff",
]

#: the cookie of a service's pass (HttpOnly, path ``/run/NAME/``)
RUN_COOKIE = "gw_run"
#: the query parameter of a handoff
HANDOFF_PARAM = "gw_handoff"
#: how long a handoff may wait to be redeemed
HANDOFF_TTL_S = 60.0
#: how long a pass lasts (a dashboard session's length)
PASS_TTL_S = 12 * 3600.0
#: at most this many handoffs, and passes, at once (the oldest go first)
MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _Entry:
    token_id: str
    name: str
    client: str
    expires_at: float


class _Book:
    """Entries by a random key, bounded, each until it expires."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: Expiring[_Entry] = Expiring(MAX_ENTRIES, clock)

    def add(self, token_id: str, name: str, client: str) -> str:
        key = secrets.token_urlsafe(32)
        self._entries.add(key, _Entry(token_id, name, client, self.clock() + self.ttl_s))
        return key

    def find(self, key: str, name: str, client: str, *, take: bool) -> str | None:
        """The token id of a live entry for ``name`` from ``client`` (None else);
        ``take``: it is used up."""
        entry = self._entries.get(key, take=take)
        if entry is None or entry.name != name or entry.client != client:
            return None
        return entry.token_id


class RunPasses:
    """This process's handoffs (one-time) and passes, each for one token, one
    service and one client address. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._handoffs = _Book(HANDOFF_TTL_S, clock)
        self._passes = _Book(PASS_TTL_S, clock)

    def handoff(self, token_id: str, name: str, client: str) -> str:
        return self._handoffs.add(token_id, name, client)

    def redeem(self, code: str, name: str, client: str) -> tuple[str, str] | None:
        """A handoff used up: ``(token id, the new pass's id)``, or None."""
        token_id = self._handoffs.find(code, name, client, take=True)
        if token_id is None:
            return None
        return token_id, self._passes.add(token_id, name, client)

    def holder(self, pass_id: str, name: str, client: str) -> str | None:
        """The token id of a live pass for service ``name`` from ``client``."""
        return self._passes.find(pass_id, name, client, take=False)


def host_of(headers: Headers) -> str:
    """The request's host name, lowercased, without its port."""
    host = (headers.get("host") or "").strip().lower()
    if host.startswith("["):  # [::1]:8787
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _port_of(headers: Headers) -> str:
    host = (headers.get("host") or "").strip()
    tail = host.rsplit("]", 1)[-1] if host.startswith("[") else host
    _, sep, port = tail.rpartition(":")
    return f":{port}" if sep and port.isdigit() else ""


def services_host_for(services_host: str, name: str) -> str:
    return services_host.replace("{name}", name).lower()


def on_services_host(services_host: str, headers: Headers, name: str | None) -> bool:
    """Whether the request came to the services host (of service ``name``; with
    ``name`` None: to any host the setting could name)."""
    if not services_host:
        return False
    host = host_of(headers)
    if name is not None:
        return host == services_host_for(services_host, name)
    if "{name}" not in services_host:
        return host == services_host.lower()
    head, _, tail = services_host.lower().partition("{name}")
    return host.startswith(head) and host.endswith(tail) and len(host) > len(head) + len(tail)


def services_url(
    services_host: str, name: str, *, scheme: str, headers: Headers, path: str, query: str
) -> str:
    """The same path on service ``name``'s host (the request's port kept)."""
    host = services_host_for(services_host, name) + _port_of(headers)
    return f"{scheme}://{host}{path}" + (f"?{query}" if query else "")


def with_handoff(query: str, code: str) -> str:
    pairs = [*parse_qsl(query, keep_blank_values=True), (HANDOFF_PARAM, code)]
    return urlencode(pairs)


def without_handoff(query: str) -> tuple[str | None, str]:
    """The handoff in a query string (None: none) and the query without it."""
    code = None
    kept = []
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k == HANDOFF_PARAM:
            code = v
        else:
            kept.append((k, v))
    return code, urlencode(kept)


def run_cookie(pass_id: str, name: str, *, secure: bool) -> str:
    """The ``Set-Cookie`` value of a pass: HttpOnly, for that service's path only."""
    attrs = f"Path=/run/{quote(name, safe='')}/; HttpOnly; SameSite=Lax; Max-Age={int(PASS_TTL_S)}"
    return f"{RUN_COOKIE}={pass_id}; {attrs}" + ("; Secure" if secure else "")
