"""Placement across hosts (core/placement.py): fit, constraints, warm affinity."""

from __future__ import annotations

from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.core.model import GIB, Lane, LaunchMode
from gpuwarden.core.placement import (
    Constraints,
    GpuRoom,
    NodeView,
    Offerable,
    never_placeable,
    offers_for,
    refusal,
    type_refusal,
)


def gpu(uuid: str, gib: float, free: float | None = None, name: str = "NVIDIA L4") -> GpuRoom:
    total = int(gib * GIB)
    room = total if free is None else int(free * GIB)
    return GpuRoom(uuid=uuid, name=name, total_bytes=total, free_bytes=room, usable_bytes=total)


def job(i: int, gib: float = 0, type_: str = "m.t", **kw: object) -> Offerable:
    lane = Lane.VRAM if gib else Lane.CPU
    fields: dict[str, object] = {
        "id": f"j{i}",
        "type": type_,
        "lane": lane,
        "vram_bytes": int(gib * GIB),
        "priority": 0,
        "seq": i,
        "submitted_at": 100.0,
    }
    fields.update(kw)
    return Offerable(**fields)  # type: ignore[arg-type]


SMALL = NodeView("small", gpus=(gpu("s0", 8),), max_jobs=4)
BIG = NodeView("big", gpus=(gpu("b0", 80),), max_jobs=4)


def test_a_node_is_offered_only_jobs_that_fit_one_of_its_gpus() -> None:
    queued = [job(1, 6), job(2, 20), job(3, 0)]
    assert offers_for(SMALL, queued, [BIG], now=100) == ["j1", "j3"]
    assert offers_for(BIG, queued, [SMALL], now=100) == ["j1", "j2", "j3"]


def test_offers_count_against_the_room_they_take_and_the_free_slots() -> None:
    node = NodeView("n", gpus=(gpu("g", 24),), max_jobs=2)
    assert offers_for(node, [job(1, 16), job(2, 16), job(3, 4)], [], now=100) == ["j1", "j3"]
    busy = NodeView("n", gpus=(gpu("g", 24),), max_jobs=2, busy=2)
    assert offers_for(busy, [job(1, 1)], [], now=100) == []


def test_priority_then_arrival() -> None:
    queued = [job(1), job(2, priority=5), job(3)]
    node = NodeView("n", max_jobs=2)
    assert offers_for(node, queued, [], now=100) == ["j2", "j1"]


def test_warm_affinity_leaves_a_job_for_the_node_holding_its_model_for_a_while() -> None:
    warm = NodeView("warm", gpus=(gpu("w", 24, free=2),), warm=frozenset({"m.llm"}))
    cold = NodeView("cold", gpus=(gpu("c", 24),))
    queued = [job(1, 14, type_="m.llm")]
    assert offers_for(cold, queued, [warm], now=110) == []
    assert offers_for(warm, queued, [cold], now=110) == ["j1"]  # fits its warm server
    # after the affinity wait any node may take it
    assert offers_for(cold, queued, [warm], now=131, affinity_wait_s=30) == ["j1"]
    # a warm node with no free slot does not hold the job back
    full = NodeView("warm", gpus=warm.gpus, warm=warm.warm, busy=4, max_jobs=4)
    assert offers_for(cold, queued, [full], now=110) == ["j1"]


def test_constraints_model_labels_min_vram_and_node() -> None:
    a100 = NodeView("a", gpus=(gpu("a0", 80, name="NVIDIA A100-SXM4-80GB"),), labels={"zone": "x"})
    l4 = NodeView("b", gpus=(gpu("b0", 24),), labels={"zone": "y"})
    queued = [
        job(1, 1, constraints=Constraints(gpu_model="a100")),
        job(2, 1, constraints=Constraints(labels={"zone": "y"})),
        job(3, 1, constraints=Constraints(min_gpu_vram_bytes=40 * GIB)),
        job(4, 1, constraints=Constraints(node="b")),
    ]
    assert offers_for(a100, queued, [l4], now=100) == ["j1", "j3"]
    assert offers_for(l4, queued, [a100], now=100) == ["j2", "j4"]


def test_a_job_lost_on_a_node_prefers_another_that_can_take_it() -> None:
    lost = job(1, 4, avoid=frozenset({"small"}))
    assert offers_for(SMALL, [lost], [BIG], now=100) == []
    assert offers_for(BIG, [lost], [SMALL], now=100) == ["j1"]
    # with no other node able to take it, the same node gets it again
    assert offers_for(SMALL, [lost], [], now=100) == ["j1"]


def test_draining_nodes_get_nothing() -> None:
    draining = NodeView("d", gpus=(gpu("g", 24),), accepting=False)
    assert offers_for(draining, [job(1)], [], now=100) == []


def test_never_placeable_says_why_per_node() -> None:
    assert never_placeable(job(1, 40), [SMALL, BIG]) is None
    why = never_placeable(job(1, 100), [SMALL, BIG])
    assert why is not None and why.startswith("no node can ever run it: small: needs 100")
    assert "big: needs 100.0 GiB on one GPU; its largest has 80.0 GiB" in why
    assert never_placeable(job(1, 100), []) is None  # no node yet: it waits
    pinned = job(2, 1, constraints=Constraints(node="gone"))
    assert "asks for node 'gone'" in (never_placeable(pinned, [SMALL]) or "")


# -- the node's own launch rules ---------------------------------------------------

BWRAP = LaunchRules(runtime=Runtime.BUBBLEWRAP)
LOCAL = LaunchRules()
LOCAL_OPEN = LaunchRules(allow_unsandboxed_containers=True)


def test_a_node_is_offered_only_types_its_launch_rules_allow() -> None:
    sandbox = NodeView("gpu-b", gpus=(gpu("b0", 24),), rules=BWRAP, modules=frozenset({"m.t"}))
    plain = NodeView("gpu-a", gpus=(gpu("a0", 24),), rules=LOCAL, modules=frozenset({"m.t"}))
    container = job(1, 4, launch=LaunchMode.CONTAINER)
    host = job(2, 0, launch=LaunchMode.HOST)
    served = job(3, 4, launch=LaunchMode.SERVE)
    queued = [container, host, served]
    assert offers_for(sandbox, queued, [plain], now=200) == ["j1", "j3"]
    assert offers_for(plain, queued, [sandbox], now=200) == ["j2"]
    assert refusal(container, plain) == "refuses container types (its runtime is local)"
    assert refusal(served, plain) == "refuses serve types (its runtime is local)"
    assert refusal(host, sandbox) == "refuses host types (its runtime is bubblewrap)"
    vram_host = job(4, 4, launch=LaunchMode.HOST)
    opened = NodeView("o", gpus=(gpu("o0", 24),), rules=LOCAL_OPEN)
    assert refusal(vram_host, opened) == (
        "refuses host types on the vram lane (model code on a GPU runs sandboxed)"
    )
    assert refusal(container, opened) is None


def test_the_types_a_node_says_it_runs_decide_and_its_modules_and_rules_say_why_not() -> None:
    container = job(1, 0, type_="m.box", launch=LaunchMode.CONTAINER)
    # it says it runs m.box: offered, whatever its rules would say of the coordinator's
    # idea of the type (its module may declare it otherwise)
    says = NodeView("n", types=frozenset({"m.box"}), modules=frozenset({"m.box"}), rules=LOCAL)
    assert type_refusal(container, says) is None
    assert offers_for(says, [container], [], now=200) == ["j1"]
    no_module = NodeView("n", types=frozenset(), modules=frozenset({"m.other"}), rules=BWRAP)
    assert type_refusal(container, no_module) == "has no module for m.box"
    refused = NodeView("n", types=frozenset(), modules=frozenset({"m.box"}), rules=LOCAL)
    assert type_refusal(container, refused) == "refuses container types (its runtime is local)"
    unknown_why = NodeView("n", types=frozenset())
    assert type_refusal(container, unknown_why) == "does not run m.box"
    # before its first report (its enrolment: modules and rules, no list of types)
    enrolled = NodeView("n", modules=frozenset({"m.box"}), rules=BWRAP)
    assert type_refusal(container, enrolled) is None
    assert type_refusal(container, NodeView("n")) is None  # an agent that says nothing


def test_never_placeable_names_each_nodes_launch_rules() -> None:
    plain = NodeView("gpu-a", gpus=(gpu("a0", 24),), rules=LOCAL)
    sandbox = NodeView("gpu-b", gpus=(gpu("b0", 24),), rules=BWRAP)
    container = job(1, 4, launch=LaunchMode.CONTAINER)
    assert never_placeable(container, [plain, sandbox]) is None
    assert never_placeable(container, [plain]) == (
        "no node can ever run it: gpu-a: refuses container types (its runtime is local)"
    )
    pinned = job(2, 4, launch=LaunchMode.CONTAINER, constraints=Constraints(node="gpu-a"))
    assert never_placeable(pinned, [plain, sandbox]) == (
        "no node can ever run it: gpu-a: refuses container types (its runtime is local); "
        "gpu-b: the job asks for node 'gpu-a'"
    )


def test_a_job_warm_on_a_node_whose_rules_refuse_it_is_not_held_back_for_it() -> None:
    served = job(1, 4, type_="m.warm", launch=LaunchMode.SERVE)
    # a warm server of the type on a node that refuses it now (its config changed)
    stale = NodeView("stale", gpus=(gpu("s0", 24),), warm=frozenset({"m.warm"}), rules=LOCAL)
    cold = NodeView("cold", gpus=(gpu("c0", 24),), rules=BWRAP)
    assert offers_for(cold, [served], [stale], now=101) == ["j1"]


# --- jobs on several GPUs ------------------------------------------------------------


PAIR = NodeView("pair", gpus=(gpu("p0", 24), gpu("p1", 24)), max_jobs=4)
ONE = NodeView("one", gpus=(gpu("o0", 80),), max_jobs=4)


def test_a_multi_gpu_job_is_offered_only_to_a_node_with_that_many_gpus_with_room() -> None:
    two = job(1, 16, gpus=2)
    assert offers_for(ONE, [two], [PAIR], now=100) == []  # one GPU, however big
    assert offers_for(PAIR, [two], [ONE], now=100) == ["j1"]
    half_busy = NodeView("pair", gpus=(gpu("p0", 24), gpu("p1", 24, free=8)), max_jobs=4)
    assert offers_for(half_busy, [two], [], now=100) == []  # never on fewer GPUs


def test_an_offered_multi_gpu_job_takes_room_on_each_of_its_gpus() -> None:
    three = NodeView("three", gpus=(gpu("t0", 24), gpu("t1", 24), gpu("t2", 24)), max_jobs=4)
    queued = [job(1, 16, gpus=2), job(2, 16, gpus=2), job(3, 16)]
    assert offers_for(three, queued, [], now=100) == ["j1", "j3"]


def test_no_node_with_enough_gpus_is_said_at_submission() -> None:
    why = never_placeable(job(1, 16, gpus=2), [ONE, SMALL])
    assert why is not None
    assert "one: needs 2 GPUs at once with 16.0 GiB on each; it has 1 such GPU(s)" in why
    assert never_placeable(job(1, 16, gpus=2), [ONE, PAIR]) is None
