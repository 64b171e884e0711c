"""``gpuwarden top``'s frame, rendered from a made-up snapshot at 80 and 160 columns."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from gpuwarden.cli.top import Reasons, guarded
from gpuwarden.cli.topview import JobRow, NodeSnapshot, TopSnapshot, cells, pack, render
from gpuwarden.client import RateLimited, Unauthorized, Unreachable
from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB
from gpuwarden.core.policy import GpuView, WarmView
from gpuwarden.errors import UserError
from gpuwarden.node.status import BrokerStatus, GpuStatus, RunningStatus, WarmStatus

NOW = 1_800_000_000.0
GPU_A = "GPU-sim-0000-aaaaaaaa"
GPU_B = "GPU-sim-0001-bbbbbbbb"
FAULT = (
    "hardware fault: Xid 79: check `nvidia-smi -q` and the kernel log (dmesg) on this host; "
    f"once fixed, `gpuwarden gpu clear {GPU_B}` (or a broker restart) resumes it"
)
WAIT = (
    f"needs 14.0 GiB on one GPU; {GPU_A} is not empty (testmods.gpu (train-7), running) and "
    f"burn.llm needs a GPU to itself. {GPU_A} is held back for it until it fits"
)


def _status() -> BrokerStatus:
    a = GpuView(
        uuid=GPU_A,
        name="gpuwarden simulated GPU",
        total_bytes=24 * GIB,
        reserve_bytes=GIB // 2,
        foreign_bytes=2 * GIB,
        holdings=(
            Holding(
                "train-7/1",
                "testmods.gpu",
                8 * GIB,
                job_id="train-7",
                since=NOW - 90,
                expected_end=NOW + 30,
            ),
            Holding(
                "warm:testmods.warm:1",
                "testmods.warm",
                6 * GIB,
                state=HoldState.WARM,
                since=NOW - 600,
            ),
        ),
        runtimes=(("ollama", 3 * GIB),),
    )
    b = GpuView(uuid=GPU_B, name="NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, degraded=FAULT)
    return BrokerStatus(
        probe="sim",
        gpus=(
            GpuStatus(GPU_A, a.name, a.total_bytes, used_bytes=19 * GIB, view=a),
            GpuStatus(GPU_B, b.name, b.total_bytes, used_bytes=GIB, view=b),
        ),
        degraded={GPU_B: FAULT},
        running=(
            RunningStatus("train-7", "testmods.gpu", 1, GPU_A, NOW - 90),
            RunningStatus("cpu-job-3", "testmods.hold", 2, None, NOW - 5),
        ),
        warm=(WarmStatus("testmods.warm", GPU_A, 1, "idle", 6 * GIB, 3, 0.3, 60.0, 4242, False),),
        warm_views=(
            WarmView(
                "testmods.warm",
                GPU_A,
                "warm:testmods.warm:1",
                busy=False,
                idle_since=NOW - 60,
                idle_grace_s=300,
            ),
        ),
        waiting={"llm-1": WAIT},
    )


def _snapshot(**kw: Any) -> TopSnapshot:
    base: dict[str, Any] = {
        "where": "/var/lib/gpuwarden",
        "now": NOW,
        "nodes": (NodeSnapshot("vm", 7041, NOW - 0.4, _status()),),
        "counts": {"queued": 2, "running": 2, "failed": 1, "done": 40},
        "queued": (
            JobRow("llm-1", "burn.llm", NOW - 725, NOW - 725),
            JobRow("late-2", "echo.echo", NOW - 1, NOW - 1),
        ),
        "failures": (
            JobRow(
                "oom-9",
                "testmods.gpu",
                NOW - 900,
                NOW - 120,
                "CUDA out of memory with the GPU to itself: the footprint is raised",
            ),
        ),
    }
    base.update(kw)
    return TopSnapshot(**base)


def _text(snap: TopSnapshot, width: int) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"), color_system=None)  # noqa: SIM115
    console.print(render(snap, width, footer="q quits"))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 160])
def test_a_frame_shows_everything_and_fits_the_width(width: int) -> None:
    text = _text(_snapshot(), width)
    lines = text.splitlines()
    assert all(len(ln) <= width for ln in lines), max(lines, key=len)
    flat = " ".join(" ".join(lines).split())  # cells wrap at 80: join the words again
    # the node, each GPU with its bars, holdings by job and warm server, in GiB
    assert "node vm" in text and "PID 7041" in text
    ledger = [ln for ln in lines if ln.startswith("ledger [")]
    device = [ln for ln in lines if ln.startswith("device [")]
    assert len(ledger) == 2 and len(device) == 2
    assert all("]" in ln for ln in ledger + device), "a bar is cut or wrapped"
    assert "14.0/24.0 GiB held" in ledger[0] and "19.0 GiB used" in device[0]
    assert "1 train-7 testmods.gpu 8.0" in text and "2 warm testmods.warm 6.0 (warm)" in text
    assert "runtime ollama 3.0" in text and "others 2.0" in text and "reserve 0.5" in text
    # the fault is a banner with its whole reason, and the GPU says so
    assert f"FAULT {GPU_B} on vm: {FAULT}" in flat
    assert "NVIDIA H100 80GB HBM3  80.0 GiB  FAULT" in text
    # running jobs: elapsed against expected; queued ones: waited and why, whole
    assert "train-7" in text and "1m30s / ~2m00s (75 %)" in flat
    assert "cpu-job-3" in text and "5s / -" in flat
    assert "llm-1" in text and "12m05s" in text and WAIT in flat
    assert "not planned yet: the broker's next status says why it waits" in flat
    # warm servers with their grace; the recent failure with its reason
    assert "4m00s" in text
    assert "oom-9" in text and "CUDA out of memory with the GPU to itself" in flat
    assert "jobs: done 40, failed 1, queued 2, running 2" in flat


@pytest.mark.parametrize("width", [40, 60, 100, 240])
def test_any_width_gets_whole_bars_and_no_longer_lines(width: int) -> None:
    lines = _text(_snapshot(), width).splitlines()
    assert all(len(ln) <= width for ln in lines), max(lines, key=len)
    bars = [ln for ln in lines if ln.startswith(("ledger [", "device ["))]
    assert len(bars) == 4 and all("]" in ln for ln in bars)


def test_a_job_without_a_holding_is_timed_against_its_types_estimate() -> None:
    flat = " ".join(_text(_snapshot(expected_s={"testmods.hold": 4.0}), 80).split())
    assert "cpu-job-3 testmods.hold 5s / ~4s (over by 1s)" in flat
    assert "1m30s / ~2m00s (75 %)" in flat  # the holding's own expected end comes first


def test_a_reason_explain_gave_stands_for_one_the_broker_did_not_publish() -> None:
    said = "it waits: needs 8.0 GiB on one GPU; none has room"
    flat = " ".join(_text(_snapshot(reasons={"late-2": said}), 80).split())
    assert f"late-2 echo.echo 1s {said}" in flat
    assert _snapshot().unexplained() == ["late-2"]  # llm-1's reason was published


def test_explain_is_asked_once_per_job_a_while_and_a_failure_gives_no_reason() -> None:
    asked: list[str] = []

    def ask(job_id: str) -> list[str]:
        asked.append(job_id)
        if job_id == "gone":
            raise UserError("no job with id 'gone'")
        return [f"{job_id} (t) is queued", "footprint 1.0 GiB; x", "it waits: for a node"]

    reasons = Reasons(ask)
    assert reasons.of(["a", "gone"]) == {"a": "it waits: for a node"}
    assert reasons.of(["a", "gone"]) == {"a": "it waits: for a node"}
    assert asked == ["a", "gone"]


def test_an_api_that_does_not_answer_is_a_banner_and_a_refusal_ends_top() -> None:
    def failing(exc: Exception) -> TopSnapshot:
        raise exc

    down = guarded(lambda: failing(Unreachable("cannot reach http://h:1: refused")))
    assert "cannot read the status: cannot reach http://h:1" in _text(down, 80)
    assert guarded(lambda: failing(RateLimited("slow down"))).error == "slow down"
    with pytest.raises(Unauthorized):
        guarded(lambda: failing(Unauthorized("the token was revoked", 401)))


def test_no_broker_running_is_said_and_queued_jobs_say_nothing_starts_them() -> None:
    old = NodeSnapshot("vm", 7041, NOW - 600, _status())
    flat = " ".join(_text(_snapshot(nodes=(old,)), 80).split())
    assert "no broker is running on /var/lib/gpuwarden (last status 10m00s ago)" in flat
    assert "no broker is running here, so nothing will start it: run `gpuwarden serve`" in flat
    assert "node vm" not in flat and "FAULT" not in flat  # an old status is not shown as live
    fresh = " ".join(_text(TopSnapshot(where="/s", now=NOW, no_state=True), 80).split())
    assert "no broker has run on /s yet: start `gpuwarden serve`" in fresh


def test_a_cluster_shows_each_node_with_its_gpus_and_heartbeat_age() -> None:
    node = {
        "node": "gpu-2",
        "state": "active",
        "problem": "",
        "heard_s_ago": 3.2,
        "gpus": [
            {
                "uuid": GPU_A,
                "name": "sim",
                "total_bytes": 24 * GIB,
                "used_bytes": 9 * GIB,
                "ledger_bytes": 8 * GIB,
                "free_bytes": 11 * GIB,
                "waiting_bytes": 4 * GIB,  # a job leased here, not started yet
                "degraded": "",
            }
        ],
        "warm": [{"type": "testmods.warm", "gpu": GPU_A, "state": "idle"}],
        "running": [{"job": "c-1", "type": "testmods.gpu", "started_at": NOW - 61}],
        "leased": 1,
    }
    off = {
        "node": "gpu-3",
        "state": "offline",
        "problem": "offline: not heard from for 300 s",
        "heard_s_ago": 300.0,
        "gpus": [],
        "running": [],
    }
    text = _text(_snapshot(nodes=(), cluster=(node, off)), 80)
    flat = " ".join(text.split())
    assert all(len(ln) <= 80 for ln in text.splitlines())
    assert "node gpu-2 active heartbeat 3.2 s ago 1 running, 1 leased here and waiting" in flat
    assert "8.0/24.0 GiB held" in flat and "9.0 GiB used" in flat
    assert "running c-1 testmods.gpu for 1m01s" in flat
    assert "node gpu-3: offline: not heard from for 300 s" in flat
    assert "no broker is running" not in flat
    assert "waits for an enrolled node to take it" in flat
    # issue 31: the leased job's room is its own, not others'; jobs run, not "none"
    assert "leased, starting 4.0" in flat and "others+reserve 1.0" in flat
    assert "running: none" not in flat
    wide = " ".join(_text(_snapshot(nodes=(), cluster=(node, off)), 160).split())
    assert "c-1 testmods.gpu gpu-2 cpu 1m01s" in wide


def test_text_from_the_store_cannot_drive_the_terminal() -> None:
    evil = JobRow("x\x1b[2Jy", "t", NOW, NOW, "bad\x1b]0;owned\x07")
    text = _text(_snapshot(failures=(evil,)), 160)
    assert "\x1b" not in text and "x\\x1b[2Jy" in text


def test_cells_are_proportional_and_never_more_than_the_bar() -> None:
    assert cells([12, 12], 24, 10) == [5, 5]
    assert sum(cells([1, 1, 1, 100], 100, 10)) <= 10
    assert all(c >= 1 for c in cells([1, 1, 1, 50], 100, 10))  # each part shows
    assert sum(cells([80, 80], 100, 20)) == 20  # more than the total: scaled down
    assert pack([], 80) == []


def test_leases_are_shown_beside_the_jobs() -> None:
    lease = {
        "id": "lease-1b8e9fd3",
        "holder": "user:alice",
        "gpu": GPU_B,
        "vram_bytes": 12 * GIB,
        "state": "running",
        "until": NOW + 1800,
    }
    queued = {"id": "lease-2", "owner": None, "vram_bytes": 4 * GIB, "state": "queued"}
    text = _text(_snapshot(leases=(lease, queued)), 160)
    row = next(ln for ln in text.splitlines() if "lease-1b8e9fd3" in ln)
    assert "user:alice" in row and GPU_B in row and "12.0" in row and "30m00s left" in row
    waiting = next(ln for ln in text.splitlines() if "lease-2" in ln)
    assert "local" in waiting and "queued" in waiting and "4.0" in waiting
    assert "holder" in text and "holder" not in _text(_snapshot(), 160)  # no leases: no table


def test_a_submitters_view_names_no_other_job_and_never_says_none() -> None:
    """Issue 31: over --url as a submitter the running job's id showed `None`. The
    API hides another token's ids (null, a holder of `another job/1`)."""
    doc = _status().to_json()
    doc["running"][0]["job"] = None  # as GET /v1/status redacts it for a submitter
    holding = doc["gpus"][0]["holdings"][0]
    holding["job_id"], holding["holder"] = None, "another job/1"
    hidden = BrokerStatus.from_json(doc)
    assert hidden.running[0].job == ""
    text = _text(_snapshot(nodes=(NodeSnapshot("vm", 7041, NOW - 0.4, hidden),)), 160)
    assert "None" not in text
    assert "1 another job 8.0" in text  # its holding: not taken for a warm server
    [row] = [ln for ln in text.splitlines() if ln.startswith("another job  testmods.gpu")]
    assert "1m30s" in row  # the running row: timed, its id not shown
