"""Measured profiles with real processes: a job that allocates RAM has its peak
measured (sampled from its process tree) and stored per attempt and per type,
and ``types`` (text, ``--json``) and ``GET /v1/types`` show each type's declared
and measured VRAM, RAM peak and wall times, on both stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from psycopg import sql

from gpuwarden import cli
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, MIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.node import explain
from gpuwarden.node.measured import RamPeaks, tree_rss, type_profiles
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES, STORE_BACKENDS

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"
LOCAL = Principal(token_id="local", name="t", role=Role.OWNER)
HOG_MIB = 160
#: a process that holds 64 MiB resident (every page touched), says so and waits
_HOLD_64_MIB = (
    "import time\n"
    "b = bytearray(64 << 20)\n"
    "b[::4096] = b'\\1' * len(range(0, len(b), 4096))\n"
    "print(1, flush=True)\n"
    "time.sleep(30)\n"
)


def test_tree_rss_counts_the_children_of_a_tree() -> None:
    """A child that holds 64 MiB resident makes its parent's tree that much larger."""
    me = tree_rss(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", _HOLD_64_MIB], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"1\n"
        assert tree_rss(child.pid) >= 64 * MIB
        assert tree_rss(os.getpid()) >= me + 64 * MIB
    finally:
        child.kill()
        child.wait()
    assert tree_rss(child.pid) == 0  # gone: nothing to count


def test_ram_peaks_keep_the_most_seen_and_sample_at_most_every_interval() -> None:
    seen = iter([10, 50, 20, 70])
    peaks = RamPeaks(every_s=1.0, read=lambda pid: next(seen))
    peaks.watch("a/1", 123)  # a first sample at once: 10
    peaks.sample(0.0)  # 50
    peaks.sample(0.5)  # too soon: not read
    assert peaks.peak("a/1") == 50
    peaks.sample(1.0)  # 20: the peak stays
    assert peaks.peak("a/1") == 50 and len(peaks) == 1
    peaks.end("a/1")
    assert peaks.peak("a/1") is None and len(peaks) == 0
    peaks.sample(5.0)  # nothing watched: nothing read
    assert next(seen) == 70


def make_config(tmp_path: Path, database: str = "") -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "database": database,
            "node_name": "testnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0},
        }
    )


@pytest.fixture(params=STORE_BACKENDS)
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    """A broker on SQLite, and on PostgreSQL (a schema of its own)."""
    database = ""
    if request.param == "postgres":
        pg_url, schema = request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema")
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        sep = "&" if "?" in pg_url else "?"
        database = f"{pg_url}{sep}options=-c%20search_path%3D{schema}"
    with open_node(make_config(tmp_path, database), mock_gpu=True) as n:
        yield n


def _done(node: Node, *ids: str) -> bool:
    jobs = [node.store.get_job(i) for i in ids]
    return all(j is not None and j.state is JobState.DONE for j in jobs)


def test_a_job_that_allocates_ram_has_its_peak_measured_and_shown_by_types(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    submit(node, JobSpec("hog", "testmods.roomy_sleep", {"seconds": 0.6, "ram_mib": HOG_MIB}))
    run_until(node, lambda: _done(node, "hog"))
    submit(node, JobSpec("small", "testmods.roomy_sleep", {"seconds": 0.6}))
    run_until(node, lambda: _done(node, "small"))
    [hog] = node.store.attempts("hog")
    [small] = node.store.attempts("small")
    assert hog.ram_peak_bytes is not None and small.ram_peak_bytes is not None
    # the hog's peak is its allocation and a Python's own few dozen MiB
    assert HOG_MIB * MIB <= hog.ram_peak_bytes <= (HOG_MIB + 120) * MIB
    assert small.ram_peak_bytes < hog.ram_peak_bytes - (HOG_MIB - 20) * MIB
    # the type keeps the larger peak, named by the job that reached it
    profile = node.store.type_profiles()["testmods.roomy_sleep"]
    assert (profile.ram_peak_bytes, profile.job_id) == (hog.ram_peak_bytes, "hog")

    config = tmp_path / "gpuwarden.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\nmodule_paths = ["{MODULES}", "{TEST_MODULES}"]\n'
        f'database = "{node.config.database}"\n'  # the broker's store: SQLite or PostgreSQL
    )
    assert cli.main(["--config", str(config), "types", "--json"]) == 0
    rows = {d["type"]: d for d in json.loads(capsys.readouterr().out)["types"]}
    shown = rows["testmods.roomy_sleep"]["profile"]
    assert shown["ram_peak_bytes"] == hog.ram_peak_bytes
    assert shown["vram_declared_bytes"] == 0 and shown["vram_measured_bytes"] is None
    wall = shown["wall"]
    assert wall["runs"] == 2 and 0.6 <= wall["median_s"] <= wall["p90_s"] <= wall["longest_s"]
    assert rows["testmods.gpu"]["profile"]["wall"] is None  # never ran: nothing measured

    assert cli.main(["--config", str(config), "types"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "testmods.roomy_sleep" in ln)
    assert "RAM 1" in line and "MiB" in line  # the hog's 160-odd MiB
    assert "median" in text and "p90 (2 runs)" in text


def _state(node: Node, job_id: str) -> JobState | None:
    job = node.store.get_job(job_id)
    return None if job is None else job.state


def test_the_broker_backfills_a_job_by_its_est_s_before_its_type_is_measured(
    node: Node,
) -> None:
    """x (10 GiB, shares, declares 4 s) runs; head (20 GiB, needs the GPU to itself)
    waits with the GPU held back; q (4 GiB, shares, declares 1 s) is expected to
    end before x does, so it starts beside x at once. q2, the same job without
    est_s, has no estimate until q's run measured its type: then it starts beside
    x too, expected to take what q took. Neither delays the head."""
    flat = "testmods.flat"
    submit(node, JobSpec("x", flat, {"gib": 10, "seconds": 4}, vram_bytes=10 * GIB, est_s=4))
    run_until(node, lambda: _state(node, "x") is JobState.RUNNING)
    submit(
        node,
        JobSpec("head", "testmods.gpu", {"gib": 20, "seconds": 0.3}, vram_bytes=20 * GIB),
        JobSpec("q", flat, {"gib": 4, "seconds": 0.3}, est_s=1),
        JobSpec("q2", flat, {"gib": 4, "seconds": 0.3}),
    )
    run_until(node, lambda: _done(node, "x", "head", "q", "q2"), timeout=60)
    [x], [head], [q], [q2] = (node.store.attempts(i) for i in ("x", "head", "q", "q2"))
    assert x.ended_at is not None and q.ended_at is not None and head.ended_at is not None
    assert q2.ended_at is not None
    assert q.started_at < x.ended_at  # beside x, on the GPU held back for the head
    assert q.ended_at <= q2.started_at < x.ended_at  # once q measured the type
    assert max(x.ended_at, q.ended_at, q2.ended_at) <= head.started_at  # not delayed


def test_types_on_a_fresh_machine_has_no_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    config = tmp_path / "gpuwarden.toml"
    config.write_text(f'state_dir = "{tmp_path / "none"}"\nmodule_paths = ["{TEST_MODULES}"]\n')
    assert cli.main(["--config", str(config), "types", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["types"]
    assert rows and all(d["profile"] is None for d in rows)
    assert not (tmp_path / "none").exists()  # nothing was created


def _ran(store: Store, job_id: str, type_name: str, seconds: float, ram: int) -> None:
    store.submit([JobSpec(job_id, type_name)], now=1.0)
    store.start_attempt(job_id, node="n", gpu_uuid="G", now=10.0)
    store.record_ram_peak(job_id, 1, type_name, ram, now=10.0 + seconds)
    store.finish_attempt(
        job_id, 1, target=JobState.DONE, now=10.0 + seconds, outcome="succeeded", reason="ok"
    )


def test_the_api_shows_each_types_profile(store: Store, tmp_path: Path) -> None:
    """On both stores: declared and measured VRAM, the RAM peak and the wall times."""
    registry = Registry.load([MODULES, TEST_MODULES])
    for i, seconds in enumerate([4.0, 2.0, 10.0, 3.0, 5.0]):
        _ran(store, f"g{i}", "testmods.gpu", seconds, (100 + i) * MIB)
    store.raise_footprint("testmods.gpu", 3 * GIB, now=20.0, job_id="g2")
    assert type_profiles(store, registry.types.values())["testmods.gpu"] == {
        "vram_declared_bytes": registry.types["testmods.gpu"].vram_bytes,
        "vram_measured_bytes": 3 * GIB,
        "ram_peak_bytes": 104 * MIB,
        "wall": {"runs": 5, "median_s": 4.0, "p90_s": 10.0, "longest_s": 10.0},
    }
    config = Config.model_validate({"state_dir": tmp_path, "module_paths": [MODULES, TEST_MODULES]})
    _, token = issue_token(store, name="r", role=Role.SUBMITTER, by=LOCAL, now=time.time())
    app = create_app(store, Registry.load(config.module_paths, config.launch_rules), config)
    got = TestClient(app).get("/v1/types", headers={"Authorization": f"Bearer {token}"})
    assert got.status_code == 200, got.text
    rows = {d["type"]: d for d in got.json()}
    assert rows["testmods.gpu"]["profile"]["wall"]["median_s"] == 4.0
    assert rows["testmods.gpu"]["profile"]["vram_measured_bytes"] == 3 * GIB
    assert rows["testmods.sleep"]["profile"]["ram_peak_bytes"] is None


def test_explain_says_what_a_declared_run_time_is_planned_with(store: Store) -> None:
    registry = Registry.load([MODULES, TEST_MODULES])
    store.submit([JobSpec("e", "testmods.gpu", est_s=30)], now=1.0)
    job = store.get_job("e")
    assert job is not None
    lines = explain.explain_job(job, store, registry, None)
    assert (
        "declared run time 30 s (planned as 32 s): used for backfill until testmods.gpu "
        "has a measured run time"
    ) in lines
    _ran(store, "g", "testmods.gpu", 7.0, MIB)
    lines = explain.explain_job(job, store, registry, None)
    assert (  # issue 31: the job's longer word wins over its type's history
        "declared run time 30 s (planned as 32 s): used for backfill, as it is longer than "
        "testmods.gpu's measured run time, 7.0 s"
    ) in lines
    _ran(store, "g2", "testmods.gpu", 70.0, MIB)
    lines = explain.explain_job(job, store, registry, None)
    assert (
        "declared run time 30 s; testmods.gpu's measured run time, 70.0 s (the longest of "
        "its latest runs), is longer and is used instead"
    ) in lines
    plain = store.submit([JobSpec("p", "testmods.gpu")], now=2.0)[0]
    assert not any("run time" in ln for ln in explain.explain_job(plain, store, registry, None))


def test_ram_peaks_sample_a_few_attempts_per_tick_in_turn() -> None:
    """With more attempts than ``per_tick``, each tick samples the next few, so a
    tick's cost stays bounded and every attempt still gets its turn."""
    read: list[int] = []
    peaks = RamPeaks(every_s=0.0, per_tick=2, read=lambda pid: read.append(pid) or pid)
    for pid in (1, 2, 3):
        peaks.watch(f"j{pid}/1", pid)
    read.clear()
    peaks.sample(1.0)
    peaks.sample(2.0)
    assert read == [1, 2, 3, 1]
    peaks.end("j2/1")
    read.clear()
    peaks.sample(3.0)
    peaks.sample(4.0)
    assert sorted(read[:2]) == [1, 3] and len(read) == 4 and 2 not in read
    assert peaks.peak("j3/1") == 3 and peaks.peak("j2/1") is None
