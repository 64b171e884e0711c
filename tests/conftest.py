"""Shared fixtures. Store backends are parametrised so that every backend runs the
same contract suite: SQLite in a temporary file, PostgreSQL in a fresh schema."""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import functools
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from gpuwarden.store.base import Store
from gpuwarden.store.sqlite import SqliteStore
from tests import supervisors

REPO = Path(__file__).resolve().parents[1]
MODULES = REPO / "src" / "gpuwarden" / "modules"

STORE_BACKENDS = ["sqlite", "postgres"]

#: the PostgreSQL server the tests use (trust auth on this machine and in CI)
PG_URL = os.environ.get("GPUWARDEN_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
#: set by .ci/run: PostgreSQL runs there, so its tests must run
REQUIRE_POSTGRES = os.environ.get("GPUWARDEN_REQUIRE_POSTGRES") == "1"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package's bytecode once, before any test (in the controller, not in
    each xdist worker). The tests start many ``python -m gpuwarden`` processes;
    where PYTHONDONTWRITEBYTECODE is set (CI's machines set it) none of them writes
    what it compiled, so each would compile every module again: 1.9 s of CPU for a
    CLI call instead of 1.0 s."""
    if not hasattr(session.config, "workerinput"):
        compileall.compile_dir(REPO / "src" / "gpuwarden", quiet=1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three workers for two cores, at most 8. Most of a test's time is
    spent waiting on the processes it started (a broker, a job, a CLI call), so more
    workers than cores keep the cores busy; two per core loaded a 2-core machine so
    that a process stalled for half a minute now and then. A file's tests stay on
    one worker (``--dist loadfile``), its module fixtures set up once."""
    cores = os.cpu_count() or 1
    return max(2, min(8, cores + cores // 2))


UNIT = REPO / "tests" / "unit"


#: the testmods service types listen on fixed ports (tests/modules/testmods/module.toml:
#: web 18431, webgpu 18432, wsweb 18433, wsplain 18434)
FIXED_PORTS = re.compile(rb"testmods\.(web|webgpu|wsweb|wsplain)\b|\b1843[1-4]\b")


@functools.cache
def starts_fixed_port_services(path: Path) -> bool:
    """Whether a test file may start a service of a fixed port (it names one)."""
    return FIXED_PORTS.search(path.read_bytes()) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/unit that is not slow ``fast``: ``pytest -m fast``
    is the inner loop (pure and in-process tests)."""
    for item in items:
        if item.path.is_relative_to(UNIT) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True, scope="module")
def _fixed_ports_one_file_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A file that starts services of fixed ports holds a lock of every xdist worker
    from before its module's fixtures to after them (an autouse fixture is set up
    first and torn down last): two such files at once would bind the same port.
    (Not an xdist_group: ``--dist loadgroup`` groups by a node id suffix that
    pytest 9.2's node ids no longer carry.)"""
    if not starts_fixed_port_services(request.path):
        yield
        return
    with one_worker_at_a_time(tmp_path_factory, "fixed-service-ports"):
        yield


@pytest.fixture(autouse=True)
def _no_orphaned_supervisors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After each test: stop the attempts a stopped broker of this test run left
    to their supervisors (a routine stop leaves them running), so that none runs
    into the next test. Only under this run's temporary folder: never another
    run's, nor a real broker's."""
    yield
    supervisors.stop_orphans(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True, scope="module")
def _no_orphaned_supervisors_of_the_module(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """The same after a module's own fixtures are torn down (an autouse fixture
    is set up first, so torn down last): a module-scoped cluster's agents,
    stopped with SIGTERM, leave their services running, which would hold their
    ports into the next module."""
    yield
    supervisors.stop_orphans(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The test server's URL; skips (fails where GPUWARDEN_REQUIRE_POSTGRES=1) when it
    cannot be reached."""
    try:
        with psycopg.connect(PG_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        why = " ".join(str(exc).split())
        how = (
            f"PostgreSQL is not reachable at {PG_URL} ({why}); start it "
            "(pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start) "
            "or point GPUWARDEN_TEST_PG_URL at a server with trust auth"
        )
        if REQUIRE_POSTGRES:
            pytest.fail(f"{how} [GPUWARDEN_REQUIRE_POSTGRES=1]")
        pytest.skip(f"{how}; CI runs these tests")
    return PG_URL


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh schema name, unused until a store creates it; dropped afterwards."""
    name = f"gw_test_{uuid.uuid4().hex[:16]}"
    try:
        yield name
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture(params=STORE_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s: Store = SqliteStore(tmp_path / "store.db")
    elif request.param == "postgres":
        from gpuwarden.store.postgres import PostgresStore

        url = request.getfixturevalue("pg_url")
        s = PostgresStore(url, schema=request.getfixturevalue("pg_schema"))
    else:  # pragma: no cover - a backend without a fixture
        raise AssertionError(request.param)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def gpuwarden_cmd() -> list[str]:
    """The CLI as a user runs it, in a subprocess."""
    return [sys.executable, "-m", "gpuwarden"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for key in list(os.environ):
        if key.startswith("GPUWARDEN_"):
            monkeypatch.delenv(key)
    return dict(os.environ)


#: set by .ci/run: the sandbox runtimes are installed there, so their tests must run
REQUIRE_CONTAINERS = os.environ.get("GPUWARDEN_REQUIRE_CONTAINERS") == "1"


def need_tool(tool: str) -> None:
    """Skip the test when ``tool`` is not installed, with the reason; where
    GPUWARDEN_REQUIRE_CONTAINERS=1 (CI), fail instead: CI never passes by skipping."""
    if shutil.which(tool) is not None:
        return
    install = {"bwrap": "apt-get install bubblewrap", "podman": "apt-get install podman"}
    how = install.get(tool, f"install {tool}")
    if REQUIRE_CONTAINERS:
        pytest.fail(f"{tool} is required (GPUWARDEN_REQUIRE_CONTAINERS=1) but not installed: {how}")
    pytest.skip(f"{tool} is not installed ({how}); CI runs this test")


BASE_IMAGE = "localhost/gpuwarden-test-base:latest"
SANDBOX_TAG = "localhost/gpuwarden-sandbox:test"


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[None]:
    """Hold a lock shared by every xdist worker of this run (a file in the folder
    above the workers' own temporary folders): a session fixture that builds one
    machine-wide thing, such as an image tag, builds it once at a time."""
    lock = tmp_path_factory.getbasetemp().parent / f"{name}.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def podman_base_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A base image with python3, made without a registry (images/base-rootfs.sh:
    debootstrap, cached under ~/.cache/gpuwarden after the first run)."""
    need_tool("podman")
    need_tool("debootstrap")
    with one_worker_at_a_time(tmp_path_factory, "podman-base-image"):
        done = subprocess.run(
            [str(REPO / "images" / "base-rootfs.sh"), "--runtime", "podman", BASE_IMAGE],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    return BASE_IMAGE


@pytest.fixture(scope="session")
def podman_image(podman_base_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sandbox image with the echo and probe modules, built by images/build.sh
    as an operator would, pinned by the id it prints (each xdist worker builds it,
    one at a time; the second build is podman's cache)."""
    with one_worker_at_a_time(tmp_path_factory, "podman-sandbox-image"):
        done = subprocess.run(
            [
                *(str(REPO / "images" / "build.sh"), "--runtime", "podman"),
                *("--only", "echo,probe", "--base", podman_base_image),
                *("--tag", SANDBOX_TAG, "--pin"),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    pins = [ln for ln in done.stdout.splitlines() if ln.startswith("sandbox_image = ")]
    assert len(pins) == 1, done.stdout
    return pins[0].split("=", 1)[1].strip().strip('"')
