"""What a job stopped for a sandbox limit means for it: its own failure, final."""

from __future__ import annotations

import pytest

from gpuwarden.core.classify import AttemptFacts, Outcome, classify
from gpuwarden.core.states import JobState
from gpuwarden.launch.sandbox import output_limit_reason


@pytest.mark.parametrize("exit_code", [-15, -9, 0, 1])
def test_output_past_its_limit_is_the_jobs_own_failure_and_never_retried(exit_code: int) -> None:
    # however the stopped job ended: SIGTERM, SIGKILL after the grace, or an exit
    # of its own before the final check found it past the limit
    facts = AttemptFacts(exit_code=exit_code, limit_exceeded=output_limit_reason(8 * 2**20))
    verdict = classify(facts, attempt=1, max_retries=3)
    assert verdict.outcome is Outcome.JOB_FAILED
    assert verdict.target is JobState.FAILED
    assert verdict.reason.startswith("output past 8 MiB: the sandbox stopped the job")
    assert "retrying" not in verdict.reason and "quarantined" not in verdict.reason


def test_a_limit_does_not_hide_a_launch_error_or_a_gpu_fault() -> None:
    launch = AttemptFacts(exit_code=None, launch_error="x", limit_exceeded="output past 1 MiB")
    assert classify(launch, attempt=1, max_retries=1).outcome is Outcome.LAUNCH_ERROR
    fault = AttemptFacts(exit_code=-9, gpu_fault="Xid 79", limit_exceeded="output past 1 MiB")
    assert classify(fault, attempt=1, max_retries=1).outcome is Outcome.GPU_FAULT


def test_a_limit_wins_over_a_timeout_and_a_signal() -> None:
    facts = AttemptFacts(exit_code=-9, timed_out=True, limit_exceeded="output past 1 MiB")
    assert classify(facts, attempt=1, max_retries=2).outcome is Outcome.JOB_FAILED


def test_the_reason_names_the_limit_in_mib() -> None:
    assert output_limit_reason(16384 * 2**20) == "output past 16384 MiB"
    assert output_limit_reason(2**19) == "output past 0.5 MiB"
