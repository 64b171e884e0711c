"""Schemathesis against the API's own OpenAPI schema, with an Owner token: whatever
it sends (valid and invalid data, every operation), the API never answers 5xx.

Bounded: at most 50 examples per operation, no deadline per example."""

from __future__ import annotations

import atexit
import collections
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from gpuwarden.api import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]

_tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-fuzz-"))
atexit.register(shutil.rmtree, _tmp, ignore_errors=True)
_config = Config.model_validate(
    {
        "state_dir": _tmp,
        "module_paths": [REPO / "modules", REPO / "tests" / "modules"],
        "allow_unsandboxed_containers": True,
        "api": {"rate_per_s": 1_000_000, "burst": 1_000_000},
    }
)
_store = SqliteStore(_tmp / "gpuwarden.db")
_, OWNER = issue_token(
    _store,
    name="fuzz",
    role=Role.OWNER,
    by=Principal(token_id="local", name="fuzz", role=Role.OWNER),
    now=1.0,
)
# a few jobs to find: one queued, one done with an output
_store.submit([JobSpec(id="queued-1", type="echo.echo", params={"text": "q"})], now=1.0)
_store.submit(
    [JobSpec(id="done-1", type="echo.echo", params={"text": "d"})],
    now=1.0,
    origin=Submission(owner="0" * 12),
)
_out = _tmp / "jobs" / "done-1" / "attempt-1" / "out"
_out.mkdir(parents=True)
(_out / "echo.txt").write_text("d")
_store.start_attempt("done-1", node="n", gpu_uuid=None, now=2.0)
_store.finish_attempt(
    "done-1",
    1,
    target=JobState.DONE,
    now=3.0,
    outcome="succeeded",
    reason="done",
    result={"outputs": ["echo.txt"], "output_dir": str(_out)},
)
app = create_app(_store, Registry.load(_config.module_paths, _config.launch_rules), _config)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)

STATUSES: collections.Counter[tuple[str, int]] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Any:
    yield
    total = sum(STATUSES.values())
    by_op: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for (op, status), n in STATUSES.items():
        by_op[op][status] += n
    lines = [f"schemathesis: {total} requests, {len(by_op)} operations"]
    for op, counts in sorted(by_op.items()):
        lines.append(f"  {op}: " + ", ".join(f"{s}x{n}" for s, n in sorted(counts.items())))
    print("\n".join(lines), file=sys.stderr)


@schema.parametrize()
@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case: Any) -> None:
    if "job_id" in (case.path_parameters or {}):
        # steer some examples to jobs that exist, so their handlers run too
        pick = len(str(case.path_parameters["job_id"])) % 3
        if pick < 2:
            case.path_parameters["job_id"] = ("done-1", "queued-1")[pick]
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {OWNER}"}, checks=[not_a_server_error]
    )
    STATUSES[(f"{case.method} {case.path}", response.status_code)] += 1
    assert response.status_code < 500
