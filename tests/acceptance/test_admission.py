"""Acceptance: VRAM admission on the simulated GPU, with a real broker, real job
processes and the real CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.gpu.select import SIM_STATE_FILE
from tests.acceptance.test_cli import GW, Broker, env, run, wait_for, write_config

GIB = 1024**3


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    cfg = write_config(
        tmp_path,
        extra="[vram]\nreserve_gib = 0\nreclaim_timeout_s = 1\n",
    )
    b = Broker(cfg, tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def submit(b: Broker, *args: str) -> None:
    r = run("--config", b.config, "submit", *args)
    assert r.returncode == 0, r.stdout + r.stderr


def state_of(b: Broker, job: str) -> dict[str, object]:
    r = run("--config", b.config, "show", job, "--json")
    assert r.returncode == 0, r.stderr
    data: dict[str, object] = json.loads(r.stdout)
    return data


def ended(b: Broker, *jobs: str) -> bool:
    return all(state_of(b, j)["state"] in ("done", "failed", "cancelled") for j in jobs)


def status(b: Broker) -> tuple[int, dict[str, object]]:
    r = run("--config", b.config, "status", "--json")
    return r.returncode, json.loads(r.stdout)["nodes"][0]


def sim_state(b: Broker) -> Path:
    return b.config.parent / "state" / SIM_STATE_FILE


def test_an_underdeclared_type_is_measured_and_raised(broker: Broker) -> None:
    # testmods.gpu declares 8 GiB; this job really takes 10 GiB, alone on the GPU
    submit(broker, "testmods.gpu", "--gib", "10", "--seconds", "0.6", "--id", "big1")
    wait_for(lambda: ended(broker, "big1"), "big1")
    assert state_of(broker, "big1")["state"] == "done"
    raised = [e for e in broker.events("footprint_raised")]
    assert raised and raised[0]["type"] == "testmods.gpu" and raised[0]["bytes"] == 10 * GIB
    wait_for(
        lambda: status(broker)[1]["footprints"]["testmods.gpu"]["measured_bytes"] > 0, "status"
    )
    fp = status(broker)[1]["footprints"]["testmods.gpu"]  # type: ignore[index]
    assert fp == {
        "declared_bytes": 8 * GIB,
        "measured_bytes": 10 * GIB,
        "effective_bytes": 10 * GIB,
    }

    # the next job is admitted against 10 GiB, not the declared 8, whatever it asks for
    p = preview(broker, "testmods.gpu")
    assert "footprint 10.0 GiB" in p
    submit(broker, "testmods.gpu", "--gib", "1", "--seconds", "5", "--id", "next1")

    def held_for_next1() -> list[int]:
        _, st = status(broker)
        return [h["bytes"] for g in st["gpus"] for h in g["holdings"] if h["job_id"] == "next1"]  # type: ignore[index,union-attr]

    seen: list[int] = []

    def held() -> bool:  # one look (a status call takes seconds on a loaded machine)
        seen[:] = held_for_next1()
        return bool(seen)

    wait_for(held, "next1's holding in the status")
    assert seen == [10 * GIB]


def test_a_leak_degrades_the_gpu_and_status_exits_1(broker: Broker) -> None:
    submit(broker, "testmods.gpu", "--gib", "3", "--leak", "--seconds", "0.1", "--id", "leaky")
    wait_for(lambda: bool(broker.events("gpu_degraded")), "the GPU to be degraded", timeout=20)
    assert state_of(broker, "leaky")["state"] == "done"  # the job itself succeeded
    code, s = status(broker)
    assert code == 1
    assert "leaky" in json.dumps(s["degraded"])
    text = run("--config", broker.config, "status")
    assert text.returncode == 1 and "degraded" in text.stdout
    # VRAM admission pauses there; cpu jobs go on
    submit(broker, "testmods.gpu", "--gib", "1", "--id", "blocked")
    submit(broker, "echo.echo", "--text", "cpu goes on", "--id", "cpu1", "--wait")
    assert state_of(broker, "blocked")["state"] == "queued"
    why = run("--config", broker.config, "explain", "blocked").stdout
    assert "degraded" in why
    # an operator frees the leaked memory: the GPU clears by itself and the job runs
    from gpuwarden.gpu.sim import SimDevice

    device = SimDevice.open(sim_state(broker))
    for a in device.allocations():
        device.free(a.id)
    wait_for(lambda: bool(broker.events("gpu_recovered")), "the GPU to recover", timeout=20)
    wait_for(lambda: ended(broker, "blocked"), "blocked to run")
    assert state_of(broker, "blocked")["state"] == "done"
    wait_for(lambda: status(broker)[0] == 0, "status to be healthy again")


def test_a_foreign_process_is_counted_never_killed(broker: Broker) -> None:
    wait_for(sim_state(broker).exists, "the simulated GPU")
    from gpuwarden.gpu.sim import SimDevice

    uuid = SimDevice.open(sim_state(broker)).uuids()[0]
    foreign = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from gpuwarden.gpu import simclient; import time; "
            f"simclient.attach().allocate({20 * GIB}); print('ok', flush=True); time.sleep(60)",
        ],
        env={**env(), "GPUWARDEN_SIM_GPU": str(sim_state(broker)), "CUDA_VISIBLE_DEVICES": uuid},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == "ok"
        submit(broker, "testmods.gpu", "--gib", "6", "--id", "waits")
        wait_for(
            lambda: (
                "by other processes" in run("--config", broker.config, "explain", "waits").stdout
            ),
            "the wait reason",
        )
        why = run("--config", broker.config, "explain", "waits").stdout
        assert "needs 8.0 GiB on one GPU" in why and "20.0 GiB by other processes" in why
        assert "would wait" in preview(broker, "testmods.gpu")
        assert foreign.poll() is None  # never killed
    finally:
        foreign.kill()
        foreign.wait()
    wait_for(lambda: ended(broker, "waits"), "the job once the foreign memory is gone")
    assert state_of(broker, "waits")["state"] == "done"


def test_coresident_types_share_and_exclusive_ones_never_do(broker: Broker) -> None:
    flats = [f"flat{i}" for i in range(3)]
    exclusive = [f"excl{i}" for i in range(2)]
    for j in flats:
        # long enough that all three overlap though each submit is a process start
        # (that takes seconds on a loaded 2-core machine: 4 s was once too short)
        submit(broker, "testmods.flat", "--seconds", "10", "--id", j)
    for j in exclusive:
        submit(broker, "testmods.gpu", "--gib", "2", "--seconds", "0.4", "--id", j)
    wait_for(lambda: ended(broker, *flats, *exclusive), "all jobs", timeout=40)
    spans = {}
    for j in flats + exclusive:
        s = state_of(broker, j)
        assert s["state"] == "done", s
        [a] = s["attempts_detail"]  # type: ignore[misc]
        spans[j] = (a["started_at"], a["ended_at"])

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    # the three 4 GiB co-resident jobs ran at the same time on the one GPU
    assert all(overlap(a, b) for a in flats for b in flats if a < b)
    # an exclusive job never overlapped anything
    for e in exclusive:
        assert not any(overlap(e, other) for other in spans if other != e)


def test_a_footprint_bigger_than_every_gpu_is_refused_at_submission(broker: Broker) -> None:
    r = run("--config", broker.config, "submit", "testmods.gpu", "--vram-gib", "30", "--id", "huge")
    assert r.returncode == 2 and "can never run on this node" in r.stderr
    queue = broker.config.parent / "queues" / "demo"
    r = run(
        "--config",
        broker.config,
        "submit",
        "--queue",
        queue,
        "testmods.gpu",
        "--vram-gib",
        "30",
        "--id",
        "huge2",
        "--wait",
        "--wait-timeout",
        "30",
    )
    assert r.returncode == 1 and "can never run on this node" in r.stdout
    assert run("--config", broker.config, "show", "huge").returncode == 2


def preview(b: Broker, type_name: str) -> str:
    r = run("--config", b.config, "preview", type_name)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_preview_without_a_broker_reads_the_probe(tmp_path: Path) -> None:
    r = subprocess.run(
        [*GW, "--mock-gpu", "--state-dir", str(tmp_path / "s"), "preview", "echo.echo"],
        capture_output=True,
        text=True,
        env={
            **env(),
            "GPUWARDEN_MODULES": str(Path(__file__).parents[2] / "src" / "gpuwarden" / "modules"),
        },
    )
    assert r.returncode == 0, r.stderr
    assert "would start now on a cpu slot" in r.stdout and "no broker is running" in r.stdout
