"""Preemption at a safe point (``core/preempt.py`` and its use in ``plan_pass``):
which running preemptible jobs are asked to checkpoint for a waiting one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.classify import (
    AttemptFacts,
    Outcome,
    checkpoints_before,
    classify,
    interruptions_before,
)
from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import GpuView, Pass, QueuedJob, Snapshot, lineups_of, plan_pass
from gpuwarden.core.preempt import (
    DEFAULT_GRACE_S,
    DEFAULT_MIN_RUN_S,
    DEFAULT_SIGNAL,
    Need,
    Victim,
    choose,
    eligible,
)
from gpuwarden.core.states import JobState
from gpuwarden.errors import ModuleError
from gpuwarden.registry import parse_module

NOW = 1_000_000.0


def held(job_id: str, gib: float, *, coresident: bool = False) -> Holding:
    return Holding(f"{job_id}/1", "train.step", int(gib * GIB), coresident, job_id=job_id)


def victim(job_id: str, gpu: str = "GPU-a", **kw: object) -> Victim:
    base: dict[str, object] = {"priority": 0, "since": NOW - 1000, "min_run_s": 300.0}
    base.update(kw)
    return Victim(job_id, f"{job_id}/1", gpu, **base)  # type: ignore[arg-type]


def queued(job_id: str, gib: float, priority: int = 10, seq: int = 1) -> QueuedJob:
    return QueuedJob(job_id, "llm.chat", Lane.VRAM, int(gib * GIB), priority, seq)


def one_pass(jobs: list[QueuedJob], gpus: list[GpuView], victims: list[Victim]) -> Pass:
    lineups, _ = lineups_of(jobs)
    snap = Snapshot(queued=(), gpus=tuple(gpus), victims=tuple(victims))
    return plan_pass(lineups, snap, NOW)


def gpu(uuid: str, gib: float, *holdings: Holding) -> GpuView:
    return GpuView(uuid, int(gib * GIB), holdings=holdings)


def test_a_waiting_job_of_higher_priority_preempts_the_job_in_its_way() -> None:
    done = one_pass(
        [queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [victim("train")]
    )
    assert [(p.job_id, p.for_job, p.signal) for p in done.preemptions] == [
        ("train", "urgent", "SIGUSR1")
    ]
    (wait,) = done.waits
    assert wait.reserved_gpu == "GPU-a"
    assert "Preempting train for urgent on GPU-a" in wait.reason


def test_a_job_that_is_not_preemptible_is_never_chosen() -> None:
    # train holds GPU-a but is no victim (its type is not preemptible)
    done = one_pass([queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [])
    assert done.preemptions == []
    assert done.waits and "Preempting" not in done.waits[0].reason


def test_not_before_min_run_s_nor_for_equal_priority() -> None:
    young = victim("train", since=NOW - 100)
    assert not eligible(young, 10, NOW)
    done = one_pass([queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [young])
    assert done.preemptions == []
    peer = victim("train", priority=10)
    done = one_pass([queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [peer])
    assert done.preemptions == []


def test_a_victim_already_asked_is_waited_for_not_asked_again() -> None:
    asked = victim("train", preempting_for="urgent")
    done = one_pass([queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [asked])
    assert done.preemptions == []
    (wait,) = done.waits
    assert wait.reserved_gpu == "GPU-a" and "Preempting train for urgent" in wait.reason
    # asked for another job: not this one's to take
    other = victim("train", preempting_for="someone")
    done = one_pass([queued("urgent", 20)], [gpu("GPU-a", 24, held("train", 16))], [other])
    assert done.preemptions == []


def test_no_preemption_when_the_job_fits_elsewhere() -> None:
    done = one_pass(
        [queued("urgent", 20)],
        [gpu("GPU-a", 24, held("train", 16)), gpu("GPU-b", 24)],
        [victim("train")],
    )
    assert done.preemptions == [] and [s.gpu_uuid for s in done.starts] == ["GPU-b"]


def test_fewest_victims_then_cheapest() -> None:
    need = Need("urgent", 12 * GIB, True, 10)
    a = [held("a1", 11, coresident=True), held("a2", 11, coresident=True)]  # both must go
    b = [held("b1", 16)]  # one on GPU-b
    victims = [victim("a1"), victim("a2"), victim("b1", "GPU-b")]
    big = Need("urgent", 14 * GIB, True, 10)
    choice = choose(big, [("GPU-a", 24 * GIB, a), ("GPU-b", 24 * GIB, b)], victims, NOW)
    assert choice is not None and [v.job_id for v in choice.victims] == ["b1"]
    # on one GPU, the lower priority goes first, then the younger run
    c = [held("lo", 12, coresident=True), held("hi", 12, coresident=True)]
    vs = [victim("lo", priority=1), victim("hi", priority=5)]
    choice = choose(need, [("GPU-a", 24 * GIB, c)], vs, NOW)
    assert choice is not None and [v.job_id for v in choice.victims] == ["lo"]
    vs = [victim("lo", since=NOW - 5000), victim("hi", since=NOW - 400)]
    choice = choose(need, [("GPU-a", 24 * GIB, c)], vs, NOW)
    assert choice is not None and [v.job_id for v in choice.victims] == ["hi"]


def test_a_non_victim_beside_the_victims_stays_and_may_block_it() -> None:
    # 'serve' is not preemptible and alone leaves too little room: no preemption
    holdings = [held("train", 8), held("serve", 14)]
    choice = choose(
        Need("urgent", 12 * GIB, False, 10), [("GPU-a", 24 * GIB, holdings)], [victim("train")], NOW
    )
    assert choice is None


def test_two_waiting_jobs_never_share_a_victim() -> None:
    jobs = [queued("u1", 20, seq=1), queued("u2", 20, seq=2)]
    gpus = [gpu("GPU-a", 24, held("train", 16))]
    done = one_pass(jobs, gpus, [victim("train")])
    assert [(p.job_id, p.for_job) for p in done.preemptions] == [("train", "u1")]


# -- a preempted job resumes and finishes once (virtual time) -----------------------


@dataclass
class _SimJob:
    id: str
    gib: int
    priority: int
    preemptible: bool
    work: int
    arrives: int
    honours: bool = True  # checkpoints on the signal (else it is stopped after the grace)
    progress: int = 0
    started: int | None = None
    gpu: str | None = None
    asked_for: str | None = None
    asked_at: int = 0
    finished: int = 0
    resumed: int = 0
    attempts: list[str] = field(default_factory=list)


GRACE, MIN_RUN = 3, 5


def _step(jobs: list[_SimJob], t: int, preempted_log: list[tuple[str, str]]) -> None:
    running = [j for j in jobs if j.gpu is not None]
    for j in running:  # an asked job checkpoints (exit 6) at once, or is stopped after the grace
        if j.asked_for is not None and (j.honours or t - j.asked_at >= GRACE):
            if not j.honours:
                j.progress = 0  # no checkpoint written: it starts over
            j.gpu, j.asked_for, j.started = None, None, None
            j.attempts.append("checkpointed" if j.honours else "preempted")
    for j in jobs:
        if j.gpu is not None:
            j.progress += 1
            if j.progress >= j.work:
                j.gpu, j.finished = None, j.finished + 1
                j.attempts.append("done")
    waiting = [j for j in jobs if j.gpu is None and not j.finished and j.arrives <= t]
    holdings = {
        u: tuple(
            Holding(f"{j.id}/x", "t", j.gib * GIB, job_id=j.id, since=float(j.started or 0))
            for j in jobs
            if j.gpu == u
        )
        for u in ("GPU-a", "GPU-b")
    }
    victims = tuple(
        Victim(
            j.id,
            f"{j.id}/x",
            j.gpu,
            j.priority,
            float(j.started or 0),
            MIN_RUN,
            "SIGUSR1",
            GRACE,
            j.asked_for,
        )
        for j in jobs
        if j.gpu is not None and j.preemptible
    )
    qs = [
        QueuedJob(j.id, f"t{j.id}", Lane.VRAM, j.gib * GIB, j.priority, n)
        for n, j in enumerate(waiting)
    ]
    lineups, _ = lineups_of(qs)
    gpus = tuple(GpuView(u, 24 * GIB, holdings=h) for u, h in holdings.items())
    done = plan_pass(lineups, Snapshot(queued=(), gpus=gpus, victims=victims), float(t))
    by_id = {j.id: j for j in jobs}
    for p in done.preemptions:
        v = by_id[p.job_id]
        assert v.preemptible and v.gpu is not None and v.asked_for is None
        assert by_id[p.for_job].priority > v.priority
        v.asked_for, v.asked_at = p.for_job, t
        preempted_log.append((p.job_id, p.for_job))
    for s in done.starts:
        j = by_id[s.job_id]
        j.gpu, j.started = s.gpu_uuid, t
        if j.attempts:
            j.resumed += 1


_jobs = st.lists(
    st.tuples(
        st.integers(4, 24),
        st.integers(0, 3),
        st.booleans(),
        st.integers(1, 30),
        st.integers(0, 40),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(_jobs)
def test_a_preempted_job_resumes_and_finishes_once(specs: list[tuple[int, ...]]) -> None:
    jobs = [
        _SimJob(f"j{n}", g, p, bool(pre), w, a, honours=bool(h))
        for n, (g, p, pre, w, a, h) in enumerate(specs)
    ]
    log: list[tuple[str, str]] = []
    for t in range(3000):
        _step(jobs, t, log)
        if all(j.finished for j in jobs):
            break
    for j in jobs:
        assert j.finished == 1, (j, log)  # every job ends, exactly once
        assert j.attempts.count("done") == 1
        assert j.attempts[-1] == "done"
        # each preemption is followed by a resumed attempt
        assert j.resumed == len(j.attempts) - 1
        if not j.preemptible:
            assert j.attempts == ["done"] and all(v != j.id for v, _ in log)


def test_the_virtual_run_does_preempt_and_resume() -> None:
    """The property above meets preemptions: this trace has both kinds of victim."""
    jobs = [
        _SimJob("train", 20, 0, True, 40, 0),
        _SimJob("stubborn", 20, 0, True, 40, 0, honours=False),
        _SimJob("urgent", 20, 3, False, 5, 10),
        _SimJob("urgent2", 20, 3, False, 5, 10),
    ]
    log: list[tuple[str, str]] = []
    for t in range(500):
        _step(jobs, t, log)
    assert sorted(v for v, _ in log) == ["stubborn", "train"]
    by_id = {j.id: j for j in jobs}
    assert by_id["train"].attempts == ["checkpointed", "done"]
    assert by_id["stubborn"].attempts == ["preempted", "done"]
    assert all(j.finished == 1 for j in jobs)


# -- the type keys and the outcomes ---------------------------------------------------

_TRAIN = """[module]
name = "mine"

[types.train]
lane = "vram"
vram_gib = 4
command = ["{python}", "src/run.py"]
"""


def _module(tmp_path: Path, extra: str, lane: str = "vram") -> Path:
    path = tmp_path / "mine"
    (path / "src").mkdir(parents=True)
    (path / "src" / "run.py").write_text("print('hi')\n")
    toml = _TRAIN if lane == "vram" else _TRAIN.replace('"vram"', '"cpu"').replace("4", "0")
    (path / "module.toml").write_text(toml + extra)
    return path


def test_module_toml_preemption_keys(tmp_path: Path) -> None:
    (jt,) = parse_module(_module(tmp_path / "a", "preemptible = true\n")).types
    assert (jt.preemptible, jt.checkpoint_signal, jt.checkpoint_grace_s, jt.min_run_s) == (
        True,
        DEFAULT_SIGNAL,
        DEFAULT_GRACE_S,
        DEFAULT_MIN_RUN_S,
    )
    keys = (
        'preemptible = true\ncheckpoint_signal = "SIGTERM"\ncheckpoint_grace_s = 5\nmin_run_s = 0\n'
    )
    (jt,) = parse_module(_module(tmp_path / "b", keys)).types
    assert (jt.checkpoint_signal, jt.checkpoint_grace_s, jt.min_run_s) == ("SIGTERM", 5.0, 0.0)
    (jt,) = parse_module(_module(tmp_path / "c", "")).types
    assert not jt.preemptible


@pytest.mark.parametrize(
    ("extra", "lane", "words"),
    [
        ('preemptible = true\ncheckpoint_signal = "SIGKILL"\n', "vram", "checkpoint_signal"),
        ("checkpoint_grace_s = 5\n", "vram", "applies only to preemptible"),
        ("preemptible = true\n", "cpu", 'lane = "vram"'),
        ('preemptible = true\nlaunch = "serve"\n', "vram", "processes of their own"),
    ],
)
def test_module_toml_preemption_refusals(tmp_path: Path, extra: str, lane: str, words: str) -> None:
    with pytest.raises(ModuleError) as info:
        parse_module(_module(tmp_path, extra, lane))
    assert words in str(info.value)


def test_exit_6_after_the_signal_is_checkpointed_and_spends_nothing() -> None:
    facts = AttemptFacts(exit_code=6, preempted_for="urgent", checkpoint_signal="SIGUSR1")
    v = classify(facts, attempt=3, max_retries=0)
    assert (v.outcome, v.target) == (Outcome.CHECKPOINTED, JobState.QUEUED)
    assert "urgent" in v.reason and "GPUWARDEN_RESUME=1" in v.reason
    # unasked, exit 6 is the job's own failure
    v = classify(AttemptFacts(exit_code=6), attempt=1, max_retries=2)
    assert v.outcome is Outcome.JOB_FAILED
    # asked, and it ended well anyway: done
    v = classify(AttemptFacts(exit_code=0, preempted_for="urgent"), attempt=1, max_retries=2)
    assert v.outcome is Outcome.SUCCEEDED


def test_stopped_after_the_grace_is_preempted_and_counted_as_an_interruption() -> None:
    facts = AttemptFacts(exit_code=-15, stopped=True, preempted_for="urgent")
    v = classify(facts, attempt=1, max_retries=0, interruptions=0, max_interruptions=1)
    assert (v.outcome, v.target) == (Outcome.PREEMPTED, JobState.QUEUED)
    assert "interruption 1/1" in v.reason
    v = classify(facts, attempt=2, max_retries=0, interruptions=1, max_interruptions=1)
    assert (v.outcome, v.target) == (Outcome.PREEMPTED, JobState.QUARANTINED)
    # a shutdown during the grace is a shutdown
    down = AttemptFacts(exit_code=-15, stopped=True, shutting_down=True, preempted_for="u")
    assert classify(down, attempt=1, max_retries=0).outcome is Outcome.SHUTDOWN
    assert interruptions_before(["preempted", "interrupted", "checkpointed", None]) == 2
    assert checkpoints_before(["preempted", "checkpointed", "checkpointed"]) == 2


def test_checkpoints_spend_no_retry_of_a_later_failure() -> None:
    launch = AttemptFacts(exit_code=None, launch_error="no runtime")
    v = classify(launch, attempt=3, max_retries=1, checkpoints=2)
    assert v.target is JobState.QUEUED and "retrying (1/1)" in v.reason
    v = classify(launch, attempt=3, max_retries=1)
    assert v.target is JobState.QUARANTINED
