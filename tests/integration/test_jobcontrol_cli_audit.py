"""Job control from the CLI on the host is audited as the API audits it (SPEC.md
section 1, "Job control", and section 15, "Audit log"): hold, release, requeue,
priority, cancel and stop each write a row, its refusals too, with this host's user
as the actor (``local``) and the detail the API's route writes."""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden import cli
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.store.base import AuditRow
from gpuwarden.store.sqlite import SqliteStore


@pytest.fixture
def state(tmp_path: Path, clean_env: dict[str, str]) -> Iterator[Path]:
    folder = tmp_path / "state"
    store = SqliteStore(folder / "gpuwarden.db")
    try:
        for job_id in ("q", "r", "e"):
            spec = JobSpec(id=job_id, type="echo.echo", params={"text": "x"}, priority=2)
            store.submit([spec], now=1.0)
        store.start_attempt("r", node="n", gpu_uuid=None, now=2.0)
        store.request_cancel("e", now=3.0)
    finally:
        store.close()
    yield folder


def gw(capsys: pytest.CaptureFixture[str], folder: Path, *args: str) -> tuple[int, str]:
    code = cli.main(["--state-dir", str(folder), *args])
    got = capsys.readouterr()
    return code, got.out + got.err


def rows(folder: Path) -> list[AuditRow]:
    store = SqliteStore(folder / "gpuwarden.db")
    try:
        return list(store.audit_rows())
    finally:
        store.close()


def test_each_job_control_action_on_the_host_writes_an_audit_row(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in (
        ("hold", "q"),
        ("priority", "q", "7"),
        ("release", "q"),
        ("requeue", "e"),
        ("cancel", "q"),
        ("stop", "r"),
    ):
        code, said = gw(capsys, state, *args)
        assert code == 0, said
    got = {r.action: r for r in rows(state)}
    assert set(got) == {
        "job.hold", "job.priority", "job.release", "job.requeue", "job.cancel", "job.stop"
    }  # fmt: skip
    user = getpass.getuser()
    for r in got.values():
        assert (r.actor, r.actor_name, r.role, r.outcome) == ("local", user, "local", "ok")
    assert got["job.hold"].target == "q"
    assert got["job.hold"].detail == {"hold_by": f"{user} (on the host)"}
    assert got["job.priority"].detail == {"from": 2, "to": 7}
    assert got["job.release"].detail == {"held_by": f"{user} (on the host)"}
    assert got["job.requeue"].detail == {"from": "cancelled", "attempts": 0}
    assert got["job.cancel"].detail == {"state": JobState.CANCELLED.value}
    assert got["job.stop"].target == "r" and got["job.stop"].detail == {"state": "running"}


def test_refusals_on_the_host_are_audited_too(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, said = gw(capsys, state, "hold", "r")
    assert code == 2 and "only a queued job can be held" in said
    code, said = gw(capsys, state, "release", "q")
    assert code == 2 and "nothing to release" in said
    code, said = gw(capsys, state, "priority", "q", "high")
    assert code == 2 and "priority must be an integer" in said
    code, said = gw(capsys, state, "requeue", "nope")
    assert code == 2 and "no job with id 'nope'" in said
    code, said = gw(capsys, state, "cancel", "e")
    assert code == 2 and "nothing to cancel" in said
    refused = [(r.action, r.target, r.outcome) for r in rows(state)]
    assert [(a, t) for a, t, _ in refused] == [
        ("job.hold", "r"),
        ("job.release", "q"),
        ("job.priority", "q"),
        ("job.requeue", "nope"),
        ("job.cancel", "e"),
    ]
    assert all(o.startswith("refused: ") for _, _, o in refused)
    assert "only a queued job can be held" in refused[0][2]
    assert "no job with id 'nope'" in refused[3][2]
