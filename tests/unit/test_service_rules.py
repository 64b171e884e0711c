"""core/service.py: a service's health check, name, share and grace rule."""

from __future__ import annotations

import pytest

from gpuwarden.core.service import (
    Health,
    HealthCheck,
    ServiceState,
    check_service_name,
    check_share,
    overdue,
    parse_health,
)


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
