"""The record a warm server keeps for the next broker (``node/warmrecord.py``):
written atomically, read as hostile (links, sizes, names, types, ranges, extra
keys), and verified against ``/proc`` and the supervisor's own record: a record
that names any other process is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from gpuwarden.launch import supervisor
from gpuwarden.node import warmrecord
from gpuwarden.node.warmrecord import ServerRecord


def record(**changes: object) -> ServerRecord:
    base = ServerRecord(
        type="testmods.warm",
        epoch=1700000000000,
        gpu="GPU-sim-0",
        marker="n-0123456789/warm-testmods.warm/1700000000000",
        pid=4242,
        start_ticks=123,
        boot_id=supervisor.boot_id() or "0",
        socket="/tmp/gpuwarden-x/1700000000000.sock",
        footprint_bytes=6 * 1024**3,
        load_s=0.3,
        device_bytes=None,
        jobs_served=2,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def raw(r: ServerRecord, **changes: object) -> bytes:
    return json.dumps({"v": 1, **asdict(r), **changes}).encode()


def test_a_written_record_reads_back(tmp_path: Path) -> None:
    r = record()
    warmrecord.write(tmp_path, r)
    path = warmrecord.records_dir(tmp_path) / f"{r.epoch}.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert warmrecord.read_all(tmp_path) == [(path.name, r)]
    warmrecord.write(tmp_path, replace(r, jobs_served=3))  # replaced whole
    assert warmrecord.read_all(tmp_path) == [(path.name, replace(r, jobs_served=3))]
    warmrecord.remove(tmp_path, path.name)
    assert warmrecord.read_all(tmp_path) == []


@pytest.mark.parametrize(
    "changes",
    [
        {"v": 2},
        {"pid": True},
        {"pid": 1},
        {"pid": "4242"},
        {"epoch": -1},
        {"start_ticks": 1.5},
        {"load_s": -1},
        {"device_bytes": "x"},
        {"type": "../etc"},
        {"gpu": "a b"},
        {"boot_id": "X" * 65},
        {"marker": ""},
        {"extra": 1},
    ],
)
def test_a_record_with_a_wrong_field_is_refused(changes: dict[str, object]) -> None:
    assert warmrecord.parse(raw(record(), **changes)) is None


def test_garbage_is_refused() -> None:
    assert warmrecord.parse(raw(record())) == record()
    for bad in (b"", b"[]", b"\xff", b'{"v": NaN}', raw(record()).replace(b"0.3", b"NaN")):
        assert warmrecord.parse(bad) is None
    data = json.loads(raw(record()))
    del data["socket"]
    assert warmrecord.parse(json.dumps(data).encode()) is None


def test_links_large_files_and_foreign_names_are_not_records(tmp_path: Path) -> None:
    r = record()
    warmrecord.write(tmp_path, r)
    folder = warmrecord.records_dir(tmp_path)
    good = folder / f"{r.epoch}.json"
    secret = tmp_path / "secret.json"
    secret.write_bytes(raw(replace(r, epoch=5)))
    (folder / "5.json").symlink_to(secret)
    (folder / "6.json").write_bytes(raw(replace(r, epoch=6)) + b" " * warmrecord.MAX_RECORD)
    (folder / "7.json").write_bytes(raw(replace(r, epoch=8)))  # its name is not its epoch
    (folder / "notes.txt").write_bytes(raw(r))
    os.mkfifo(folder / "9.json")
    got = dict(warmrecord.read_all(tmp_path))
    assert got == {
        good.name: r,
        "5.json": None,
        "6.json": None,
        "7.json": None,
        "9.json": None,
        "notes.txt": None,
    }
    warmrecord.remove(tmp_path, "5.json")  # the link goes, not what it names
    assert secret.exists() and not (folder / "5.json").is_symlink()


def test_verify_refuses_any_process_but_the_servers_supervisor(tmp_path: Path) -> None:
    log_dir = tmp_path / "warm" / "testmods.warm-1"
    marker = "n-0123456789/warm-testmods.warm/1"
    folder = Path(supervisor.folder_of(str(log_dir)))
    folder.mkdir(parents=True)
    ready = tmp_path / "started"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            supervisor.__file__,
            str(folder),
            "inf",
            "0.3",
            marker,
            "--",
            sys.executable,
            "-c",
            f"open({str(ready)!r}, 'w').close(); import time; time.sleep(60)",
        ]
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        end = time.monotonic() + 60
        while not (ready.exists() and (folder / supervisor.STARTED).exists()):
            assert time.monotonic() < end, "the supervisor did not start"
            time.sleep(0.05)
        ticks = supervisor.start_ticks(proc.pid)
        assert ticks is not None
        good = record(marker=marker, pid=proc.pid, start_ticks=ticks)
        assert warmrecord.verify(good, log_dir) is None
        assert "another process" in str(
            warmrecord.verify(replace(good, start_ticks=ticks + 1), log_dir)
        )
        assert "booted" in str(warmrecord.verify(replace(good, boot_id="0"), log_dir))
        other_ticks = supervisor.start_ticks(other.pid)
        assert other_ticks is not None
        forged = replace(good, pid=other.pid, start_ticks=other_ticks)
        assert warmrecord.verify(forged, log_dir) == (
            f"process {other.pid} is not the server's supervisor"
        )
        assert "not the server's" in str(
            warmrecord.verify(replace(good, marker=marker + "x"), log_dir)
        )
    finally:
        for p in (proc, other):
            p.terminate()
            p.wait(30)
    assert warmrecord.verify(good, log_dir) is not None  # it has ended
