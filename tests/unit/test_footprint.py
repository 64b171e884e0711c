"""The footprint rule (core/footprint.py): what a job is admitted with, and when a
measured peak or a CUDA out-of-memory raises its type's footprint."""

from __future__ import annotations

from gpuwarden.core import footprint
from gpuwarden.core.model import GIB, MIB
from gpuwarden.core.policy import GpuView

STEP = 64 * MIB
GPUS = (GpuView("G0", 24 * GIB, reserve_bytes=GIB), GpuView("G1", 16 * GIB))


def test_the_effective_footprint_is_the_declaration_raised_to_the_measurement() -> None:
    assert footprint.effective(4 * GIB, None, 0) == 4 * GIB
    assert footprint.effective(4 * GIB, 2 * GIB, 0) == 2 * GIB  # the job's own
    assert footprint.effective(4 * GIB, 2 * GIB, 3 * GIB) == 3 * GIB  # never below measured
    assert footprint.effective(4 * GIB, None, 3 * GIB) == 4 * GIB  # never lowered


def test_a_peak_within_what_the_job_was_admitted_with_raises_nothing() -> None:
    assert footprint.raised(4 * GIB, admitted=4 * GIB, measured=0, step=STEP, gpus=GPUS) is None


def test_a_peak_above_it_is_rounded_up_to_the_step() -> None:
    new = footprint.raised(4 * GIB + 1, admitted=4 * GIB, measured=0, step=STEP, gpus=GPUS)
    assert new == 4 * GIB + STEP


def test_a_raise_never_goes_past_the_largest_gpus_room() -> None:
    new = footprint.raised(30 * GIB, admitted=4 * GIB, measured=0, step=STEP, gpus=GPUS)
    assert new == 23 * GIB  # 24 GiB less the reserve: never locked out for good


def test_no_raise_below_what_is_measured_already() -> None:
    peak = 5 * GIB
    assert footprint.raised(peak, admitted=4 * GIB, measured=6 * GIB, step=STEP, gpus=GPUS) is None


def test_without_gpus_the_peak_is_its_own_ceiling() -> None:
    assert footprint.raised(5 * GIB, admitted=4 * GIB, measured=0, step=STEP, gpus=()) == 5 * GIB


def test_after_a_cuda_oom_half_as_much_again_as_it_reached() -> None:
    assert footprint.after_oom(4 * GIB, 2 * GIB) == 6 * GIB
    assert footprint.after_oom(4 * GIB, 6 * GIB) == 9 * GIB
