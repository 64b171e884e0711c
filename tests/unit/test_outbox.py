"""The agent's durable outbox: reports kept on disk in order until answered, and
the event cursor beside them."""

from __future__ import annotations

import stat
from pathlib import Path

from gpuwarden.cluster.outbox import Outbox, Saved


def report(kind: str, job: str, **kw: object) -> Saved:
    return Saved(seq=0, kind=kind, job_id=job, local_id=job, lease_id="L", **kw)  # type: ignore[arg-type]


def test_reports_are_kept_in_order_until_answered_and_survive_a_new_outbox(
    tmp_path: Path,
) -> None:
    box = Outbox(tmp_path / "box")
    assert stat.S_IMODE((tmp_path / "box").stat().st_mode) == 0o700
    a = box.put(report("start", "j1", body={"gpu": None}))
    b = box.put(report("finish", "j1", body={"state": "done"}, attempt=1))
    c = box.put(report("start", "j2"))
    assert a < b < c
    again = Outbox(tmp_path / "box")  # the agent started again
    assert [(s.seq, s.kind, s.job_id) for s in again.load()] == [
        (a, "start", "j1"),
        (b, "finish", "j1"),
        (c, "start", "j2"),
    ]
    assert again.load()[1].body == {"state": "done"} and again.load()[1].attempt == 1
    box.done(a)
    box.done(a)  # twice: nothing
    saved = again.load()[0]
    saved.uploaded = ["out/x.txt"]
    again.update(saved)
    assert [s.seq for s in Outbox(tmp_path / "box").load()] == [b, c]
    assert Outbox(tmp_path / "box").load()[0].uploaded == ["out/x.txt"]
    assert again.put(report("finish", "j2")) > c  # numbers go on after a restart


def test_the_cursor_and_a_damaged_report(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "box")
    assert box.cursor() is None
    box.save_cursor(41)
    assert Outbox(tmp_path / "box").cursor() == 41
    box.put(report("start", "j1"))
    (tmp_path / "box" / "000000000099.json").write_text("{not json")
    assert [s.job_id for s in box.load()] == ["j1"]  # the damaged one is left, logged
    assert Outbox(tmp_path / "box").put(report("start", "j3")) == 100  # never over it
    (tmp_path / "box" / "cursor").write_text("x")
    assert box.cursor() is None
    box.clear()
    assert box.load() == []
