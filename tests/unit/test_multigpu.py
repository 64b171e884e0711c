"""Jobs on several GPUs (``gpus = N``): the planner's rule, the ledger's holdings
per GPU, and the checks at submission. Pure parts first, then a property over
random nodes and queues: a multi-GPU job never starts on fewer GPUs than it asked
for, never on a GPU twice, and never where one of its GPUs lacks its footprint."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.cli.node import preemption_cell, vram_cell
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.ledger import Holding, parts_of
from gpuwarden.core.model import GIB, Attempt, JobSpec, Lane, check_gpus, gpu_list
from gpuwarden.core.policy import (
    GpuView,
    QueuedJob,
    Refuse,
    Snapshot,
    Start,
    Wait,
    never_fits,
    plan,
)
from gpuwarden.errors import ValidationError
from gpuwarden.gpu.base import GpuReading, ProcessUsage
from gpuwarden.intake.jobs import prepare
from gpuwarden.node.settings import VramSettings
from gpuwarden.node.vram import VramBook
from gpuwarden.registry import Registry, parse_module
from tests.unit.test_registry import head, make_module, module_error

NOW = 1_000_000.0


def job(job_id: str, gib: float, gpus: int = 1, *, seq: int = 0, priority: int = 0) -> QueuedJob:
    return QueuedJob(job_id, "train.big", Lane.VRAM, int(gib * GIB), priority, seq, gpus=gpus)


def held(job_id: str, gib: float, *, since: float = 0.0) -> Holding:
    return Holding(f"{job_id}/1", "x.y", int(gib * GIB), job_id=job_id, since=since)


def gpu(uuid: str, total_gib: float = 24, *holdings: Holding, degraded: str = "") -> GpuView:
    return GpuView(uuid, int(total_gib * GIB), holdings=tuple(holdings), degraded=degraded)


def decide(*jobs: QueuedJob, gpus: Sequence[GpuView], held_back: tuple[tuple[str, str], ...] = ()):
    out = plan(Snapshot(tuple(jobs), tuple(gpus), held_back=held_back), NOW)
    return {d.job_id: d for d in out}


# -- the rule ------------------------------------------------------------------------


def test_a_two_gpu_job_starts_on_two_gpus_at_once() -> None:
    d = decide(job("tp", 16, 2), gpus=[gpu("G0"), gpu("G1"), gpu("G2", 24, held("x", 4))])
    start = d["tp"]
    assert isinstance(start, Start)
    assert gpu_list(start.gpu_uuid) == ("G0", "G1")  # the empty ones; never G2 (not empty)


def test_it_never_starts_on_fewer_gpus_than_it_asked_for() -> None:
    # one GPU is free, the other is held: it waits, and takes neither
    d = decide(job("tp", 16, 2), gpus=[gpu("G0"), gpu("G1", 24, held("x", 12))])
    wait = d["tp"]
    assert isinstance(wait, Wait)
    assert "needs 16.0 GiB on each of 2 GPUs at once, and 1 can take it now" in wait.reason
    assert "G0 could take it" in wait.reason and "G1 is not empty" in wait.reason


def test_its_gpus_are_held_back_for_it_all_of_them() -> None:
    gpus = [gpu("G0", 24, held("a", 12)), gpu("G1", 24, held("b", 12)), gpu("G2")]
    d = decide(job("tp", 16, 2, seq=0), job("one", 8, seq=1), gpus=gpus)
    wait = d["tp"]
    assert isinstance(wait, Wait) and wait.reserved_gpu is not None
    reserved = set(gpu_list(wait.reserved_gpu))
    assert len(reserved) == 2 and reserved < {"G0", "G1", "G2"}
    assert "G2" in reserved  # the empty GPU fits it soonest
    # a later single-GPU job does not take a GPU held back for it
    one = d["one"]
    assert isinstance(one, Wait), one
    assert "held back for job tp" in one.reason


def test_a_later_job_starts_on_a_gpu_not_held_back_for_it() -> None:
    gpus = [gpu("G0", 12), gpu("G1", 24, held("b", 12)), gpu("G2")]  # G0: too small for tp
    d = decide(job("tp", 16, 2, seq=0), job("one", 8, seq=1), gpus=gpus)
    wait = d["tp"]
    assert isinstance(wait, Wait) and wait.reserved_gpu == "G1,G2"
    assert "G1, G2 are held back for it until it fits on all 2" in wait.reason
    assert d["one"] == Start("one", "G0")


def test_it_keeps_the_gpus_held_back_for_it_in_the_previous_pass() -> None:
    # G0 and G1 both fit it as soon as their one job ends; G1 was held last time
    gpus = [gpu("G0", 24, held("a", 12, since=9)), gpu("G1", 24, held("b", 12, since=5)), gpu("G2")]
    fresh = decide(job("tp", 16, 2), gpus=gpus)["tp"]
    assert isinstance(fresh, Wait) and fresh.reserved_gpu == "G0,G2"  # G0's job is younger
    kept = decide(job("tp", 16, 2), gpus=gpus, held_back=(("tp", "G1,G2"),))["tp"]
    assert isinstance(kept, Wait) and kept.reserved_gpu == "G1,G2"


def test_it_is_refused_where_the_node_has_too_few_gpus_big_enough() -> None:
    d = decide(job("tp", 20, 3), gpus=[gpu("G0"), gpu("G1"), gpu("G2", 16)])
    refused = d["tp"]
    assert isinstance(refused, Refuse)
    assert "needs 3 GPUs at once with 20.0 GiB on each" in refused.reason
    assert "2 of them that big" in refused.reason
    assert never_fits(20 * GIB, [gpu("G0"), gpu("G1")], 2) is None
    assert "each of 2 GPUs" in (never_fits(30 * GIB, [gpu("G0"), gpu("G1")], 2) or "")


def test_a_degraded_gpu_is_not_one_of_its_gpus() -> None:
    d = decide(job("tp", 8, 2), gpus=[gpu("G0"), gpu("G1", degraded="xid 79"), gpu("G2")])
    start = d["tp"]
    assert isinstance(start, Start) and gpu_list(start.gpu_uuid) == ("G0", "G2")


def test_starts_in_one_pass_count_on_each_of_its_gpus() -> None:
    # two 2-GPU jobs on 3 GPUs: the second must wait (only one GPU is left)
    d = decide(job("a", 8, 2, seq=0), job("b", 8, 2, seq=1), gpus=[gpu("G0"), gpu("G1"), gpu("G2")])
    assert isinstance(d["a"], Start) and isinstance(d["b"], Wait)


# -- values and the ledger's names ---------------------------------------------------------


def test_gpu_list_and_parts() -> None:
    assert gpu_list(None) == () and gpu_list("G0") == ("G0",)
    assert gpu_list("G0,G1") == ("G0", "G1")
    assert parts_of("j/1", 1) == ("j/1",)
    assert parts_of("j/1", 3) == ("j/1", "j/1+1", "j/1+2")
    a = Attempt("j", 1, "n", "G0,G1", 0.0)
    assert a.gpus == ("G0", "G1")


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, True, "2", None])
def test_check_gpus_refuses_what_is_not_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match="gpus must be"):
        check_gpus(bad)


TYPES = """
[types.srv]
lane = "vram"
runtime = "ollama"
model = "llama3:8b"
command = ["x"]
vram_gib = 1

[types.cpu]
lane = "cpu"
command = ["x"]

[types.job]
lane = "vram"
launch = "container"
command = ["x"]
vram_gib = 1
"""


def test_a_type_declares_gpus_in_module_toml(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + TYPES + "gpus = 4\n")
    types = {t.name: t for t in parse_module(path).types}
    assert types["mine.job"].gpus == 4 and types["mine.srv"].gpus == 1


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('[types.a]\nlane = "cpu"\ncommand = ["x"]\ngpus = 2\n', 'use lane = "vram"'),
        (
            '[types.a]\nlane = "vram"\nlaunch = "serve"\nvram_gib = 1\ncommand = ["x"]\ngpus = 2\n',
            "a warm server or a runtime type holds one GPU",
        ),
        ('[types.a]\nlane = "vram"\nvram_gib = 1\ncommand = ["x"]\ngpus = 0\n', "types.a.gpus"),
        ('[types.a]\nlane = "vram"\nvram_gib = 1\ncommand = ["x"]\ngpus = 65\n', "types.a.gpus"),
    ],
)
def test_a_wrong_gpus_key_is_refused_naming_it(tmp_path: Path, body: str, said: str) -> None:
    assert said in module_error(make_module(tmp_path, "mine", head() + body))


def test_a_job_asks_for_gpus_only_where_its_type_may_span_them(tmp_path: Path) -> None:
    make_module(tmp_path, "mine", head() + TYPES)
    reg = Registry.load(
        [tmp_path], LaunchRules(allow_unsandboxed_containers=True), installed=False, builtin=False
    )
    with pytest.raises(ValidationError, match="holds one GPU"):
        prepare(reg, JobSpec(id="a", type="mine.srv", gpus=2))
    with pytest.raises(ValidationError, match="cpu lane"):
        prepare(reg, JobSpec(id="b", type="mine.cpu", gpus=2))
    with pytest.raises(ValidationError, match="gpus must be from 1"):
        prepare(reg, JobSpec(id="c", type="mine.job", gpus=0))
    assert prepare(reg, JobSpec(id="d", type="mine.job", gpus=4)).gpus == 4
    assert prepare(reg, JobSpec(id="e", type="mine.srv", gpus=1)).gpus == 1


# -- the property --------------------------------------------------------------------------


@st.composite
def node_and_queue(draw: st.DrawFn) -> tuple[list[GpuView], list[QueuedJob]]:
    n = draw(st.integers(1, 6))
    gpus = []
    for i in range(n):
        total = draw(st.sampled_from([16, 24, 48]))
        holdings = tuple(
            held(f"h{i}-{k}", draw(st.sampled_from([2, 6, 12])), since=float(k))
            for k in range(draw(st.integers(0, 2)))
        )
        gpus.append(gpu(f"G{i}", total, *holdings, degraded=draw(st.sampled_from(["", "", "x"]))))
    jobs = [
        job(
            f"j{k}",
            draw(st.sampled_from([2, 8, 16, 30])),
            draw(st.integers(1, 4)),
            seq=k,
            priority=draw(st.integers(0, 2)),
        )
        for k in range(draw(st.integers(1, 8)))
    ]
    return gpus, jobs


@settings(max_examples=300, deadline=None)
@given(node_and_queue())
def test_a_multi_gpu_job_never_starts_on_fewer_gpus_nor_where_one_lacks_room(
    case: tuple[list[GpuView], list[QueuedJob]],
) -> None:
    gpus, jobs = case
    by_uuid = {g.uuid: g for g in gpus}
    free = {g.uuid: g.free_bytes for g in gpus}
    empty = {g.uuid: not g.holdings for g in gpus}
    asked = {j.id: j for j in jobs}
    for d in plan(Snapshot(tuple(jobs), tuple(gpus)), NOW):
        if not isinstance(d, Start):
            continue
        mine = gpu_list(d.gpu_uuid)
        j = asked[d.job_id]
        assert len(mine) == j.gpus, (d, j)  # exactly as many as it asked for
        assert len(set(mine)) == len(mine)  # never one GPU twice
        for u in mine:
            assert not by_uuid[u].degraded
            assert empty[u], "an exclusive job started beside another holder"
            assert free[u] >= j.vram_bytes  # its footprint fits on each of them
            free[u] -= j.vram_bytes
            empty[u] = False


def test_a_started_multi_gpu_job_is_one_start_in_a_plan() -> None:
    out = plan(Snapshot((job("tp", 4, 2),), (gpu("G0"), gpu("G1"))), NOW)
    assert [dataclasses.astuple(d) for d in out] == [("tp", "G0,G1", None, False)]


# -- the VRAM book ---------------------------------------------------------------------

SETTINGS = VramSettings(
    reserve_bytes=0, reclaim_timeout_s=30, tolerance_bytes=64 << 20, step_bytes=256 << 20
)
PID = 4343  # not a live process of this test: its tree is itself


def readings(used: dict[str, float]) -> list[GpuReading]:
    return [
        GpuReading(
            uuid,
            "sim",
            24 * GIB,
            int(gib * GIB),
            (ProcessUsage(PID, int(gib * GIB)),) if gib else (),
        )
        for uuid, gib in used.items()
    ]


def test_a_multi_gpu_attempt_holds_measures_and_is_reclaimed_on_each_gpu() -> None:
    book = VramBook(SETTINGS)
    book.observe(readings({"G0": 0, "G1": 0, "G2": 0}), 0.0)
    book.start(
        "tp/1", "G0,G2", type_name="t.p", job_id="tp", nbytes=8 * GIB, coresident=False, now=0.0
    )
    book.set_pid("tp/1", PID)
    held = {v.uuid: [h.holder for h in v.holdings] for v in book.views()}
    assert held == {"G0": ["tp/1"], "G1": [], "G2": ["tp/1+1"]}
    assert book.held_bytes("tp/1") == 16 * GIB

    # it uses 9 GiB on G0 and 10 on G2: each holding grows to what its GPU shows
    book.observe(readings({"G0": 9, "G1": 0, "G2": 10}), 1.0)
    assert book.held_bytes("tp/1") == 19 * GIB
    assert book.peak("tp/1") == 10 * GIB  # the most on one GPU: the per-GPU footprint
    assert book.alone("tp/1")

    m = book.end("tp/1", 2.0)
    assert m is not None and (m.peak_bytes, m.alone) == (10 * GIB, True)
    states = {h.holder: h.state.value for v in book.views() for h in v.holdings}
    assert states == {"tp/1": "reclaiming", "tp/1+1": "reclaiming"}
    # G0's memory shows free first: only its holding goes
    book.observe(readings({"G0": 0, "G1": 0, "G2": 10}), 3.0)
    assert [h.holder for v in book.views() for h in v.holdings] == ["tp/1+1"]
    book.observe(readings({"G0": 0, "G1": 0, "G2": 0}), 4.0)
    assert len(book.ledger) == 0


def test_a_multi_gpu_attempt_that_never_ran_holds_nothing_after_its_end() -> None:
    book = VramBook(SETTINGS)
    book.observe(readings({"G0": 0, "G1": 0}), 0.0)
    book.start(
        "tp/1", "G0,G1", type_name="t.p", job_id="tp", nbytes=8 * GIB, coresident=False, now=0.0
    )
    book.end("tp/1", 1.0)  # no process ever started
    assert len(book.ledger) == 0 and book.parts("tp/1") == ("tp/1",)


# -- `types` -----------------------------------------------------------------------------

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def test_types_show_gpus_and_the_preemption_keys() -> None:
    registry = Registry.load([TEST_MODULES], installed=False, builtin=False)
    rows = {d["type"]: d for d in registry.describe()}
    assert rows["testmods.pair"]["gpus"] == 2 and rows["testmods.pair"]["preemption"] is None
    assert rows["trainmods.train"]["preemptible"] is True
    keys = rows["trainmods.train"]["preemption"]
    assert keys == {"checkpoint_signal": "SIGUSR1", "checkpoint_grace_s": 20.0, "min_run_s": 0.0}
    assert rows["testmods.gpu"]["gpus"] == 1 and rows["testmods.gpu"]["preemptible"] is False
    # the table's cells
    assert vram_cell(8 * GIB, 2) == "8.0 GiB on each of 2 GPUs"
    assert vram_cell(8 * GIB, 1) == "8.0 GiB" and vram_cell(0, 1) == "-"
    assert preemption_cell(keys) == "\npreemptible (SIGUSR1, grace 20 s, min run 0 s)"
    assert preemption_cell(None) == ""
