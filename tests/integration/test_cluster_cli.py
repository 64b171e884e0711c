"""The commands of several hosts through the real CLI (`gpuwarden.cli.main`) on the
coordinator's own PostgreSQL database, a fresh one per test: `status` shows every
enrolled node and exits 1 for an offline node or a degraded GPU; `node list` and
`explain` say when a node is silent; `explain` names the node whose launch rules
refuse a type; `node resume` gives a drained node work again, audited; `node
invite` prints the URL to paste. The agents' reports are written as an agent
sends them (tests/acceptance/test_cluster.py runs real agents)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from gpuwarden.cli import main
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import NodeState
from gpuwarden.store.postgres import PostgresStore

REPO = Path(__file__).resolve().parents[2]
MODULES = [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"]
#: a node last heard from 10 s ago, its lease renewed then for 30 s (the seconds
#: are the CLI's own clock: a second or two of leeway for a slow machine)
SILENT = re.compile(r"silent for 1[0-2] s \(lease ends in (1[89]|20) s\)")


@dataclass
class Site:
    config: Path
    store: PostgresStore
    capsys: pytest.CaptureFixture[str]

    def gw(self, *args: str) -> tuple[int, str, str]:
        code = main(["--config", str(self.config), *args])
        got = self.capsys.readouterr()
        return code, got.out, got.err

    def enrol(self, name: str, runtime: str = "local", **allow: bool) -> None:
        self.store.create_token(
            token_id=uuid.uuid4().hex[:12], name=name, role=Role.NODE, secret_hash="x",
            now=time.time(), created_by="local", node=name,
        )  # fmt: skip
        token = [t for t in self.store.list_tokens() if t.node == name][-1]
        co.enroll(self.store, name, token_id=token.id, capabilities={}, now=time.time())
        self.beat(name, runtime, **allow)

    def run(self, name: str, job_id: str) -> None:
        """An echo job, leased to the node and started there, as its agent reports."""
        self.store.submit([JobSpec(id=job_id, type="echo.echo", params={"text": "x"})], now=1.0)
        record = self.store.get_node(name)
        assert record is not None
        now = time.time()
        [leased] = co.claim(
            self.store, Registry.load(MODULES), name, nv.node_view(record), now, lease_s=30.0
        )
        assert leased["id"] == job_id
        co.start(self.store, name, job_id, lease_id=leased["lease_id"], gpu_uuid=None, now=now)

    def beat(
        self, name: str, runtime: str = "local", *, ago: float = 0.0, **kw: Any
    ) -> dict[str, Any]:
        """A heartbeat of the node ``ago`` seconds ago: its report, its leases renewed."""
        rep = agent_report(runtime, **kw)
        held = [lease.job_id for lease in self.store.leases(name)]
        co.heartbeat(self.store, name, rep, time.time() - ago, 30.0, held=held)
        return rep


def agent_report(runtime: str, degraded: str = "", **allow: bool) -> dict[str, Any]:
    rules = LaunchRules(runtime=Runtime(runtime), **allow)
    reg = Registry.load(MODULES, rules)
    return {
        "gpus": [
            {
                "uuid": "GPU-sim-0", "name": "gpuwarden simulated GPU",
                "total_bytes": 24 * GIB, "usable_bytes": int(23.5 * GIB),
                "free_bytes": 0 if degraded else 20 * GIB, "used_bytes": 3 * GIB,
                "ledger_bytes": 3 * GIB, "degraded": degraded,
            }
        ],
        "warm": [], "warm_servers": [], "running": [], "busy": 0, "max_jobs": 4,
        "labels": {}, "types": sorted(t.name for t in reg.types.values()
                                      if rules.refusal(t) is None),
        "modules": sorted(reg.types), "launch_rules": rules.to_json(), "probe": "sim",
        "probe_error": "", "heartbeat_every_s": 1.0, "accepting": True,
    }  # fmt: skip


@pytest.fixture
def site(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> Iterator[Site]:
    name = f"gw_cli_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = pg_url.rsplit("/", 1)[0] + f"/{name}"
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\ndatabase = "{url}"\n'
        f"module_paths = {json.dumps([str(p) for p in MODULES])}\n"
        "[cluster]\nlease_s = 30\noffline_after_s = 60\n"
    )
    store = PostgresStore(url)
    try:
        yield Site(config=config, store=store, capsys=capsys)
    finally:
        store.close()
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def test_status_shows_every_node_and_fails_for_a_degraded_gpu_or_an_offline_node(
    site: Site,
) -> None:
    code, _, err = site.gw("status")
    assert code == 1 and "no broker status" in err  # nothing enrolled yet
    site.enrol("gpu-a")
    site.enrol("gpu-b", "bubblewrap")
    site.run("gpu-a", "run-1")
    code, out, err = site.gw("status")
    assert code == 0, out + err
    assert "node gpu-a  active  heartbeat" in out and "node gpu-b  active" in out
    assert "1 running" in out and "ok" in out
    for column in ("total", "used", "gpuwarden", "free"):
        assert column in out
    assert "run-1" in out and "echo.echo" in out
    assert "24.0 GiB" in out and "3.0 GiB" in out and "20.0 GiB" in out  # total, used, free
    code, out, _ = site.gw("status", "--json")
    data = json.loads(out)
    assert code == 0 and [n["node"] for n in data["cluster"]] == ["gpu-a", "gpu-b"]
    assert data["cluster"][0]["gpus"][0]["ledger_bytes"] == 3 * GIB
    assert data["cluster"][0]["running"][0]["job"] == "run-1"
    # a degraded GPU on one node: exit 1, saying which
    site.beat("gpu-b", "bubblewrap", degraded="3.0 GiB of job x still shows as used")
    code, out, _ = site.gw("status")
    assert code == 1
    assert "node gpu-b  active" in out and "1 GPU(s) degraded: VRAM admission paused there" in out
    assert "degraded: 3.0 GiB of job x still shows as used" in out
    # an offline node (past offline_after_s): exit 1 too
    site.beat("gpu-b", "bubblewrap")
    assert site.gw("status")[0] == 0
    site.beat("gpu-b", "bubblewrap", ago=90.0)
    code, out, _ = site.gw("status")
    assert code == 1 and re.search(r"offline: not heard from for 9[0-2] s", out), out
    # a revoked node is shown, and is no problem
    co.revoke(site.store, Registry.load(MODULES), "gpu-b", now=time.time())
    code, out, _ = site.gw("status")
    assert code == 0 and "node gpu-b  revoked" in out


def test_a_silent_node_and_its_jobs_say_so(site: Site) -> None:
    site.enrol("gpu-a")
    site.run("gpu-a", "run-1")
    code, out, _ = site.gw("node", "list")
    assert code == 0 and "active" in out and "silent" not in out
    code, out, _ = site.gw("explain", "run-1")
    # 0 s, or 1 s where the command took a while on a loaded machine
    assert re.search(r"on node gpu-a, heard from [01] s ago", out), out
    # its heartbeats stop (it beats every second): 10 s later it is overdue
    site.beat("gpu-a", ago=10.0)
    code, out, _ = site.gw("node", "list")
    assert code == 0
    assert SILENT.search(out) and "active" not in out, out
    got = json.loads(site.gw("node", "list", "--json")[1])
    assert got[0]["state"] == "active" and got[0]["silent_s"] >= 10
    assert SILENT.fullmatch(got[0]["condition"]), got
    code, out, _ = site.gw("explain", "run-1")
    assert code == 0 and re.search(r"its node gpu-a is " + SILENT.pattern, out), out
    code, out, _ = site.gw("status")
    assert code == 1 and SILENT.search(out), out


def test_explain_names_the_node_whose_rules_refuse_the_type(site: Site) -> None:
    site.enrol("gpu-a")  # local, no allowances: host types only
    site.enrol("gpu-b", "bubblewrap")
    co.drain(site.store, "gpu-b", now=time.time())
    site.store.submit(
        [JobSpec(id="box-1", type="testmods.gpu", params={"gib": 1}, vram_bytes=GIB)],
        now=time.time(),
    )
    code, out, _ = site.gw("explain", "box-1")
    assert code == 0, out
    assert "node gpu-a refuses container types (its runtime is local)" in out
    assert "has no module" not in out
    assert "node gpu-b is draining: it takes no new work" in out


def test_node_resume_gives_a_drained_node_work_again_and_is_audited(site: Site) -> None:
    site.enrol("gpu-a")
    assert site.gw("node", "drain", "gpu-a")[0] == 0
    node = site.store.get_node("gpu-a")
    assert node is not None and node.state is NodeState.DRAINING
    code, _, err = site.gw("node", "resume", "gpu-a")
    assert code == 0 and "node gpu-a takes new work again" in err
    node = site.store.get_node("gpu-a")
    assert node is not None and node.state is NodeState.ACTIVE
    code, _, err = site.gw("node", "resume", "gpu-a")
    assert code == 0 and "was not draining (it is active): nothing to resume" in err
    code, _, err = site.gw("node", "resume", "ghost")
    assert code == 2 and "no node named 'ghost'" in err
    audit = [(a.action, a.target, a.actor, a.detail) for a in site.store.audit_rows()]
    assert ("node.resume", "gpu-a", "local", {"resumed": True}) in audit
    assert ("node.resume", "gpu-a", "local", {"resumed": False}) in audit


def test_node_invite_prints_the_url_to_paste(site: Site) -> None:
    code, out, err = site.gw("node", "invite", "gpu-c")
    assert code == 0 and out.startswith("gw_")
    assert "gpuwarden agent --coordinator URL --enroll-file FILE" in err
    assert "set [cluster] coordinator_url in the coordinator's config" in err
    assert out.strip() not in err  # the token is on stdout only, never in the command
    text = site.config.read_text().replace(
        "[cluster]\n", '[cluster]\ncoordinator_url = "http://gpu-coord.lan:8765"\n'
    )
    site.config.write_text(text)
    code, out, err = site.gw("node", "invite", "gpu-d")
    assert code == 0
    assert "gpuwarden agent --coordinator http://gpu-coord.lan:8765 --enroll-file FILE" in err
    assert "coordinator_url" not in err and "loopback" not in err


def test_a_local_submit_on_the_coordinators_host_follows_the_nodes_rules(site: Site) -> None:
    """The coordinator's config names no runtime (its own rules would refuse every
    container type): a submit through its store is decided by the enrolled nodes."""
    code, _, err = site.gw("submit", "echo.container", "--text", "x")
    assert code == 0, err  # nothing enrolled yet: accepted, it waits for a node
    site.enrol("gpu-a")  # local, no allowances: host types only
    code, _, err = site.gw("submit", "echo.container", "--text", "x")
    assert code == 2 and "no node can ever run it: gpu-a: refuses container types" in err, err
    site.enrol("gpu-b", "bubblewrap")  # this one runs container types
    code, _, err = site.gw("submit", "echo.container", "--text", "x", "--id", "box-2")
    assert code == 0, err
    job = site.store.get_job("box-2")
    assert job is not None and job.type == "echo.container"
