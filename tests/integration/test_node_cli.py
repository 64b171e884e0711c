"""`gpuwarden node ...` without --url: straight on the store of the state directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwarden.cli import main
from gpuwarden.core.model import JobSpec
from gpuwarden.store.cluster import NodeState
from gpuwarden.store.sqlite import SqliteStore


def run(capsys: pytest.CaptureFixture[str], state: Path, *args: str) -> tuple[int, str, str]:
    code = main(["--state-dir", str(state), *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_node_commands_on_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    SqliteStore(state / "gpuwarden.db").close()
    code, out, _ = run(capsys, state, "node", "invite", "gpu-a", "--json")
    assert code == 0
    invite = json.loads(out)
    assert invite["node"] == "gpu-a" and invite["token"].startswith("gw_")
    code, out, _ = run(capsys, state, "node", "invite", "../x")
    assert code == 2
    code, out, _ = run(capsys, state, "node", "list", "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = run(capsys, state, "node", "drain", "gpu-a")
    assert code == 2 and "no node named" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        store.upsert_node("gpu-a", token_id="a" * 12, capabilities={}, now=1.0)
    finally:
        store.close()
    assert run(capsys, state, "node", "drain", "gpu-a")[0] == 0
    code, out, _ = run(capsys, state, "node", "list", "--json")
    assert [n["state"] for n in json.loads(out)] == ["draining"]
    code, _, err = run(capsys, state, "node", "revoke", "gpu-a")
    assert code == 0 and "revoked" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        node = store.get_node("gpu-a")
        assert node is not None and node.state is NodeState.REVOKED
        actions = [(a.action, a.actor) for a in store.audit_rows()]
    finally:
        store.close()
    assert ("node.invite", "local") in actions and ("node.revoke", "local") in actions


def test_node_diagnostic_on_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    store = SqliteStore(state / "gpuwarden.db")
    try:
        store.upsert_node("gpu-a", token_id="a" * 12, capabilities={}, now=1.0)
        store.submit([JobSpec(id="j1", type="echo.echo", params={"text": "x"})], now=1.0)
    finally:
        store.close()
    code, _, err = run(capsys, state, "node", "diagnostic", "gpu-a", "j1", "--reason", "fan")
    assert code == 2 and "draining" in err  # not drained: refused
    assert run(capsys, state, "node", "drain", "gpu-a")[0] == 0
    code, out, _ = run(
        capsys, state, "node", "diagnostic", "gpu-a", "j1", "--reason", "fan", "--json"
    )
    assert code == 0 and json.loads(out)["job"] == "j1"
    code, out, _ = run(capsys, state, "node", "list", "--json")
    assert [n["grant"]["job"] for n in json.loads(out)] == ["j1"]
    store = SqliteStore(state / "gpuwarden.db")
    try:
        node = store.get_node("gpu-a")
        assert node is not None and node.state is NodeState.DRAINING
        grant = store.open_grant("gpu-a")
        assert grant is not None and grant.job_id == "j1" and grant.reason == "fan"
        actions = [a.action for a in store.audit_rows()]
    finally:
        store.close()
    assert "node.diagnostic" in actions
