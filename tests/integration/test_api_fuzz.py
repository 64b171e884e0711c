"""Schemathesis against the API's own OpenAPI schema: whatever it sends (valid and
invalid data, every operation), the API never answers 5xx. Clients' routes go
with an Owner token; the agents' routes with a node's token, steered to a job
leased to that node and started, so an output upload's path (``PUT
/v1/node/jobs/{id}/outputs/{path}``) reaches the code that writes the file.

Bounded: at most 50 examples per operation, no deadline per example."""

from __future__ import annotations

import atexit
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from gpuwarden.api.app import create_app
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
        "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
        "allow_unsandboxed_containers": True,
        "api": {"rate_per_s": 1_000_000, "burst": 1_000_000},
        "cluster": {"lease_s": 3600},
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

# a node, enrolled, holding two started leases: one for uploads only (a fuzzed
# finish would end it), one for the other node routes
_tc = TestClient(app)
_owner = {"Authorization": f"Bearer {OWNER}"}
_invite = _tc.post("/v1/nodes/invite", json={"name": "n1"}, headers=_owner).json()["token"]
NODE = _tc.post(
    "/v1/nodes/enroll",
    json={"capabilities": {}},
    headers={"Authorization": f"Bearer {_invite}"},
).json()["token"]
_node = {"Authorization": f"Bearer {NODE}"}
_, ENROLL = issue_token(
    _store,
    name="fuzz enroll",
    role=Role.ENROLL,
    by=Principal(token_id="local", name="fuzz", role=Role.OWNER),
    now=time.time(),
    node="n2",
)
_store.submit(
    [JobSpec(id=i, type="echo.echo", params={"text": "l"}) for i in ("leased-up", "leased-x")],
    now=time.time(),
)
LEASES: dict[str, str] = {}
for _job in _tc.post(
    "/v1/node/claim",
    json={"report": {"types": ["echo.echo"], "gpus": [], "max_jobs": 9}, "want": 9},
    headers=_node,
).json()["jobs"]:
    LEASES[_job["id"]] = _job["lease_id"]
    _started = _tc.post(
        f"/v1/node/jobs/{_job['id']}/start", json={"lease_id": _job["lease_id"]}, headers=_node
    )
    assert _started.status_code == 200, _started.text
assert {"leased-up", "leased-x"} <= LEASES.keys(), LEASES
UPLOAD = "/v1/node/jobs/{job_id}/outputs/{path}"

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
    token = OWNER
    params = case.path_parameters or {}
    if case.path.startswith("/v1/node/"):
        token = NODE
        # steer most examples to its started leases, so the handlers run to the end
        job = "leased-up" if case.path == UPLOAD else "leased-x"
        if "job_id" in params and len(str(params["job_id"])) % 3 < 2:
            params["job_id"] = job
        elif params.get("job_id") == "leased-up":
            params["job_id"] = "leased-x"  # a fuzzed finish must not end the upload lease
        if isinstance(case.query, dict) and len(str(case.query.get("lease_id"))) % 3 < 2:
            case.query["lease_id"] = (
                LEASES[str(params.get("job_id"))]
                if (str(params.get("job_id")) in LEASES)
                else LEASES[job]
            )
    elif case.path == "/v1/nodes/enroll":
        token = ENROLL
    elif "job_id" in params:
        # steer some examples to jobs that exist, so their handlers run too
        pick = len(str(params["job_id"])) % 3
        if pick < 2:
            params["job_id"] = ("done-1", "queued-1")[pick]
    if case.path.endswith("/logs/{stream}") and isinstance(case.query, dict):
        # a followed stream lasts until its attempt ends (its contract); a fuzzed
        # follow of an attempt leased to a node that never ends it would never end
        case.query["follow"] = False
    if case.path == "/v1/events":
        # the event stream follows by default and lasts until the client leaves (its
        # contract); the in-process transport reads a response to its end, so a
        # fuzzed request without follow=false would hang until the test's timeout
        if not isinstance(case.query, dict):
            case.query = {}
        case.query["follow"] = False
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {token}"}, checks=[not_a_server_error]
    )
    STATUSES[(f"{case.method} {case.path}", response.status_code)] += 1
    assert response.status_code < 500
