"""bench/chaos.py at its smoke size: brokers really killed, nothing lost or repeated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_bench_smoke() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--smoke", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures) == {
        "rounds",
        "accepted",
        "done",
        "failed",
        "lost",
        "duplicated",
        "restart_to_running_s",
    }
    assert figures["rounds"] == 2
    # the brokers were killed (the attack happened) and every job still ended once
    assert done.stdout.count(" -9 ") >= 2, done.stdout
    assert figures["accepted"] == 16
    assert figures["done"] + figures["failed"] == figures["accepted"]
    assert figures["lost"] == figures["duplicated"] == 0
