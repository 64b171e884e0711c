"""Service jobs on one node (SPEC.md, "Service jobs"): real processes, driven
tick by tick; reached through the broker's forwarder."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.launch.base import attempt_name_of
from gpuwarden.launch.sandbox import LABEL_ATTEMPT, LABEL_INSTANCE, LABEL_JOB, SandboxLauncher
from gpuwarden.node.services import ROUTE_HEADER, STOPPED_KEEP_S, Forwarder, ServiceRoute
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES, need_tool
from tests.integration.test_broker import TEST_MODULES, make_config
from tests.integration.test_sandbox import make_config as sandbox_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        yield n
        n.broker.shutdown(2)


def route(node: Node, job_id: str) -> ServiceRoute | None:
    return next((r for r in node.broker.service_routes().values() if r.job_id == job_id), None)


def wait_state(node: Node, job_id: str, state: str, timeout: float = 15) -> ServiceRoute:
    def there() -> bool:
        r = route(node, job_id)
        return r is not None and r.state == state and bool(r.upstream)

    run_until(node, there, timeout)
    found = route(node, job_id)
    assert found is not None
    return found


def get(upstream: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = upstream.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def ended(node: Node, job_id: str) -> bool:
    job = node.store.get_job(job_id)
    return job is not None and job.state.terminal


def test_a_service_starts_becomes_healthy_is_reached_with_its_credential_and_stops(
    node: Node,
) -> None:
    submit(node, JobSpec(id="w1", type="testmods.web", service="hello", share=("operator",)))
    r = wait_state(node, "w1", "healthy")
    assert r.name == "hello" and r.share == ("operator",) and r.upstream.startswith("http://")
    # the published status has the service and its upstream, never its credential
    node.broker._publish(time.time(), force=True)
    status = node.store.node_statuses()[0].payload
    (published,) = status["services"]
    assert published["name"] == "hello" and published["upstream"] == r.upstream
    assert r.credential not in json.dumps(status)
    # with the credential: relayed, the header stripped; without it: 403
    code, body = get(r.upstream, "/echo?x=1", {ROUTE_HEADER: r.credential})
    assert code == 200
    echoed = json.loads(body)
    assert echoed["path"] == "/echo?x=1"
    assert ROUTE_HEADER.lower() not in {k.lower() for k in echoed["headers"]}
    assert get(r.upstream, "/echo", {})[0] == 403
    assert get(r.upstream, "/echo", {ROUTE_HEADER: "wrong"})[0] == 403
    service_pid = echoed["pid"]
    assert psutil.pid_exists(service_pid)
    # a second running service of the same name is refused at its start
    submit(node, JobSpec(id="w2", type="testmods.web", service="hello"))
    run_until(node, lambda: ended(node, "w2"))
    w2 = node.store.get_job("w2")
    assert w2 is not None and w2.state is JobState.FAILED and "already runs" in w2.reason
    # stop: done, "stopped by", its process gone, its forwarder closed
    node.store.request_stop("w1", by="alice", now=time.time())
    run_until(node, lambda: ended(node, "w1"))
    job = node.store.get_job("w1")
    assert job is not None and job.state is JobState.DONE
    assert job.reason == "stopped by alice"
    assert not psutil.pid_exists(service_pid)
    # its route is kept as stopped (no upstream; when it was last seen healthy)
    gone = route(node, "w1")
    assert gone is not None and gone.state == "stopped" and gone.upstream == ""
    assert gone.last_ok is not None and r.last_ok is not None and gone.last_ok >= r.last_ok
    node.broker._publish(time.time(), force=True)
    (published,) = node.store.node_statuses()[0].payload["services"]
    assert published["job"] == "w1" and published["state"] == "stopped"
    with pytest.raises(OSError):
        get(r.upstream, "/echo", {ROUTE_HEADER: r.credential})
    # the name is free: a new service of that name replaces the stopped route
    submit(node, JobSpec(id="w3", type="testmods.web", service="hello"))
    again = wait_state(node, "w3", "healthy")
    assert node.broker.service_routes()["hello"] == again
    node.store.request_stop("w3", by="alice", now=time.time())
    run_until(node, lambda: ended(node, "w3"))


def test_a_stopped_route_is_dropped_after_it_was_kept(node: Node) -> None:
    submit(node, JobSpec(id="k1", type="testmods.web", service="kept"))
    wait_state(node, "k1", "healthy")
    node.store.request_stop("k1", by="alice", now=time.time())
    run_until(node, lambda: ended(node, "k1"))
    assert node.broker.service_routes()["kept"].state == "stopped"
    later = time.time() + STOPPED_KEEP_S + 1
    node.broker.services.clock = lambda: later
    assert "kept" not in node.broker.service_routes()
    assert node.broker.services.statuses() == []


def test_a_never_healthy_service_is_stopped_after_its_grace_retried_then_quarantined(
    node: Node,
) -> None:
    submit(node, JobSpec(id="sick", type="testmods.web", params={"behave": "never_healthy"}))
    r = wait_state(node, "sick", "starting")
    # the fault is real: its health check is answered 503 (once its process listens)
    deadline = time.monotonic() + 10
    while (code := get(r.upstream, "/healthz", {ROUTE_HEADER: r.credential})[0]) == 502:
        assert time.monotonic() < deadline
        node.broker.tick()
    assert code == 503
    run_until(node, lambda: ended(node, "sick"), timeout=25)
    job = node.store.get_job("sick")
    assert job is not None and job.state is JobState.QUARANTINED
    attempts = node.store.attempts("sick")
    assert [a.outcome for a in attempts] == ["service_unhealthy", "service_unhealthy"]
    assert "did not pass its health check (GET /healthz: answered" in attempts[0].reason
    assert "health_grace_s = 3 s" in attempts[0].reason and "quarantined" in job.reason


def test_a_service_that_exits_by_itself_fails_by_the_usual_rules(node: Node) -> None:
    submit(node, JobSpec(id="dies", type="testmods.web", params={"behave": "die"}))
    wait_state(node, "dies", "healthy")
    run_until(node, lambda: ended(node, "dies"))
    job = node.store.get_job("dies")
    assert job is not None and job.state is JobState.FAILED
    assert "exited with code 4" in job.reason


def test_a_gpu_services_vram_is_held_on_the_ledger_while_it_runs(node: Node) -> None:
    submit(node, JobSpec(id="g1", type="testmods.webgpu"))
    wait_state(node, "g1", "healthy")
    held = [h for v in node.broker.vram.views() for h in v.holdings if h.holder == "g1/1"]
    assert held and held[0].bytes == 2 * 1024**3
    node.store.request_stop("g1", by="bob", now=time.time())
    run_until(node, lambda: ended(node, "g1"))
    assert not [h for v in node.broker.vram.views() for h in v.holdings if h.holder == "g1/1"]
    assert os.environ.get("GPUWARDEN_SERVICE_PORT") is None  # only the job's own environment


@pytest.fixture
def bwrap_node(tmp_path: Path) -> Iterator[Node]:
    need_tool("bwrap")
    config = sandbox_config(tmp_path, "bubblewrap", module_paths=[MODULES, TEST_MODULES])
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(2)


def test_a_service_in_bubblewrap_is_reached_inside_its_network_namespace(
    bwrap_node: Node,
) -> None:
    node = bwrap_node
    submit(node, JobSpec(id="boxed", type="testmods.web"))
    r = wait_state(node, "boxed", "healthy", timeout=25)
    # the host cannot reach its port: it listens in the sandbox's own namespace
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", 18431), timeout=1).close()
    code, body = get(r.upstream, "/echo", {ROUTE_HEADER: r.credential})
    assert code == 200 and json.loads(body)["path"] == "/echo"
    node.store.request_stop("boxed", by="carol", now=time.time())
    run_until(node, lambda: ended(node, "boxed"), timeout=20)
    job = node.store.get_job("boxed")
    assert job is not None and job.state is JobState.DONE and job.reason == "stopped by carol"


def test_a_forwarder_takes_the_current_and_the_previous_credential_only() -> None:
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        port = upstream.getsockname()[1]
        fwd = Forwarder(
            "x", "first-credential", lambda: socket.create_connection(("127.0.0.1", port))
        )
        try:

            def asks(cred: str) -> bytes:
                with socket.create_connection(("127.0.0.1", fwd.port), timeout=5) as c:
                    c.sendall(f"GET / HTTP/1.1\r\n{ROUTE_HEADER}: {cred}\r\n\r\n".encode())
                    c.shutdown(socket.SHUT_WR)
                    upstream.settimeout(0.5)
                    try:
                        conn, _ = upstream.accept()
                        conn.close()
                        return b"relayed"
                    except TimeoutError:
                        return c.recv(100)

            fwd.rotate("second-credential")
            assert asks("second-credential") == b"relayed"
            assert asks("first-credential") == b"relayed"  # the one before: still taken
            fwd.rotate("third-credential")
            assert asks("first-credential").startswith(b"HTTP/1.1 403")
        finally:
            fwd.close()


def test_a_podman_service_is_adopted_only_from_its_own_running_container(
    podman_base_image: str,
) -> None:
    """adoptable_pid finds the attempt's container by its name, and takes it only
    running and with this instance's, job's and attempt's labels."""
    launcher = SandboxLauncher(Runtime.PODMAN, image=podman_base_image)
    instance, name = "adopt-test", attempt_name_of("adopt-test", "j1", 1)

    def run(*labels: str) -> None:
        subprocess.run(["podman", "rm", "--force", name], capture_output=True, check=False)
        # as the launcher runs it here: the ulimits it sets, and on a host that mixes
        # cgroup v1 controllers with a v2 mount, in a mount namespace without the latter
        hybrid = 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hybrid, "sh"]
        argv += ["podman", "run", "--detach", "--name", name, "--network", "none"]
        argv += ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
        for label in labels:
            argv += ["--label", label]
        argv += [podman_base_image, "sleep", "60"]
        subprocess.run(argv, capture_output=True, check=True)

    own = (f"{LABEL_INSTANCE}={instance}", f"{LABEL_JOB}=j1", f"{LABEL_ATTEMPT}=1")
    try:
        assert launcher.adoptable_pid(instance, "j1", 1, 12345) is None  # no container
        run(*own)
        pid = launcher.adoptable_pid(instance, "j1", 1, 12345)
        assert pid is not None and pid != 12345 and psutil.pid_exists(pid)
        assert launcher.adoptable_pid(instance, "j1", 2, 12345) is None  # another attempt
        run(own[0], own[1], f"{LABEL_ATTEMPT}=7")  # its name, another attempt's label
        assert launcher.adoptable_pid(instance, "j1", 1, 12345) is None
        subprocess.run(["podman", "stop", "--time", "0", name], capture_output=True, check=True)
        assert launcher.adoptable_pid(instance, "j1", 1, 12345) is None  # not running
        run(*own)
        launcher.release_adopted(instance, "j1", 1)
        assert not launcher.exists(name)
    finally:
        subprocess.run(["podman", "rm", "--force", name], capture_output=True, check=False)
