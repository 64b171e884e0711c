"""``node/preempting.py: signal_group``: the checkpoint signal reaches an attempt's
process group, and nothing that does not lead one."""

from __future__ import annotations

import subprocess
import sys

from gpuwarden.node.preempting import signal_group

WAIT = "import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(6))\n"
WAIT += "print('ready', flush=True)\nwhile True: time.sleep(0.01)\n"


def test_the_signal_reaches_the_group_leader_and_its_handler_exits_6() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAIT], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert signal_group(proc.pid, "SIGUSR1")
        assert proc.wait(10) == 6
    finally:
        proc.kill()
        proc.wait()
    # gone now: nothing is sent
    assert not signal_group(proc.pid, "SIGUSR1")


def test_a_process_that_leads_no_group_gets_nothing() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAIT], stdout=subprocess.PIPE, text=True
    )  # in the test's own process group
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert not signal_group(proc.pid, "SIGUSR1")
        assert proc.poll() is None  # still running: it was not signalled
    finally:
        proc.kill()
        proc.wait()
