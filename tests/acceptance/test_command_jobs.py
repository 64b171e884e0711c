"""Acceptance: any command is a job (issue 29; SPEC.md, "Command jobs"), through the
real CLI, for local users the test creates (``useradd``), against a real
``gpuwarden serve`` (root) on two simulated GPUs.

The users run the CLI as themselves: the broker learns who they are from the
kernel (``SO_PEERCRED`` on its local socket), never from what the CLI says.
Their CLI runs on the system's Python 3.11 (the test's own interpreter may be
under ``/root``, which they cannot enter) with this checkout's ``src`` and the
virtual environment's packages on its path. Each job counts its own work in a
file of the user's that the broker never writes.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.acceptance.test_cli import GW, env, wait_for
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)

REQUIRE = os.environ.get("GPUWARDEN_REQUIRE_USERS") == "1"
#: the system's interpreter, which any user may run (the same minor version)
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _skip_or_fail(why: str) -> None:
    if REQUIRE:
        pytest.fail(f"{why} [GPUWARDEN_REQUIRE_USERS=1]")
    pytest.skip(why)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path


def _make_user(name: str) -> User:
    subprocess.run(["useradd", "-m", "-U", "-s", "/bin/sh", name], check=True)
    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def _readable_by_all(path: Path) -> bool:
    """Every folder up to ``path`` searchable by others."""
    return all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents] if p.exists())


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    """Two users: one the node allows, one it does not."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        _skip_or_fail("needs root and useradd to make the test's users")
    site = Path(sysconfig.get_paths()["purelib"])
    readable = _readable_by_all(REPO / "src") and _readable_by_all(site)
    if not SYSTEM_PYTHON.exists() or not readable:
        _skip_or_fail(
            f"the test's users run the CLI with {SYSTEM_PYTHON}, {REPO / 'src'} and {site}: "
            "each must be there and readable by every user"
        )
    tag = f"{os.getpid() % 100000}"
    made = [_make_user(f"gwrun{tag}"), _make_user(f"gwno{tag}")]
    try:
        yield made[0], made[1]
    finally:
        for u in made:
            subprocess.run(["pkill", "-KILL", "-u", u.name], check=False)
            subprocess.run(["userdel", "-r", u.name], check=False, capture_output=True)


@dataclass
class Node:
    dir: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "gpuwarden.sock"

    def start(self) -> None:
        with (self.dir / "serve.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*GW, "--config", str(self.config), "serve"],
                env=env(), stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(self.socket.is_socket, "the broker's local socket", timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def job(self, job_id: str) -> sqlite3.Row:
        with contextlib.closing(sqlite3.connect(self.dir / "state" / "gpuwarden.db")) as db:
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        assert row is not None, f"no job {job_id}"
        return row

    def jobs(self) -> list[sqlite3.Row]:
        with contextlib.closing(sqlite3.connect(self.dir / "state" / "gpuwarden.db")) as db:
            db.row_factory = sqlite3.Row
            return db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()


def _node(allowed: User) -> Node:
    # a folder any user may search (pytest's own are 0700), for the socket and config
    folder = Path(tempfile.mkdtemp(prefix="gw-cmd-", dir="/tmp"))
    folder.chmod(0o755)
    config = folder / "gpuwarden.toml"
    config.write_text(
        f"""
state_dir = "state"
node_name = "cmd"
gpu = "sim"
module_paths = []
[sim_gpu]
count = 2
release_delay_s = 0
[broker]
poll_interval_s = 0.05
status_interval_s = 0.2
[commands]
users = ["{allowed.name}"]
socket = "{folder / "gpuwarden.sock"}"
"""
    )
    config.chmod(0o644)
    return Node(folder, config)


@pytest.fixture(scope="module")
def node(users: tuple[User, User]) -> Iterator[Node]:
    n = _node(users[0])
    n.start()
    try:
        yield n
    finally:
        n.stop()
        shutil.rmtree(n.dir, ignore_errors=True)


def as_user(user: User, *args: str, cwd: Path) -> subprocess.Popen[str]:
    """The real CLI, as ``user``, in ``cwd``."""
    site = sysconfig.get_paths()["purelib"]
    user_env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(user.home),
        "PYTHONPATH": f"{REPO / 'src'}:{site}",
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
    }
    return subprocess.Popen(
        [str(SYSTEM_PYTHON), "-m", "gpuwarden", *args],
        user=user.uid, group=user.gid, extra_groups=[], cwd=cwd, env=user_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def workdir(user: User, name: str) -> Path:
    """A folder of the user's own, made by the user."""
    path = user.home / name
    subprocess.run(["runuser", "-u", user.name, "--", "mkdir", "-p", str(path)], check=True)
    return path


def ledger_lines(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


# -- the tests -----------------------------------------------------------------------


def test_run_streams_output_live_as_the_user_on_one_gpu_in_their_folder(
    node: Node, users: tuple[User, User]
) -> None:
    user = users[0]
    here = workdir(user, "live")
    script = (
        "echo started; id -u; echo gpu=$CUDA_VISIBLE_DEVICES; pwd; echo made > made.txt; "
        "while [ ! -e go ]; do sleep 0.05; done; echo finished; echo to-stderr >&2"
    )
    cli = as_user(
        user, "--config", str(node.config), "run", "--vram", "1G", "--name", "live",
        "--", "sh", "-c", script, cwd=here,
    )  # fmt: skip
    assert cli.stdout is not None
    first = cli.stdout.readline()
    # live: the job's first line reached the user while the job still waits for go
    assert first == "started\n", first + (cli.stderr.read() if cli.stderr else "")
    assert not (here / "go").exists()
    (here / "go").touch()
    # what readline buffered stays in the file object: read on from it (not communicate)
    out, err = first + cli.stdout.read(), cli.stderr.read() if cli.stderr else ""
    assert cli.wait(60) == 0, err
    uid_line, gpu_line, pwd_line, last = out.splitlines()[1:]
    assert int(uid_line) == user.uid  # as the user, never as root
    gpu = gpu_line.removeprefix("gpu=")
    assert gpu.startswith("GPU-sim-") and "," not in gpu  # one GPU of the two
    assert pwd_line == str(here) and last == "finished"
    assert "to-stderr" in err
    made = here / "made.txt"
    assert made.read_text() == "made\n" and made.stat().st_uid == user.uid
    [job] = [j for j in node.jobs() if j["type"] == "command:live"]
    assert job["state"] == "done" and job["owner"] == f"user:{user.name}"


def test_run_exits_with_the_commands_exit_status(node: Node, users: tuple[User, User]) -> None:
    user = users[0]
    cli = as_user(
        user, "--config", str(node.config), "run", "--", "sh", "-c", "exit 3",
        cwd=workdir(user, "status"),
    )  # fmt: skip
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 3, err
    assert "exited with code 3" in err


def test_ctrl_c_during_run_cancels_the_job(node: Node, users: tuple[User, User]) -> None:
    user = users[0]
    here = workdir(user, "cancel")
    ledger = here / "ledger"
    script = f"echo start >> {ledger}; sleep 60; echo done >> {ledger}"
    cli = as_user(
        user, "--config", str(node.config), "run", "--id", "to-cancel",
        "--", "sh", "-c", script, cwd=here,
    )  # fmt: skip
    wait_for(lambda: ledger_lines(ledger) == [["start"]], "the job to start", timeout=60)
    cli.send_signal(signal.SIGINT)  # what Ctrl-C sends
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 130, err
    assert "cancelling job to-cancel" in err
    wait_for(lambda: node.job("to-cancel")["state"] == "cancelled", "the job cancelled")
    # the job's process tree is gone, and it never got to its end
    wait_for(
        lambda: subprocess.run(["pgrep", "-u", user.name, "sleep"], check=False).returncode == 1,
        "the user's sleep to end",
        timeout=60,
    )
    assert ledger_lines(ledger) == [["start"]]


def test_a_user_the_node_does_not_allow_is_refused_with_the_rule(
    node: Node, users: tuple[User, User]
) -> None:
    other = users[1]
    before = len(node.jobs())
    cli = as_user(
        other, "--config", str(node.config), "submit", "--", "true", cwd=workdir(other, "no")
    )
    _, err = cli.communicate(timeout=60)
    assert cli.returncode != 0
    assert f"user {other.name} (uid {other.uid}) may not run commands" in err
    assert "[commands] users" in err
    assert len(node.jobs()) == before  # nothing was stored


def test_array_runs_each_index_once_and_at_most_n_at_once(
    node: Node, users: tuple[User, User]
) -> None:
    user = users[0]
    here = workdir(user, "array")
    ledger = here / "ledger"
    script = (
        f'echo "start $GPUWARDEN_ARRAY_INDEX $(date +%s.%N)" >> {ledger}; sleep 0.4; '
        f'echo "end $GPUWARDEN_ARRAY_INDEX $(date +%s.%N)" >> {ledger}'
    )
    cli = as_user(
        user, "--config", str(node.config), "submit", "--id", "arr", "--array", "0-5%2",
        "--share-gpu", "--vram", "1G", "--wait", "--", "sh", "-c", script, cwd=here,
    )  # fmt: skip
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, err
    assert out.split()[:6] == [f"arr_{i}" for i in range(6)]
    lines = ledger_lines(ledger)
    starts = sorted(int(i) for what, i, _ in lines if what == "start")
    assert starts == list(range(6))  # each index once
    events = sorted((float(t), 1 if what == "start" else -1) for what, _, t in lines)
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= 2, lines  # %2: never more than two at once


def test_a_command_job_survives_a_broker_restart(users: tuple[User, User]) -> None:
    user = users[0]
    n = _node(user)
    n.start()
    try:
        here = workdir(user, "restart")
        ledger = here / "ledger"
        script = (
            f"echo start $$ >> {ledger}; while [ ! -e go ]; do sleep 0.05; done; "
            f"echo done $$ >> {ledger}"
        )
        cli = as_user(
            user, "--config", str(n.config), "submit", "--id", "outlives",
            "--", "sh", "-c", script, cwd=here,
        )  # fmt: skip
        _, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        wait_for(lambda: len(ledger_lines(ledger)) == 1, "the job to start", timeout=60)
        n.stop()  # a routine stop leaves the job running
        assert n.proc is not None and n.proc.returncode == 0
        [[_, pid]] = ledger_lines(ledger)
        os.kill(int(pid), 0)  # the job still runs with no broker
        n.start()
        (here / "go").touch()
        wait_for(lambda: n.job("outlives")["state"] == "done", "the job to end", timeout=60)
        assert ledger_lines(ledger) == [["start", pid], ["done", pid]]  # once, the same process
        assert n.job("outlives")["attempts"] == 1
    finally:
        n.stop()
        shutil.rmtree(n.dir, ignore_errors=True)
