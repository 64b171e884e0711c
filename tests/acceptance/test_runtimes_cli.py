"""Acceptance: ``gpuwarden runtimes`` on a real broker (simulated GPU) beside a
runtime whose model memory is held by a child of its server process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.core.model import GIB
from gpuwarden.gpu.select import SIM_STATE_FILE
from tests.acceptance.test_cli import Broker, env, run, wait_for, write_config

# a runtime: GET /status says how many requests run (the file ``busy`` holds it),
# POST /unload is its release; its model is held by a child on the simulated GPU
SERVER = r"""
import http.server, json, subprocess, sys
busy_file, runner = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", runner], stdin=subprocess.PIPE)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps({"running": int(open(busy_file).read())}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], child.pid, flush=True)
server.serve_forever()
"""
RUNNER = """
import sys
from gpuwarden.gpu import simclient
simclient.attach().allocate(4 * 1024**3, label="model")
print("loaded", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    yield b
    if b.proc.poll() is None:
        b.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_runtimes_lists_state_capabilities_and_the_trees_memory(
    broker: Broker, tmp_path: Path
) -> None:
    status = json.loads(run("--config", broker.config, "status", "--json").stdout)
    gpu = status["nodes"][0]["gpus"][0]["uuid"]
    busy = tmp_path / "busy"
    busy.write_text("1")
    server_env = {
        **env(),
        "GPUWARDEN_SIM_GPU": str(tmp_path / "state" / SIM_STATE_FILE),
        "CUDA_VISIBLE_DEVICES": gpu,
    }
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(busy), RUNNER],
        env=server_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port_s, child_s = server.stdout.readline().split()
        closed = free_port()
        base = broker.config.read_text()
        broker.config.write_text(
            base
            + f"""
[[runtimes]]
name = "mine"
kind = "generic"
url = "http://127.0.0.1:{port_s}"
busy = {{ path = "/status", busy_key = "running" }}
release = {{ method = "POST", path = "/unload" }}

[[runtimes]]
name = "gone"
kind = "generic"
url = "http://127.0.0.1:{closed}"
busy = {{ path = "/status", busy_key = "running" }}
"""
        )

        def rows() -> dict[str, dict[str, object]]:
            r = run("--config", broker.config, "runtimes", "--json")
            assert r.returncode == 0, r.stderr
            return {row["name"]: row for row in json.loads(r.stdout)["runtimes"]}

        # the broker's reading shows the child's memory (not the server's): wait for it
        wait_for(lambda: bool(rows()["mine"]["memory"]), "the runtime's memory in a reading")
        listed = rows()
        mine, gone = listed["mine"], listed["gone"]
        assert mine["pid"] == server.pid and int(child_s) != server.pid
        assert mine["memory"] == {gpu: 4 * GIB}
        assert (mine["state"], mine["detail"]) == ("busy", "running = 1")
        assert mine["capabilities"] == {
            "busy_signal": "exact",
            "release": "waits-for-inflight",
            "releasable": True,
            "notes": [
                "busy: GET /status key 'running'",
                "release: POST /unload",
            ],
        }
        assert gone["state"] == "unreachable"
        assert f"http://127.0.0.1:{closed}" in str(gone["detail"])
        busy.write_text("0")
        assert rows()["mine"]["state"] == "idle"
        table = run("--config", broker.config, "runtimes")
        assert table.returncode == 0, table.stderr
        assert "4.0 GiB on" in table.stdout and "unreachable" in table.stdout
        assert server.poll() is None  # only looked at: nothing was asked of it
    finally:
        server.kill()
        server.wait(10)
    assert broker.stop() == 0


def test_no_runtimes_says_how_to_add_one(tmp_path: Path) -> None:
    r = run("--config", write_config(tmp_path), "runtimes")
    assert r.returncode == 0, r.stderr
    assert "no managed runtimes: add [[runtimes]] tables" in r.stdout
