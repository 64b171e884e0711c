"""Trust at the API's edges (issue 30): forwarded headers believed only from
``[api] trusted_proxies``, node reports bounded and free of NUL, and event
streams that many tenants cannot take from the owner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.api import proxy
from gpuwarden.api.routers import events as events_router
from gpuwarden.api.routers.nodes import REPORT_CAPS
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.config import ApiSettings
from gpuwarden.core.model import Role
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_api import Api, build

BAD = {"Authorization": "Bearer gw_000000000000_notarealsecretnotarealsecret00"}


def _serve(a: Api) -> ApiThread:
    registry = Registry.load(a.config.module_paths, a.config.launch_rules)
    thread = ApiThread(
        SqliteStore(a.tmp / "gpuwarden.db"), registry, a.config, "127.0.0.1", 0, name="edges"
    )
    assert thread.start()
    return thread


def _bad_sign_ins(url: str, n: int) -> list[int]:
    """``n`` requests with a wrong token, each claiming another client address."""
    codes = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for i in range(n):
            forged = {**BAD, "X-Forwarded-For": f"203.0.113.{i}", "X-Real-IP": f"198.51.100.{i}"}
            codes.append(http.get("/v1/jobs", headers=forged).status_code)
    return codes


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted-proxy"])
def test_forwarded_for_is_believed_only_from_a_trusted_proxy(tmp_path: Path, trusted: bool) -> None:
    proxies = ["127.0.0.1/32"] if trusted else []
    a = build(tmp_path, rate_per_s=0.01, burst=5, trusted_proxies=proxies)
    thread = _serve(a)
    try:
        codes = _bad_sign_ins(thread.url, 12)
        # the attack was made: every request claimed an address of its own
        assert codes[0] == 401
        if trusted:  # a proxy says who the clients are: each address has its own bucket
            assert set(codes) == {401}
        else:  # from loopback, not a trusted proxy: one peer, one bucket, throttled
            assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}, codes
        with httpx.Client(base_url=thread.url, headers=a.h("owner"), timeout=10) as http:
            assert http.get("/v1/jobs").status_code == 200  # the next real request works
    finally:
        thread.stop()
        a.store.close()


def test_a_trusted_proxy_must_be_an_address() -> None:
    with pytest.raises(ValueError, match=r"trusted_proxies: 'proxy\.local' is not an IP address"):
        ApiSettings.model_validate({"trusted_proxies": ["proxy.local"]})


def test_the_service_proxy_drops_the_clients_own_address_claims() -> None:
    for name in ("x-real-ip", "true-client-ip", "x-client-ip", "forwarded", "x-forwarded-for"):
        assert name in proxy.DROPPED or name.startswith(proxy.DROPPED_PREFIXES), name


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    a.token("gpu-a", Role.NODE)
    yield a
    a.store.close()


def _heartbeat(a: Api, body: dict[str, Any]) -> httpx.Response:
    return a.client.post("/v1/node/heartbeat", json=body, headers=a.h("gpu-a"))


@pytest.mark.parametrize("key", ["gpus", "types", "running"])
def test_a_report_with_too_many_entries_is_refused_naming_the_bound(api: Api, key: str) -> None:
    cap = REPORT_CAPS[key]
    many = [{"uuid": f"GPU-{i}", "total_bytes": 1 << 30} for i in range(cap + 1)]
    report = {key: many}
    r = _heartbeat(api, {"report": report, "jobs": []})
    assert len(report[key]) == cap + 1  # the forged report was sent
    assert r.status_code == 422, r.text
    assert f"report.{key} has {cap + 1} entries: at most {cap} are taken" in r.json()["error"]


def test_a_nul_in_a_heartbeat_is_refused_not_a_500(api: Api) -> None:
    r = _heartbeat(api, {"report": {}, "jobs": ["job\x00x"]})
    assert r.status_code == 422, r.text
    assert "jobs" in r.json()["error"]
    r = _heartbeat(api, {"report": {"labels": {"rack": "a\x00"}}, "jobs": []})
    assert r.status_code == 422 and "must not contain NUL" in r.json()["error"]


def test_tenants_cannot_take_the_owners_event_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_router, "MAX_STREAMS", 6)
    monkeypatch.setattr(events_router, "KEPT_FOR_STAFF", 2)
    streams = events_router.Streams()
    taken = [streams.take(f"sub{i}", tenant=True) for i in range(5)]
    # the tenants filled every place open to them: the fifth is refused
    assert taken[:4] == [None] * 4 and taken[4] is not None
    assert streams.take("owner", tenant=False) is None  # the owner's place is kept
    assert streams.take("operator", tenant=False) is None
    assert streams.take("owner", tenant=False) is not None  # all 6 used now
    streams.give("sub0", tenant=True)
    assert streams.tenants == 3 and streams.total == 5
    assert streams.take("sub9", tenant=True) is None
