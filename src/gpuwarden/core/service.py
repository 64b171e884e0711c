"""Service jobs: the rules of a service's health and name. Pure.

A type with ``launch = "service"`` runs until it is stopped; its process listens
on ``port`` inside its sandbox, and the broker checks its health (an HTTP ``GET``
of a path, or a TCP connect) every ``health_every_s``. SPEC.md, "Service jobs".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpuwarden.core.model import Job
from gpuwarden.core.states import JobState


class ServiceState(StrEnum):
    STARTING = "starting"  # running, not healthy yet
    HEALTHY = "healthy"  # its last check succeeded
    UNHEALTHY = "unhealthy"  # its last check failed after one succeeded
    STOPPED = "stopped"  # its attempt has ended


#: a service's name in URLs: the rules of a job id
SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: a share entry: a token id or a role name
SHARE_ENTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: the most entries a service's ``share`` may hold
SHARE_MAX = 64
#: the most a health path may be long
HEALTH_PATH_MAX = 512
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,511}")


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """How a service's health is checked: ``GET path`` answered 2xx, or (path
    None) a TCP connect to its port."""

    path: str | None

    def __str__(self) -> str:
        return "tcp" if self.path is None else f"GET {self.path}"


def parse_health(text: str) -> HealthCheck:
    """``"GET /healthz"`` or ``"tcp"``; raise :class:`ValueError` saying what is wrong."""
    if text == "tcp":
        return HealthCheck(None)
    method, _, path = text.partition(" ")
    if method != "GET" or not _PATH.fullmatch(path):
        raise ValueError(
            f'health must be "GET " and an absolute path (such as "GET /healthz") or '
            f'"tcp", got {text!r:.80}'
        )
    return HealthCheck(path)


def check_service_name(name: object) -> str:
    """A service's name: the rules of a job id. Raise :class:`ValueError`."""
    if not isinstance(name, str) or not SERVICE_NAME.fullmatch(name):
        raise ValueError(
            "service must be 1-128 letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit (the rules of a job id), got {name!r:.80}"
        )
    return name


def check_share(value: object) -> tuple[str, ...]:
    """A service's ``share``: token ids or role names. Raise :class:`ValueError`."""
    if not isinstance(value, list | tuple) or len(value) > SHARE_MAX:
        raise ValueError(f"share must be a list of at most {SHARE_MAX} token ids or role names")
    for entry in value:
        if not isinstance(entry, str) or not SHARE_ENTRY.fullmatch(entry):
            raise ValueError(f"share: {entry!r:.80} is not a token id or a role name")
    return tuple(dict.fromkeys(value))


@dataclass(frozen=True, slots=True)
class Health:
    """What the broker knows of one running service's health."""

    state: ServiceState
    #: since when it is in that state
    since: float
    #: when a check last succeeded (None: never)
    last_ok: float | None = None
    #: what the last failed check said ("" after a success)
    error: str = ""

    def after_check(self, ok: bool, error: str, now: float) -> Health:
        """The health after one check at ``now``."""
        if ok:
            if self.state is ServiceState.HEALTHY:
                return Health(ServiceState.HEALTHY, self.since, now)
            return Health(ServiceState.HEALTHY, now, now)
        if self.state is ServiceState.HEALTHY:
            return Health(ServiceState.UNHEALTHY, now, self.last_ok, error)
        return Health(self.state, self.since, self.last_ok, error)


def overdue(health: Health, check: HealthCheck, grace_s: float, now: float) -> str | None:
    """Why a service must be stopped now, or None: it has been starting, or
    unhealthy, for more than ``grace_s``."""
    if health.state not in (ServiceState.STARTING, ServiceState.UNHEALTHY):
        return None
    if now - health.since <= grace_s:
        return None
    said = f": {health.error}" if health.error else ""
    if health.state is ServiceState.STARTING:
        return (
            f"the service did not pass its health check ({check}{said}) within "
            f"health_grace_s = {grace_s:g} s of its start; it was stopped"
        )
    return (
        f"the service failed its health check ({check}{said}) for {grace_s:g} s "
        "(health_grace_s); it was stopped"
    )


def url_path(name: str) -> str:
    """Where the API serves a service: ``/run/<name>/``."""
    return f"/run/{name}/"


@dataclass(frozen=True, slots=True)
class ServiceView:
    """A service job's state as people are shown it (``jobs``, ``show``, the API's
    job JSON). ``state`` None: not known now (the job is not running, nor ended,
    or no broker published its status lately)."""

    state: str | None
    url_path: str
    #: since when it is in ``state`` (None: not known)
    since: float | None = None
    #: when it last passed its health check (None: never, or not known)
    last_ok: float | None = None
    #: what its last failed check said
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        """The job JSON's ``service_*`` keys."""
        return {
            "service_state": self.state,
            "service_url_path": self.url_path,
            "service_since": self.since,
            "service_last_ok": self.last_ok,
            "service_error": self.error,
        }


def view_of(job: Job, published: Mapping[str, Any] | None, *, live: bool) -> ServiceView:
    """A service job's view from its entry in the freshest node status
    (``published``, None: not listed) and whether a broker published lately
    (``live``): an ended job is ``stopped``; a running one has its published
    state, or is ``starting`` while its broker has not published it yet; a
    queued one has none."""
    path = url_path(job.service_name)
    entry = published or {}
    last_ok = _number(entry.get("last_ok"))
    if job.state.terminal:
        since = _number(entry.get("since")) if entry.get("state") == "stopped" else None
        return ServiceView(ServiceState.STOPPED.value, path, since or job.updated_at, last_ok)
    if job.state is not JobState.RUNNING:
        return ServiceView(None, path)
    if published is None or entry.get("state") == ServiceState.STOPPED.value:
        # begun, not published yet (a stopped entry is its attempt before)
        return ServiceView(ServiceState.STARTING.value if live else None, path)
    state = str(entry.get("state") or "")
    return ServiceView(
        state if state in set(ServiceState) else None,
        path,
        _number(entry.get("since")),
        last_ok,
        str(entry.get("error") or ""),
    )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
