"""A managed runtime's memory is its whole process tree's, as the device shows it
(gpuwarden.runtimes.tree): a server listening on a port whose model is held by a
child process, on the simulated GPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from gpuwarden.core.model import GIB
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.runtimes.tree import holdings, is_local, listener_pid, process_tree
from tests.integration.test_sim_gpu import child_env

# a "server": listens on a port and starts a "runner" child that holds 3 GiB
SERVER = """
import socket, subprocess, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
runner = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE)
print(s.getsockname()[1], runner.pid, flush=True)
sys.stdin.read()
runner.stdin.close(); runner.wait()
"""
RUNNER = """
import sys
from gpuwarden.gpu import simclient
simclient.attach().allocate(3 * 1024**3, label="runner")
sys.stdin.read()
"""


def test_the_holding_is_the_childs_memory_found_from_the_listening_port(tmp_path: Path) -> None:
    probe = SimProbe(tmp_path / "sim.json", SimGpuConfig(count=2, vram_bytes=24 * GIB))
    gpu = probe.read()[1].uuid
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, RUNNER],
        env=child_env(probe.path, gpu),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port_s, runner_s = server.stdout.readline().split()
        port, runner = int(port_s), int(runner_s)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while not any(p.pid == runner for g in probe.read() for p in g.processes):
            assert time.monotonic() < deadline, "the runner never allocated"
            time.sleep(0.05)
        # the server itself holds nothing: the memory is its child's
        readings = probe.read()
        assert holdings({server.pid}, readings) == {}
        assert listener_pid(url) == server.pid
        tree = process_tree(server.pid)
        assert {server.pid, runner} <= tree
        assert holdings(tree, readings) == {gpu: 3 * GIB}
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(20)
    assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == "zombie"
    assert process_tree(server.pid) == set()


def test_only_this_hosts_urls_are_looked_up() -> None:
    assert is_local("http://127.0.0.1:11434")
    assert is_local("http://localhost:8188/")
    assert is_local("http://[::1]:8000")
    assert not is_local("http://10.1.2.3:11434")
    assert listener_pid("http://10.1.2.3:11434") is None
