"""core/service.py: a service's health check, name, share and grace rule."""

from __future__ import annotations

import pytest

from gpuwarden.core.model import Job
from gpuwarden.core.service import (
    Health,
    HealthCheck,
    ServiceState,
    ServiceView,
    check_service_name,
    check_share,
    overdue,
    parse_health,
    view_of,
)
from gpuwarden.core.states import JobState


def test_health_is_get_and_an_absolute_path_or_tcp() -> None:
    assert parse_health("GET /healthz") == HealthCheck("/healthz")
    assert parse_health("tcp") == HealthCheck(None)
    for bad in ("POST /x", "GET healthz", "GET ", "get /x", "GET /a b", "udp"):
        with pytest.raises(ValueError, match="health must be"):
            parse_health(bad)


def test_names_follow_the_job_id_rules_and_share_lists_ids_or_roles() -> None:
    assert check_service_name("web-1.a_b") == "web-1.a_b"
    for bad in ("", "-x", "a/b", "x" * 129, 3):
        with pytest.raises(ValueError):
            check_service_name(bad)
    assert check_share(["operator", "abc123", "operator"]) == ("operator", "abc123")
    for bad_share in ("operator", ["a b"], [""], ["x"] * 65):
        with pytest.raises(ValueError):
            check_share(bad_share)


def test_starting_then_healthy_then_unhealthy_and_the_grace_rule() -> None:
    check = HealthCheck("/healthz")
    h = Health(ServiceState.STARTING, since=100.0)
    h = h.after_check(False, "connection refused", 101.0)
    assert h.state is ServiceState.STARTING and h.since == 100.0
    assert overdue(h, check, 60, 160.0) is None
    why = overdue(h, check, 60, 160.5)
    assert why is not None and "GET /healthz: connection refused" in why and "within" in why
    h = h.after_check(True, "", 120.0)
    assert (h.state, h.since, h.last_ok) == (ServiceState.HEALTHY, 120.0, 120.0)
    assert overdue(h, check, 60, 1000.0) is None
    h = h.after_check(False, "answered 'HTTP/1.0 500'", 130.0)
    assert (h.state, h.since, h.last_ok) == (ServiceState.UNHEALTHY, 130.0, 120.0)
    why = overdue(h, check, 60, 191.0)
    assert why is not None and "for 60 s" in why and "it was stopped" in why


def _job(state: JobState, service: str | None = "web") -> Job:
    return Job(
        id="j1", type="m.web", state=state, priority=0, params={}, inputs=(), outputs=(),
        vram_bytes=None, submitted_at=1.0, updated_at=50.0, service=service,
    )  # fmt: skip


def test_a_running_service_shows_its_published_state_and_its_url_path() -> None:
    entry = {"state": "healthy", "since": 10.0, "last_ok": 20.0, "error": ""}
    assert view_of(_job(JobState.RUNNING), entry, live=True) == ServiceView(
        "healthy", "/run/web/", 10.0, 20.0
    )
    unhealthy = {"state": "unhealthy", "since": 30.0, "last_ok": 20.0, "error": "refused"}
    view = view_of(_job(JobState.RUNNING, service=None), unhealthy, live=True)
    assert view == ServiceView("unhealthy", "/run/j1/", 30.0, 20.0, "refused")
    assert view.to_json() == {
        "service_state": "unhealthy",
        "service_url_path": "/run/j1/",
        "service_since": 30.0,
        "service_last_ok": 20.0,
        "service_error": "refused",
    }


def test_a_service_not_published_yet_is_starting_and_without_a_broker_not_known() -> None:
    assert view_of(_job(JobState.RUNNING), None, live=True).state == "starting"
    # a stopped entry of the name is its attempt before: this one is starting
    assert view_of(_job(JobState.RUNNING), {"state": "stopped"}, live=True).state == "starting"
    assert view_of(_job(JobState.RUNNING), None, live=False).state is None
    assert view_of(_job(JobState.QUEUED), None, live=True) == ServiceView(None, "/run/web/")


def test_an_ended_service_is_stopped_since_its_end() -> None:
    kept = {"state": "stopped", "since": 45.0, "last_ok": 44.0}
    assert view_of(_job(JobState.DONE), kept, live=True) == ServiceView(
        "stopped", "/run/web/", 45.0, 44.0
    )
    # no longer published: since the job's last change
    assert view_of(_job(JobState.FAILED), None, live=False) == ServiceView(
        "stopped", "/run/web/", 50.0
    )
