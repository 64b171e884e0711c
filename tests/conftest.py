"""Shared fixtures. Store backends are parametrised so that every backend runs the
same contract suite (PostgreSQL joins the list when its adapter exists)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.store.base import Store
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[1]
MODULES = REPO / "modules"

STORE_BACKENDS = ["sqlite"]


@pytest.fixture(params=STORE_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s: Store = SqliteStore(tmp_path / "store.db")
    else:  # pragma: no cover - no other backend yet
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


@pytest.fixture(scope="session")
def podman_base_image() -> str:
    """A base image with python3, made without a registry (images/base-rootfs.sh:
    debootstrap, cached under ~/.cache/gpuwarden after the first run)."""
    need_tool("podman")
    need_tool("debootstrap")
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
def podman_image(podman_base_image: str) -> str:
    """The sandbox image with the echo and probe modules, built by images/build.sh
    as an operator would, pinned by the id it prints."""
    done = subprocess.run(
        [
            *(str(REPO / "images" / "build.sh"), "--runtime", "podman", "--only", "echo,probe"),
            *("--base", podman_base_image, "--tag", SANDBOX_TAG, "--pin"),
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
