"""The probe module (modules/probe) and the echo module's container and serve types.

``probe.py`` runs here as a plain host process (no sandbox), so what it reports
is the host: every key must be there with its type, output and scratch must be
writable, and a marker made in tmp_path must be visible, which proves the check
can see a path at all. The sandboxed runs belong to the container launcher's
tests. ``echo_serve.py`` is driven for real through WarmProcess and HostLauncher.

No test here sends traffic off this machine: every ``connect`` is to loopback.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.core.model import GIB, Lane, LaunchMode, ParamType
from gpuwarden.launch.base import LaunchRequest
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.warmproc import LoadReport, WarmProcess
from gpuwarden.registry import parse_module

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "src" / "gpuwarden" / "modules" / "probe"
ECHO = REPO / "src" / "gpuwarden" / "modules" / "echo"
PY = sys.executable

#: every key of report.json, and the type(s) of its value
REPORT_KEYS: dict[str, type | tuple[type, ...]] = {
    "uid": int,
    "gid": int,
    "euid": int,
    "pid": int,
    "cap_eff": str,
    "cap_prm": str,
    "cap_bnd": str,
    "no_new_privs": int,
    "seccomp": int,
    "interfaces": list,
    "connect": dict,
    "root_writable": dict,
    "tmp_writable": dict,
    "cwd_writable": dict,
    "output_writable": dict,
    "scratch_writable": dict,
    "input_dir_writable": dict,
    "input_readable": (dict, type(None)),
    "input_writable": (dict, type(None)),
    "marker_visible": (dict, type(None)),
    "mounts": list,
    "rlimits": dict,
    "pid1": str,
    "hostname": str,
    "cwd": str,
    "python": str,
    "job_type": (str, type(None)),
    "env_keys": list,
    "devices": list,
    "gpu": dict,
    "groups": list,
    "uid_map": str,
    "userns": dict,
    "mount": dict,
    "keyctl": dict,
    "tmp": dict,
    "tried": dict,
    "errors": dict,
}


def assert_check(value: Any, ok: bool | None = None) -> None:
    """A check of a path: {"path": str, "ok": bool, "error": str}."""
    assert isinstance(value, dict), value
    assert isinstance(value["path"], str)
    assert isinstance(value["ok"], bool)
    assert isinstance(value["error"], str)
    assert value["ok"] == (value["error"] == ""), value
    if ok is not None:
        assert value["ok"] is ok, value


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str], dirs: dict[str, Path]) -> None:
        self.proc = proc
        self.dirs = dirs
        out = dirs["out"] / "report.json"
        self.report: dict[str, Any] | None = json.loads(out.read_text()) if out.exists() else None
        msg = dirs["root"] / "message.json"
        self.message: str | None = json.loads(msg.read_text())["message"] if msg.exists() else None


def run_probe(
    tmp_path: Path,
    params: dict[str, Any],
    *,
    inputs: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> Run:
    """Run probe.py as the broker would, as a plain host process. An ``input``
    parameter names one of ``inputs``."""
    root = tmp_path / f"attempt-{uuid.uuid4().hex[:6]}"
    dirs = {"root": root, "in": root / "in", "out": root / "out", "scratch": root / "scratch"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    for name, text in (inputs or {}).items():
        (dirs["in"] / name).write_text(text)
    params = dict(params)
    if "input" in params:  # as the broker gives it: an absolute path
        params["input"] = str(dirs["in"] / params["input"])
    (root / "params.json").write_text(json.dumps(params))
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONUNBUFFERED": "1",
        "GPUWARDEN_PARAMS": str(root / "params.json"),
        "GPUWARDEN_INPUT_DIR": str(dirs["in"]),
        "GPUWARDEN_OUTPUT_DIR": str(dirs["out"]),
        "GPUWARDEN_SCRATCH_DIR": str(dirs["scratch"]),
        "GPUWARDEN_RESULT": str(root / "message.json"),
        "GPUWARDEN_JOB_ID": "probe-test",
        "GPUWARDEN_JOB_TYPE": "probe.sandbox",
    }
    full_env.update(env or {})
    proc = subprocess.run(
        [PY, "src/probe.py"],
        cwd=PROBE,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Run(proc, dirs)


@pytest.fixture
def listener() -> Iterator[str]:
    """host:port of a TCP listener on loopback."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture
def closed_port() -> str:
    """host:port on loopback where nothing listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"127.0.0.1:{port}"


def probe_leftovers() -> list[Path]:
    return list(PROBE.glob(".gpuwarden-probe-*"))


# ---------------------------------------------------------------------------
# probe.py on the host


def test_probe_reports_every_key_on_the_host(tmp_path: Path, listener: str) -> None:
    marker = tmp_path / "host-only-marker"
    marker.write_text("secret")
    run = run_probe(
        tmp_path,
        {"marker": str(marker), "connect": listener, "input": "data.txt"},
        inputs={"data.txt": "input data\n"},
    )
    data = run.dirs["in"] / "data.txt"
    assert run.proc.returncode == 0, run.proc.stderr
    report = run.report
    assert report is not None

    assert set(report) == set(REPORT_KEYS)
    for key, types in REPORT_KEYS.items():
        assert isinstance(report[key], types), (key, report[key])
    assert report["errors"] == {}
    # what the probe printed is the report it wrote
    assert json.loads(run.proc.stdout) == report

    # identity and privileges, as this process has them
    assert (report["uid"], report["gid"], report["euid"]) == (
        os.getuid(),
        os.getgid(),
        os.geteuid(),
    )
    for key in ("cap_eff", "cap_prm", "cap_bnd"):
        int(report[key], 16)  # hex
    assert report["no_new_privs"] in (0, 1)
    assert report["cwd"] == str(PROBE)
    assert report["job_type"] == "probe.sandbox"
    assert report["hostname"] == socket.gethostname()
    assert report["pid1"]  # readable on the host

    # the network: loopback is there and the listener answers
    assert "lo" in report["interfaces"]
    assert all(isinstance(n, str) for n in report["interfaces"])
    assert report["connect"] == {"target": listener, "ok": True, "error": "", "kind": "ok"}

    # file systems: the job's own folders are writable on the host
    assert set(report["root_writable"]) == {"/", "/usr"}
    for value in report["root_writable"].values():
        assert_check(value)  # root may write there, another user not: not judged here
    assert_check(report["output_writable"], ok=True)
    assert_check(report["scratch_writable"], ok=True)
    assert_check(report["input_dir_writable"], ok=True)  # no sandbox: nothing protects it
    assert_check(report["tmp_writable"])
    assert_check(report["cwd_writable"])
    assert report["output_writable"]["path"] == str(run.dirs["out"])
    assert_check(report["input_readable"], ok=True)
    assert_check(report["input_writable"])
    assert report["input_readable"]["path"] == str(data)

    # the marker made here is visible: the check can see a host path
    seen = report["marker_visible"]
    assert seen["path"] == str(marker)
    assert seen["exists"] is True and seen["visible"] is True and seen["error"] == ""
    assert seen["stat"]["size"] == len("secret")
    assert seen["stat"]["ino"] == marker.stat().st_ino

    # limits, mounts, environment, devices
    assert set(report["rlimits"]) == {"RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CPU"}
    for limit in report["rlimits"].values():
        assert set(limit) == {"soft", "hard"}
        assert all(v is None or isinstance(v, int) for v in limit.values())
    assert any(m["target"] == "/" for m in report["mounts"])
    assert report["env_keys"] == sorted(report["env_keys"])
    assert "GPUWARDEN_OUTPUT_DIR" in report["env_keys"]
    assert not any("=" in k or "/" in k for k in report["env_keys"])  # names, not values
    assert all(d.startswith("nvidia") for d in report["devices"])
    assert report["gpu"] == {"cuda_visible_devices": None, "cuda": None}

    # it left nothing behind and changed no input
    assert sorted(p.name for p in run.dirs["out"].iterdir()) == ["report.json"]
    assert list(run.dirs["scratch"].iterdir()) == []
    assert sorted(p.name for p in run.dirs["in"].iterdir()) == ["data.txt"]
    assert data.read_text() == "input data\n"
    assert probe_leftovers() == []

    # the one-line summary
    assert run.message is not None
    assert "\n" not in run.message
    assert run.message.startswith(f"uid {os.getuid()}, CapEff ")
    assert "interfaces lo" in run.message
    assert "connect ok" in run.message
    assert "marker VISIBLE" in run.message


def test_probe_without_input_or_marker_and_a_refused_connection(
    tmp_path: Path, closed_port: str
) -> None:
    run = run_probe(tmp_path, {"marker": "", "connect": closed_port})
    assert run.proc.returncode == 0, run.proc.stderr
    report = run.report
    assert report is not None
    assert set(report) == set(REPORT_KEYS)
    assert report["input_readable"] is None
    assert report["input_writable"] is None
    assert report["marker_visible"] is None
    assert report["connect"]["target"] == closed_port
    assert report["connect"]["ok"] is False
    assert report["connect"]["kind"] == "refused"
    assert report["connect"]["error"].startswith("ECONNREFUSED")
    assert run.message is not None and "connect refused" in run.message


def test_probe_reports_a_missing_marker_as_hidden(tmp_path: Path) -> None:
    missing = tmp_path / "not-here" / "marker"
    run = run_probe(tmp_path, {"marker": str(missing), "connect": ""})
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.report is not None
    seen = run.report["marker_visible"]
    assert (seen["exists"], seen["visible"], seen["stat"]) == (False, False, None)
    assert seen["error"].startswith("ENOENT")
    assert run.report["connect"] == {"target": "", "ok": False, "error": "", "kind": "skipped"}
    assert run.message is not None
    assert "marker hidden" in run.message and "connect skipped" in run.message


def test_probe_rejects_a_malformed_connect_target(tmp_path: Path) -> None:
    run = run_probe(tmp_path, {"connect": "no-port-here"})
    assert run.proc.returncode == 0
    assert run.report is not None
    assert run.report["connect"]["ok"] is False
    assert run.report["connect"]["kind"] == "bad target"


def test_probe_exits_1_when_it_cannot_write_the_report(tmp_path: Path) -> None:
    gone = tmp_path / "no-such-output"
    run = run_probe(tmp_path, {"connect": ""}, env={"GPUWARDEN_OUTPUT_DIR": str(gone)})
    assert run.proc.returncode == 1
    assert "cannot write report.json" in run.proc.stderr.strip().splitlines()[-1]
    # the report still went to stdout, and says why
    printed = json.loads(run.proc.stdout)
    assert printed["output_writable"]["ok"] is False
    assert printed["output_writable"]["error"].startswith("ENOENT")
    assert not gone.exists()


@pytest.mark.slow  # may import torch
def test_probe_gpu_reports_cuda_and_never_fails_for_it(tmp_path: Path) -> None:
    gpu = "GPU-11111111-2222-3333-4444-555555555555"
    run = run_probe(
        tmp_path,
        {"marker": "", "connect": "", "cuda": True},
        env={"CUDA_VISIBLE_DEVICES": gpu, "GPUWARDEN_JOB_TYPE": "probe.gpu"},
        timeout=110,
    )
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.report is not None
    got = run.report["gpu"]
    assert got["cuda_visible_devices"] == gpu
    cuda = got["cuda"]
    assert isinstance(cuda["ok"], bool)
    assert isinstance(cuda["device_count"], int)
    assert set(cuda["via"]) <= {"libcuda", "torch"}
    assert cuda["ok"] == bool(cuda["via"])
    assert isinstance(cuda["libcuda"]["ok"], bool)
    assert isinstance(cuda["libcuda"]["error"], str)
    assert isinstance(cuda["torch"]["importable"], bool)
    if not cuda["ok"]:  # no GPU here (this UUID is made up): said, not failed
        assert cuda["libcuda"]["error"]
        assert run.message is not None and "cuda unavailable" in run.message


# ---------------------------------------------------------------------------
# the registry


def test_registry_parses_probe() -> None:
    module = parse_module(PROBE)
    types = {t.name: t for t in module.types}
    assert set(types) == {"probe.sandbox", "probe.gpu"}
    sandbox, gpu = types["probe.sandbox"], types["probe.gpu"]
    for t in (sandbox, gpu):
        assert t.launch is LaunchMode.CONTAINER
        assert t.command == ("{python}", "src/probe.py")
        assert t.max_retries == 0
        assert t.module_dir == str(PROBE.resolve())
        marker, connect, given = t.param("marker"), t.param("connect"), t.param("input")
        assert marker is not None and connect is not None and given is not None
        assert (marker.type, marker.required, marker.default) == (ParamType.STRING, False, "")
        assert (connect.type, connect.default) == (ParamType.STRING, "")
        assert (given.type, given.required, given.default) == (ParamType.INPUT, False, None)
    assert (sandbox.lane, sandbox.vram_bytes, sandbox.timeout_s) == (Lane.CPU, 0, 60.0)
    assert sandbox.param("cuda") is None
    assert (gpu.lane, gpu.vram_bytes, gpu.coresident, gpu.timeout_s) == (
        Lane.VRAM,
        GIB,
        True,
        120.0,
    )
    cuda = gpu.param("cuda")
    assert cuda is not None and (cuda.type, cuda.default) == (ParamType.BOOLEAN, True)


def test_registry_parses_echo_with_its_three_types() -> None:
    module = parse_module(ECHO)
    types = {t.name: t for t in module.types}
    assert set(types) == {"echo.echo", "echo.container", "echo.serve"}
    echo, container, serve = types["echo.echo"], types["echo.container"], types["echo.serve"]
    assert echo.launch is LaunchMode.HOST  # unchanged
    assert container.launch is LaunchMode.CONTAINER
    assert container.lane is Lane.CPU
    assert container.command == echo.command == ("{python}", "src/echo.py")
    assert container.params == echo.params
    assert (container.timeout_s, container.max_retries) == (echo.timeout_s, echo.max_retries)

    assert serve.launch is LaunchMode.SERVE
    assert serve.lane is Lane.VRAM
    assert serve.command == ("{python}", "src/echo_serve.py")
    assert serve.vram_bytes == GIB // 4
    assert serve.coresident is True
    assert (serve.timeout_s, serve.load_timeout_s) == (60.0, 60.0)
    assert [p.name for p in serve.params] == ["text", "output", "repeat"]
    text, output = serve.param("text"), serve.param("output")
    assert text is not None and text.required
    assert output is not None and output.default == "echo.txt"


# ---------------------------------------------------------------------------
# echo_serve.py, a real warm server


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for the socket (a unix socket path is at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_echo_serve_writes_each_jobs_text(tmp_path: Path, sock_dir: Path) -> None:
    gpu = "GPU-11111111-2222-3333-4444-555555555555"
    req = LaunchRequest(
        job_id="echo-serve-worker",
        attempt=1,
        argv=(PY, "src/echo_serve.py"),
        cwd=str(ECHO),
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": gpu,
        },
        attempt_dir=str(tmp_path / "worker"),
        timeout_s=math.inf,
        kill_grace_s=0.3,
        instance="test-echo-serve",
    )
    worker = WarmProcess(HostLauncher(), req, sock_dir / "echo.sock", 3, stop_wait_s=2.0)

    def job(n: int, **params: Any) -> tuple[Any, Path]:
        out = tmp_path / f"job-{n}" / "out"
        out.mkdir(parents=True)
        report = worker.run_job(
            f"job-{n}", 1, params, tmp_path / "in", out, tmp_path / f"job-{n}" / "scratch", 10.0
        )
        return report, out

    try:
        loaded = worker.start(30.0)
        assert isinstance(loaded, LoadReport)
        assert loaded.device_bytes is None

        first, out = job(1, text="hello", output="echo.txt")
        assert first.ok, first.error
        assert first.message == "wrote 5 characters to echo.txt"
        assert (out / "echo.txt").read_text() == "hello"

        # a bad job fails alone; the same process serves the next
        bad, out = job(2, text="x", output="../escape.txt")
        assert not bad.ok
        assert (
            bad.error == "ValueError: output '../escape.txt' must stay inside the output directory"
        )
        assert not (out.parent / "escape.txt").exists()
        assert worker.alive()

        nested, out = job(3, text="deep", output="a/b.txt")
        assert nested.ok and nested.message == "wrote 4 characters to a/b.txt"
        assert (out / "a" / "b.txt").read_text() == "deep"
        assert worker.pid == loaded.pid
    finally:
        ended = worker.stop("end of test")
    assert ended.exit_code == 0  # it took `stop` and exited by itself
    assert ended.survivors == ()
    assert gone(loaded.pid)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
