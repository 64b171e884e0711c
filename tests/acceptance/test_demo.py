"""Acceptance: ``gpuwarden demo`` crashes jobs on their own and none through gpuwarden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.tools.demo import workload

GW = [sys.executable, "-m", "gpuwarden"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    e["PYTHONUNBUFFERED"] = "1"
    return e


def demo(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GW, "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env(),
    )


@pytest.mark.slow
def test_demo_crashes_jobs_on_their_own_and_none_through_gpuwarden(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--jobs", "6", "--seed", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = proc.stdout.strip().splitlines()  # --json: one line on stdout, the rest on stderr
    figures = json.loads(line)
    own, gw = figures["on_their_own"], figures["through_gpuwarden"]
    assert figures["ok"] is True
    assert figures["jobs"] == own["jobs"] == gw["jobs"] == 6
    assert own["oom"] >= 1
    assert own["done"] + own["oom"] + own["other_failed"] == 6
    assert own["loads"] == 6
    assert gw["oom"] == 0
    assert gw["done"] == 6
    assert gw["other_failed"] == 0
    assert gw["loads"] >= 6
    assert 0 < gw["peak_gib"] <= gw["total_gib"] == 24
    assert 0 < own["peak_gib"] <= 24
    # the table and the conclusion are on stderr
    table = proc.stderr
    assert "on their own" in table
    assert "through gpuwarden" in table
    row = next(ln for ln in table.splitlines() if "jobs crashed by out-of-memory" in ln)
    cells = [c.strip() for c in row.strip("│ \n").split("│")]
    assert cells == ["jobs crashed by out-of-memory", str(own["oom"]), "0"]
    for label in ("jobs done", "peak VRAM", "model loads", "wall time"):
        assert label in table
    assert "through gpuwarden all 6 finished and none crashed" in table


def test_demo_refuses_a_bad_job_count(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--jobs", "2", timeout=30)
    assert proc.returncode == 2
    assert "--jobs must be between 4 and 64" in proc.stderr


@pytest.mark.parametrize("jobs", [4, 8, 16, 64])
def test_workload_is_fixed_by_its_seed_and_overfills_the_gpu(jobs: int) -> None:
    work = workload(5, jobs)
    assert work == workload(5, jobs)
    assert work != workload(6, jobs)
    assert len(work) == jobs
    assert len({j.id for j in work}) == jobs
    types = [j.type for j in work]
    assert types.count("burn.llm") >= 2  # two LLMs alone overfill 24 GiB
    assert types.count("burn.vision") >= 1
    for j in work:
        assert 1.0 <= j.params["seconds"] <= 3.0
        assert 0.2 <= j.params["ramp_s"] <= 0.8
        assert 0.0 <= j.offset_s <= 0.5
