"""What a job or its module wrote (a reason, an event's detail) is shown as it is
by ``jobs`` and ``show``: never read as the terminal library's markup, which
would drop ``[sandbox]`` from "set [sandbox] weights_dir" or let a job style the
operator's screen."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuwarden.core.states import JobState
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_est_s import _run

REASON = "no weights dir: set [sandbox] weights_dir, then [bold red]retry[/]"


def test_jobs_and_show_print_a_reason_with_brackets_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    SqliteStore(state / "gpuwarden.db").close()
    base = ["--state-dir", str(state)]
    code, _, err = _run(capsys, *base, "submit", "echo.echo", "--text", "hi", "--id", "m1")
    assert code == 0, err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        now = time.time()
        store.start_attempt("m1", node="n", gpu_uuid=None, now=now)
        store.finish_attempt(
            "m1", 1, target=JobState.FAILED, now=now, outcome="worker_error", reason=REASON,
            detail={"why": REASON},
        )  # fmt: skip
        store.commit()
        job = store.get_job("m1")
        assert job is not None and job.reason == REASON  # the bracketed reason is stored
    finally:
        store.close()
    code, out, err = _run(capsys, *base, "show", "m1")
    assert code == 0, err
    assert f"reason: {REASON}" in out
    assert "[sandbox] weights_dir" in " ".join(out.split())
    code, out, err = _run(capsys, *base, "jobs")
    assert code == 0, err
    assert "[sandbox]" in out and "[bold red]" in out
