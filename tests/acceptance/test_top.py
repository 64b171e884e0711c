"""Acceptance: the real ``gpuwarden top`` under a pseudo-terminal against a broker on
the simulated GPU: it shows the running jobs, ``q`` quits it at once, and the
terminal is left as it was found; piped (or with ``--once``) it prints one frame."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_cli import GW, Broker, env, run, wait_for, write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env

#: what rich writes to enter and to leave the alternate screen
ALT_SCREEN_ON = b"\x1b[?1049h"
ALT_SCREEN_OFF = b"\x1b[?1049l"


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[Broker, Path]]:
    """A broker with a cpu job held running and a vram job holding 2 GiB."""
    b = Broker(write_config(tmp_path, grace=0.5), tmp_path / "events.jsonl")
    release = tmp_path / "release"
    try:
        for args in (
            ("testmods.hold", "--until", release, "--id", "top-hold"),
            ("testmods.gpu", "--gib", "2", "--seconds", "25", "--id", "top-gpu"),
        ):
            r = run("--config", b.config, "submit", *args)
            assert r.returncode == 0, r.stderr
        for job in ("top-hold", "top-gpu"):
            wait_for(
                lambda job=job: any(
                    e.get("job") == job and e.get("to") == "running" for e in b.events()
                ),
                f"{job} running",
            )
        yield b, tmp_path
    finally:
        release.write_text("")
        b.stop(signal.SIGTERM)


class Pty:
    """A pseudo-terminal of ``cols`` x ``rows``; the test keeps both ends open, so
    it can read the terminal's mode after the program has gone."""

    def __init__(self, cols: int, rows: int) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.seen = b""

    def read(self, seconds: float) -> None:
        """Read what the program wrote for up to ``seconds`` (it must never block on
        a full terminal)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.master], [], [], left)
            if not ready:
                return
            try:
                self.seen += os.read(self.master, 65536)
            except OSError:
                return

    def read_until(self, proc: subprocess.Popen[bytes], *wanted: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(w in self.seen for w in wanted):
            assert proc.poll() is None, f"top exited {proc.returncode}: {self.seen[-2000:]!r}"
            assert time.monotonic() < deadline, f"never saw {wanted}: {self.seen[-3000:]!r}"
            self.read(0.1)

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


def test_top_in_a_terminal_shows_the_running_jobs_and_q_quits(
    busy: tuple[Broker, Path],
) -> None:
    b, _ = busy
    term = Pty(cols=80, rows=50)
    before = termios.tcgetattr(term.slave)
    assert before[3] & termios.ICANON and before[3] & termios.ECHO
    proc = subprocess.Popen(
        [*GW, "--config", str(b.config), "top", "--interval", "0.5"],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env={**env(), "TERM": "xterm-256color"},
        start_new_session=True,
    )
    try:
        term.read_until(proc, ALT_SCREEN_ON, b"top-hold", b"top-gpu", b"ledger [", timeout=30)
        # it runs in cbreak mode while it shows: a key at a time, no echo
        during = termios.tcgetattr(term.slave)
        assert not during[3] & termios.ICANON and not during[3] & termios.ECHO
        term.read(1.2)  # it redraws: a second frame with the job still there
        assert term.seen.count(b"top-hold") >= 2
        os.write(term.master, b"q")
        pressed = time.monotonic()
        while proc.poll() is None and time.monotonic() - pressed < 2.0:
            term.read(0.05)
        assert proc.poll() == 0, f"top did not exit 0 within 2 s of q: {proc.poll()}"
        term.read(0.3)
        # the alternate screen was left, after it was entered, and the mode is back
        assert term.seen.rfind(ALT_SCREEN_OFF) > term.seen.rfind(ALT_SCREEN_ON)
        after = termios.tcgetattr(term.slave)
        assert after[3] == before[3], "the terminal's local modes were not restored"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        term.close()
    # the frame was drawn for 80 columns: the GPU's bars are whole lines in it
    frames = term.seen.decode("utf-8", "replace").replace("\x1b[H", "\n")  # each from home
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frames)
    lines = plain.replace("\r", "").split("\n")
    bars = [ln for ln in lines if ln.lstrip().startswith("ledger [")]
    assert bars and all("] 8.0/24.0 GiB held" in ln and len(ln) <= 80 for ln in bars), bars
    assert all(len(ln) <= 80 for ln in lines), max(lines, key=len)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_top_ctrl_c_or_sigterm_also_restores_the_terminal(
    busy: tuple[Broker, Path], sig: signal.Signals, code: int
) -> None:
    b, _ = busy
    term = Pty(cols=100, rows=40)
    before = termios.tcgetattr(term.slave)
    proc = subprocess.Popen(
        [*GW, "--config", str(b.config), "top"],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env={**env(), "TERM": "xterm-256color"},
        start_new_session=True,
    )
    try:
        term.read_until(proc, b"top-hold", timeout=30)
        assert not termios.tcgetattr(term.slave)[3] & termios.ICANON
        proc.send_signal(sig)  # SIGINT: what Ctrl-C sends to the foreground program
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            term.read(0.05)
        assert proc.poll() == code
        term.read(0.3)
        assert term.seen.rfind(ALT_SCREEN_OFF) > term.seen.rfind(ALT_SCREEN_ON)
        assert termios.tcgetattr(term.slave)[3] == before[3]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        term.close()


def test_top_piped_or_once_prints_one_frame(busy: tuple[Broker, Path]) -> None:
    b, tmp_path = busy
    for args in ((), ("--once",)):
        r = run("--config", b.config, "top", *args, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "\x1b[" not in r.stdout  # no terminal: no alternate screen, no colour
        assert "node accept" in r.stdout and "top-hold" in r.stdout and "top-gpu" in r.stdout
        # the vram job holds its footprint in the ledger; the device shows what it took
        assert "1 top-gpu testmods.gpu 8.0" in r.stdout and "2.0 GiB used" in r.stdout
        assert all(len(ln) <= 80 and ln == ln.rstrip() for ln in r.stdout.splitlines())
    # a job that cannot fit beside the held 8 GiB waits, and top says why (explain's words)
    r = run("--config", b.config, "submit", "testmods.gpu", "--vram-gib", "20", "--id", "big-1")
    assert r.returncode == 0, r.stderr
    shown = ""

    def says_why() -> bool:
        nonlocal shown
        shown = " ".join(run("--config", b.config, "top", "--once").stdout.split())
        return "big-1" in shown and "needs 20.0 GiB on one GPU" in shown

    wait_for(says_why, "big-1's wait reason in top")
    assert "queued job" in shown
    r = run("--config", b.config, "explain", "big-1")
    said = r.stdout.split("it waits: ", 1)[1].split("\n", 1)[0]
    assert " ".join(said.split())[:60] in shown
    # no broker has run there yet: it says so, and still exits 0
    r = run("--state-dir", tmp_path / "nowhere", "top", "--once")
    assert r.returncode == 0, r.stderr
    assert "no broker has run on" in r.stdout


def test_top_once_through_the_api(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    b = ApiBroker(config)
    release = tmp_path / "release"
    try:
        made = run("--config", config, "token", "create", "viewer", "--role", "owner", "--json")
        token = json.loads(made.stdout)["token"]
        r = run("--config", config, "submit", "testmods.hold", "--until", release, "--id", "h-1")
        assert r.returncode == 0, r.stderr
        shown = ""

        def running() -> bool:
            nonlocal shown
            r = run_env("top", "--once", "--url", b.url, token=token)
            assert r.returncode == 0, r.stderr
            shown = r.stdout
            return "h-1" in r.stdout and "running job" in r.stdout

        wait_for(running, "h-1 in top through the API")
        assert f"gpuwarden top  {b.url}" in shown and "node accept" in shown
        # a bad token is refused as every command refuses it (exit 2), not drawn
        r = run_env("top", "--once", "--url", b.url, token="gw_nope_nope")
        assert r.returncode == 2 and "error:" in r.stderr
    finally:
        release.write_text("")
        b.stop()
