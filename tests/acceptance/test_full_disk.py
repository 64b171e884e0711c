"""Acceptance: a queue root on a real file system that fills up, under a real
``gpuwarden serve``. The test mounts a tiny tmpfs (root only; skipped with the
reason otherwise), drops bundles, fills the file system to ENOSPC, and checks
that the results wait (``result_waiting``) instead of being given up, that
nothing is refused, and that once space is freed every bundle completes with no
temporary, empty or reason file left anywhere in the queue root."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwarden.core.model import JobSpec
from gpuwarden.intake import bundlewrite

REPO = Path(__file__).resolve().parents[2]
GW = [sys.executable, "-m", "gpuwarden"]
BUNDLES = 6


def wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test alone, unmounted after it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: the full-disk test runs as root only")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` until it says ENOSPC; return the filler."""
    filler = folder / "filler.bin"
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler


def events(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]


def kinds(log: Path, kind: str) -> list[dict[str, object]]:
    return [e for e in events(log) if e["event"] == kind]


def broker_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != "filler.bin"]


def test_a_full_queue_root_makes_results_wait_and_all_complete_once_freed(
    tmp_path: Path, tiny_fs: Path
) -> None:
    root = tiny_fs / "queue"
    config = tmp_path / "gpuwarden.toml"
    config.write_text(
        f"""
state_dir = "{tmp_path / "state"}"
node_name = "full"
gpu = "sim"
allow_unsandboxed_containers = true
module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}"]
queue_roots = ["{root}"]
[broker]
poll_interval_s = 0.05
status_interval_s = 0.5
"""
    )
    # the bundles are written whole on the small disk first, beside the queue root
    ready = tiny_fs / "ready"
    ready.mkdir()
    names = [
        bundlewrite.write_bundle(
            ready,
            [JobSpec(id=f"full-{i}", type="echo.echo", params={"text": "x" * 64})],
            now=time.time(),
        ).name
        for i in range(BUNDLES)
    ]
    log = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    proc = subprocess.Popen(
        [*GW, "--config", str(config), "serve", "--log", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.stderr").open("w"),
        env=env,
        start_new_session=True,
    )
    try:
        wait_for(lambda: bool(kinds(log, "broker_started")) or proc.poll() is not None, "serve")
        assert proc.poll() is None, (tmp_path / "serve.stderr").read_text()
        filler = fill(tiny_fs)
        with pytest.raises(OSError) as full:  # the fault is real: not one more byte
            (tiny_fs / "probe.bin").write_bytes(b"\0" * 8192)
        assert full.value.errno == 28
        (tiny_fs / "probe.bin").unlink(missing_ok=True)
        for name in names:  # a rename needs no space: the bundles arrive on a full disk
            os.rename(ready / name, root / "inbox" / name)

        def all_waiting() -> bool:
            return {str(e["bundle"]) for e in kinds(log, "result_waiting")} == set(names)

        wait_for(all_waiting, "every result to wait for space")
        said = kinds(log, "result_waiting")[0]
        assert "ENOSPC" in str(said["waits_for"]), said
        assert not kinds(log, "bundle_unwritable") and not kinds(log, "bundle_rejected")
        assert list((root / "failed").iterdir()) == [] and list((root / "outbox").iterdir()) == []
        assert sorted(p.name for p in (root / "processing").iterdir()) == sorted(names)

        filler.unlink()  # space comes back
        wait_for(
            lambda: sorted(p.name for p in (root / "outbox").iterdir()) == sorted(names),
            "every result in outbox/",
        )
        wait_for(lambda: not list((root / "processing").iterdir()), "processing/ emptied")
        for name in names:
            with zipfile.ZipFile(root / "outbox" / name) as zf:
                results = [json.loads(zf.read(n)) for n in zf.namelist() if n.endswith(".json")]
            assert [r["status"] for r in results] == ["done"], results
        assert list((root / "failed").iterdir()) == []
        for path in broker_files(root):
            assert path.stat().st_size > 0, f"{path} is empty"
            assert not path.name.startswith(".gw-"), f"{path}: a temporary file was left"
        assert len(kinds(log, "result_wait_over")) == BUNDLES
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
