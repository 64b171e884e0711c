"""Acceptance: the command line copies a job's outputs like the broker reads them
(issue 11): regular files and folders only, never through a link, never into a
name that is already there; what it leaves behind it says. Real CLI processes."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden import safefs
from tests.acceptance.test_cli import GW, Broker, env, run, write_config


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop()


def test_run_once_copies_only_regular_outputs_and_says_what_it_left(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("a host file")
    cfg = write_config(tmp_path)
    r = run(
        "--config",
        cfg,
        "--mock-gpu",
        "run-once",
        "testmods.hostile",
        "--attack",
        "odd_outputs",
        "--target",
        secret,
        "--keep",
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    kept = Path(re.search(r"^kept\s+(\S+)", r.stdout, re.MULTILINE).group(1))  # type: ignore[union-attr]
    try:
        [out] = kept.glob("state/jobs/*/attempt-1/out")
        # the attack was in place: a link, a FIFO and a device among its outputs
        assert (out / "link").is_symlink()
        assert stat.S_ISFIFO(os.lstat(out / "pipe").st_mode)
        assert stat.S_ISCHR(os.lstat(out / "null").st_mode)
        assert sorted(os.listdir(kept / "outputs")) == ["ok.txt"]
        for name in ("link", "pipe", "null"):
            assert re.search(rf"not copied:\s+{name}:", r.stderr), r.stderr
        assert secret.read_text() == "a host file"
    finally:
        safefs.remove_tree(kept)


def test_run_once_removes_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    temp = tmp_path / "tmp"
    temp.mkdir()
    r = subprocess.run(
        [
            *GW,
            *("--config", str(cfg), "--mock-gpu", "run-once", "testmods.hostile"),
            *("--attack", "deep_outputs", "--depth", "1100"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env(), "TMPDIR": str(temp)},
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not remove" not in r.stderr, r.stderr
    assert list(temp.iterdir()) == []  # its temporary folder is gone, depth and all


def test_submit_results_dir_never_writes_through_a_link_already_there(
    broker: Broker, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (results / "ok.txt").symlink_to(elsewhere / "ok.txt")
    assert (results / "ok.txt").is_symlink()  # a link where an output will go
    r = run(
        "--config",
        broker.config,
        "submit",
        "testmods.hostile",
        "--id",
        "h1",
        "--wait",
        "--results-dir",
        results,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (elsewhere / "ok.txt").exists()
    assert (results / "ok.txt").is_symlink()
    assert "not copied:" in r.stderr and "already in the destination" in r.stderr
