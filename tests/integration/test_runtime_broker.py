"""The broker sees a managed runtime: its process tree's memory is named by the
runtime (not foreign) in the GPUs' views, status and wait reasons, and its state
comes from its own API (gpuwarden.node.runtimes)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.gpu.select import SIM_STATE_FILE
from tests.acceptance.test_runtimes_cli import RUNNER, SERVER
from tests.brokerkit import submit
from tests.integration.test_broker import make_config
from tests.integration.test_sim_gpu import child_env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[tuple[Node, subprocess.Popen[str], Path]]:
    one_gpu = make_config(tmp_path).model_dump()
    one_gpu["sim_gpu"]["count"] = 1  # the job below must wait beside the runtime
    base = Config.model_validate(one_gpu)
    busy = tmp_path / "busy"
    busy.write_text("0")
    # the device state exists once a node has opened it: open one to learn the GPU
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(busy), RUNNER],
        env=child_env(base.state_dir / SIM_STATE_FILE, gpu),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    port = server.stdout.readline().split()[0]
    raw = base.model_dump()
    raw["runtimes"] = [
        {
            "name": "mine",
            "kind": "generic",
            "url": f"http://127.0.0.1:{port}",
            "busy": {"path": "/status", "busy_key": "running"},
        },
        {
            "name": "gone",
            "kind": "generic",
            "url": f"http://127.0.0.1:{free_port()}",
            "busy": {"path": "/status", "busy_key": "running"},
        },
    ]
    try:
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            yield node, server, busy
    finally:
        server.kill()
        server.wait(10)


def settle(node: Node, check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting for the runtime's notes"
        node.broker.tick()
        time.sleep(0.05)


def test_the_runtimes_memory_is_named_and_its_state_read(
    runtime: tuple[Node, subprocess.Popen[str], Path],
) -> None:
    node, server, busy = runtime
    broker = node.broker
    broker.runtimes.start()
    try:

        def named() -> bool:
            views = broker.vram.views()
            return bool(views) and views[0].runtimes == (("mine", 4 * GIB),)

        settle(node, named)
        view = broker.vram.views()[0]
        gpu = view.uuid
        assert view.foreign_bytes == 0  # named, not foreign
        assert view.capacity == 24 * GIB - 4 * GIB  # and still counted against the budget

        def rows() -> dict[str, dict[str, object]]:
            return {str(r["name"]): r for r in broker.status().runtimes}

        # the poller's looks come once a second (an HTTP read each): wait for both
        settle(
            node,
            lambda: rows()["mine"]["state"] == "idle" and rows()["gone"]["state"] != "unknown",
        )
        mine, gone = rows()["mine"], rows()["gone"]
        assert mine["state"] == "idle" and server.pid in mine["pids"]
        assert mine["busy_signal"] == "exact" and mine["release"] == "not-releasable"
        assert mine["may_be_asked"] is False and "cannot be asked to release" in mine["why"]
        assert gone["state"] == "unreachable" and "http://127.0.0.1:" in gone["detail"]
        busy.write_text("2")
        settle(node, lambda: broker.status().runtimes[0]["state"] == "busy")
        assert broker.status().runtimes[0]["detail"] == "running = 2"

        # a job that does not fit beside it is told why, by the runtime's name
        submit(node, JobSpec("big", "testmods.gpu", {"gib": 22}, vram_bytes=22 * GIB))
        broker.tick()
        reason = broker.wait_reason("big") or ""
        assert f"{gpu} has" in reason and "4.0 GiB by the runtime mine" in reason, reason
        assert server.poll() is None  # looked at only
    finally:
        broker.runtimes.stop()


def test_an_ollama_runtimes_runner_memory_is_named_ollama(tmp_path: Path) -> None:
    """The Ollama stand-in (tests/standins/ollama.py): its model is held by a runner
    child; the broker finds the server by its port and names the child's memory."""
    import httpx

    one_gpu = make_config(tmp_path).model_dump()
    one_gpu["sim_gpu"]["count"] = 1
    base = Config.model_validate(one_gpu)
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    env = child_env(base.state_dir / SIM_STATE_FILE, gpu)
    env.pop("OLLAMA_KEEP_ALIVE", None)
    standin = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.ollama", "--port", "0", "--model", f"tiny={GIB}"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert standin.stdout is not None
        url = standin.stdout.readline().strip().removeprefix("listening on ")
        loaded = httpx.post(f"{url}/api/generate", json={"model": "tiny"}, timeout=60).json()
        assert loaded["done_reason"] == "load"
        raw = base.model_dump()
        raw["runtimes"] = [{"name": "ollama", "kind": "ollama", "url": url}]
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            broker = node.broker
            broker.runtimes.start()
            try:
                settle(
                    node,
                    lambda: (
                        bool(broker.vram.views())
                        and broker.vram.views()[0].runtimes == (("ollama", GIB),)
                    ),
                )
                assert broker.vram.views()[0].foreign_bytes == 0
                [row] = broker.status().runtimes
                assert (row["state"], row["busy_signal"], row["release"]) == (
                    "unknown",
                    "heuristic",
                    "waits-for-inflight",
                )
                assert standin.pid in row["pids"] and len(row["pids"]) >= 2  # and its runner
            finally:
                broker.runtimes.stop()
        assert standin.poll() is None  # nothing asked it to stop
    finally:
        standin.terminate()
        standin.wait(30)
