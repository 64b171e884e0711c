"""How the broker follows a release it asked of a managed runtime, on the device's
readings (gpuwarden.node.runtimes.ManagedRuntimes.follow), tick by tick."""

from __future__ import annotations

from typing import Any

from gpuwarden.core.model import GIB
from gpuwarden.core.policy import AskRuntime, GpuView
from gpuwarden.core.runtime import (
    Activity,
    BusySignal,
    Capabilities,
    Reading,
    ReleaseSafety,
    RuntimeKind,
)
from gpuwarden.node.running import Mailbox, RuntimeNote
from gpuwarden.node.runtimes import HANDOFF_S, ManagedRuntimes
from gpuwarden.node.settings import RuntimeSpec

URL = "http://127.0.0.1:1"


class Device:
    """What the VRAM book would show: the runtime's bytes on one GPU."""

    def __init__(self) -> None:
        self.bytes = 16 * GIB
        self.runtime_pids: dict[str, set[int]] = {}
        #: gpuwarden's own jobs of each runtime, as the VRAM book holds them
        self.jobs: dict[str, list[str]] = {}

    def views(self) -> tuple[GpuView, ...]:
        named = (("ollama", self.bytes),) if self.bytes else ()
        return (GpuView("G", 24 * GIB, runtimes=named),)

    def runtime_jobs(self) -> dict[str, list[str]]:
        return self.jobs


def book(timeout_s: float = 10.0) -> tuple[ManagedRuntimes, Device, list[tuple[str, Any]]]:
    events: list[tuple[str, Any]] = []
    device = Device()
    rts = ManagedRuntimes(
        (
            RuntimeSpec(
                "ollama", RuntimeKind.OLLAMA, "http://127.0.0.1:1", release_timeout_s=timeout_s
            ),
        ),
        vram=device,  # type: ignore[arg-type]
        mailbox=Mailbox(),
        clock=lambda: 0.0,
        emit=lambda kind, **detail: events.append((kind, detail)),
    )
    # one look: it answers, with Ollama's capabilities
    caps = Capabilities(BusySignal.HEURISTIC, ReleaseSafety.WAITS)
    rts.on_note(RuntimeNote("ollama", 0.0, frozenset({1}), Reading(Activity.UNKNOWN), caps))
    return rts, device, events


def test_released_once_the_device_shows_it_then_a_reload_in_the_handoff_is_reported() -> None:
    rts, device, events = book()
    rts.ask(AskRuntime("ollama", "G", 16 * GIB, "j"), now=100.0)
    rts.ask(AskRuntime("ollama", "G", 16 * GIB, "j"), now=100.5)  # one release at a time
    assert [k for k, _ in events] == ["runtime_release_requested"]
    assert not rts.follow(101.0)  # asked, nothing back yet
    device.bytes = 0
    assert rts.follow(102.5)
    kind, detail = events[-1]
    assert kind == "runtime_released"
    assert (detail["after_s"], detail["bytes"], detail["job"]) == (2.5, 16 * GIB, "j")
    device.bytes = 16 * GIB  # a client pinned the model again (keep_alive -1)
    assert rts.follow(110.0)
    kind, detail = events[-1]
    assert kind == "runtime_reloaded_during_handoff"
    assert (detail["reloads"], detail["bytes"]) == (1, 16 * GIB)
    assert rts.statuses(110.0)[0]["reloads_during_handoff"] == 1


def test_our_own_runtime_jobs_preload_in_the_handoff_is_no_reload() -> None:
    """Issue 31: gpuwarden's preload for its own job of that runtime was counted
    as a client pinning the model again."""
    rts, device, events = book()
    rts.ask(AskRuntime("ollama", "G", 16 * GIB, "j"), now=100.0)
    device.bytes = 0
    assert rts.follow(102.5)
    assert events[-1][0] == "runtime_released"
    device.jobs = {"ollama": ["chat-1"]}  # a runtime job of ours starts: its preload
    device.bytes = 16 * GIB
    rts.follow(104.0)
    assert "runtime_reloaded_during_handoff" not in [k for k, _ in events]
    assert rts.statuses(104.0)[0]["reloads_during_handoff"] == 0


def test_a_reload_after_the_handoff_window_is_no_handoff() -> None:
    rts, device, events = book()
    rts.ask(AskRuntime("ollama", "G", 16 * GIB, "j"), now=0.0)
    device.bytes = 0
    rts.follow(1.0)
    rts.follow(1.0 + HANDOFF_S + 1)
    device.bytes = 16 * GIB
    rts.follow(2.0 + HANDOFF_S + 1)
    assert "runtime_reloaded_during_handoff" not in [k for k, _ in events]


def test_nothing_back_by_the_deadline_is_ineffective_until_its_memory_moves() -> None:
    rts, device, events = book(timeout_s=5.0)
    rts.ask(AskRuntime("ollama", "G", 16 * GIB, "j"), now=0.0)
    assert not rts.follow(4.0)
    assert rts.follow(6.0)
    kind, detail = events[-1]
    assert (kind, detail["residual_bytes"]) == ("runtime_release_ineffective", 16 * GIB)
    [view] = rts.views(6.0)
    assert not view.may_ask and "release-ineffective: 16.0 GiB stayed" in view.why
    device.bytes = 4 * GIB  # it let some go by itself: it may be asked again later
    assert rts.follow(7.0)
    assert "release-ineffective" not in rts.views(7.0)[0].why
