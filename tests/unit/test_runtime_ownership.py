"""When a managed runtime may be asked to release (gpuwarden.core.runtime.Ownership)."""

from __future__ import annotations

from gpuwarden.core.runtime import Activity, Ownership, Reading


def test_never_while_busy_then_only_past_the_grace_since_the_last_work() -> None:
    o = Ownership(idle_grace_s=300, registered_at=0.0)
    assert o.may_ask(0.0) == (False, "not looked at yet")
    o.see(Reading(Activity.BUSY, "queue_running has 1 prompt"), now=10.0)
    assert o.may_ask(10.0) == (False, "busy (queue_running has 1 prompt)")
    o.see(Reading(Activity.IDLE), now=20.0)
    ok, why = o.may_ask(200.0)
    assert not ok and why == "in its grace: idle for 190 s of 300 s"
    ok, why = o.may_ask(310.0)
    assert ok and why == "idle for 300 s"


def test_the_grace_starts_at_registration() -> None:
    o = Ownership(idle_grace_s=60, registered_at=100.0)
    o.see(Reading(Activity.IDLE), now=100.0)
    assert not o.may_ask(150.0)[0]
    assert o.may_ask(160.0)[0]


def test_unknown_is_busy_until_the_grace_has_passed_since_a_sign_of_work() -> None:
    o = Ownership(idle_grace_s=300, registered_at=0.0)
    o.see(Reading(Activity.UNKNOWN), now=0.0)
    o.see(Reading(Activity.UNKNOWN, "expires_at moved", worked=True), now=250.0)
    ok, why = o.may_ask(400.0)
    assert not ok and why == "in its grace: no sign of work for 150 s of 300 s"
    o.see(Reading(Activity.UNKNOWN), now=560.0)
    ok, why = o.may_ask(560.0)
    assert ok and "it has no busy signal" in why
