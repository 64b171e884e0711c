"""Acceptance: a job on two GPUs beside single-GPU ones, on a simulated node of
three GPUs, with a real broker, real job processes and the real CLI. Each process
must see exactly the GPUs it was given, and no two jobs ever overlap on a GPU."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_cli import Broker, run, wait_for, write_config
from tests.acceptance.test_preemption import show, submit


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    cfg = write_config(tmp_path, extra="[vram]\nreserve_gib = 0\nreclaim_timeout_s = 5\n")
    cfg.write_text(cfg.read_text().replace("[sim_gpu]\n", "[sim_gpu]\ncount = 3\n"))
    b = Broker(cfg, tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def out_file(b: Broker, job: str, name: str) -> Path:
    return b.config.parent / "state" / "jobs" / job / "attempt-1" / "out" / name


def ended(b: Broker, *jobs: str) -> bool:
    return all(show(b, j)["state"] in ("done", "failed", "cancelled") for j in jobs)


def explain(b: Broker, job: str) -> str:
    r = run("--config", b.config, "explain", job)
    assert r.returncode == 0, r.stderr
    return r.stdout


def holding(b: Broker, job: str) -> bool:
    """The holder runs and holds its memory (it wrote held.json)."""
    return out_file(b, job, "held.json").exists()


def release(b: Broker, job: str) -> None:
    out_file(b, job, "go").write_text("")


def test_a_two_gpu_job_waits_for_two_gpus_and_sees_exactly_them(broker: Broker) -> None:
    # three holders take the three GPUs (16 GiB each: no two share one), in this order
    holders = ("h0", "h1", "h2")
    for h in holders:
        submit(broker, "testmods.vramhold", "--gib", "16", "--vram-gib", "16",
               "-p", "wait_for=go", "--id", h)  # fmt: skip
        wait_for(lambda h=h: holding(broker, h), h)
    submit(broker, "testmods.pair", "--gib", "10", "--seconds", "1", "--id", "pair")
    submit(broker, "testmods.gpu", "--gib", "8", "--seconds", "0.5", "--id", "late")

    # the pair waits, every GPU taken, with two GPUs held back for it: the two whose
    # holders are youngest (they are likely to end soonest)
    wait_for(lambda: "on each of 2 GPUs at once" in explain(broker, "pair"), "the pair's reason")
    said = explain(broker, "pair")
    assert show(broker, "pair")["state"] == "queued", said
    assert "are held back for it until it fits on all 2" in said, said
    gpu_of = {h: show(broker, h)["attempts_detail"][0]["gpu"] for h in holders}
    assert f"{', '.join(sorted([gpu_of['h1'], gpu_of['h2']]))} are held back" in said, said

    # the first GPU comes free: not held back for the pair, it takes the later job
    release(broker, "h0")
    wait_for(lambda: ended(broker, "late"), "late")
    assert show(broker, "pair")["state"] == "queued"  # one free GPU is not two
    # a second comes free: the pair starts on two GPUs at once
    release(broker, "h1")
    wait_for(lambda: ended(broker, "pair"), "pair", timeout=60)
    release(broker, "h2")
    jobs = (*holders, "pair", "late")
    wait_for(lambda: ended(broker, *jobs), "all ended", timeout=60)
    shown = {j: show(broker, j) for j in jobs}
    assert all(s["state"] == "done" for s in shown.values()), shown

    # the pair's one attempt ran on two distinct GPUs, and its process saw exactly them
    (attempt,) = shown["pair"]["attempts_detail"]
    pair_gpus = attempt["gpu"].split(",")
    assert len(pair_gpus) == 2 and len(set(pair_gpus)) == 2
    assert out_file(broker, "pair", "visible.txt").read_text() == attempt["gpu"]
    assert out_file(broker, "pair", "gpus.txt").read_text() == attempt["gpu"]
    (late,) = shown["late"]["attempts_detail"]
    assert (
        late["gpu"] == gpu_of["h0"]
        and out_file(broker, "late", "gpu.txt").read_text() == late["gpu"]
    )
    for h in holders:
        assert json.loads(out_file(broker, h, "held.json").read_text())["gpu"] == gpu_of[h]

    # no two attempts overlapping in time shared a GPU (a holder co-resides, but none
    # of the others does, and 16 GiB leave no room beside it)
    spans = [
        (set(a["gpu"].split(",")), a["started_at"], a["ended_at"], j)
        for j in jobs
        for a in shown[j]["attempts_detail"]
    ]
    for n, (g1, start1, end1, j1) in enumerate(spans):
        for g2, start2, end2, j2 in spans[n + 1 :]:
            if start1 < end2 and start2 < end1:
                assert not g1 & g2, f"{j1} and {j2} overlapped on {g1 & g2}"
    # it started only once two holders had ended, and after the later job had run
    h_ends = sorted(shown[h]["attempts_detail"][0]["ended_at"] for h in holders)
    assert h_ends[1] <= attempt["started_at"] and late["started_at"] < attempt["started_at"]


def test_a_job_asking_for_more_gpus_than_the_node_has_is_refused_at_submission(
    broker: Broker,
) -> None:
    r = run("--config", broker.config, "submit", "testmods.pair", "--gpus", "4", "--id", "four")
    assert r.returncode != 0
    assert "needs 4 GPUs at once with 8.0 GiB on each" in r.stdout + r.stderr
    assert "this node has 3 GPU(s)" in r.stdout + r.stderr
    r = run("--config", broker.config, "show", "four", "--json")
    assert r.returncode != 0  # nothing was stored
