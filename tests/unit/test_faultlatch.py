"""The fault latch's rules: what a broker puts back at its start, and the reason."""

from __future__ import annotations

from gpuwarden.core.faultlatch import Latch, latched_reason, restore

A, B = "GPU-a", "GPU-b"


def test_the_store_is_the_truth_when_it_answers() -> None:
    stored = [Latch(A, 79, 10.0)]
    # the file's older latch on A was cleared in the store: it stays closed
    latches, lost = restore(stored, [Latch(A, 48, 5.0)], known=[(A, 5.0), (A, 10.0)])
    assert latches == [Latch(A, 79, 10.0)] and lost == []


def test_a_latch_the_store_never_had_is_kept_and_written_again() -> None:
    latches, lost = restore([], [Latch(B, 94, 3.0)], known=[])
    assert latches == [Latch(B, 94, 3.0)] and lost == [Latch(B, 94, 3.0)]


def test_a_latch_the_store_closed_is_not_brought_back_by_the_file() -> None:
    latches, lost = restore([], [Latch(B, 94, 3.0)], known=[(B, 3.0)])
    assert latches == [] and lost == []


def test_without_the_store_the_files_latches_hold_one_per_gpu() -> None:
    filed = [Latch(A, 48, 9.0), Latch(A, 79, 2.0), Latch(B, 63, 4.0)]
    latches, lost = restore(None, filed)
    assert sorted(latches, key=lambda x: x.gpu) == [Latch(A, 79, 2.0), Latch(B, 63, 4.0)]
    assert lost == []


def test_the_file_entries_that_are_not_latches_are_left_out() -> None:
    assert Latch.from_json({"gpu": A, "xid": 79, "latched_at": 1}) == Latch(A, 79, 1.0)
    for bad in (
        None,
        [],
        {"gpu": A},
        {"gpu": "", "xid": 1, "latched_at": 1.0},
        {"gpu": A, "xid": True, "latched_at": 1.0},
        {"gpu": A, "xid": 79, "latched_at": "now"},
    ):
        assert Latch.from_json(bad) is None
    assert Latch.from_json(Latch(B, 63, 4.5).to_json()) == Latch(B, 63, 4.5)


def test_the_reason_says_since_when_and_that_only_gpu_clear_ends_it() -> None:
    why = latched_reason(Latch(A, 79, 0.0))
    assert why.startswith("Xid 79 (latched since 1970-01-01 00:00:00 UTC)")
    assert f"`gpuwarden gpu clear {A} --reason TEXT` ends it" in why
    assert "a broker restart does not" in why
