"""The agent's side of a running attempt's streams: new bytes only, once a second,
from the coordinator's offset after a gap, the last bytes at the end, no link read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwarden.cluster import logcopy
from gpuwarden.cluster.logship import BURST_CHUNKS, BURST_S, FINAL_CHUNKS, LogShipper


class FakeCoordinator:
    """Keeps the copies as the coordinator does (the append rule of logcopy)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[tuple[str, int, int]] = []

    def send_log(self, job_id: str, lease_id: str, stream: str, offset: int, data: bytes) -> int:
        self.calls.append((stream, offset, len(data)))
        path = logcopy.log_path(self.root, job_id, 1, stream)
        try:
            return logcopy.append(path, offset, data, bound=1 << 30)
        except logcopy.Gap as gap:
            return gap.offset

    def copy(self, stream: str) -> bytes:
        return logcopy.log_path(self.root, "J", 1, stream).read_bytes()[logcopy.HEADER_LEN :]


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _setup(tmp_path: Path) -> tuple[LogShipper, FakeCoordinator, Clock, Path]:
    jobs = tmp_path / "jobs"
    folder = jobs / "j" / "attempt-1"
    folder.mkdir(parents=True)
    coord = FakeCoordinator(tmp_path / "coord")
    clock = Clock()
    fake: Any = coord
    return LogShipper(fake, jobs, clock), coord, clock, folder


def test_new_bytes_once_a_second(tmp_path: Path) -> None:
    ship, coord, clock, folder = _setup(tmp_path)
    (folder / "stdout.log").write_bytes(b"a\n")
    ship.ship("J", "L", "j", 1)
    (folder / "stdout.log").write_bytes(b"a\nb\n")
    ship.ship("J", "L", "j", 1)  # the same second: nothing
    assert coord.calls == [("stdout", 0, 2)]
    clock.t += 1
    ship.ship("J", "L", "j", 1)
    assert coord.calls[-1] == ("stdout", 2, 2)
    clock.t += 1
    ship.ship("J", "L", "j", 1)  # nothing new: no request
    assert len(coord.calls) == 2 and coord.copy("stdout") == b"a\nb\n"


def test_a_gap_resends_from_the_coordinators_offset(tmp_path: Path) -> None:
    ship, coord, clock, folder = _setup(tmp_path)
    (folder / "stderr.log").write_bytes(b"01234")
    ship.ship("J", "L", "j", 1)
    logcopy.log_path(coord.root, "J", 1, "stderr").unlink()  # the coordinator has none now
    (folder / "stderr.log").write_bytes(b"0123456789")
    clock.t += 1
    ship.ship("J", "L", "j", 1)  # from 5: refused, the answer says 0
    clock.t += 1
    ship.ship("J", "L", "j", 1)
    assert [c[1] for c in coord.calls] == [0, 5, 0]
    assert coord.copy("stderr") == b"0123456789"


def test_the_last_bytes_go_at_once_and_once(tmp_path: Path) -> None:
    ship, coord, _clock, folder = _setup(tmp_path)
    big = b"x" * (logcopy.MAX_CHUNK * 3 + 7)
    (folder / "stdout.log").write_bytes(big)
    ship.ship("J", "L", "j", 1, final=True)  # no wait between its chunks
    assert coord.copy("stdout") == big and len(coord.calls) == 4 <= FINAL_CHUNKS
    ship.ship("J", "L", "j", 1, final=True)
    assert len(coord.calls) == 4


def test_a_link_is_never_read(tmp_path: Path) -> None:
    ship, coord, _clock, folder = _setup(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the job's")
    (folder / "stdout.log").symlink_to(secret)
    ship.ship("J", "L", "j", 1)
    assert coord.calls == []


def test_a_fast_stream_goes_in_bursts_of_full_chunks(tmp_path: Path) -> None:
    ship, coord, clock, folder = _setup(tmp_path)
    data = bytes(range(256)) * (logcopy.MAX_CHUNK * (BURST_CHUNKS + 2) // 256) + b"tail"
    (folder / "stdout.log").write_bytes(data)
    ship.begin()  # a sync
    ship.ship("J", "L", "j", 1)  # one burst: BURST_CHUNKS full chunks, no more
    assert [c[2] for c in coord.calls] == [logcopy.MAX_CHUNK] * BURST_CHUNKS
    ship.ship("J", "L", "j", 1)  # the same second: nothing
    assert len(coord.calls) == BURST_CHUNKS
    clock.t += 1
    ship.begin()
    ship.ship("J", "L", "j", 1)  # the rest: two full chunks, then the short tail ends it
    assert [c[2] for c in coord.calls[BURST_CHUNKS:]] == [logcopy.MAX_CHUNK] * 2 + [4]
    assert coord.copy("stdout") == data


def test_one_sync_spends_its_burst_budget_once_for_all_streams(tmp_path: Path) -> None:
    ship, coord, clock, folder = _setup(tmp_path)
    full = b"x" * (logcopy.MAX_CHUNK * 4)
    for stream in ("stdout", "stderr", "build"):
        (folder / f"{stream}.log").write_bytes(full)
    sent = coord.send_log

    def slow(*args: Any) -> int:
        clock.t += BURST_S / 2  # each request takes half the sync's budget
        return sent(*args)

    coord.send_log = slow  # type: ignore[method-assign]
    ship.begin()
    ship.ship("J", "L", "j", 1)
    by_stream = [c[0] for c in coord.calls]
    # stdout: its first chunk, one more within the budget; then the budget is spent:
    # stderr and build send their first chunk each, no more
    assert by_stream == ["stdout", "stdout", "stderr", "build"], by_stream
