"""The agent's sync step in one process: a real broker on a simulated GPU, the
coordinator's app on SQLite through an in-process transport. The lease watchdog,
what a stopping agent gives back, and a refused credential."""

from __future__ import annotations

import io
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from gpuwarden import safefs
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster.coordinator_client import Coordinator, CredentialRefused, enroll
from gpuwarden.cluster.enrolment import ENROLL_ENV, enrolment_token
from gpuwarden.cluster.outbox import OUTBOX_DIR, Outbox
from gpuwarden.cluster.sync import Agent
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import prepare
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
MODULES = [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


class Switch(httpx.BaseTransport):
    """The coordinator, or (``down``) no answer at all."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.down = False
        #: paths answered 404, as by a coordinator without those routes
        self.gone: set[str] = set()
        #: every path asked for, in order
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("the coordinator is down (test)")
        self.paths.append(request.url.path)
        if request.url.path in self.gone:
            return httpx.Response(404, json={"error": "Not Found"})
        got = self.inner.handle_request(request)
        return httpx.Response(got.status_code, headers=got.headers, content=got.read())


class Mono:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@dataclass
class Rig:
    store: SqliteStore  # the coordinator's
    node: Node  # the agent's broker
    agent: Agent
    switch: Switch
    mono: Mono

    def step(self) -> None:
        self.node.broker.tick()
        self.agent.sync()

    def until(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            time.sleep(0.02)

    def job(self, job_id: str) -> Any:
        return self.store.get_job(job_id)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


def make_rig(tmp_path: Path, modules: list[Path] = MODULES, **api: Any) -> Iterator[Rig]:
    coord_config = Config.model_validate(
        {
            "state_dir": tmp_path / "coord",
            "module_paths": modules,
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000, **api},
            "cluster": {"lease_s": 6, "offline_after_s": 8},
        }
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = SqliteStore(tmp_path / "coord.db")
    registry = Registry.load(modules, coord_config.launch_rules)
    client = TestClient(create_app(store, registry, coord_config))
    switch = Switch(client._transport)
    _, invite = issue_token(
        store,
        name="enroll a",
        role=Role.ENROLL,
        by=ADMIN,
        now=time.time(),
        expires_at=time.time() + 900,
        node="a",
    )
    agent_config = Config.model_validate(
        {
            "state_dir": tmp_path / "agent",
            "node_name": "a",
            "module_paths": modules,
            "allow_unsandboxed_containers": True,
            "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
            "broker": {"poll_interval_s": 0.02, "shutdown_grace_s": 1},
        }
    )
    with open_node(agent_config, mock_gpu=True) as node:
        got = enroll("http://testserver", invite, {"gpus": []}, transport=switch)
        mono = Mono()
        agent = Agent(
            node.broker,
            Coordinator("http://testserver", got["token"], transport=switch),
            node="a",
            lease_s=float(got["lease_s"]),
            max_jobs=4,
            labels={},
            claim_every_s=0.05,
            monotonic=mono,
            outbox=Outbox(tmp_path / "agent" / OUTBOX_DIR),
        )
        node.broker.tick()  # the first status: the GPU is observed
        try:
            yield Rig(store=store, node=node, agent=agent, switch=switch, mono=mono)
        finally:
            node.broker.shutdown(0.0)
            agent.coordinator.close()
            client.close()
            store.close()


def gpu_job(job_id: str, seconds: float) -> JobSpec:
    return JobSpec(
        id=job_id,
        type="testmods.gpu",
        params={"gib": 2, "seconds": seconds, "leak": False},
        vram_bytes=2 * GIB,
    )


def test_a_leased_job_runs_here_and_its_result_goes_up(rig: Rig) -> None:
    registry = Registry.load(MODULES)
    spec = prepare(registry, JobSpec(id="e1", type="echo.echo", params={"text": "hi"}))
    rig.store.submit([spec], now=time.time())
    rig.until("e1 done", lambda: rig.job("e1").state is JobState.DONE)
    job = rig.job("e1")
    assert job.result["node"] == "a" and job.result["message"]
    [attempt] = rig.store.attempts("e1")
    assert attempt.node == "a" and attempt.outcome == "succeeded"
    assert rig.store.lease_of("e1") is None
    local = rig.node.store.get_job("e1")
    assert local is not None and local.state is JobState.DONE
    rig.until("e1 forgotten", lambda: not rig.agent.held)
    # its outputs went up first: the result points at the coordinator's copy
    here = Path(job.result["output_dir"])
    assert here.is_relative_to(Path(rig.store.path).parent / "coord" / "outputs" / "e1")
    assert job.result["outputs"] == ["echo.txt"]
    mine = Path(job.result["node_output_dir"]) / "echo.txt"
    assert (here / "echo.txt").read_bytes() == mine.read_bytes()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "old-coordinator"])
def test_reports_go_several_a_request_or_one_each(rig: Rig, batched: bool) -> None:
    if not batched:
        rig.switch.gone.add("/v1/node/reports")
    registry = Registry.load(MODULES)
    ids = [f"b{i}" for i in range(6)]
    rig.store.submit(
        [prepare(registry, JobSpec(id=i, type="echo.echo", params={"text": i})) for i in ids],
        now=time.time(),
    )
    rig.until("all done", lambda: all(rig.job(i).state is JobState.DONE for i in ids))
    for i in ids:
        assert len(rig.store.attempts(i)) == 1 and rig.store.lease_of(i) is None
    singles = [p for p in rig.switch.paths if p.endswith(("/start", "/finish"))]
    batches = rig.switch.paths.count("/v1/node/reports")
    if batched:
        # a report that is alone in the outbox when it is sent goes by itself
        # (``Agent._deliver``): how many do depends on timing; together they must
        # be fewer requests than reports
        assert batches >= 1
        assert batches + len(singles) < 2 * len(ids)  # several reports a request
    else:  # asked once, then one report a request
        assert batches == 1 and len(singles) == 2 * len(ids)
    audited = [(a.action, a.target) for a in rig.store.audit_rows()]
    for i in ids:
        assert ("node.start", i) in audited and ("node.finish", i) in audited


def test_a_job_with_staged_inputs_is_fetched_and_runs_here(rig: Rig, tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "data.txt").write_text("data\n")
    registry = Registry.load(MODULES)
    spec = prepare(
        registry,
        JobSpec(id="c1", type="testmods.cat", params={"file": "data.txt"}, inputs=("data.txt",)),
    )
    rig.store.submit([spec], now=time.time(), origin=Submission(input_dir=str(staged)))
    rig.until("c1 done", lambda: rig.job("c1").state is JobState.DONE)
    job = rig.job("c1")
    assert (Path(job.result["output_dir"]) / "copy").read_text() == "data\n"
    assert (staged / "data.txt").read_text() == "data\n"  # the agent ran on its own copy


def test_an_output_over_the_limit_is_skipped_and_the_end_still_reported(
    tmp_path: Path,
) -> None:
    rigs = make_rig(tmp_path, max_output_mib=1e-6)  # 1 byte
    rig = next(rigs)
    try:
        registry = Registry.load(MODULES)
        spec = prepare(registry, JobSpec(id="e2", type="echo.echo", params={"text": "hi"}))
        rig.store.submit([spec], now=time.time())
        rig.until("e2 done", lambda: rig.job("e2").state is JobState.DONE)
        here = Path(rig.job("e2").result["output_dir"])
        assert here.is_dir() and not list(here.iterdir())
    finally:
        rigs.close()


def test_the_agent_reports_its_gpu_room(rig: Rig) -> None:
    rig.step()
    node = rig.store.get_node("a")
    assert node is not None
    [gpu] = node.report["gpus"]
    assert gpu["total_bytes"] == 24 * GIB and gpu["usable_bytes"] == int(23.5 * GIB)
    assert "testmods.gpu" in node.report["types"] and node.report["accepting"]


def test_the_watchdog_stops_held_jobs_and_gives_them_back_saying_why(rig: Rig) -> None:
    rig.store.submit([gpu_job("g1", 20)], now=time.time())
    rig.until("g1 running", lambda: rig.job("g1").state is JobState.RUNNING)
    rig.switch.down = True
    rig.mono.offset += rig.agent.stop_after_s + 1  # no answer for that long
    rig.until(
        "g1 stopped here",
        lambda: (j := rig.node.store.get_job("g1")) is not None and j.state.terminal,
        timeout=20,
    )
    assert rig.node.store.get_job("g1").state is JobState.CANCELLED  # type: ignore[union-attr]
    lost = [e for e in rig.node.store.events(job_id="g1") if e.kind == "lease_lost"]
    assert lost and "the coordinator did not answer" in lost[0].detail["reason"]
    assert rig.job("g1").state is JobState.RUNNING  # the coordinator heard nothing yet
    rig.switch.down = False
    rig.until("its end reported", lambda: rig.job("g1").state is not JobState.RUNNING)
    # given back, not cancelled: the reason is the node's own, and it is offered again
    job = rig.job("g1")
    assert job.state is JobState.QUEUED
    [attempt] = rig.store.attempts("g1")
    assert attempt.outcome == "interrupted"
    assert "its node a stopped it: the coordinator did not answer" in attempt.reason
    assert rig.store.lease_of("g1") is None
    assert rig.agent.box is not None and rig.agent.box.load() == []  # answered: gone


def test_a_stopping_agent_gives_its_running_jobs_back(rig: Rig) -> None:
    rig.store.submit([gpu_job("g2", 20)], now=time.time())
    rig.until("g2 running", lambda: rig.job("g2").state is JobState.RUNNING)
    rig.agent.stopping = True
    rig.node.broker.shutdown(0.0)
    rig.agent.final_reports()
    job = rig.job("g2")
    assert job.state is JobState.QUEUED
    [attempt] = rig.store.attempts("g2")
    assert attempt.outcome == "interrupted" and "shut down" in attempt.reason
    assert rig.store.lease_of("g2") is None  # offered again at once


def test_a_client_cancel_stops_the_job_here_and_its_end_is_reported(rig: Rig) -> None:
    rig.store.submit([gpu_job("g3", 20)], now=time.time())
    rig.until("g3 running", lambda: rig.job("g3").state is JobState.RUNNING)
    rig.store.request_cancel("g3", now=time.time())
    rig.agent._last_beat = -1e9  # the next sync heartbeats
    rig.until("g3 cancelled", lambda: rig.job("g3").state is JobState.CANCELLED)
    [attempt] = rig.store.attempts("g3")
    assert attempt.outcome == "cancelled" and attempt.node == "a"


def test_a_stop_on_the_coordinator_reaches_the_agent_and_the_job_ends_done(
    rig: Rig,
) -> None:
    """Issue 31: `gpuwarden stop` on a coordinator never reached the agent (the
    heartbeat carried only cancels); the service kept serving."""
    rig.store.submit([gpu_job("g4", 60)], now=time.time())
    rig.until("g4 running", lambda: rig.job("g4").state is JobState.RUNNING)
    rig.store.request_stop("g4", by="alice", now=time.time())
    rig.agent._last_beat = -1e9  # the next sync heartbeats
    rig.until("g4 stopped here", lambda: rig.node.store.get_job("g4").stop_requested_by)
    local = rig.node.store.get_job("g4")
    assert local is not None and local.stop_requested_by == "alice"
    rig.until("g4 ended there", lambda: rig.job("g4").state.terminal, timeout=60)
    [attempt] = rig.store.attempts("g4")
    assert rig.job("g4").state is JobState.DONE, attempt.reason
    assert attempt.node == "a" and "alice" in attempt.reason
    assert not rig.job("g4").cancel_requested


def test_a_revoked_agent_is_told_so(rig: Rig) -> None:
    rig.step()
    co.revoke(rig.store, None, "a", now=time.time())
    rig.agent._last_beat = -1e9
    with pytest.raises(CredentialRefused, match="revoked"):
        rig.agent.sync()


# -- the enrolment token: never from the command line ------------------------------

TOKEN = "gw_0123456789ab_" + "s" * 43


def _token(
    *,
    enroll: str | None = None,
    enroll_file: Path | None = None,
    environ: dict[str, str] | None = None,
    stdin: str = "",
) -> str | None:
    return enrolment_token(
        enroll=enroll,
        enroll_file=enroll_file,
        environ=environ if environ is not None else {},
        stdin=io.StringIO(stdin),
    )


def test_a_token_on_the_command_line_is_refused_saying_what_to_use() -> None:
    env = {ENROLL_ENV: "gw_other_x"}
    with pytest.raises(UserError) as info:
        _token(enroll=TOKEN, environ=env)
    message = info.value.message
    assert "s" * 43 not in message  # the secret is never echoed
    for way in ("--enroll-file FILE", "--enroll -", ENROLL_ENV, "/proc/PID/cmdline"):
        assert way in message, way
    assert "gpuwarden token revoke 0123456789ab" in message
    assert ENROLL_ENV not in env  # removed first, whatever happens next


def test_the_token_comes_from_a_file_standard_input_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "enroll"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert _token(enroll_file=f) == TOKEN
    assert _token(enroll="-", stdin=TOKEN + "\n") == TOKEN
    env = {ENROLL_ENV: TOKEN, "OTHER": "kept"}
    assert _token(environ=env) == TOKEN
    assert env == {"OTHER": "kept"}  # nothing this process starts inherits it
    assert _token() is None


@pytest.mark.parametrize(
    ("mode", "content", "says"),
    [
        (0o644, TOKEN, "can be read by others (mode 644): run `chmod 600"),
        (0o640, TOKEN, "can be read by others (mode 640)"),
        (0o600, "", "is empty"),
        (0o600, f"{TOKEN} {TOKEN}", "more than one word"),
        (0o600, "x" * 5000, "more than 4096 bytes"),
    ],
)
def test_a_token_file_is_refused_unless_only_its_owner_reads_one_token(
    tmp_path: Path, mode: int, content: str, says: str
) -> None:
    f = tmp_path / "enroll"
    f.write_text(content)
    f.chmod(mode)
    assert stat.S_IMODE(f.stat().st_mode) == mode
    with pytest.raises(UserError, match=re.escape(says)):
        _token(enroll_file=f)


def test_a_token_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    f = tmp_path / "enroll"
    os.mkfifo(f, 0o600)
    assert stat.S_ISFIFO(f.stat().st_mode)
    with pytest.raises(UserError, match="is a fifo, not a file"):
        _token(enroll_file=f)


def test_a_token_given_two_ways_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "enroll"
    f.write_text(TOKEN)
    f.chmod(0o600)
    with pytest.raises(UserError, match=r"given 2 ways \(--enroll-file, GPUWARDEN_ENROLL_TOKEN\)"):
        _token(enroll_file=f, environ={ENROLL_ENV: TOKEN})


# -- a job's hostile output folder ------------------------------------------------------

HOSTILE = """\
[module]
name = "hostile"
description = "A job that leaves links, a FIFO and a device among its outputs."

[types.outputs]
lane = "cpu"
launch = "host"
command = ["{python}", "src/outputs.py"]
timeout_s = 30
max_retries = 0

[types.outputs.params.secret]
type = "string"
required = true
"""

HOSTILE_SRC = """\
import json, os, stat
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
(out / "ok.txt").write_text("fine")
(out / "link.txt").symlink_to(params["secret"])
(out / "d").symlink_to(os.path.dirname(params["secret"]))
os.mkfifo(out / "fifo")
os.mknod(out / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
"""


def test_links_fifos_and_devices_among_a_jobs_outputs_never_go_up(tmp_path: Path) -> None:
    mod = tmp_path / "mods" / "hostile"
    (mod / "src").mkdir(parents=True)
    (mod / "module.toml").write_text(HOSTILE)
    (mod / "src" / "outputs.py").write_text(HOSTILE_SRC)
    secret = tmp_path / "secret" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("never on the coordinator")
    rigs = make_rig(tmp_path / "rig", modules=[*MODULES, tmp_path / "mods"])
    rig = next(rigs)
    try:
        registry = Registry.load([*MODULES, tmp_path / "mods"])
        spec = JobSpec(id="h1", type="hostile.outputs", params={"secret": str(secret)})
        rig.store.submit([prepare(registry, spec)], now=time.time())
        rig.until("h1 ended", lambda: rig.job("h1").state.terminal)
        job = rig.job("h1")
        assert job.state is JobState.DONE, job.reason
        # the attack was in place in the agent's own copy
        mine = Path(job.result["node_output_dir"])
        assert (mine / "link.txt").is_symlink() and (mine / "d").is_symlink()
        assert stat.S_ISFIFO((mine / "fifo").lstat().st_mode)
        assert stat.S_ISCHR((mine / "null").lstat().st_mode)
        # what went up: the regular file only, and nothing of the secret anywhere
        here = Path(job.result["output_dir"])
        assert sorted(p.name for p in here.iterdir()) == ["ok.txt"]
        assert (here / "ok.txt").read_text() == "fine"
        coord = tmp_path / "rig" / "coord"
        for p in coord.rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert b"never on the coordinator" not in p.read_bytes(), p
        # the result says what did not go up, and why: the broker's listing refuses
        # what is not a regular file (never offered for upload), and the agent
        # names anything that changed before it went up
        refused = {
            e["path"]: f"{e.get('kind', '')} {e['why']}"
            for e in [*job.result.get("refused", []), *job.result.get("outputs_not_uploaded", [])]
        }
        assert "link.txt" in refused and "symlink" in refused["link.txt"], job.result
        assert {"d", "fifo", "null"} <= set(refused), job.result
        # the agent is up: the next job runs and its output goes up
        nxt = prepare(registry, JobSpec(id="e9", type="echo.echo", params={"text": "next"}))
        rig.store.submit([nxt], now=time.time())
        rig.until("e9 done", lambda: rig.job("e9").state is JobState.DONE)
        assert (Path(rig.job("e9").result["output_dir"]) / "echo.txt").read_text() == "next"
    finally:
        rigs.close()


def test_the_coordinator_client_refuses_to_read_a_link_or_a_fifo(rig: Rig, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("secret")
    (out / "link").symlink_to(tmp_path / "secret.txt")
    (out / "sub" / "via").symlink_to(tmp_path)
    os.mkfifo(out / "fifo")
    assert (out / "link").is_symlink() and stat.S_ISFIFO((out / "fifo").lstat().st_mode)
    for rel in ("link", "fifo", "sub/via/secret.txt"):
        with pytest.raises(safefs.UnsafePathError):  # before anything is sent
            rig.agent.coordinator.upload("nope", "lease", rel, out)
    assert not [a for a in rig.store.audit_rows() if a.action == "node.upload"]


def test_the_cli_names_the_same_variable() -> None:
    from gpuwarden.cli import cluster as cluster_cli

    assert cluster_cli.ENROLL_ENV == ENROLL_ENV == "GPUWARDEN_ENROLL_TOKEN"
