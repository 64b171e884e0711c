"""Acceptance: the GPU lock file (``gpu_lock``) with a real broker on the simulated
GPU, real processes and real ``flock``s: a lock held by an outside process keeps a
job waiting with the holder named, then the job runs once it is released; ``gpuwarden
gpu lock UUID -- CMD`` waits for a running job, and the broker starts nothing new
there meanwhile; a link planted at the lock's path is never followed."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_cli import GW, Broker, env, run, wait_for, write_config
from tests.acceptance.test_preemption import show, submit

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    extra = f'gpu_lock = "{tmp_path}/locks/GPU-<uuid>.lock"\n[vram]\nreserve_gib = 0\n'
    b = Broker(write_config(tmp_path, extra=extra), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def gpu_uuid(b: Broker) -> str:
    found: list[str] = []

    def shown() -> bool:
        r = run("--config", b.config, "status")
        found[:] = re.findall(r"GPU-sim-\d{4}-[0-9a-f]{8}", r.stdout)
        return bool(found)

    wait_for(shown, "the GPU in the status")
    return found[0]


def lock_path(b: Broker, uuid: str) -> Path:
    return b.config.parent / "locks" / f"GPU-{uuid}.lock"  # as the template names it


def flock_pids(path: Path, *, waiting: bool = False) -> list[int]:
    """The PIDs /proc/locks lists as holding (or waiting for) a flock on ``path``."""
    st = path.stat()
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if (len(f) > 1 and f[1] == "->") != waiting:
            continue
        f = f[1:] if waiting else f
        if len(f) > 5 and f[1] == "FLOCK" and f[5] == node:
            pids.append(int(f[4]))
    return pids


def explain(b: Broker, job: str) -> str:
    r = run("--config", b.config, "explain", job)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_outside_holder_keeps_a_job_waiting_until_it_lets_go(broker: Broker) -> None:
    uuid = gpu_uuid(broker)
    path = lock_path(broker, uuid)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        # the fault is real: the outsider holds the flock, and no one else may take it
        assert flock_pids(path) == [holder.pid]
        fd = os.open(path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)

        submit(broker, "testmods.gpu", "--gib", "1", "--seconds", "0.2", "--id", "j1")
        said = f"GPU locked by PID {holder.pid}"
        wait_for(lambda: said in explain(broker, "j1"), "the lock named in explain")
        assert "python" not in explain(broker, "j1")  # never the holder's command line
        assert show(broker, "j1")["state"] == "queued"
        r = run("--config", broker.config, "status")
        assert said in r.stdout and "python" not in r.stdout, r.stdout
        wait_for(lambda: broker.events("gpu_locked"), "gpu_locked")
        [locked] = broker.events("gpu_locked")
        assert locked["gpu"] == uuid and locked["pid"] == holder.pid
        assert "python" in str(locked["cmd"])  # the event (owners, operators) has it
    finally:
        assert holder.stdin is not None
        holder.stdin.write(b"\n")
        holder.stdin.close()
        holder.wait(10)
    wait_for(lambda: show(broker, "j1")["state"] == "done", "j1 done")
    assert show(broker, "j1")["attempts"] == 1
    assert [e["pid"] for e in broker.events("gpu_unlocked")] == [holder.pid]
    assert len(broker.events("gpu_locked")) == 1  # said once, not every tick
    assert path.stat().st_mode & 0o777 == 0o660  # the broker's user and group may open it


def test_gpu_lock_waits_for_a_running_job_then_runs_its_command(
    broker: Broker, tmp_path: Path
) -> None:
    uuid = gpu_uuid(broker)
    path = lock_path(broker, uuid)
    submit(broker, "testmods.vramhold", "--gib", "1", "-p", "wait_for=go", "--id", "h")
    held = broker.config.parent / "state" / "jobs" / "h" / "attempt-1" / "out"
    wait_for((held / "held.json").exists, "h holds its memory")
    # the fault is real: the broker itself holds the GPU's flock for its running job
    assert broker.proc.pid in flock_pids(path)

    stamp = tmp_path / "cmd-ran"
    cmd = f"import pathlib, time; pathlib.Path({str(stamp)!r}).write_text(repr(time.time()))"
    lock_err = (tmp_path / "lock.stderr").open("w")
    locker = subprocess.Popen(
        [*GW, "--config", str(broker.config), "gpu", "lock", uuid, "--",
         sys.executable, "-c", cmd + "; raise SystemExit(7)"],
        stdout=subprocess.DEVNULL, stderr=lock_err, env=env(),
    )  # fmt: skip
    try:
        waits = f"waiting for the lock of GPU {uuid}: held by PID {broker.proc.pid} ("
        wait_for(lambda: waits in (tmp_path / "lock.stderr").read_text(), "gpu lock waits")
        wait_for(lambda: locker.pid in flock_pids(path, waiting=True), "a real flock wait")
        # the broker sees the waiter: nothing new starts on that GPU meanwhile
        submit(broker, "testmods.vramhold", "--gib", "1", "-p", "limit_s=5", "--id", "next")
        wants = f"GPU wanted by PID {locker.pid}, which waits for its lock"
        wait_for(lambda: wants in explain(broker, "next"), "the waiter named in explain")
        assert show(broker, "next")["state"] == "queued"
        assert not stamp.exists()  # CMD has not run while the job runs

        (held / "go").write_text("")
        assert locker.wait(30) == 7  # CMD's exit status comes back
    finally:
        if locker.poll() is None:
            locker.kill()
        lock_err.close()
    h_end = show(broker, "h")["attempts_detail"][0]["ended_at"]
    assert float(stamp.read_text()) >= float(h_end)
    wait_for(lambda: show(broker, "next")["state"] == "done", "next done after the lock")


def test_a_link_planted_at_the_lock_path_is_never_followed(broker: Broker, tmp_path: Path) -> None:
    uuid = gpu_uuid(broker)
    path = lock_path(broker, uuid)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    missing = tmp_path / "made-through-the-link"
    wait_for(path.exists, "the lock file")
    path.unlink()
    path.symlink_to(victim)
    assert path.is_symlink()  # the attack is in place

    submit(broker, "testmods.gpu", "--gib", "1", "--seconds", "0.2", "--id", "j")
    wait_for(lambda: "is a symlink" in explain(broker, "j"), "the link named in explain")
    assert show(broker, "j")["state"] == "queued"
    r = run("--config", broker.config, "gpu", "lock", uuid, "--", "true")
    assert r.returncode == 2 and "symlink" in r.stderr, r.stderr
    path.unlink()
    path.symlink_to(missing)
    r = run("--config", broker.config, "gpu", "lock", uuid, "--", "true")
    assert r.returncode == 2, r.stderr
    time.sleep(0.6)  # a look of the broker's at the new link (LOOK_S)
    assert victim.read_text() == "keep me" and not missing.exists()
    path.unlink()  # gone: the broker makes a plain file again and the job runs
    wait_for(lambda: show(broker, "j")["state"] == "done", "j done")


def test_gpu_lock_refuses_without_gpu_lock_and_a_bad_uuid(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    r = run("--config", cfg, "gpu", "lock", "GPU-0", "--", "true")
    assert r.returncode == 2 and "no gpu_lock" in r.stderr, r.stderr
    cfg = write_config(tmp_path, extra=f'gpu_lock = "{tmp_path}/locks/<uuid>.lock"\n')
    r = run("--config", cfg, "gpu", "lock", "../etc", "--", "true")
    assert r.returncode == 2 and "not a GPU UUID" in r.stderr, r.stderr
    assert not (tmp_path / "locks").exists()
