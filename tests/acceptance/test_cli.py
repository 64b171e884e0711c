"""Acceptance: the real CLI in subprocesses, with real broker and job processes."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_MODULES = REPO / "tests" / "modules"
GW = [sys.executable, "-m", "gpuwarden"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    e["PYTHONUNBUFFERED"] = "1"
    return e


def run(
    *args: str | Path, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GW, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env(),
    )


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def write_config(tmp: Path, *, grace: float = 20, extra: str = "", on_stop: str = "leave") -> Path:
    cfg = tmp / "gpuwarden.toml"
    cfg.write_text(
        f"""
state_dir = "state"
node_name = "accept"
gpu = "sim"
allow_unsandboxed_containers = true
module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}", "{TEST_MODULES}"]
queue_roots = ["queues/demo"]
{extra}
[sim_gpu]
release_delay_s = 0

[broker]
poll_interval_s = 0.05
status_interval_s = 0.2
shutdown_grace_s = {grace}
kill_grace_s = 0.3
on_stop = "{on_stop}"
"""
    )
    return cfg


class Broker:
    """``gpuwarden serve`` in a subprocess."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.stderr = config.parent / "serve.stderr"
        self.proc = subprocess.Popen(
            [*GW, "--config", str(config), "serve", "--log", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr.open("w"),
            env=env(),
            start_new_session=True,
        )
        wait_for(lambda: self.events("broker_started") or self.proc.poll() is not None, "serve")
        assert self.proc.poll() is None, self.stderr.read_text()

    def events(self, kind: str | None = None) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        rows = [json.loads(ln) for ln in self.log.read_text().splitlines() if ln.strip()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop(signal.SIGKILL)


def test_run_once_prints_status_message_output_and_content() -> None:
    r = run("--mock-gpu", "run-once", "echo.echo", "--text", "hello", "--output", "out/hello.txt")
    assert r.returncode == 0, r.stderr
    assert re.search(r"status\s+done", r.stdout)
    assert "wrote 5 characters to out/hello.txt" in r.stdout
    m = re.search(r"output\s+(\S+hello\.txt)", r.stdout)
    assert m, r.stdout
    assert re.search(r"content\s+hello", r.stdout)
    assert not Path(m.group(1)).exists()  # the temporary directory is removed


def test_run_once_keep_keeps_the_directory() -> None:
    r = run("--mock-gpu", "run-once", "echo.echo", "--text", "kept", "--keep")
    assert r.returncode == 0, r.stderr
    kept = Path(re.search(r"^kept\s+(\S+)", r.stdout, re.MULTILINE).group(1))  # type: ignore[union-attr]
    try:
        assert (kept / "outputs" / "echo.txt").read_text() == "kept"
    finally:
        import shutil

        shutil.rmtree(kept)


def test_run_once_reports_a_failing_job() -> None:
    r = run("--mock-gpu", "run-once", "echo.echo", "--text", "x", "--exit-code", "4")
    assert r.returncode == 1
    assert re.search(r"status\s+failed", r.stdout) and "exited with code 4" in r.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nope.nope"], "unknown job type 'nope.nope'"),
        (["echo.echo"], "missing required parameter 'text'"),
        (["echo.echo", "--text", "x", "--colour", "red"], "has no parameter 'colour'"),
        (["echo.echo", "--text", "x", "--colour"], "unknown option --colour: not an option"),
        (["echo.echo", "--txet", "x"], "unknown option --txet (did you mean --text?)"),
        (["echo.ecoh", "--text", "x"], "unknown job type 'echo.ecoh' (did you mean echo.echo?)"),
        (["echo.echo", "--text", "x", "-p", "colr=1"], "echo.echo has no parameter 'colr'"),
        (["echo.echo", "--text", "x", "--sleep-s", "soon"], "--sleep_s must be a number"),
        (["echo.echo", "--text", "x", "--output", "../escape"], None),
        (["echo.echo", "--text", "x", "--id", "bad id!"], "job id 'bad id!' is not valid"),
        (["echo.echo", "--text", "x", "--vram-gib", "4"], "runs on the cpu lane"),
    ],
)
def test_run_once_bad_input_is_a_clear_error(args: list[str], expected: str | None) -> None:
    r = run("--mock-gpu", "run-once", *args)
    if expected is None:  # refused by the module itself: a failed job, not a crash
        assert r.returncode == 1 and "must stay inside the output directory" in r.stdout
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr
    assert "Traceback" not in r.stderr


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('state_dir = "s"\n[broker]\npoll_intervall_s = 1\n')
    r = run("--config", cfg, "serve")
    assert r.returncode == 2
    assert "unknown key 'broker.poll_intervall_s'" in r.stderr and "poll_interval_s" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_queue_root_is_a_clear_error(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="create_queue_roots = false")
    r = run("--config", cfg, "serve")
    assert r.returncode == 2 and "queues/demo" in r.stderr and "Traceback" not in r.stderr
    # says which key makes it, in the config's words, not Python's
    assert "create_queue_roots = true in the broker's config" in r.stderr
    assert "create=True" not in r.stderr
    assert not (tmp_path / "queues").exists()
    r = run("submit", "--queue", tmp_path / "q", "echo.echo", "--text", "x")
    assert r.returncode == 2 and "create=True" not in r.stderr
    assert f"`gpuwarden serve --queue {tmp_path / 'q'}` makes it" in r.stderr
    assert not (tmp_path / "q").exists()


def test_serve_submit_status_jobs_show(broker: Broker, tmp_path: Path) -> None:
    cfg = broker.config
    queue = tmp_path / "queues" / "demo"
    r = run(
        "--config",
        cfg,
        "submit",
        "--queue",
        queue,
        "echo.echo",
        "--text",
        "hello",
        "--wait",
        "--id",
        "q1",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"status\s+done", r.stdout) and re.search(r"content\s+hello", r.stdout)
    assert list((queue / "outbox").glob("q1-*.zip"))
    assert list((queue / "processing").iterdir()) == []

    # the example client knows only the bundle format
    c = subprocess.run(
        [sys.executable, str(REPO / "examples" / "queue_client.py"), str(queue), "from a client"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )
    assert c.returncode == 0, c.stdout + c.stderr
    assert "done - wrote 13 characters to echo.txt" in c.stdout

    # straight into the store
    r = run("--config", cfg, "submit", "echo.echo", "--text", "direct", "--id", "d1", "--wait")
    assert r.returncode == 0 and re.search(r"content\s+direct", r.stdout), r.stdout + r.stderr

    wait_for(lambda: run("--config", cfg, "status").returncode == 0, "a fresh status")
    s = run("--config", cfg, "status")
    assert "GPU-sim" in s.stdout and "24.0 GiB" in s.stdout and "queues/demo" in s.stdout
    sj = json.loads(run("--config", cfg, "status", "--json").stdout)
    assert sj["nodes"][0]["node"] == "accept" and sj["jobs"]["done"] == 3

    jobs = run("--config", cfg, "jobs")
    assert "q1" in jobs.stdout and "d1" in jobs.stdout and "done" in jobs.stdout
    show = run("--config", cfg, "show", "q1")
    assert (
        show.returncode == 0
        and "queued -> running" in show.stdout
        and "running -> done" in show.stdout
    )
    assert run("--config", cfg, "show", "nope").returncode == 2

    assert broker.stop() == 0
    stopped = run("--config", cfg, "status")
    assert stopped.returncode == 1 and "stopped" in stopped.stdout


def test_cancel_through_the_cli(broker: Broker, tmp_path: Path) -> None:
    cfg = broker.config
    # held until the test releases it (never: the cancel ends it), not a sleep
    r = run("--config", cfg, "submit", "testmods.hold", "--until", tmp_path / "never", "--id", "c1")
    assert r.returncode == 0, r.stderr
    wait_for(
        lambda: bool(
            broker.events("transition")
            and any(
                e.get("job") == "c1" and e.get("to") == "running"
                for e in broker.events("transition")
            )
        ),
        "c1 running",
    )
    r = run("--config", cfg, "cancel", "c1")
    assert r.returncode == 0 and "will stop it" in r.stdout
    wait_for(
        lambda: any(e.get("job") == "c1" and e.get("to") == "cancelled" for e in broker.events()),
        "cancel",
    )
    again = run("--config", cfg, "cancel", "c1")
    assert again.returncode == 2 and "already ended" in again.stderr


def test_second_broker_refused_with_pid(broker: Broker) -> None:
    r = run("--config", broker.config, "serve")
    assert r.returncode == 2
    assert f"PID {broker.proc.pid}" in r.stderr


def test_commands_that_need_a_state_dir_refuse_a_missing_one(tmp_path: Path) -> None:
    """A mistyped --state-dir is refused the same way by every command that needs
    an existing state, `submit` too: no new, empty store strands the job."""
    for cmd in (
        ["submit", "echo.echo", "--text", "x"],
        ["jobs"],
        ["show", "x"],
        ["cancel", "x"],
        ["explain", "x"],
        ["logs", "x"],
        ["gpu", "clear", "GPU-sim-0", "--reason", "checked"],
        ["token", "list"],
        ["token", "revoke", "0123456789ab"],
        ["audit"],
    ):
        r = run("--state-dir", tmp_path / "typo", *cmd)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert f"no gpuwarden state in {tmp_path / 'typo'}: check --state-dir" in r.stderr
        assert "`gpuwarden serve` creates a state directory" in r.stderr, cmd
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "typo").exists()


def test_run_once_of_a_gpu_job_without_a_gpu_says_so(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'gpu = "none"\nallow_unsandboxed_containers = true\nmodule_paths = ["{TEST_MODULES}"]\n'
    )
    r = run("--config", cfg, "run-once", "testmods.gpu", timeout=30)
    assert r.returncode == 2 and "needs a GPU and none was found" in r.stderr
    assert "--mock-gpu" in r.stderr


def test_status_without_a_broker_exits_1(tmp_path: Path) -> None:
    r = run("--state-dir", tmp_path / "nothing", "status")
    assert r.returncode == 1 and "no broker" in r.stderr


def test_status_wait_waits_for_a_broker_starting_in_the_background(tmp_path: Path) -> None:
    """`serve &` then `status --wait`: the script goes on once the broker reports,
    not before (a submit right after `serve &` can meet no state directory yet)."""
    cfg = write_config(tmp_path)
    waiting = subprocess.Popen(
        [*GW, "--config", str(cfg), "status", "--wait", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    # it says what it waits for before the broker starts: no state directory yet
    assert waiting.stderr is not None
    ready, _, _ = select.select([waiting.stderr], [], [], 60)
    said = waiting.stderr.readline() if ready else ""
    assert f"waiting up to 60 s for a broker to report on {tmp_path / 'state'}" in said
    assert waiting.poll() is None and not (tmp_path / "state").exists()
    b = Broker(cfg, tmp_path / "events.jsonl")
    try:
        stdout, stderr = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, said + stderr
        assert "node accept" in stdout and "running" in stdout
    finally:
        b.stop(signal.SIGKILL)
    # nothing comes: it says what it waited for, then why it gave up (exit 1)
    r = run("--state-dir", tmp_path / "nothing", "status", "--wait", "0.5")
    assert r.returncode == 1
    assert "waiting up to 0.5 s for a broker" in r.stderr and "no broker has run" in r.stderr


def test_sigterm_with_stop_jobs_gives_grace_then_fails_running_job(tmp_path: Path) -> None:
    b = Broker(write_config(tmp_path, grace=0.3, on_stop="stop-jobs"), tmp_path / "events.jsonl")
    try:  # held, not a sleep: it runs past any grace until the broker stops it
        r = run(
            "--config", b.config, "submit", "testmods.hold", "--until", tmp_path / "never",
            "--id", "g1",
        )  # fmt: skip
        assert r.returncode == 0
        wait_for(
            lambda: any(e.get("job") == "g1" and e.get("to") == "running" for e in b.events()),
            "g1 running",
        )
        assert b.stop(signal.SIGTERM) == 0
    finally:
        if b.proc.poll() is None:
            b.stop(signal.SIGKILL)
    show = json.loads(run("--config", b.config, "show", "g1", "--json").stdout)
    assert show["state"] == "failed" and "shut down" in show["reason"]


def test_broker_killed_mid_job_then_restarted_finishes_the_job(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    queue = tmp_path / "queues" / "demo"
    b = Broker(cfg, tmp_path / "events.jsonl")
    release = tmp_path / "release"
    r = run(
        "--config", cfg, "submit", "--queue", queue, "testmods.hold", "--until", release,
        "--id", "k1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    wait_for(
        lambda: any(e.get("job") == "k1" and e.get("to") == "running" for e in b.events()),
        "k1 running",
    )
    stdout_log = tmp_path / "state" / "jobs" / "k1" / "attempt-1" / "stdout.log"
    wait_for(lambda: "holding" in _text(stdout_log), "the job's pid")
    job_pid = int(_text(stdout_log).split()[1].rstrip(":"))
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL  # the fault really happened
    assert _alive(job_pid)  # the job outlives its broker, under its supervisor
    assert list((queue / "processing").glob("k1-*.zip"))

    b2 = Broker(cfg, tmp_path / "events2.jsonl")
    try:
        # the new broker takes the running attempt back: the same process goes on
        adopted = b2.events("attempt_adopted")
        assert [e["job"] for e in adopted] == ["k1"]
        assert _alive(job_pid)
        release.touch()  # the attempt may finish now
        wait_for(
            lambda: bool(list((queue / "outbox").glob("k1-*.zip"))), "k1's result after restart"
        )
        # the result is written first, then the bundle leaves processing/: a loaded
        # machine can show the moment between the two
        wait_for(lambda: list((queue / "processing").iterdir()) == [], "processing/ emptied")
    finally:
        b2.stop()
    show = json.loads(run("--config", cfg, "show", "k1", "--json").stdout)
    assert show["state"] == "done" and show["attempts"] == 1
    assert show["attempts_detail"][0]["outcome"] == "succeeded"


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_errors_with_brackets_are_printed_as_written(tmp_path: Path) -> None:
    mods = tmp_path / "modules" / "bad"  # ./modules is on the default module path
    mods.mkdir(parents=True)
    (mods / "module.toml").write_text(
        '[module]\nname = "bad"\n[types.x]\nlane = "cpu"\ncommand = ["true"]\nkeep_warm = true\n'
    )
    r = run("--state-dir", tmp_path / "s", "--mock-gpu", "run-once", "bad.x", cwd=tmp_path)
    assert r.returncode == 2
    assert "[types.x]: key 'keep_warm' applies only to" in r.stderr, r.stderr
