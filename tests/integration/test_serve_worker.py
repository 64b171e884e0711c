"""Serve workers with real processes: a worker written with
``gpuwarden.server.worker.serve`` and crafted workers that break the protocol,
driven by ``gpuwarden.launch.warmproc.WarmProcess``.

Every failure must end with the worker's whole process tree confirmed gone and
a ServeError; the job's own failure must not stop the worker; stale reports
must never be taken for the real one."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.launch.base import LaunchRequest
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.warmproc import (
    JobReport,
    LoadReport,
    ServeError,
    WarmProcess,
    placement_check,
)
from gpuwarden.server.protocol import Channel
from gpuwarden.server.worker import run_worker

PY = sys.executable
GPU = "GPU-11111111-2222-3333-4444-555555555555"

# A worker written the way a module author writes one. Its behaviour is chosen by
# environment variables (load) and job parameters (handle).
MODULE_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from gpuwarden.server.worker import serve

    def load(ctx):
        time.sleep(float(os.environ.get("LOAD_SLEEP", "0")))
        mode = os.environ.get("LOAD_MODE", "ok")
        if mode == "fail":
            raise RuntimeError("no weights here")
        if mode == "hang":
            time.sleep(60)
        with open(os.environ["LOAD_LOG"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return {"pid": os.getpid(), "gpu": ctx.gpu, "scratch": str(ctx.scratch_dir), "jobs": 0}

    def handle(model, job):
        model["jobs"] += 1
        mode = job.params.get("mode", "ok")
        if mode == "raise":
            raise ValueError(f"bad input {job.params.get('x')}")
        if mode == "exit":
            print("crashing now", file=sys.stderr, flush=True)
            os._exit(3)
        if mode == "hang":
            if job.params.get("fork") and os.fork() == 0:
                time.sleep(60)  # a child that keeps the socket open
                os._exit(0)
            (job.output_dir / "pid").write_text(str(os.getpid()))
            time.sleep(60)
        (job.output_dir / "out.txt").write_text(str(job.params.get("x")))
        return json.dumps({
            "pid": model["pid"], "jobs": model["jobs"], "gpu": model["gpu"],
            "scratch": model["scratch"], "attempt": job.attempt, "job": job.job_id,
            "input_dir": str(job.input_dir), "scratch_dir": str(job.scratch_dir),
        })

    def device_bytes(model):
        return int(os.environ["DEVICE_BYTES"])

    serve(load, handle, device_bytes=device_bytes if "DEVICE_BYTES" in os.environ else None)
    """
)

# A crafted worker that speaks the protocol by hand; CRAFT selects the misbehaviour.
CRAFTED_WORKER = textwrap.dedent(
    """
    import os, socket, sys, time
    from gpuwarden.server.protocol import Channel, encode

    epoch = int(os.environ["GPUWARDEN_SERVE_EPOCH"])
    craft = os.environ["CRAFT"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["GPUWARDEN_SERVE_SOCKET"])
    ch = Channel(sock)

    if craft == "garbage_hello":
        sock.sendall(b"GET / HTTP/1.1\\r\\n\\r\\n")
        time.sleep(60)
    if craft == "wrong_epoch_hello":
        ch.send({"type": "hello", "epoch": epoch + 1, "pid": os.getpid()})
        time.sleep(60)
    ch.send({"type": "hello", "epoch": epoch, "pid": os.getpid()})
    ch.send({"type": "ready", "epoch": epoch, "load_s": 0.0, "device_bytes": None})
    while True:
        msg = ch.recv(None)
        if msg["type"] == "stop":
            if craft == "ignore_stop":
                continue
            sys.exit(0)
        if msg["epoch"] != epoch or msg["type"] != "job":
            continue
        job, attempt = msg["job"], msg["attempt"]
        def result(**kw):
            out = {"type": "result", "epoch": epoch, "job": job, "attempt": attempt,
                   "ok": True, "message": "real", "error": None}
            out.update(kw)
            return out
        if craft == "garbage_result":
            sock.sendall(b"\\x00\\x00\\x00\\x05hello")
            time.sleep(60)
        if craft == "malformed_result":
            ch.send(result(ok="yes"))
            time.sleep(60)
        if craft == "stale":
            ch.send(result(epoch=epoch - 1, message="stale epoch"))
            ch.send(result(attempt=attempt - 1, message="superseded attempt"))
            ch.send(result(job="other-job", message="another job"))
            ch.send({"type": "ready", "epoch": epoch, "load_s": 0.0, "device_bytes": 1})
        ch.send(result())
    """
)

BASE_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "PYTHONUNBUFFERED": "1",
    "CUDA_VISIBLE_DEVICES": GPU,
}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for sockets (a unix socket path is at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


MakeWorker = Callable[..., WarmProcess]


@pytest.fixture
def make_worker(tmp_path: Path, sock_dir: Path) -> Iterator[MakeWorker]:
    """Build ServeWorkers; every one is stopped at the end of the test."""
    workers: list[WarmProcess] = []
    (tmp_path / "module_worker.py").write_text(MODULE_WORKER)
    (tmp_path / "crafted_worker.py").write_text(CRAFTED_WORKER)

    def make(
        script: str = "module_worker.py",
        *,
        env: dict[str, str] | None = None,
        epoch: int = 7,
        argv: tuple[str, ...] | None = None,
        stop_wait_s: float = 2.0,
        socket_path: Path | None = None,
    ) -> WarmProcess:
        name = f"serve-{uuid.uuid4().hex[:8]}"
        full_env = dict(BASE_ENV)
        full_env["LOAD_LOG"] = str(tmp_path / f"{name}.loads")
        full_env.update(env or {})
        req = LaunchRequest(
            job_id=name,
            attempt=1,
            argv=argv or (PY, str(tmp_path / script)),
            cwd=str(tmp_path),
            env=full_env,
            attempt_dir=str(tmp_path / name),
            timeout_s=math.inf,
            kill_grace_s=0.3,
            instance="test-serve",
        )
        worker = WarmProcess(
            HostLauncher(),
            req,
            socket_path or sock_dir / f"{name}.sock",
            epoch,
            stop_wait_s=stop_wait_s,
        )
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop("end of test")


def run(
    worker: WarmProcess,
    tmp_path: Path,
    n: int = 1,
    *,
    timeout_s: float = 10.0,
    attempt: int = 1,
    **params: Any,
) -> JobReport:
    job = f"job-{n}"
    out = tmp_path / job / "out"
    out.mkdir(parents=True, exist_ok=True)
    return worker.run_job(
        job, attempt, params, tmp_path / "inputs", out, tmp_path / job / "scratch", timeout_s
    )


def assert_gone(worker: WarmProcess) -> None:
    result = worker.launch_result
    assert result is not None
    assert result.survivors == ()
    assert worker.pid is not None and gone(worker.pid)
    assert not worker.alive()
    assert not worker.socket_path.exists()


# ---------------------------------------------------------------------------
# happy path


def test_loads_once_and_serves_jobs_one_at_a_time(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker(env={"LOAD_SLEEP": "0.2"})
    pids: list[int] = []
    report = worker.start(10.0, on_pid=pids.append)
    assert isinstance(report, LoadReport)
    assert report.load_s >= 0.2
    assert report.device_bytes is None
    assert report.pid == worker.pid == pids[0]
    assert worker.alive()
    assert not worker.socket_path.exists()  # one connection, then the file goes

    for n in (1, 2, 3):
        result = run(worker, tmp_path, n, attempt=n, x=n * 10)
        assert result.ok and result.error is None and result.stale_dropped == []
        assert result.message is not None
        said = json.loads(result.message)
        assert said["pid"] == served_by(report)
        assert said["jobs"] == n  # the same model object: loaded once
        assert said["gpu"] == GPU
        assert said["attempt"] == n and said["job"] == f"job-{n}"
        assert said["input_dir"] == str(tmp_path / "inputs")
        assert said["scratch_dir"] == str(tmp_path / f"job-{n}" / "scratch")
        assert (tmp_path / f"job-{n}" / "out" / "out.txt").read_text() == str(n * 10)
    loads = Path(worker.request.env["LOAD_LOG"]).read_text().split()
    assert loads == [str(served_by(report))]
    # the load's scratch folder defaults to the worker's attempt directory
    assert said["scratch"] == str(Path(worker.request.attempt_dir) / "scratch")
    assert worker.request.env["GPUWARDEN_SERVE_EPOCH"] == "7"

    ended = worker.stop("idle past its grace")
    assert ended.exit_code == 0  # it took `stop` and exited by itself
    assert not ended.stopped
    assert worker.stop("again") is ended
    assert worker.stop_reason == "idle past its grace"
    assert_gone(worker)


def test_handle_exception_is_the_jobs_failure_and_the_worker_goes_on(
    make_worker: MakeWorker, tmp_path: Path
) -> None:
    worker = make_worker()
    report = worker.start(10.0)
    failed = run(worker, tmp_path, 1, mode="raise", x=5)
    assert not failed.ok
    assert failed.error == "ValueError: bad input 5"
    assert failed.message is None
    assert worker.alive()
    assert "Traceback" in worker.stderr_tail()
    assert "ValueError: bad input 5" in worker.stderr_tail()

    ok = run(worker, tmp_path, 2, x=1)
    assert ok.ok and ok.message is not None
    assert json.loads(ok.message)["pid"] == served_by(report)
    assert json.loads(ok.message)["jobs"] == 2


def served_by(report: LoadReport) -> int:
    """The worker's own process: the one child of its supervisor (``report.pid``)."""
    [child] = psutil.Process(report.pid).children()
    return child.pid


# ---------------------------------------------------------------------------
# failures while loading


def test_load_failed_stops_the_worker(make_worker: MakeWorker) -> None:
    worker = make_worker(env={"LOAD_MODE": "fail"})
    with pytest.raises(ServeError) as err:
        worker.start(10.0)
    assert err.value.kind == "load_failed"
    assert err.value.infrastructure
    assert "RuntimeError: no weights here" in err.value.message
    assert err.value.launch_result is not None
    assert err.value.launch_result.exit_code == 1
    assert "Traceback" in worker.stderr_tail()
    assert_gone(worker)


def test_load_timeout_stops_the_worker(make_worker: MakeWorker) -> None:
    worker = make_worker(env={"LOAD_MODE": "hang"})
    start = time.monotonic()
    with pytest.raises(ServeError) as err:
        worker.start(0.5)
    assert err.value.kind == "load_timeout"
    assert "did not load within 0.5 s" in err.value.message
    assert time.monotonic() - start < 5
    assert_gone(worker)


def test_exit_before_connecting(make_worker: MakeWorker) -> None:
    worker = make_worker(
        argv=(PY, "-c", "import sys; print('bad module', file=sys.stderr); sys.exit(4)")
    )
    with pytest.raises(ServeError) as err:
        worker.start(10.0)
    assert err.value.kind == "crashed"
    assert "exit status 4" in err.value.message
    assert "bad module" in err.value.message
    assert_gone(worker)


def test_command_that_cannot_start(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker(argv=(str(tmp_path / "no-such-program"),))
    with pytest.raises(ServeError) as err:
        worker.start(10.0)
    assert err.value.kind == "start"
    assert "cannot start" in err.value.message
    assert not worker.alive()


def test_socket_path_too_long(make_worker: MakeWorker, sock_dir: Path) -> None:
    worker = make_worker(socket_path=sock_dir / ("s" * 120))
    with pytest.raises(ServeError) as err:
        worker.start(10.0)
    assert err.value.kind == "start"
    assert "longer than 107 bytes" in err.value.message
    assert worker.pid is None  # nothing was started


@pytest.mark.parametrize(
    ("craft", "match"), [("garbage_hello", "more than"), ("wrong_epoch_hello", "epoch 8")]
)
def test_garbage_or_wrong_epoch_while_loading(
    make_worker: MakeWorker, craft: str, match: str
) -> None:
    worker = make_worker("crafted_worker.py", env={"CRAFT": craft})
    with pytest.raises(ServeError, match=match) as err:
        worker.start(10.0)
    assert err.value.kind == "protocol"
    assert_gone(worker)


# ---------------------------------------------------------------------------
# the placement check


def test_placement_check_is_pure() -> None:
    gib = 1024**3
    assert placement_check(LoadReport(1.0, None, 1), None) is None
    assert placement_check(LoadReport(1.0, 10, 1), None) is None
    assert placement_check(LoadReport(1.0, math.ceil(0.99 * 4 * gib), 1), 4 * gib) is None
    assert placement_check(LoadReport(1.0, math.ceil(0.99 * 4 * gib) - 1, 1), 4 * gib) is not None
    assert placement_check(LoadReport(1.0, 990, 1), 1000) is None
    assert placement_check(LoadReport(1.0, 5 * gib, 1), 4 * gib) is None
    refused = placement_check(LoadReport(1.0, int(2.44 * gib), 1), 4 * gib)
    assert refused == (
        "only 61% of the model (2.4 GiB of 4.0 GiB) is in GPU memory: it fell back to the CPU"
    )
    # 98.9 % is refused and says 98 %, never a rounded-up 99 %
    assert "only 98%" in (placement_check(LoadReport(1.0, 989, 1), 1000) or "")
    assert "did not report" in (placement_check(LoadReport(1.0, None, 1), gib) or "")
    assert "(600 B of 1000 B)" in (placement_check(LoadReport(1.0, 600, 1), 1000) or "")


def test_placement_check_refuses_a_load_partly_on_the_cpu(make_worker: MakeWorker) -> None:
    gib = 1024**3
    worker = make_worker(env={"DEVICE_BYTES": str(int(2.4 * gib))})
    with pytest.raises(ServeError) as err:
        worker.start(10.0, expected_device_bytes=4 * gib)
    assert err.value.kind == "placement"
    assert err.value.infrastructure
    assert err.value.message.startswith("only 60% of the model (2.4 GiB of 4.0 GiB)")
    assert_gone(worker)


def test_placement_check_accepts_99_percent(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker(env={"DEVICE_BYTES": "990"})
    report = worker.start(10.0, expected_device_bytes=1000)
    assert report.device_bytes == 990
    assert run(worker, tmp_path).ok


# ---------------------------------------------------------------------------
# failures during a job


def test_crash_mid_job(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker()
    worker.start(10.0)
    with pytest.raises(ServeError) as err:
        run(worker, tmp_path, mode="exit")
    assert err.value.kind == "crashed"
    assert err.value.infrastructure
    assert "exit status 3" in err.value.message
    assert "crashing now" in err.value.message
    assert_gone(worker)
    with pytest.raises(ServeError) as again:
        run(worker, tmp_path, 2)
    assert again.value.kind == "stopped"


def test_hang_past_the_timeout_stops_the_whole_tree(
    make_worker: MakeWorker, tmp_path: Path
) -> None:
    worker = make_worker()
    worker.start(10.0)
    start = time.monotonic()
    with pytest.raises(ServeError) as err:
        run(worker, tmp_path, timeout_s=0.5, mode="hang", fork=True)
    assert time.monotonic() - start < 5
    assert err.value.kind == "timeout"
    assert "got no result within 0.5 s" in err.value.message
    result = err.value.launch_result
    assert result is not None and result.survivors == ()
    assert len(result.reaped) >= 2  # the worker and the child it forked
    assert all(gone(pid) for pid in result.reaped)
    assert_gone(worker)


def test_garbage_result(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker("crafted_worker.py", env={"CRAFT": "garbage_result"})
    worker.start(10.0)
    with pytest.raises(ServeError) as err:
        run(worker, tmp_path)
    assert err.value.kind == "protocol"
    assert "not JSON" in err.value.message
    assert_gone(worker)


def test_malformed_result(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker("crafted_worker.py", env={"CRAFT": "malformed_result"})
    worker.start(10.0)
    with pytest.raises(ServeError, match="'ok'") as err:
        run(worker, tmp_path)
    assert err.value.kind == "protocol"
    assert_gone(worker)


def test_stale_epoch_and_attempt_reports_are_dropped(
    make_worker: MakeWorker, tmp_path: Path
) -> None:
    worker = make_worker("crafted_worker.py", env={"CRAFT": "stale"}, epoch=5)
    worker.start(10.0)
    result = run(worker, tmp_path, attempt=3)
    assert result.ok and result.message == "real"
    dropped = [
        (m["type"], m["epoch"], m.get("attempt"), m.get("message")) for m in result.stale_dropped
    ]
    assert dropped == [
        ("result", 4, 3, "stale epoch"),
        ("result", 5, 2, "superseded attempt"),
        ("result", 5, 3, "another job"),
        ("ready", 5, None, None),
    ]
    # the worker is still usable and the next job gets its own result
    again = run(worker, tmp_path, 2, attempt=4)
    assert again.ok and len(again.stale_dropped) == 4


# ---------------------------------------------------------------------------
# stop


def test_stop_kills_a_worker_that_ignores_stop(make_worker: MakeWorker) -> None:
    worker = make_worker("crafted_worker.py", env={"CRAFT": "ignore_stop"}, stop_wait_s=0.2)
    worker.start(10.0)
    result = worker.stop("evicted for a bigger job")
    assert result.stopped
    assert result.exit_code == -15  # SIGTERM from the launcher
    assert_gone(worker)


def test_stop_from_another_thread_during_a_job(make_worker: MakeWorker, tmp_path: Path) -> None:
    worker = make_worker()
    worker.start(10.0)
    stopper = threading.Timer(0.3, worker.stop, ("cancelled by the user",))
    stopper.start()
    start = time.monotonic()
    try:
        with pytest.raises(ServeError) as err:
            run(worker, tmp_path, timeout_s=30.0, mode="hang")
    finally:
        stopper.join()
    assert time.monotonic() - start < 5
    assert err.value.kind == "stopped"
    assert "cancelled by the user" in err.value.message
    assert worker.stop_reason == "cancelled by the user"
    assert not worker.busy
    assert_gone(worker)


def test_stop_from_another_thread_while_loading(make_worker: MakeWorker) -> None:
    worker = make_worker(env={"LOAD_MODE": "hang"})
    stopper = threading.Timer(0.5, worker.stop, ("broker shutting down",))
    stopper.start()
    try:
        with pytest.raises(ServeError) as err:
            worker.start(30.0)
    finally:
        stopper.join()
    assert err.value.kind == "stopped"
    assert_gone(worker)


def test_stop_before_start(make_worker: MakeWorker) -> None:
    worker = make_worker()
    result = worker.stop("never needed")
    assert result.stopped and result.pid is None
    with pytest.raises(RuntimeError):
        worker.start(1.0)


def test_a_worker_that_dies_while_idle_is_not_alive(
    make_worker: MakeWorker, tmp_path: Path
) -> None:
    worker = make_worker()
    report = worker.start(10.0)
    psutil.Process(served_by(report)).kill()  # the worker, not its supervisor
    deadline = time.monotonic() + 5
    while worker.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.alive()
    with pytest.raises(ServeError) as err:
        run(worker, tmp_path)
    assert err.value.kind == "crashed"
    assert "killed by signal 9" in err.value.message
    assert_gone(worker)


# ---------------------------------------------------------------------------
# the worker helper, driven by hand


@pytest.fixture
def raw_worker(tmp_path: Path, sock_dir: Path) -> Iterator[Callable[[], tuple[Any, Channel]]]:
    """Start the module worker against a socket this test listens on; yield a
    function that returns (process, channel) once it has said hello and ready."""
    (tmp_path / "module_worker.py").write_text(MODULE_WORKER)
    procs: list[subprocess.Popen[bytes]] = []
    channels: list[Channel] = []

    def start() -> tuple[subprocess.Popen[bytes], Channel]:
        path = sock_dir / f"{uuid.uuid4().hex[:8]}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(10)
        env = dict(BASE_ENV, LOAD_LOG=str(tmp_path / "loads"))
        env.update(GPUWARDEN_SERVE_SOCKET=str(path), GPUWARDEN_SERVE_EPOCH="3")
        proc = subprocess.Popen(
            [PY, str(tmp_path / "module_worker.py")], env=env, stderr=subprocess.PIPE
        )
        procs.append(proc)
        conn, _ = listener.accept()
        listener.close()
        channel = Channel(conn)
        channels.append(channel)
        assert channel.recv(10)["type"] == "hello"
        assert channel.recv(10)["type"] == "ready"
        return proc, channel

    yield start
    for channel in channels:
        channel.close()
    for proc in procs:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def job_msg(tmp_path: Path, epoch: int, job: str, **params: Any) -> dict[str, Any]:
    return {
        "type": "job",
        "epoch": epoch,
        "job": job,
        "attempt": 1,
        "params": params,
        "input_dir": str(tmp_path),
        "output_dir": str(tmp_path),
        "scratch_dir": str(tmp_path),
    }


def test_worker_ignores_messages_of_another_epoch(
    raw_worker: Callable[[], tuple[subprocess.Popen[bytes], Channel]], tmp_path: Path
) -> None:
    proc, channel = raw_worker()
    channel.send(job_msg(tmp_path, 2, "old"))
    channel.send({"type": "stop", "epoch": 4})
    channel.send({"type": "something-new", "epoch": 3})
    channel.send(job_msg(tmp_path, 3, "mine", x=1))
    result = channel.recv(10)
    assert (result["type"], result["job"], result["epoch"], result["ok"]) == (
        "result",
        "mine",
        3,
        True,
    )
    with pytest.raises(TimeoutError):
        channel.recv(0.2)  # nothing for the ignored job
    channel.send({"type": "stop", "epoch": 3})
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "ignored a 'job' message of epoch 2" in err
    assert "ignored a 'stop' message of epoch 4" in err


def test_worker_exits_0_at_end_of_file(
    raw_worker: Callable[[], tuple[subprocess.Popen[bytes], Channel]],
) -> None:
    proc, channel = raw_worker()
    channel.close()
    assert proc.wait(10) == 0


def test_worker_exits_1_on_garbage_from_the_broker(
    raw_worker: Callable[[], tuple[subprocess.Popen[bytes], Channel]], tmp_path: Path
) -> None:
    proc, channel = raw_worker()
    bad = job_msg(tmp_path, 3, "bad")
    bad["attempt"] = "one"  # valid frame, malformed job
    channel.send(bad)
    assert proc.wait(10) == 1
    assert proc.stderr is not None
    assert "protocol error" in proc.stderr.read().decode()


def test_worker_outside_gpuwarden_exits_2() -> None:
    def never(*_: Any) -> None:
        raise AssertionError("not called")

    assert run_worker(never, never, env={}) == 2
    assert (
        run_worker(
            never, never, env={"GPUWARDEN_SERVE_SOCKET": "/nowhere", "GPUWARDEN_SERVE_EPOCH": "x"}
        )
        == 2
    )
    assert (
        run_worker(
            never, never, env={"GPUWARDEN_SERVE_SOCKET": "/nowhere", "GPUWARDEN_SERVE_EPOCH": "1"}
        )
        == 1
    )
