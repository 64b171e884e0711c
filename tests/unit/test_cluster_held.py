"""The agent's held-lease file (gpuwarden.cluster.held): kept across restarts."""

from __future__ import annotations

from pathlib import Path

from gpuwarden.cluster.held import Held, held_rows, load_held, save_held


def test_held_leases_round_trip_for_the_same_node_only(tmp_path: Path) -> None:
    path = tmp_path / "agent-held.json"
    held = [
        Held(job_id="j1", local_id="j1", lease_id="aa"),
        Held(job_id="j2", local_id="j2.2", lease_id="bb"),
        Held(job_id="j3", local_id="j3", lease_id="cc", lost=True),  # not kept
    ]
    save_held(path, "n1", held_rows(held))
    assert path.stat().st_mode & 0o777 == 0o600
    got = load_held(path, "n1")
    assert [(h.job_id, h.local_id, h.lease_id) for h in got] == [
        ("j1", "j1", "aa"),
        ("j2", "j2.2", "bb"),
    ]
    assert load_held(path, "n2") == []  # another node's


def test_a_missing_or_broken_file_holds_nothing(tmp_path: Path) -> None:
    path = tmp_path / "agent-held.json"
    assert load_held(path, "n1") == []
    path.write_text("{not json")
    assert load_held(path, "n1") == []
    path.write_text('{"node": "n1", "held": [{"job": "j1"}]}')
    assert load_held(path, "n1") == []
