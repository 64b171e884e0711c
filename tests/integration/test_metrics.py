"""``GET /metrics`` on the API beside a broker in this process, with real job
processes on the simulated GPU: the output parses with prometheus_client's own
parser, and its values follow a scripted run (a job admitted and another queued
behind it, a GPU faulted by an Xid, a footprint raised by a measurement). Who may
scrape, the coordinator's view of its agents' reports, and the Grafana dashboard
over these series."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.api.metrics import scrape
from gpuwarden.api.routers import nodes
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, MIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.gpu.base import GpuSensors
from gpuwarden.node.stats import NodeStats
from gpuwarden.node.status import GpuReport
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import NodeState
from gpuwarden.store.sqlite import SqliteStore
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

REPO = Path(__file__).resolve().parents[2]
TEST_MODULES = REPO / "tests" / "modules"
DASHBOARD = REPO / "examples" / "grafana" / "gpuwarden.json"
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
NODE = "metricsnode"
GPU_TYPE = "testmods.gpu"  # declares 8 GiB


def make_config(tmp_path: Path, **api: Any) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": NODE,
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 1, "reclaim_timeout_s": 5},
            "api": {"rate_per_s": 10_000, "burst": 10_000, **api},
        }
    )


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Served:
    node: Node
    api: SqliteStore  # the API's own connection to the store, as serve --api has it
    http: TestClient
    token: str
    gpu: str

    def scrape(self) -> Samples:
        """Publish the node's status now (the loop does so on its own every tick
        something changed), then scrape and parse."""
        self.node.broker._publish(time.time(), force=True)
        r = self.http.get("/metrics", headers={"Authorization": f"Bearer {self.token}"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse(r.text)

    def value(self, samples: Samples, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in samples, f"no {name}{labels} in the scrape"
        return samples[key]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def serve(tmp_path: Path, **api: Any) -> Iterator[Served]:
    config = make_config(tmp_path, **api)
    with open_node(config, mock_gpu=True) as node:
        api_store = SqliteStore(config.state_dir / "gpuwarden.db")
        _, token = issue_token(api_store, name="prom", role=Role.OPERATOR, by=ADMIN, now=1.0)
        app = create_app(api_store, node.broker.registry, config)
        node.broker.tick()
        [gpu] = [g.uuid for g in node.broker.gpus.readings]
        try:
            yield Served(node, api_store, TestClient(app), token, gpu)
        finally:
            node.broker.shutdown(0)
            api_store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path)


def state(node: Node, job_id: str) -> JobState:
    job = node.store.get_job(job_id)
    assert job is not None
    return job.state


def gpu_job(i: str, **params: object) -> JobSpec:
    return JobSpec(id=i, type=GPU_TYPE, params={"gib": 2, "seconds": 0.5, **params})


def test_a_job_admitted_shows_in_the_ledger_queue_attempts_and_histograms(served: Served) -> None:
    s, gpu = served, served.gpu
    before = s.scrape()
    assert s.value(before, "gpuwarden_gpu_total_bytes", node=NODE, gpu=gpu) == 24 * GIB
    assert s.value(before, "gpuwarden_gpu_reserve_bytes", node=NODE, gpu=gpu) == GIB
    assert s.value(before, "gpuwarden_gpu_ledger_bytes", node=NODE, gpu=gpu) == 0
    assert s.value(before, "gpuwarden_queue_depth", node=NODE, state="queued", type=GPU_TYPE) == 0
    assert s.value(before, "gpuwarden_footprint_declared_bytes", type=GPU_TYPE) == 8 * GIB
    # two jobs that each want 20 GiB of the one GPU: the first runs, the second waits
    submit(s.node, JobSpec(id="first", type=GPU_TYPE, params={"gib": 2, "seconds": 2},
                           vram_bytes=20 * GIB))  # fmt: skip
    submit(s.node, JobSpec(id="second", type=GPU_TYPE, params={"gib": 1, "seconds": 0.2},
                           vram_bytes=20 * GIB))  # fmt: skip
    run_until(s.node, lambda: state(s.node, "first") is JobState.RUNNING)
    run_until(s.node, lambda: s.node.broker.gpus.readings[0].used_bytes >= 2 * GIB)
    during = s.scrape()
    assert s.value(during, "gpuwarden_gpu_ledger_bytes", node=NODE, gpu=gpu) == 20 * GIB
    depth = {st: s.value(during, "gpuwarden_queue_depth", node=NODE, state=st, type=GPU_TYPE)
             for st in ("queued", "running")}  # fmt: skip
    assert depth == {"queued": 1, "running": 1}
    used = s.node.broker.gpus.readings[0].used_bytes
    assert s.value(during, "gpuwarden_gpu_device_used_bytes", node=NODE, gpu=gpu) == used
    dcgm = {"gpu": "0", "UUID": gpu, "device": "nvidia0", "Hostname": NODE}
    dcgm["modelName"] = s.node.broker.gpus.readings[0].name
    assert s.value(during, "DCGM_FI_DEV_FB_USED", **dcgm) == used // MIB
    assert s.value(during, "DCGM_FI_DEV_FB_FREE", **dcgm) == (24 * GIB - used) // MIB
    wait = "gpuwarden_queue_wait_seconds_count"
    assert s.value(during, wait, node=NODE, type=GPU_TYPE) == 1

    run_until(s.node, lambda: state(s.node, "second").terminal)
    run_until(s.node, lambda: len(s.node.broker.vram.ledger) == 0)  # reclaimed
    after = s.scrape()
    assert state(s.node, "first") is state(s.node, "second") is JobState.DONE
    ok = {"node": NODE, "type": GPU_TYPE, "outcome": "succeeded"}
    assert s.value(after, "gpuwarden_attempts_total", **ok) == 2
    assert s.value(after, wait, node=NODE, type=GPU_TYPE) == 2
    # the second waited for the first to run (2 s) and its memory to come back
    assert s.value(after, "gpuwarden_queue_wait_seconds_sum", node=NODE, type=GPU_TYPE) >= 1.5
    inf = {"node": NODE, "type": GPU_TYPE, "le": "+Inf"}
    assert s.value(after, "gpuwarden_queue_wait_seconds_bucket", **inf) == 2
    assert s.value(after, "gpuwarden_attempt_run_seconds_count", node=NODE, type=GPU_TYPE) == 2
    assert s.value(after, "gpuwarden_attempt_run_seconds_sum", node=NODE, type=GPU_TYPE) >= 2.0
    assert s.value(after, "gpuwarden_reclaim_seconds_count", node=NODE, gpu=gpu) == 2
    assert s.value(after, "gpuwarden_gpu_ledger_bytes", node=NODE, gpu=gpu) == 0
    depth = {st: s.value(after, "gpuwarden_queue_depth", node=NODE, state=st, type=GPU_TYPE)
             for st in ("queued", "running")}  # fmt: skip
    assert depth == {"queued": 0, "running": 0}
    assert s.value(after, "gpuwarden_node_heartbeat_age_seconds", node=NODE) < 5
    assert s.value(after, "gpuwarden_node_accepting", node=NODE) == 1


def test_a_faulted_gpu_raises_its_fault_flag_and_counts_the_xid(served: Served) -> None:
    s, gpu = served, served.gpu
    before = s.scrape()
    assert s.value(before, "gpuwarden_gpu_fault", node=NODE, gpu=gpu) == 0
    assert not [k for k in before if k[0] == "gpuwarden_gpu_xid_errors_total"]
    submit(s.node, gpu_job("victim", seconds=10))
    run_until(s.node, lambda: state(s.node, "victim") is JobState.RUNNING)
    s.node.probe.device.inject_xid(gpu, 79)  # type: ignore[attr-defined]
    run_until(s.node, lambda: "gpu_fault" in [e.kind for e in s.node.store.events()])
    run_until(s.node, lambda: s.node.store.attempts("victim")[0].outcome == "gpu_fault")
    assert "hardware fault" in s.node.broker.status().degraded[gpu]  # the fault happened
    faulted = s.scrape()
    assert s.value(faulted, "gpuwarden_gpu_fault", node=NODE, gpu=gpu) == 1
    assert s.value(faulted, "gpuwarden_gpu_degraded", node=NODE, gpu=gpu) == 0
    assert s.value(faulted, "gpuwarden_gpu_xid_errors_total", node=NODE, gpu=gpu, xid="79") == 1
    fault = {"node": NODE, "type": GPU_TYPE, "outcome": "gpu_fault"}
    assert s.value(faulted, "gpuwarden_attempts_total", **fault) == 1
    # retried, but the only GPU is faulted: the job waits in the queue
    assert state(s.node, "victim") is JobState.QUEUED
    queued = {"node": NODE, "state": "queued", "type": GPU_TYPE}
    assert s.value(faulted, "gpuwarden_queue_depth", **queued) == 1
    s.node.store.request_gpu_clear(gpu, now=time.time())  # `gpuwarden gpu clear`
    run_until(s.node, lambda: "gpu_fault_cleared" in [e.kind for e in s.node.store.events()])
    cleared = s.scrape()
    assert s.value(cleared, "gpuwarden_gpu_fault", node=NODE, gpu=gpu) == 0
    assert s.value(cleared, "gpuwarden_gpu_xid_errors_total", node=NODE, gpu=gpu, xid="79") == 1


def test_a_footprint_raised_by_a_measurement_rises_in_its_series(served: Served) -> None:
    s = served
    before = s.scrape()
    assert ("gpuwarden_footprint_measured_bytes", frozenset({("type", GPU_TYPE)})) not in before
    submit(s.node, gpu_job("big", gib=10, seconds=1))  # 10 GiB used, 8 GiB declared
    run_until(s.node, lambda: state(s.node, "big").terminal)
    run_until(s.node, lambda: GPU_TYPE in s.node.store.footprints())
    assert s.node.store.footprints()[GPU_TYPE].bytes >= 10 * GIB  # the raise happened
    after = s.scrape()
    measured = s.value(after, "gpuwarden_footprint_measured_bytes", type=GPU_TYPE)
    assert measured == s.node.store.footprints()[GPU_TYPE].bytes >= 10 * GIB
    assert s.value(after, "gpuwarden_footprint_declared_bytes", type=GPU_TYPE) == 8 * GIB


def test_a_warm_server_loaded_and_evicted_is_counted(served: Served) -> None:
    s, warm = served, "testmods.warm"
    submit(s.node, JobSpec(id="w", type=warm, params={}))
    run_until(s.node, lambda: state(s.node, "w").terminal)
    loaded = s.scrape()
    assert s.value(loaded, "gpuwarden_warm_servers", node=NODE, type=warm, state="idle") == 1
    assert s.value(loaded, "gpuwarden_warm_load_seconds_count", node=NODE, type=warm) == 1
    assert s.value(loaded, "gpuwarden_warm_load_seconds_sum", node=NODE, type=warm) > 0
    # 20 GiB does not fit beside the 6 GiB warm server on the 23 GiB the GPU offers
    submit(s.node, JobSpec(id="big", type=GPU_TYPE, params={"gib": 20, "seconds": 0.1}))
    run_until(s.node, lambda: state(s.node, "big").terminal)
    stopped = [e for e in s.node.store.events() if e.kind == "warm_server_stopped"]
    assert len(stopped) == 1 and "evicted" in str(stopped[0].detail["reason"])  # it happened
    after = s.scrape()
    assert s.value(after, "gpuwarden_warm_evictions_total", node=NODE, type=warm) == 1
    assert not [k for k in after if k[0] == "gpuwarden_warm_servers"]


def test_who_may_scrape(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    tokens = {
        role: issue_token(store, name=role.value, role=role, by=ADMIN, now=1.0)[1]
        for role in (Role.OWNER, Role.OPERATOR, Role.SUBMITTER, Role.NODE)
    }
    http = TestClient(create_app(store, registry, config))
    assert http.get("/metrics").status_code == 401
    for role, code in ((Role.OWNER, 200), (Role.OPERATOR, 200), (Role.SUBMITTER, 403),
                       (Role.NODE, 403)):  # fmt: skip
        got = http.get("/metrics", headers={"Authorization": f"Bearer {tokens[role]}"})
        assert got.status_code == code, (role, got.text)
    public = make_config(tmp_path, metrics_public=True)
    open_http = TestClient(create_app(store, registry, public))
    r = open_http.get("/metrics")
    assert r.status_code == 200 and "gpuwarden_footprint_declared_bytes" in r.text
    assert open_http.get("/v1/status").status_code == 401  # only /metrics is opened
    store.close()


def test_a_coordinator_gives_each_node_as_its_agent_reported_it(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    record, _ = issue_token(store, name="n1", role=Role.NODE, by=ADMIN, now=1.0)
    stats = NodeStats(since=1.0)
    stats.attempt_ended(GPU_TYPE, "succeeded", 3.0)
    stats.on_event("gpu_xid", {"gpu": "GPU-a", "xid": 79})
    gpu = GpuReport("GPU-a", "sim", 24 * GIB, 4 * GIB, 23 * GIB, 6 * GIB, 8 * GIB, 0, GIB, "")
    report = {
        "gpus": [gpu.to_json(), {"uuid": 7}, "junk"],  # what an agent wrote: checked
        "running": [{"job": "j", "type": GPU_TYPE, "gpu": "GPU-a"}, {"type": 3}],
        "warm_servers": [],
        "accepting": True,
        "stats": stats.snapshot(queued={GPU_TYPE: 2}, faults=["GPU-a"]).to_json(),
    }
    store.upsert_node("n1", token_id=record.id, capabilities={}, now=100.0)
    store.touch_node("n1", report, 100.0)
    text = scrape(store, registry, clock=lambda: 130.0, coordinator=True).decode()
    got = parse(text)
    at = frozenset({("node", "n1"), ("gpu", "GPU-a")})
    assert got[("gpuwarden_gpu_ledger_bytes", at)] == 8 * GIB
    assert got[("gpuwarden_gpu_device_used_bytes", at)] == 6 * GIB
    assert got[("gpuwarden_gpu_fault", at)] == 1
    assert got[("gpuwarden_node_heartbeat_age_seconds", frozenset({("node", "n1")}))] == 30
    assert got[("gpuwarden_node_leases", frozenset({("node", "n1")}))] == 0
    assert got[("gpuwarden_node_state", frozenset({("node", "n1"), ("state", "active")}))] == 1
    running = frozenset({("node", "n1"), ("state", "running"), ("type", GPU_TYPE)})
    assert got[("gpuwarden_queue_depth", running)] == 1
    queued = frozenset({("node", "n1"), ("state", "queued"), ("type", GPU_TYPE)})
    assert got[("gpuwarden_queue_depth", queued)] == 2
    done = frozenset({("node", "n1"), ("type", GPU_TYPE), ("outcome", "succeeded")})
    assert got[("gpuwarden_attempts_total", done)] == 1
    assert got[("gpuwarden_cluster_queued_jobs", frozenset())] == 0
    # a plain API on the same store is no coordinator: its node records are not read
    assert "n1" not in scrape(store, registry, clock=lambda: 130.0).decode()
    # the coordinator's app (as `gpuwarden coordinator` makes it) answers the same
    app = create_app(store, registry, make_config(tmp_path, metrics_public=True))
    nodes.install_coordinator(app)
    served = parse(TestClient(app).get("/metrics").text)
    assert served[("gpuwarden_gpu_ledger_bytes", at)] == 8 * GIB
    assert served[("gpuwarden_node_leases", frozenset({("node", "n1")}))] == 0
    # revoked: its GPUs and jobs go; its state stays (issue 31: its last figures stayed)
    assert store.set_node_state("n1", NodeState.REVOKED, now=140.0)
    gone = parse(scrape(store, registry, clock=lambda: 150.0, coordinator=True).decode())
    assert ("gpuwarden_gpu_ledger_bytes", at) not in gone
    assert gone.get(("gpuwarden_queue_depth", running), 0) == 0
    assert gone[("gpuwarden_node_state", frozenset({("node", "n1"), ("state", "revoked")}))] == 1
    store.close()


def exposed_names(text: str) -> set[str]:
    """Every name a scrape declares: families and their samples' suffixes."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def test_the_grafana_dashboard_parses_and_uses_only_exposed_series(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    names = exposed_names(scrape(store, registry, clock=time.time, coordinator=True).decode())
    store.close()
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 6
    used = {m for e in exprs for m in re.findall(r"\b(?:gpuwarden_\w+|DCGM_FI_\w+)", e)}
    assert used and used <= names, sorted(used - names)
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for needed in ("ledger", "queue depth", "wait", "attempts"):
        assert needed in titles


def test_gpu_utilisation_temperature_and_power_under_dcgm_names(tmp_path: Path) -> None:
    """Issue 31: what GPUStack and DCGM users look for first. An agent's report
    carries each GPU's sensors to the coordinator; a GPU that reports none has no
    such series (never a made-up 0)."""
    config = make_config(tmp_path)
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    record, _ = issue_token(store, name="n1", role=Role.NODE, by=ADMIN, now=1.0)
    hot = GpuReport("GPU-a", "sim", 24 * GIB, 4 * GIB, 23 * GIB, 6 * GIB, 8 * GIB, 0, GIB, "",
                    sensors=GpuSensors(util_pct=87.0, temp_c=64.0, power_w=312.5))  # fmt: skip
    quiet = GpuReport("GPU-b", "sim", 24 * GIB, 4 * GIB, 23 * GIB, 0, 0, 0, GIB, "")
    report = {"gpus": [hot.to_json(), quiet.to_json()], "accepting": True}
    assert report["gpus"][0]["sensors"] == {"util_pct": 87.0, "temp_c": 64.0, "power_w": 312.5}
    store.upsert_node("n1", token_id=record.id, capabilities={}, now=100.0)
    store.touch_node("n1", report, 100.0)
    got = parse(scrape(store, registry, clock=lambda: 110.0, coordinator=True).decode())
    at = frozenset(
        {("gpu", "0"), ("UUID", "GPU-a"), ("device", "nvidia0"), ("modelName", "sim"),
         ("Hostname", "n1")}
    )  # fmt: skip
    assert got[("DCGM_FI_DEV_GPU_UTIL", at)] == 87.0
    assert got[("DCGM_FI_DEV_GPU_TEMP", at)] == 64.0
    assert got[("DCGM_FI_DEV_POWER_USAGE", at)] == 312.5
    b_series = [k for k in got if k[0].startswith("DCGM_FI_DEV_") and ("UUID", "GPU-b") in k[1]]
    assert sorted(k[0] for k in b_series) == ["DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED"]
    store.close()


def test_a_simulated_gpu_publishes_its_sensors_idle_then_busy(served: Served) -> None:
    def util() -> float:
        return next(v for (name, at), v in served.scrape().items()
                    if name == "DCGM_FI_DEV_GPU_UTIL" and ("UUID", served.gpu) in at)  # fmt: skip

    served.node.broker.tick()
    assert util() == 0.0  # nothing held: idle
    submit(served.node, gpu_job("busy", seconds=5))
    run_until(served.node, lambda: state(served.node, "busy") is JobState.RUNNING)
    run_until(served.node, lambda: util() > 0)  # its 2 GiB held: at work
    status = served.node.broker.status()
    [g] = [g for g in status.gpus if g.uuid == served.gpu]
    assert g.sensors is not None and g.sensors.temp_c is not None and g.sensors.temp_c > 30
    served.node.store.request_cancel("busy", now=time.time())
