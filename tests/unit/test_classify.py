"""Failure classification: an ended attempt's facts -> the job's next state and reason."""

from __future__ import annotations

import pytest

from gpuwarden.core.classify import (
    INFRASTRUCTURE,
    AttemptFacts,
    Outcome,
    Verdict,
    classify,
    internal_error,
    interruptions_before,
    is_cuda_oom,
)
from gpuwarden.core.states import JobState

LAUNCH = AttemptFacts(exit_code=None, launch_error="runtime docker not found")
INTERRUPTED = AttemptFacts(exit_code=None, interrupted=True)

LAUNCH_REASON = "launch error: runtime docker not found"
INTERRUPTED_REASON = "the broker stopped unexpectedly while the job ran"


def test_infrastructure_outcomes() -> None:
    assert (
        frozenset(
            {
                Outcome.LAUNCH_ERROR,
                Outcome.INTERRUPTED,
                Outcome.WORKER_FAILED,
                Outcome.GPU_FAULT,
                Outcome.KILLED,
                Outcome.CUDA_OOM_SHARED,
                Outcome.SERVICE_UNHEALTHY,
                Outcome.HOST_FAULT,
            }
        )
        == INFRASTRUCTURE
    )


def test_a_failed_warm_server_is_retried_then_given_up() -> None:
    facts = AttemptFacts(exit_code=None, worker_error="it stopped answering")
    first = classify(facts, attempt=1, max_retries=1)
    assert first.outcome is Outcome.WORKER_FAILED and first.target is JobState.QUEUED
    assert first.reason == "its warm server failed: it stopped answering; retrying (1/1)"
    last = classify(facts, attempt=2, max_retries=1)
    assert last.target is JobState.QUARANTINED
    assert "quarantined after 2 attempts" in last.reason


def test_a_warm_server_stopped_for_a_cancel_is_a_cancel() -> None:
    facts = AttemptFacts(
        exit_code=None, worker_error="stopped", stopped=True, cancel_requested=True
    )
    assert classify(facts, attempt=1, max_retries=3).target is JobState.CANCELLED


def test_succeeded() -> None:
    assert classify(AttemptFacts(exit_code=0), attempt=1, max_retries=2) == Verdict(
        Outcome.SUCCEEDED, JobState.DONE, "done"
    )


@pytest.mark.parametrize("code", [1, 2, 3, 255, -15])
def test_job_failed(code: int) -> None:
    assert classify(AttemptFacts(exit_code=code), attempt=1, max_retries=5) == Verdict(
        Outcome.JOB_FAILED, JobState.FAILED, f"the job exited with code {code}"
    )


def test_job_failed_with_stderr_tail() -> None:
    facts = AttemptFacts(exit_code=1, stderr_tail="ValueError: bad prompt")
    verdict = classify(facts, attempt=1, max_retries=2)
    assert verdict.reason == "the job exited with code 1: ValueError: bad prompt"
    assert verdict.target is JobState.FAILED


def test_missing_output_fails_an_exit_zero_attempt() -> None:
    facts = AttemptFacts(exit_code=0, missing_outputs=("a.txt", "dir/b.json"))
    assert classify(facts, attempt=1, max_retries=2) == Verdict(
        Outcome.MISSING_OUTPUT,
        JobState.FAILED,
        "the job exited 0 but did not write the output(s) asked for: a.txt, dir/b.json",
    )


def test_non_zero_exit_wins_over_missing_outputs() -> None:
    facts = AttemptFacts(exit_code=2, missing_outputs=("a.txt",))
    verdict = classify(facts, attempt=1, max_retries=2)
    assert verdict.outcome is Outcome.JOB_FAILED
    assert verdict.reason == "the job exited with code 2"


@pytest.mark.parametrize(("timeout_s", "shown"), [(60.0, "60"), (0.5, "0.5"), (3600.0, "3600")])
def test_timed_out(timeout_s: float, shown: str) -> None:
    facts = AttemptFacts(exit_code=-15, timed_out=True, timeout_s=timeout_s)
    assert classify(facts, attempt=1, max_retries=3) == Verdict(
        Outcome.TIMED_OUT,
        JobState.FAILED,
        f"timed out after {shown} s; its processes were stopped and confirmed gone",
    )


def test_cancelled_while_running() -> None:
    facts = AttemptFacts(exit_code=-15, stopped=True, cancel_requested=True)
    assert classify(facts, attempt=1, max_retries=2) == Verdict(
        Outcome.CANCELLED,
        JobState.CANCELLED,
        "cancelled while running; its processes were stopped",
    )


def test_stopped_for_shutdown() -> None:
    facts = AttemptFacts(exit_code=-15, stopped=True, shutting_down=True)
    assert classify(facts, attempt=1, max_retries=2) == Verdict(
        Outcome.SHUTDOWN,
        JobState.FAILED,
        "the broker shut down while the job ran; it was stopped after the grace period",
    )


def test_stopped_without_any_request_counts_as_shutdown() -> None:
    verdict = classify(AttemptFacts(exit_code=None, stopped=True), attempt=1, max_retries=2)
    assert verdict.outcome is Outcome.SHUTDOWN
    assert verdict.target is JobState.FAILED


def test_cancel_requested_but_finished_first_is_judged_by_its_exit() -> None:
    done = classify(AttemptFacts(exit_code=0, cancel_requested=True), attempt=1, max_retries=2)
    assert done.target is JobState.DONE
    failed = classify(AttemptFacts(exit_code=4, cancel_requested=True), attempt=1, max_retries=2)
    assert failed.outcome is Outcome.JOB_FAILED
    assert failed.target is JobState.FAILED


def test_cancel_wins_over_a_non_zero_exit_when_stopped() -> None:
    facts = AttemptFacts(exit_code=1, stopped=True, cancel_requested=True, stderr_tail="x")
    assert classify(facts, attempt=1, max_retries=2).target is JobState.CANCELLED


# --- infrastructure failures: retried up to max_retries, then given up --------------


def test_infrastructure_retry_sequence() -> None:
    outcome = Outcome.LAUNCH_ERROR
    assert classify(LAUNCH, attempt=1, max_retries=2) == Verdict(
        outcome, JobState.QUEUED, f"{LAUNCH_REASON}; retrying (1/2)"
    )
    assert classify(LAUNCH, attempt=2, max_retries=2) == Verdict(
        outcome, JobState.QUEUED, f"{LAUNCH_REASON}; retrying (2/2)"
    )
    assert classify(LAUNCH, attempt=3, max_retries=2) == Verdict(
        outcome,
        JobState.QUARANTINED,
        f"{LAUNCH_REASON}; {QUARANTINED_AFTER.format(n=3, s='s')}",
    )


QUARANTINED_AFTER = "quarantined after {n} attempt{s} (each attempt's reason: `gpuwarden show JOB`)"


def test_no_retries_allowed() -> None:
    verdict = classify(LAUNCH, attempt=1, max_retries=0)
    assert verdict.target is JobState.QUARANTINED
    assert verdict.reason == f"{LAUNCH_REASON}; {QUARANTINED_AFTER.format(n=1, s='')}"


@pytest.mark.parametrize("max_retries", range(5))
@pytest.mark.parametrize("attempt", range(1, 8))
def test_infrastructure_retried_while_attempt_within_max(attempt: int, max_retries: int) -> None:
    verdict = classify(LAUNCH, attempt=attempt, max_retries=max_retries)
    assert verdict.outcome in INFRASTRUCTURE
    if attempt <= max_retries:
        assert verdict.target is JobState.QUEUED
        assert verdict.reason.endswith(f"; retrying ({attempt}/{max_retries})")
    else:
        assert verdict.target is JobState.QUARANTINED
        plural = "" if attempt == 1 else "s"
        assert verdict.reason.endswith(QUARANTINED_AFTER.format(n=attempt, s=plural))


# --- interruptions: the broker's own end spends no retry ------------------------------


@pytest.mark.parametrize("max_retries", [0, 1, 2])
def test_an_interruption_spends_no_retry(max_retries: int) -> None:
    for earlier in range(5):  # up to the default limit of 5, this one included
        verdict = classify(
            INTERRUPTED, attempt=earlier + 1, max_retries=max_retries, interruptions=earlier
        )
        assert verdict == Verdict(
            Outcome.INTERRUPTED,
            JobState.QUEUED,
            f"{INTERRUPTED_REASON}; re-queued without spending a retry "
            f"(interruption {earlier + 1}/5)",
        )


def test_a_job_interrupted_past_max_interruptions_is_quarantined_saying_why() -> None:
    verdict = classify(INTERRUPTED, attempt=3, max_retries=5, interruptions=2, max_interruptions=2)
    assert verdict.outcome is Outcome.INTERRUPTED and verdict.target is JobState.QUARANTINED
    assert "during 3 of its attempts (max_interruptions = 2)" in verdict.reason
    assert "may be what takes the broker down" in verdict.reason
    none_allowed = classify(INTERRUPTED, attempt=1, max_retries=5, max_interruptions=0)
    assert none_allowed.target is JobState.QUARANTINED


def test_two_broker_crashes_then_a_kill_leave_the_whole_retry_budget() -> None:
    """The campaign that quarantined innocent jobs: max_retries = 1, the broker
    killed twice while the job ran (attempts 1 and 2), then a real failure."""
    killed = AttemptFacts(exit_code=-9)
    third = classify(killed, attempt=3, max_retries=1, interruptions=2)
    assert third.target is JobState.QUEUED and third.reason.endswith("; retrying (1/1)")
    fourth = classify(killed, attempt=4, max_retries=1, interruptions=2)
    assert fourth.target is JobState.QUARANTINED
    assert fourth.reason.endswith(QUARANTINED_AFTER.format(n=4, s="s"))


@pytest.mark.parametrize("max_retries", range(4))
@pytest.mark.parametrize("interruptions", range(4))
@pytest.mark.parametrize("failures", range(1, 6))
def test_infrastructure_failures_count_without_interruptions(
    max_retries: int, interruptions: int, failures: int
) -> None:
    verdict = classify(
        LAUNCH,
        attempt=interruptions + failures,
        max_retries=max_retries,
        interruptions=interruptions,
    )
    assert (verdict.target is JobState.QUEUED) == (failures <= max_retries)


def test_interruptions_before_counts_interrupted_outcomes_only() -> None:
    assert interruptions_before(["interrupted", "killed", None, "interrupted"]) == 2
    assert interruptions_before([]) == 0


def test_an_internal_error_fails_the_job_naming_the_error() -> None:
    verdict = internal_error("RecursionError('maximum recursion depth exceeded')")
    assert verdict.outcome is Outcome.INTERNAL_ERROR and verdict.target is JobState.FAILED
    assert "RecursionError" in verdict.reason and verdict.outcome not in INFRASTRUCTURE


@pytest.mark.parametrize("max_retries", [0, 1, 3, 100])
@pytest.mark.parametrize("attempt", [1, 2, 5])
def test_own_failure_timeout_and_stop_are_never_retried(attempt: int, max_retries: int) -> None:
    for facts in (
        AttemptFacts(exit_code=1),
        AttemptFacts(exit_code=-9, timed_out=True, timeout_s=10),
        AttemptFacts(exit_code=0, missing_outputs=("x",)),
        AttemptFacts(exit_code=None, stopped=True, shutting_down=True),
        AttemptFacts(exit_code=None, stopped=True, cancel_requested=True),
    ):
        verdict = classify(facts, attempt=attempt, max_retries=max_retries)
        assert verdict.target is not JobState.QUEUED
        assert verdict.target in {JobState.FAILED, JobState.CANCELLED}
        assert "retrying" not in verdict.reason


def test_launch_error_wins_over_everything_else() -> None:
    facts = AttemptFacts(
        exit_code=1,
        timed_out=True,
        stopped=True,
        cancel_requested=True,
        interrupted=True,
        launch_error="image refused",
        missing_outputs=("x",),
    )
    verdict = classify(facts, attempt=1, max_retries=1)
    assert verdict.outcome is Outcome.LAUNCH_ERROR
    assert verdict.reason == "launch error: image refused; retrying (1/1)"


def test_interrupted_wins_over_stop_and_exit() -> None:
    facts = AttemptFacts(exit_code=1, stopped=True, cancel_requested=True, interrupted=True)
    assert classify(facts, attempt=1, max_retries=1).outcome is Outcome.INTERRUPTED


def test_stop_wins_over_timeout() -> None:
    facts = AttemptFacts(exit_code=None, stopped=True, cancel_requested=True, timed_out=True)
    assert classify(facts, attempt=1, max_retries=1).outcome is Outcome.CANCELLED


def test_timeout_wins_over_exit_code_and_missing_outputs() -> None:
    facts = AttemptFacts(exit_code=1, timed_out=True, timeout_s=5, missing_outputs=("x",))
    assert classify(facts, attempt=1, max_retries=1).outcome is Outcome.TIMED_OUT


def test_every_verdict_targets_a_state_a_running_job_may_move_to() -> None:
    from gpuwarden.core.states import allowed

    cases = [
        AttemptFacts(exit_code=0),
        AttemptFacts(exit_code=1),
        AttemptFacts(exit_code=0, missing_outputs=("x",)),
        AttemptFacts(exit_code=None, timed_out=True),
        AttemptFacts(exit_code=None, stopped=True, cancel_requested=True),
        AttemptFacts(exit_code=None, stopped=True),
        LAUNCH,
        INTERRUPTED,
    ]
    for facts in cases:
        for attempt in (1, 5):
            verdict = classify(facts, attempt=attempt, max_retries=2)
            assert allowed(JobState.RUNNING, verdict.target), (facts, verdict)


def test_cuda_oom_is_the_jobs_own_when_it_had_the_gpu_alone() -> None:
    alone = AttemptFacts(
        exit_code=1, cuda_oom=True, gpu_alone=True, stderr_tail="CUDA out of memory"
    )
    verdict = classify(alone, attempt=1, max_retries=3)
    assert verdict.outcome is Outcome.CUDA_OOM and verdict.target is JobState.FAILED
    assert "footprint is too small" in verdict.reason
    shared = AttemptFacts(exit_code=1, cuda_oom=True, gpu_alone=False)
    retried = classify(shared, attempt=1, max_retries=3)
    assert retried.outcome is Outcome.CUDA_OOM_SHARED and retried.target is JobState.QUEUED
    assert retried.reason.startswith("CUDA out of memory beside another job")


def test_oom_markers() -> None:
    assert is_cuda_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    assert is_cuda_oom("gpuwarden.errors.SimOutOfMemoryError: CUDA out of memory. Tried")
    assert not is_cuda_oom("ValueError: out of range")


def test_sigkill_from_outside_is_infrastructure_but_our_own_stop_is_not() -> None:
    killed = classify(AttemptFacts(exit_code=-9), attempt=1, max_retries=1)
    assert killed.outcome is Outcome.KILLED and killed.target is JobState.QUEUED
    timed = classify(
        AttemptFacts(exit_code=-9, timed_out=True, timeout_s=5), attempt=1, max_retries=1
    )
    assert timed.outcome is Outcome.TIMED_OUT and timed.target is JobState.FAILED


def test_gpu_fault_and_application_error() -> None:
    fault = classify(
        AttemptFacts(exit_code=None, stopped=True, gpu_fault="Xid 79"), attempt=1, max_retries=1
    )
    assert fault.outcome is Outcome.GPU_FAULT and fault.target is JobState.QUEUED
    assert "its GPU reported a fault (Xid 79)" in fault.reason
    app = classify(
        AttemptFacts(exit_code=None, stopped=True, app_error="Xid 13"), attempt=1, max_retries=5
    )
    assert app.outcome is Outcome.JOB_FAILED and app.target is JobState.FAILED


def test_exit_137_says_whether_the_container_runtime_recorded_an_oom_kill() -> None:
    oom = classify(AttemptFacts(exit_code=137, oom_killed=True), attempt=1, max_retries=1)
    assert oom.outcome is Outcome.KILLED and oom.target is JobState.QUEUED
    assert oom.reason.startswith("killed for memory: the container runtime recorded an OOM kill")
    other = classify(AttemptFacts(exit_code=137, oom_killed=False), attempt=2, max_retries=1)
    assert other.outcome is Outcome.KILLED and other.target is JobState.QUARANTINED
    assert "the container runtime recorded no OOM kill" in other.reason
    unknown = classify(AttemptFacts(exit_code=137), attempt=1, max_retries=1)
    assert "recorded" not in unknown.reason  # no runtime: it cannot say
    # an OOM kill does not turn a clean exit into a failure
    assert classify(
        AttemptFacts(exit_code=0, oom_killed=True), attempt=1, max_retries=1
    ).target is (JobState.DONE)


# -- a job's own RAM cap (ram_gib), enforced by the kernel --------------------

CAP = 2 * 2**30


@pytest.mark.parametrize("code", [-9, 137])
def test_killed_at_its_own_ram_cap_is_the_jobs_failure_not_retried(code: int) -> None:
    facts = AttemptFacts(exit_code=code, oom_killed=True, ram_cap_bytes=CAP)
    verdict = classify(facts, attempt=1, max_retries=3)
    assert verdict == Verdict(
        Outcome.RAM_CAP_EXCEEDED,
        JobState.FAILED,
        "killed for memory: it passed its RAM cap of 2.00 GiB (ram_gib) and the kernel "
        "stopped it (OOM kill in its memory cgroup); raise ram_gib or use less memory",
    )
    assert Outcome.RAM_CAP_EXCEEDED not in INFRASTRUCTURE
    assert Outcome.RAM_CAP_EXCEEDED.value == "ram_cap_exceeded"


def test_a_child_killed_at_the_cap_fails_the_job_with_the_exit_code_said() -> None:
    facts = AttemptFacts(exit_code=1, oom_killed=True, ram_cap_bytes=CAP // 4, stderr_tail="x")
    verdict = classify(facts, attempt=1, max_retries=3)
    assert verdict.outcome is Outcome.RAM_CAP_EXCEEDED and verdict.target is JobState.FAILED
    assert "RAM cap of 0.50 GiB" in verdict.reason and "exited with code 1" in verdict.reason


def test_under_its_cap_without_an_oom_kill_a_sigkill_stays_killed() -> None:
    facts = AttemptFacts(exit_code=137, oom_killed=False, ram_cap_bytes=CAP)
    verdict = classify(facts, attempt=1, max_retries=3)
    assert verdict.outcome is Outcome.KILLED and verdict.target is JobState.QUEUED


def test_without_a_cap_the_runtimes_oom_kill_is_still_retried() -> None:
    facts = AttemptFacts(exit_code=137, oom_killed=True)
    verdict = classify(facts, attempt=1, max_retries=3)
    assert verdict.outcome is Outcome.KILLED and verdict.target is JobState.QUEUED
    assert verdict.reason.startswith("killed for memory: the container runtime recorded")


def test_a_capped_job_that_succeeds_or_is_cancelled_is_not_a_cap_failure() -> None:
    ok = AttemptFacts(exit_code=0, oom_killed=False, ram_cap_bytes=CAP)
    assert classify(ok, attempt=1, max_retries=0).outcome is Outcome.SUCCEEDED
    cancelled = AttemptFacts(
        exit_code=-9, oom_killed=True, ram_cap_bytes=CAP, stopped=True, cancel_requested=True
    )
    assert classify(cancelled, attempt=1, max_retries=0).outcome is Outcome.CANCELLED


def test_a_stopped_service_is_done_and_an_unhealthy_one_is_retried_then_quarantined() -> None:
    stopped = AttemptFacts(exit_code=-15, stopped=True, stopped_by="alice")
    assert classify(stopped, attempt=1, max_retries=1) == Verdict(
        Outcome.SUCCEEDED, JobState.DONE, "stopped by alice"
    )
    why = "the service failed its health check (GET /healthz: refused) for 3 s"
    sick = AttemptFacts(exit_code=-15, stopped=True, service_unhealthy=why)
    first = classify(sick, attempt=1, max_retries=1)
    assert first.outcome is Outcome.SERVICE_UNHEALTHY and first.target is JobState.QUEUED
    last = classify(sick, attempt=2, max_retries=1)
    assert last.target is JobState.QUARANTINED and last.reason.startswith(why)


FULL = "the node's disk under /state/jobs/j/attempt-1 is full (3.0 MiB free of 900 MiB)"


def test_a_failure_while_the_nodes_disk_is_full_is_the_hosts_and_is_retried() -> None:
    failed = classify(AttemptFacts(exit_code=1, host_disk_full=FULL), attempt=1, max_retries=2)
    assert failed.outcome is Outcome.HOST_FAULT and failed.target is JobState.QUEUED
    assert FULL in failed.reason and "not the job's" in failed.reason
    assert failed.reason.endswith("retrying (1/2)")
    missing = AttemptFacts(exit_code=0, missing_outputs=("a.wav",), host_disk_full=FULL)
    verdict = classify(missing, attempt=3, max_retries=2)
    assert verdict.outcome is Outcome.HOST_FAULT and verdict.target is JobState.QUARANTINED
    # the same failures on a disk with room are the job's own
    assert classify(AttemptFacts(exit_code=1), attempt=1, max_retries=2).outcome is (
        Outcome.JOB_FAILED
    )
    # success stays success, and a RAM cap's kill stays the job's, whatever the disk
    done = classify(AttemptFacts(exit_code=0, host_disk_full=FULL), attempt=1, max_retries=2)
    assert done.outcome is Outcome.SUCCEEDED
    capped = AttemptFacts(exit_code=-9, oom_killed=True, ram_cap_bytes=2**30, host_disk_full=FULL)
    assert classify(capped, attempt=1, max_retries=2).outcome is Outcome.RAM_CAP_EXCEEDED
