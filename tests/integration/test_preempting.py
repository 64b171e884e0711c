"""``node/preempting.py: signal_group``: the checkpoint signal reaches an attempt's
process group, and nothing that does not lead one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from gpuwarden.node.attempts import AttemptLayout, Launching
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


def test_a_resumed_attempt_gets_the_checkpoints_files_but_never_a_link_out(
    tmp_path: Path,
) -> None:
    """The previous attempt's output folder is the job's to write: a link planted
    there (to a file of the host's) must not be followed into the next attempt."""
    secret = tmp_path / "secret"
    secret.write_text("host's own")
    before = AttemptLayout(tmp_path / "attempt-1")
    before.out.mkdir(parents=True)
    (before.out / "step.txt").write_text("41")
    (before.out / "leak").symlink_to(secret)
    (before.out / "dir-leak").symlink_to(tmp_path)
    assert (before.out / "leak").read_text() == "host's own", "the attack is in place"
    after = AttemptLayout(tmp_path / "attempt-2")
    after.out.mkdir(parents=True)
    events: list[tuple[str, dict[str, object]]] = []
    fake = SimpleNamespace(
        sandbox_for=lambda jobtype: None, emit=lambda kind, **d: events.append((kind, d))
    )
    run = SimpleNamespace(
        resume_from=before.out,
        jobtype=None,
        job=SimpleNamespace(id="j"),
        attempt=SimpleNamespace(number=2),
    )
    Launching.carry_outputs(fake, run, after, None)  # type: ignore[arg-type]
    assert (after.out / "step.txt").read_text() == "41"
    assert not (after.out / "leak").exists() and not (after.out / "leak").is_symlink()
    assert not (after.out / "dir-leak").exists()
    assert events == [
        ("outputs_carried_over", {"job": "j", "attempt": 2, "files": 1, "refused": 2})
    ]
