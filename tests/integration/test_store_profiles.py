"""Measured profiles in the store (migration 0008), on every backend (conftest.store):
a job's declared ``est_s``, each attempt's RAM peak, each type's largest one."""

from __future__ import annotations

from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.store.base import Store
from gpuwarden.store.rows import spec_hash


def test_est_s_is_stored_with_the_job_and_in_its_queue_entry(store: Store) -> None:
    store.submit(
        [JobSpec("a", "t.x", est_s=42.5), JobSpec("b", "t.x")],
        now=1.0,
    )
    a, b = store.get_job("a"), store.get_job("b")
    assert a is not None and a.est_s == 42.5
    assert b is not None and b.est_s is None
    entries = {e.id: e for e in store.queue_entries()}
    assert entries["a"].est_s == 42.5 and entries["b"].est_s is None
    assert [e.est_s for e in store.queue_entries(["a"])] == [42.5]


def test_est_s_is_part_of_what_a_resubmission_must_match() -> None:
    plain = JobSpec("a", "t.x")
    assert spec_hash(plain) == spec_hash(JobSpec("a", "t.x", est_s=None))
    assert spec_hash(plain) != spec_hash(JobSpec("a", "t.x", est_s=10.0))


def test_a_ram_peak_is_kept_per_attempt_and_the_largest_per_type(store: Store) -> None:
    store.submit([JobSpec("a", "t.x"), JobSpec("b", "t.x"), JobSpec("c", "t.y")], now=1.0)
    assert store.type_profiles() == {}
    for job_id, nbytes in (("a", 300 << 20), ("b", 200 << 20), ("c", 50 << 20)):
        store.start_attempt(job_id, node="n", gpu_uuid=None, now=2.0)
        store.record_ram_peak(job_id, 1, "t.y" if job_id == "c" else "t.x", nbytes, now=3.0)
        store.finish_attempt(
            job_id, 1, target=JobState.DONE, now=4.0, outcome="succeeded", reason="ok"
        )
    assert [a.ram_peak_bytes for a in store.attempts("a")] == [300 << 20]
    assert [a.ram_peak_bytes for a in store.attempts("b")] == [200 << 20]
    profiles = store.type_profiles()
    assert set(profiles) == {"t.x", "t.y"}
    # b's lower peak did not lower the type's: a's stays, with a's id
    assert (profiles["t.x"].ram_peak_bytes, profiles["t.x"].job_id) == (300 << 20, "a")
    assert profiles["t.y"].ram_peak_bytes == 50 << 20


def test_an_attempt_without_a_measurement_has_no_ram_peak(store: Store) -> None:
    store.submit([JobSpec("a", "t.x")], now=1.0)
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    assert [a.ram_peak_bytes for a in store.attempts("a")] == [None]
