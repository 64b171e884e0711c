"""bench/chaos.py at its smoke size: brokers really killed, then stopped gracefully
under running jobs; judged by the jobs' own ledger lines, nothing lost, completed
twice, stopped or repeated."""

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
    assert list(figures)[:5] == ["rounds", "accepted", "lost", "completed_twice", "restart"]
    assert list(figures["restart"])[:4] == ["running", "stopped", "repeated", "adopt_p50_ms"]
    assert figures["rounds"] == 2
    # the brokers were killed (the attack happened): one round while a job ran, one
    # while none did (the smoke's round 1 waits until every job ended)
    assert done.stdout.count(" -9 ") >= 2, done.stdout
    assert figures["kills_while_idle"] >= 1, done.stdout
    # 2 rounds of 8, and the 4 held through the graceful restart
    assert figures["accepted"] == 2 * 8 + 4
    assert figures["lost"] == figures["completed_twice"] == figures["duplicated"] == 0
    # the graceful stop happened while all 4 ran, and the next broker took them back
    restart = figures["restart"]
    assert restart["running"] == 4, done.stdout
    assert restart["stopped"] == restart["repeated"] == restart["not_adopted"] == 0
    assert restart["adopt_p50_ms"] > 0
