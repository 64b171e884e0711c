"""The coordinator's result bundles: outputs on an agent's disk are not packed;
``outputs_on`` and a note say where they are."""

from __future__ import annotations

import dataclasses
import json
import time
import zipfile
from pathlib import Path
from typing import Any

from gpuwarden.cluster.queues import QueueWatcher
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]


def test_outputs_left_on_the_agent_are_named_not_packed(tmp_path: Path) -> None:
    config = Config.model_validate(
        {"state_dir": tmp_path / "state", "module_paths": [REPO / "src" / "gpuwarden" / "modules"]}
    )
    registry = Registry.load(config.module_paths)
    root = QueueRoot.open(tmp_path / "queue", create=True)
    store = SqliteStore(tmp_path / "store.db")
    try:
        watcher = QueueWatcher(store, registry, config, [root])
        here = tmp_path / "here-out"
        (here / "sub").mkdir(parents=True)
        (here / "sub" / "echo.txt").write_text("near\n")
        specs = [
            prepare(registry, JobSpec(id=i, type="echo.echo", params={"text": i}))
            for i in ("far", "near")
        ]
        jobs = store.submit(
            specs,
            now=time.time(),
            origin=Submission(queue_root=str(root.path), bundle="b.zip"),
        )
        results: dict[str, dict[str, Any]] = {
            "far": {"output_dir": "/nowhere/attempt/out", "outputs": ["echo.txt"], "node": "n9"},
            "near": {"output_dir": str(here), "outputs": ["sub/echo.txt"], "node": "n1"},
        }
        done = [dataclasses.replace(j, state=JobState.DONE, result=results[j.id]) for j in jobs]
        bodies = [watcher.intake._job_result(j) for j in done]
        far, near = (b for b, _ in bodies)
        assert far["outputs_on"] == "n9" and far["node"] == "n9"
        assert "outputs_on" not in near and near["node"] == "n1"
        # the same writer the finish step uses
        from gpuwarden.intake.service import _write_with_note

        path = _write_with_note(root.outbox, "b.zip", bodies)
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            note = zf.read("far/outputs/OUTPUTS.txt").decode()
            assert json.loads(zf.read("far/result.json"))["outputs_on"] == "n9"
        assert "near/outputs/sub/echo.txt" in names
        assert "n9" in note and "/nowhere/attempt/out" in note and "echo.txt" in note
    finally:
        store.close()
