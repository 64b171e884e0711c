"""The dashboard in a real headless browser (Debian's chromium, driven by Selenium)
against a real API server (uvicorn on a free port) beside a broker on the
simulated GPU, both in this process, as ``serve --api`` runs them.

Sign in with a token; a running job's bar appears on its GPU; a fault banner
shows within 2 s of an injected Xid; a job cancelled from the page ends; the
page does not overflow at 1,600 px or at 390 px (screenshots kept under the
test's tmp dir, and with GPUWARDEN_WRITE_SCREENSHOTS=1 the desktop one written
to docs/dashboard.png); a submitter's session sees only its own jobs and no admin
action; an action without the cookie, cross-site, or without the CSRF header is
refused (over HTTP, with httpx).

Skipped when chromium, chromedriver or selenium is missing, unless
GPUWARDEN_REQUIRE_BROWSER=1 (CI), where that fails."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.api.session import SESSION_COOKIE
from gpuwarden.app import Node, open_node, open_store
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, Role
from gpuwarden.store.base import Store
from tests.conftest import MODULES

REPO = Path(__file__).resolve().parents[2]
TEST_MODULES = REPO / "tests" / "modules"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REQUIRE = os.environ.get("GPUWARDEN_REQUIRE_BROWSER") == "1"
SCREENSHOT = REPO / "docs" / "dashboard.png"

pytestmark = pytest.mark.slow


def _binary(path: Path) -> Path | None:
    """The program at ``path``, else the one of its name on PATH."""
    if path.exists():
        return path
    found = shutil.which(path.name)
    return Path(found) if found else None


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if _binary(path) is None:
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


def _need_browser() -> None:
    why = _missing()
    if why is None:
        return
    if REQUIRE:
        pytest.fail(f"{why} [GPUWARDEN_REQUIRE_BROWSER=1]")
    pytest.skip(f"{why}; CI runs these tests")


def wait_for(what: str, ok: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- the server -------------------------------------------------------------------


@dataclass
class Served:
    node: Node
    api: ApiThread
    store: Store
    url: str
    tokens: dict[str, str] = field(default_factory=dict)

    def http(self, who: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[who]}"}
        )

    def submit(self, who: str, **body: Any) -> str:
        with self.http(who) as client:
            r = client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def token_id(self, who: str) -> str:
        return self.tokens[who].split("_")[1]

    def job(self, job_id: str) -> dict[str, Any]:
        with self.http("owner") as client:
            r = client.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc

    def running_on(self, job_id: str) -> str:
        def gpu() -> str | None:
            detail = self.job(job_id)
            attempts = detail.get("attempts_detail") or []
            if detail["state"] != "running" or not attempts:
                return None
            return attempts[-1].get("gpu_uuid") or attempts[-1].get("gpu")

        return str(wait_for(f"{job_id} running", gpu, 30))


def make_config(tmp: Path) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp / "state",
            "node_name": "dashnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 2, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.05, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 1, "reclaim_timeout_s": 5},
            "api": {"rate_per_s": 1000, "burst": 1000},
        }
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    _need_browser()
    tmp = tmp_path_factory.mktemp("dash")
    config = make_config(tmp)
    stop = threading.Event()
    with open_node(config, mock_gpu=True) as node:
        node.broker.recover()
        loop = threading.Thread(target=node.broker.run, args=(stop,), daemon=True)
        loop.start()
        store = open_store(config)
        api = ApiThread(
            store, node.broker.registry, config, "127.0.0.1", 0, name="dash-api", broker=node.broker
        )
        assert api.start(), "the API did not start"
        # a short run: the timeline sampled each second, the stats not cached for a minute
        api.app.state.gw_history.every_s = 1.0
        api.app.state.gw_stats.ttl_s = 1.0
        s = Served(node=node, api=api, store=store, url=api.url)
        admin = Principal(token_id="local", name="test", role=Role.OWNER)
        for name, role in (
            ("owner", Role.OWNER),
            ("alice", Role.SUBMITTER),
            ("bob", Role.SUBMITTER),
        ):
            _, s.tokens[name] = issue_token(store, name=name, role=role, by=admin, now=time.time())
        try:
            yield s
        finally:
            api.stop()
            stop.set()
            loop.join(30)
            store.close()


@pytest.fixture(scope="module")
def driver(served: Served) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(_binary(CHROMIUM))
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1600,1000")
    d = webdriver.Chrome(service=Service(str(_binary(CHROMEDRIVER))), options=options)
    d.set_page_load_timeout(30)
    try:
        yield d
    finally:
        d.quit()


def by_css(d: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(d.find_elements(By.CSS_SELECTOR, css))


def click(d: Any, css: str) -> str:
    """Click the element ``css`` selects, once, and return its text after the click
    ("(gone)" when it went). The page redraws its lists every second: an element
    found may be replaced before the click lands, so it is found again until one
    click does."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> bool:
        try:
            found = by_css(d, css)
            if found:
                found[0].click()
            return bool(found)
        except StaleElementReferenceException:
            return False

    def text() -> str | None:
        try:
            after = by_css(d, css)
            return str(after[0].text) if after else "(gone)"
        except StaleElementReferenceException:
            return None

    wait_for(f"a click on {css}", clicked, 10)
    return str(wait_for(f"the text of {css}", text, 10))


def sign_in(d: Any, served: Served, who: str) -> None:
    d.delete_all_cookies()
    d.get(served.url + "/")
    field_ = wait_for(
        "the sign-in form", lambda: [e for e in by_css(d, "#token") if e.is_displayed()]
    )
    field_[0].send_keys(served.tokens[who])
    by_css(d, "#signin-button")[0].click()
    wait_for("the dashboard", lambda: by_css(d, "#main:not([hidden])"))
    wait_for("who is signed in", lambda: who in by_css(d, "#who")[0].text)


def redrawn(d: Any, times: int = 1) -> None:
    """Wait until the page has refreshed its data ``times`` more (it counts them)."""

    def count() -> int:
        return int(d.execute_script("return Number(document.body.dataset.refreshes || 0)"))

    start = count()
    for _ in range(times):  # the page refreshes when it is shown again: now
        seen = count()
        d.execute_script("document.dispatchEvent(new Event('visibilitychange'))")
        wait_for("a refresh", lambda: count() > seen, 15)  # noqa: B023 - used at once
    assert count() >= start + times


def set_width(d: Any, width: int, height: int = 1000, *, mobile: bool = False) -> None:
    d.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
    )


def screenshot(d: Any, path: Path, width: int, *, mobile: bool) -> None:
    """The whole page at ``width`` CSS pixels; no horizontal overflow first."""
    set_width(d, width, mobile=mobile)
    wait_for(f"a width of {width}", lambda: d.execute_script("return innerWidth") == width)
    redrawn(d)  # drawn again at this width
    inner = d.execute_script("return window.innerWidth")
    scroll = d.execute_script("return document.documentElement.scrollWidth")
    assert inner == width
    assert scroll <= inner, f"the page overflows at {width} px: {scroll} > {inner}"
    height = min(6000, int(d.execute_script("return document.documentElement.scrollHeight")))
    set_width(d, width, height, mobile=mobile)
    path.write_bytes(d.get_screenshot_as_png())
    assert path.stat().st_size > 10_000


# -- the tests ----------------------------------------------------------------------


def test_sign_in_and_see_a_running_jobs_bar_on_its_gpu(driver: Any, served: Served) -> None:
    sign_in(driver, served, "owner")
    job_id = served.submit("owner", type="testmods.gpu", params={"gib": 3, "seconds": 8})
    gpu = served.running_on(job_id)
    seg = wait_for(
        "the job's bar",
        lambda: by_css(driver, f'.bar[data-gpu="{gpu}"] .seg.job[data-job="{job_id}"]'),
    )
    assert float(seg[0].value_of_css_property("width").removesuffix("px")) > 0
    row = wait_for(
        "its running row", lambda: by_css(driver, f'li.job-running[data-job="{job_id}"]')
    )
    assert "testmods.gpu" in row[0].text
    # the event stream is open (EventSource sends the cookie)
    wait_for("the live badge", lambda: by_css(driver, "#live.on"))
    assert by_css(driver, "#live")[0].text == "live"
    # the session is a cookie that is not the token, and the page got no token back
    cookie = driver.get_cookie(SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert served.tokens["owner"] not in cookie["value"]
    assert served.tokens["owner"] not in driver.page_source


def busy_gpus(served: Served) -> set[str]:
    with served.http("owner") as client:
        nodes = client.get("/v1/status").json()["nodes"]
    return {r["gpu"] for n in nodes for r in n.get("running", []) if r.get("gpu")}


def fault_banner_within_two_seconds(driver: Any, served: Served) -> None:
    """Inject an Xid on an idle GPU: the page shows its fault banner within 2 s;
    then an owner clears it from the page."""
    device = served.node.probe.device  # type: ignore[attr-defined]
    idle = [u for u in device.uuids() if u not in busy_gpus(served)]
    assert idle, "no idle GPU to fault"
    gpu = idle[0]
    assert not by_css(driver, f'.banner.fault[data-gpu="{gpu}"]')
    device.inject_xid(gpu, 79)
    injected = time.monotonic()
    assert 79 in device.xids(gpu)  # the fault is really there
    banner = wait_for(
        "the fault banner", lambda: by_css(driver, f'.banner.fault[data-gpu="{gpu}"]'), 10
    )
    took = time.monotonic() - injected
    assert took <= 2.0, f"the banner took {took:.2f} s"
    assert "Xid 79" in banner[0].text
    # an owner clears it from the page (two clicks: the button asks once more)
    clear = f'button[data-action="clear:{gpu}"]'
    assert "clear fault" in by_css(driver, clear)[0].text
    device.clear_xids(gpu)
    assert click(driver, clear) == "confirm clear fault"
    click(driver, clear)
    wait_for("the banner to go", lambda: not by_css(driver, f'.banner.fault[data-gpu="{gpu}"]'))


def test_a_fault_banner_within_two_seconds_of_an_xid(driver: Any, served: Served) -> None:
    assert by_css(driver, "#live.on")  # by the event stream
    fault_banner_within_two_seconds(driver, served)


def test_without_the_event_stream_the_page_polls_and_shows_the_fault_too(
    driver: Any, served: Served
) -> None:
    hidden = driver.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": "delete window.EventSource;"}
    )
    try:
        driver.refresh()  # still signed in: the cookie
        wait_for("the dashboard", lambda: by_css(driver, "#main:not([hidden])"))
        assert driver.execute_script("return typeof window.EventSource") == "undefined"
        wait_for(
            "the polling badge", lambda: by_css(driver, "#live")[0].text == "polling every 1 s"
        )
        fault_banner_within_two_seconds(driver, served)
    finally:
        driver.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": hidden["identifier"]}
        )
        driver.refresh()
        wait_for("the live badge", lambda: by_css(driver, "#live.on"))


def test_cancel_a_job_from_the_page_and_see_it_end(driver: Any, served: Served) -> None:
    job_id = served.submit("owner", type="testmods.gpu", params={"gib": 1, "seconds": 25})
    served.running_on(job_id)
    button = f'button[data-action="cancel:{job_id}"]'
    assert click(driver, button) == "confirm cancel"  # the button asks once more
    redrawn(driver)  # the list is redrawn meanwhile: the button still asks
    assert by_css(driver, button)[0].text == "confirm cancel"
    click(driver, button)
    wait_for("the job to end", lambda: served.job(job_id)["state"] == "cancelled", 20)
    wait_for(
        "its row to leave the running list",
        lambda: not by_css(driver, f'li.job-running[data-job="{job_id}"]'),
    )


def test_a_vram_lease_shows_in_its_own_section_and_ends_from_the_page(
    driver: Any, served: Served
) -> None:
    sign_in(driver, served, "owner")
    body = {"vram_bytes": 2 * GIB, "ttl_s": 60, "holder": "alice's notebook"}
    with served.http("alice") as client:
        r = client.post("/v1/leases", params={"wait": 20}, json=body, timeout=40)
    assert r.status_code == 201 and r.json()["granted"], r.text
    lease = r.json()
    row = wait_for(
        "the lease's row", lambda: by_css(driver, f'li.lease-granted[data-lease="{lease["id"]}"]')
    )
    text = row[0].text
    assert lease["gpu"] in text and "2.0 GiB" in text, text
    assert "alice's notebook (alice)" in text and "ttl runs out in" in text, text
    assert "1 granted" in by_css(driver, "#leases-count")[0].text
    button = f'button[data-action="end:{lease["id"]}"]'
    assert click(driver, button) == "confirm end"
    click(driver, button)
    wait_for("the lease to end", lambda: served.job(lease["id"])["state"] == "done", 20)
    wait_for("its row to go", lambda: not by_css(driver, f'li[data-lease="{lease["id"]}"]'))


def test_screenshots_at_1600_and_390_px_without_horizontal_overflow(
    driver: Any, served: Served, tmp_path: Path
) -> None:
    device = served.node.probe.device  # type: ignore[attr-defined]
    device.add_foreign(device.uuids()[0], 2 * 1024**3, label="someone's notebook")
    for gib, seconds in ((6, 12), (4, 12)):
        served.submit("owner", type="testmods.gpu", params={"gib": gib, "seconds": seconds})
    served.submit("alice", type="testmods.gpu", params={"gib": 2, "seconds": 2})
    served.submit("owner", type="testmods.sleep", params={"seconds": 5})  # past its timeout
    wait_for("a queued job with its reason", lambda: by_css(driver, "li.job-queued .reason"))
    wait_for("two running jobs", lambda: len(by_css(driver, "li.job-running")) >= 2, 30)
    wait_for("a failure", lambda: by_css(driver, "#failures li"), 20)
    driver.refresh()  # the page reads the stats every 30 s: now, for the picture
    wait_for("GPU-hours", lambda: by_css(driver, "#hours .hbar"))
    wait_for("two running jobs", lambda: len(by_css(driver, "li.job-running")) >= 2, 30)
    desktop, mobile = tmp_path / "dashboard-1600.png", tmp_path / "dashboard-390.png"
    screenshot(driver, desktop, 1600, mobile=False)
    screenshot(driver, mobile, 390, mobile=True)
    if os.environ.get("GPUWARDEN_WRITE_SCREENSHOTS") == "1":
        shutil.copyfile(desktop, SCREENSHOT)
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    device.clear_foreign()


def test_a_submitters_session_sees_only_its_own_jobs_and_no_admin_action(
    driver: Any, served: Served
) -> None:
    mine = served.submit("alice", type="testmods.gpu", params={"gib": 1, "seconds": 4})
    theirs = served.submit("bob", type="testmods.gpu", params={"gib": 1, "seconds": 4})
    sign_in(driver, served, "alice")
    wait_for("her own job", lambda: by_css(driver, f'[data-job="{mine}"]'))
    assert served.job(theirs)["state"] in ("queued", "running")
    redrawn(driver, 2)  # refreshes more: nothing of bob's arrives later either
    page = driver.page_source
    assert theirs not in page and theirs.split("-", 1)[1] not in page
    assert "bob" not in by_css(driver, "#main")[0].text
    labels = [b.text for b in by_css(driver, "button") if b.is_displayed()]
    assert not [t for t in labels if t in ("clear fault", "drain", "resume")]
    assert by_css(driver, "#cluster-card[hidden]")
    # every job id drawn is one of hers (others' holdings are drawn without theirs)
    drawn = {e.get_attribute("data-job") for e in by_css(driver, "[data-job]")}
    assert drawn and all(j.startswith(served.token_id("alice")) for j in drawn)


def test_over_http_actions_need_the_cookie_the_origin_and_the_csrf_header(served: Served) -> None:
    job_id = served.submit("alice", type="testmods.gpu", params={"gib": 1, "seconds": 20})
    origin = served.url
    cancel = f"/v1/jobs/{job_id}/cancel"
    with httpx.Client(base_url=served.url) as browser:
        r = browser.post(
            "/v1/session", json={"token": served.tokens["alice"]}, headers={"Origin": origin}
        )
        assert r.status_code == 200, r.text
        csrf = r.json()["csrf"]
        assert browser.cookies.get(SESSION_COOKIE)
        refused = [
            browser.post(
                cancel, headers={"Origin": "https://evil.example", "X-Gpuwarden-CSRF": csrf}
            ),
            browser.post(cancel, headers={"Origin": origin}),
            browser.post(cancel, headers={"X-Gpuwarden-CSRF": csrf}),
        ]
        assert [x.status_code for x in refused] == [403, 403, 403]
        assert all("browser session" in x.json()["error"] for x in refused)
        with httpx.Client(base_url=served.url) as stranger:  # no cookie at all
            r = stranger.post(cancel, headers={"Origin": origin, "X-Gpuwarden-CSRF": csrf})
            assert r.status_code == 401
        # the same requests from the page's origin with the header go through
        r = browser.post(cancel, headers={"Origin": origin, "X-Gpuwarden-CSRF": csrf})
        assert r.status_code == 200, r.text
    wait_for("the job to end", lambda: served.job(job_id)["state"] == "cancelled")
