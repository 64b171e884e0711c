"""Fair share across hosts (SPEC.md section 11, "Fair share"), on every store
backend: the owners of queued jobs and each owner's claimable jobs (migration
0011), the coordinator's claim order (least-used owner first at equal priority,
priority still first, past the first page of the queue), the charge a finish
report brings (capped at the node's GPUs, counted once), and explain's line."""

from __future__ import annotations

import itertools
import time
from functools import partial
from pathlib import Path

import httpx
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.api.routers.nodes import FinishIn
from gpuwarden.cluster import claimorder
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster import report as rp
from gpuwarden.cluster.claimorder import ClaimQueue, owners_use
from gpuwarden.core.fairshare import claim_rank, decayed
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission
from gpuwarden.store.cluster import ClusterStore
from tests.integration.test_agent import make_rig
from tests.integration.test_coordinator import TIMING, enrol

REPO = Path(__file__).resolve().parents[2]
WEEK = 7 * 86400.0
NOW = 1_000_000.0


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load([REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"])


@pytest.fixture
def s(store: Store) -> ClusterStore:
    assert isinstance(store, ClusterStore)
    return store


def submit(
    s: ClusterStore, owner: str | None, *ids: str, priority: int = 0, now: float = NOW
) -> None:
    specs = [JobSpec(id=i, type="echo.echo", params={"text": i}, priority=priority) for i in ids]
    s.submit(specs, now=now, origin=Submission(owner=owner))


def test_queued_owners_and_each_owners_claimable_jobs(s: ClusterStore) -> None:
    assert s.queued_owners() == []
    submit(s, "tok-b", "b1", "b2")
    submit(s, None, "l1")
    submit(s, "tok-a", "a1")
    submit(s, "tok-a", "a2", priority=3)
    submit(s, "tok-c", "c1")
    s.start_attempt("c1", node="x", gpu_uuid=None, now=NOW)  # running: not queued
    assert s.queued_owners() == ["", "tok-a", "tok-b"]
    assert [j.id for j in s.claimable_jobs_of("tok-a", now=NOW)] == ["a2", "a1"]
    assert [j.owner for j in s.claimable_jobs_of("tok-a", now=NOW)] == ["tok-a", "tok-a"]
    assert [j.id for j in s.claimable_jobs_of("", now=NOW)] == ["l1"]
    assert [j.id for j in s.claimable_jobs_of("tok-b", now=NOW, limit=1)] == ["b1"]
    b1 = s.claimable_jobs_of("tok-b", now=NOW, limit=1)[0]
    after = (b1.priority, b1.seq)
    assert [j.id for j in s.claimable_jobs_of("tok-b", now=NOW, after=after)] == ["b2"]
    # a leased job is not claimable; its owner still has queued jobs
    assert s.lease_jobs("n", ["b1", "b2"], lease_id="L", expires_at=NOW + 10, now=NOW)
    assert s.claimable_jobs_of("tok-b", now=NOW) == []
    assert "tok-b" in s.queued_owners()
    assert [j.owner for j in s.claimable_jobs(now=NOW)] == ["tok-a", None, "tok-a"]


def test_claims_offer_the_least_used_owners_job_first(s: ClusterStore, registry: Registry) -> None:
    view = enrol(s, "n1", 24, now=NOW)
    s.add_fair_share("heavy", 500.0, now=NOW - 3600, half_life_s=WEEK)
    s.add_fair_share("light", 1.0, now=NOW - 3600, half_life_s=WEEK)
    # the heavy owner's jobs came first, more than a claim's first page of them
    submit(s, "heavy", *(f"h{i:03d}" for i in range(co.CLAIM_PAGE * 2)))
    submit(s, "light", "l1", "l2")
    submit(s, None, "local1")  # the CLI on the host: used nothing
    submit(s, "heavy", "urgent", priority=5)

    def claim_one(half_life_s: float = WEEK) -> str:
        [got] = co.claim(
            s, registry, "n1", view, NOW, timing=TIMING, want=1, half_life_s=half_life_s
        )
        job_id = str(got["id"])
        s.start_attempt(job_id, node="n1", gpu_uuid=None, now=NOW)  # it leaves the queue
        s.drop_lease(job_id)  # and the node has room again
        return job_id

    assert ClaimQueue(s, now=NOW, use=owners_use(s, NOW, WEEK)).merged
    got = [claim_one() for _ in range(5)]
    assert got == ["urgent", "local1", "l1", "l2", "h000"]  # priority still beats fair share
    # fair share off: arrival order, as before
    submit(s, "light", "l3")
    assert claim_one(half_life_s=0.0) == "h001"
    assert claim_one() == "l3"


def test_explain_says_a_job_waits_behind_a_lighter_owners(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n1", 24, now=NOW)
    s.add_fair_share("heavy", 40.0, now=NOW, half_life_s=WEEK)
    submit(s, "heavy", "h1")
    submit(s, "light", "l1")
    h1, l1 = s.get_job("h1"), s.get_job("l1")
    assert h1 is not None and l1 is not None
    lines = rp.explain_waiting(s, registry, h1, NOW, WEEK)
    assert lines[-1] == (
        "it waits behind another owner's jobs: fair share: owner light has used less: "
        "0.00 GiB-h against 40.00"
    )
    assert not any("fair share" in line for line in rp.explain_waiting(s, registry, l1, NOW, WEEK))
    assert not any("fair share" in line for line in rp.explain_waiting(s, registry, h1, NOW, 0.0))
    # the light owner's job is leased to a node: nothing waits ahead of h1 here any more
    assert s.lease_jobs("n1", ["l1"], lease_id="L", expires_at=NOW + 10, now=NOW)
    assert not any("fair share" in line for line in rp.explain_waiting(s, registry, h1, NOW, WEEK))


def _run(s: ClusterStore, registry: Registry, job_id: str, start: float) -> str:
    record = s.get_node("n1")
    if record is None:
        view = enrol(s, "n1", 24, now=start)
    else:
        s.touch_node("n1", record.report, start)  # heard from now
        view = nv.node_view(record)
    [payload] = co.claim(s, registry, "n1", view, start, timing=TIMING, want=1, lease_s=1e5)
    assert payload["id"] == job_id
    co.start(s, "n1", job_id, lease_id=payload["lease_id"], gpu_uuid="GPU-0", now=start)
    return str(payload["lease_id"])


def test_a_finish_report_charges_its_owner_once_capped_at_the_nodes_gpus(
    s: ClusterStore, registry: Registry
) -> None:
    submit(s, "tok-a", "a1")
    lease = _run(s, registry, "a1", NOW)
    end = NOW + 1800  # half an hour, by the coordinator's clock
    kw = {"lease_id": lease, "state": JobState.DONE, "outcome": "succeeded", "reason": ""}
    co.finish(s, registry, "n1", "a1", **kw, now=end, held_bytes=4 * GIB, half_life_s=WEEK)
    assert s.fair_share() == [("tok-a", pytest.approx(2.0), end)]  # 4 GiB x 0.5 h
    with pytest.raises(co.LeaseRefused):  # the same report again: refused, not charged
        co.finish(s, registry, "n1", "a1", **kw, now=end + 1, held_bytes=4 * GIB)
    assert s.fair_share() == [("tok-a", pytest.approx(2.0), end)]
    # a node that says its attempt held more than all its GPUs is counted its GPUs
    submit(s, None, "l1")
    lease = _run(s, registry, "l1", end)
    kw["lease_id"] = lease
    co.finish(s, registry, "n1", "l1", **kw, now=end + 3600, held_bytes=2**50, half_life_s=WEEK)
    assert dict((o, v) for o, v, _ in s.fair_share())[""] == pytest.approx(24.0)  # 24 GiB x 1 h
    # no held_bytes (an older agent) or fair share off: nothing counted
    submit(s, "tok-b", "b1", "b2")
    for job_id, extra in (("b1", {}), ("b2", {"held_bytes": GIB, "half_life_s": 0.0})):
        kw["lease_id"] = _run(s, registry, job_id, end)
        co.finish(s, registry, "n1", job_id, **kw, now=end + 60, **extra)  # type: ignore[arg-type]
    assert "tok-b" not in {o for o, _, _ in s.fair_share()}


_counter = itertools.count()

queue_st = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", ""]), st.integers(-1, 1)), min_size=1, max_size=40
)
use_st = st.fixed_dictionaries(
    {},
    optional={o: st.floats(0.01, 100.0) for o in ("a", "b", "c", "")},
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(queue=queue_st, use=use_st, chunk=st.integers(1, 7), owner_chunk=st.integers(1, 16))
def test_the_claim_queue_is_the_pure_order_by_decayed_use(
    s: ClusterStore,
    queue: list[tuple[str, int]],
    use: dict[str, float],
    chunk: int,
    owner_chunk: int,
) -> None:
    """Whatever the owners, uses and page sizes, the queue read through the store
    is the claimable jobs sorted by (priority, owner's use decayed to now, arrival)."""
    n = next(_counter)
    owner_of = {o: f"x{n}-{o}" if o else "" for o in ("a", "b", "c", "")}
    # uses stored at different times: the order is by the use as it counts now
    for i, (o, u) in enumerate(sorted(use.items())):
        s.add_fair_share(owner_of[o] or None, u, now=NOW - 86400.0 * i, half_life_s=WEEK)
    for i, (o, p) in enumerate(queue):
        submit(s, owner_of[o] or None, f"x{n}-{i}", priority=p)
    saved, claimorder.MIN_CHUNK = claimorder.MIN_CHUNK, owner_chunk  # refills too
    try:
        now = NOW + 60
        table = owners_use(s, now, WEEK)
        q = ClaimQueue(s, now=now, use=table)
        got: list[str] = []
        while page := q.take(chunk):
            got += [j.id for j in page]
        claimable = s.claimable_jobs(now=now, limit=10_000)
        want = sorted(
            claimable, key=lambda j: claim_rank(j.priority, table.get(j.owner or "", 0.0), j.seq)
        )
        assert got == [j.id for j in want]
        for o, u in use.items():  # the table is the stored use, decayed to now
            i = sorted(use).index(o)
            assert table[owner_of[o]] >= decayed(u, NOW - 86400.0 * i, now, WEEK) - 1e-9
    finally:  # the next example starts with an empty queue
        claimorder.MIN_CHUNK = saved
        for i in range(len(queue)):
            s.request_cancel(f"x{n}-{i}", now=NOW)


def test_an_agents_finish_report_charges_the_owner_on_the_coordinator(tmp_path: Path) -> None:
    """A real broker on a simulated GPU, the coordinator's app in process: the
    finish report says what the attempt held here, and the coordinator's table
    counts it for the job's owner (the coordinator's clock times the run)."""
    rigs = make_rig(tmp_path)
    rig = next(rigs)
    try:
        job = JobSpec(
            id="g1",
            type="testmods.gpu",
            params={"gib": 2, "seconds": 0.5, "leak": False},
            vram_bytes=2 * GIB,
        )
        rig.store.submit([job], now=time.time(), origin=Submission(owner="tok-a"))
        rig.until("g1 done", lambda: rig.job("g1").state is JobState.DONE)
        [attempt] = rig.store.attempts("g1")
        assert attempt.node == "a" and attempt.ended_at is not None
        [(owner, gib_h, as_of)] = rig.store.fair_share()
        assert owner == "tok-a" and as_of == attempt.ended_at
        span_h = (attempt.ended_at - attempt.started_at) / 3600
        assert gib_h == pytest.approx(2 * span_h, rel=0.3)  # about 2 GiB held the whole run
        assert rig.node.broker.fair.ends == {}  # taken for the report, kept no longer
    finally:
        rigs.close()


class _BeforeHeldBytes(httpx.BaseTransport):
    """A coordinator from before ``held_bytes``: a body with it is refused (422)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if b'"held_bytes"' in request.read():
            self.refused += 1
            return httpx.Response(422, json={"error": "held_bytes: extra field not permitted"})
        return self.inner.handle_request(request)


def test_an_agent_sends_its_finish_again_without_held_bytes_to_an_older_coordinator(
    tmp_path: Path,
) -> None:
    rigs = make_rig(tmp_path)
    rig = next(rigs)
    try:
        old = _BeforeHeldBytes(rig.switch.inner)
        rig.switch.inner = old
        refused = []
        for job_id in ("g1", "g2"):
            job = JobSpec(
                id=job_id,
                type="testmods.gpu",
                params={"gib": 1, "seconds": 0.2, "leak": False},
                vram_bytes=GIB,
            )
            rig.store.submit([job], now=time.time(), origin=Submission(owner="tok-a"))
            rig.until(f"{job_id} done", lambda j=job_id: rig.job(j).state is JobState.DONE)
            refused.append(old.refused)
        # g1's finish was refused for the field and sent again without it (its end
        # is recorded); g2's went without it at once
        assert refused[0] >= 1 and refused[1] == refused[0]
        assert [a.outcome for j in ("g1", "g2") for a in rig.store.attempts(j)] == [
            "succeeded",
            "succeeded",
        ]
        assert rig.store.fair_share() == []  # that coordinator counts nothing
    finally:
        rigs.close()


@pytest.mark.parametrize("bad", [-1, 2**50 + 1, True, "5", 1.5])
def test_a_finish_report_with_an_absurd_held_bytes_is_refused(bad: object) -> None:
    body = {"lease_id": "L", "state": "done"}
    assert FinishIn.model_validate({**body, "held_bytes": 4 * GIB}).held_bytes == 4 * GIB
    assert FinishIn.model_validate(body).held_bytes is None  # an agent from before it
    with pytest.raises(pydantic.ValidationError, match="held_bytes"):
        FinishIn.model_validate({**body, "held_bytes": bad})


def test_what_a_running_job_has_held_so_far_counts_for_its_owner(
    s: ClusterStore, registry: Registry
) -> None:
    view = enrol(s, "n1", 24, now=NOW)
    s.add_fair_share("light", 1.0, now=NOW, half_life_s=WEEK)
    ten_h_ago = NOW - 10 * 3600
    long = JobSpec(id="long", type="testmods.gpu", params={"gib": 8}, vram_bytes=8 * GIB)
    s.submit([long], now=ten_h_ago, origin=Submission(owner="heavy"))
    s.start_attempt("long", node="n1", gpu_uuid="GPU-0", now=ten_h_ago)
    submit(s, "heavy", "h1")
    submit(s, "light", "l1")
    held_of = partial(nv.held_by, registry, {})
    use = owners_use(s, NOW, WEEK, held_of=held_of)
    assert use == {"heavy": pytest.approx(80.0), "light": pytest.approx(1.0)}  # 8 GiB x 10 h
    assert owners_use(s, NOW, WEEK) == {"light": pytest.approx(1.0)}  # the table alone
    [got] = co.claim(s, registry, "n1", view, NOW, timing=TIMING, want=1, half_life_s=WEEK)
    assert got["id"] == "l1"  # the heavy owner's running job counts before it ends
