"""The VRAM ledger: per GPU, who holds how much; hold once, release once."""

from __future__ import annotations

import pytest

from gpuwarden.core.ledger import Holding, HoldState, Ledger, LedgerError, compatible
from gpuwarden.core.model import GIB


def holding(
    holder: str,
    gib: float = 1,
    *,
    coresident: bool = False,
    state: HoldState = HoldState.RUNNING,
    since: float = 0.0,
) -> Holding:
    return Holding(holder, "t.model", int(gib * GIB), coresident, state, None, since)


def test_a_new_ledger_knows_its_gpus_and_holds_nothing() -> None:
    ledger = Ledger(["G0", "G1"])
    assert ledger.gpus() == ["G0", "G1"]
    assert len(ledger) == 0
    assert ledger.holdings("G0") == ()
    assert ledger.held_bytes("G1") == 0
    assert ledger.held_bytes("unknown") == 0
    assert ledger.holdings("unknown") == ()


def test_add_gpu_is_idempotent() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1"))
    ledger.add_gpu("G0")  # must not wipe what G0 holds
    ledger.add_gpu("G1")
    assert ledger.gpus() == ["G0", "G1"]
    assert ledger.held_bytes("G0") == GIB


def test_hold_and_held_bytes() -> None:
    ledger = Ledger(["G0", "G1"])
    ledger.hold("G0", holding("a/1", 2))
    ledger.hold("G0", holding("b/1", 3))
    ledger.hold("G1", holding("c/1", 5))
    assert ledger.held_bytes("G0") == 5 * GIB
    assert ledger.held_bytes("G1") == 5 * GIB
    assert len(ledger) == 3
    assert [h.holder for h in ledger.holdings("G0")] == ["a/1", "b/1"]
    assert ledger.gpu_of("c/1") == "G1"
    assert ledger.get("a/1") == holding("a/1", 2)


def test_hold_on_a_gpu_not_named_at_creation() -> None:
    ledger = Ledger()
    ledger.hold("G9", holding("a/1"))
    assert ledger.gpus() == ["G9"]
    assert ledger.held_bytes("G9") == GIB


def test_holding_twice_under_one_name_raises_even_on_another_gpu() -> None:
    ledger = Ledger(["G0", "G1"])
    ledger.hold("G0", holding("a/1"))
    with pytest.raises(LedgerError, match=r"a/1 already holds memory on G0"):
        ledger.hold("G0", holding("a/1"))
    with pytest.raises(LedgerError, match="already holds"):
        ledger.hold("G1", holding("a/1"))
    assert ledger.held_bytes("G0") == GIB  # unchanged
    assert ledger.held_bytes("G1") == 0


def test_a_negative_holding_raises() -> None:
    ledger = Ledger(["G0"])
    with pytest.raises(LedgerError, match="negative"):
        ledger.hold("G0", Holding("a/1", "t", -1))
    assert len(ledger) == 0
    assert ledger.get("a/1") is None


def test_a_zero_byte_holding_is_allowed() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", Holding("a/1", "t", 0))
    assert len(ledger) == 1
    assert ledger.held_bytes("G0") == 0


def test_update_grows_and_changes_state() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1", 2, since=5.0))
    grown = ledger.update("a/1", bytes=3 * GIB)
    assert grown.bytes == 3 * GIB
    assert ledger.held_bytes("G0") == 3 * GIB
    reclaiming = ledger.update("a/1", state=HoldState.RECLAIMING)
    assert reclaiming.state is HoldState.RECLAIMING
    assert reclaiming.bytes == 3 * GIB  # still counted until released
    assert reclaiming.since == 5.0
    assert ledger.get("a/1") == reclaiming
    assert ledger.held_bytes("G0") == 3 * GIB


def test_update_of_an_unknown_holder_raises() -> None:
    ledger = Ledger(["G0"])
    with pytest.raises(LedgerError, match="holds nothing"):
        ledger.update("ghost/1", bytes=1)


def test_update_with_an_unknown_field_raises_type_error() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1"))
    with pytest.raises(TypeError):
        ledger.update("a/1", colour="red")


def test_release_returns_the_holding_and_frees_it() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1", 2))
    ledger.hold("G0", holding("b/1", 1))
    released = ledger.release("a/1")
    assert released == holding("a/1", 2)
    assert ledger.held_bytes("G0") == GIB
    assert ledger.get("a/1") is None
    assert ledger.gpu_of("a/1") is None
    assert len(ledger) == 1


def test_double_release_raises() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1"))
    ledger.release("a/1")
    with pytest.raises(LedgerError, match="released twice"):
        ledger.release("a/1")
    assert ledger.held_bytes("G0") == 0


def test_releasing_what_was_never_held_raises() -> None:
    with pytest.raises(LedgerError, match="holds nothing"):
        Ledger(["G0"]).release("never/1")


def test_a_released_name_may_hold_again() -> None:
    ledger = Ledger(["G0", "G1"])
    ledger.hold("G0", holding("a/1"))
    ledger.release("a/1")
    ledger.hold("G1", holding("a/1", 4))
    assert ledger.gpu_of("a/1") == "G1"
    assert ledger.held_bytes("G0") == 0
    assert ledger.held_bytes("G1") == 4 * GIB


def test_holding_json_round_trip() -> None:
    h = Holding("a/1", "m.t", 123, True, HoldState.WARM, "a", 7.5)
    assert Holding.from_json(h.to_json()) == h
    assert h.to_json()["state"] == "warm"


def test_evolve_leaves_the_original() -> None:
    h = holding("a/1")
    h2 = h.evolve(bytes=5)
    assert h.bytes == GIB
    assert h2.bytes == 5
    assert h2.holder == "a/1"


# --- compatible ---------------------------------------------------------------------


def test_anyone_may_join_an_empty_gpu() -> None:
    assert compatible(False, [])
    assert compatible(True, [])
    assert compatible(True, iter(()))


def test_a_coresident_newcomer_joins_coresident_holders() -> None:
    held = [holding("a/1", coresident=True), holding("b/1", coresident=True)]
    assert compatible(True, held)


def test_an_exclusive_newcomer_never_joins_anyone() -> None:
    assert not compatible(False, [holding("a/1", coresident=True)])
    assert not compatible(False, [holding("a/1", coresident=False)])


def test_a_coresident_newcomer_never_joins_an_exclusive_holder() -> None:
    held = [holding("a/1", coresident=True), holding("b/1", coresident=False)]
    assert not compatible(True, held)


def test_reclaiming_and_warm_holdings_count_like_any_other() -> None:
    reclaiming = holding("a/1", coresident=False, state=HoldState.RECLAIMING)
    warm = holding("w", coresident=True, state=HoldState.WARM)
    assert not compatible(True, [reclaiming])  # the reclaim gate
    assert not compatible(False, [warm])
    assert compatible(True, [warm])


def test_compatible_accepts_a_generator() -> None:
    ledger = Ledger(["G0"])
    ledger.hold("G0", holding("a/1", coresident=True))
    assert compatible(True, (h for h in ledger.holdings("G0")))
    assert not compatible(False, (h for h in ledger.holdings("G0")))
