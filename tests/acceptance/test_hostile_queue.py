"""Acceptance: hostile entries in a queue root, through a LIVE broker (issue 11).

Real ``gpuwarden serve`` processes on the simulated GPU and real job processes.
The corpus of hostile names and file types (``tests/hostile/corpus.py``) goes
through one broker; the other tests replay, one by one, what an attacker showed:
a FIFO in ``inbox/`` (and SIGTERM afterwards), names of 251 to 255 bytes, a
refused ``X.zip`` followed by ``X.input.zip``, a ``.ZIP`` claimed just before a
crash, a forged zip64 count, a bomb beside a running job, a store that lost its
last commits, a damaged database. Each test first asserts that its attack is in
place, then that the broker stayed up, wrote nothing outside the queue root and
its state directory, said what it refused and why, and that a following bundle
completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuwarden import faults
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.queueroot import NAME_MAX, own_name, record_name
from tests.acceptance.test_chaos import Serve
from tests.acceptance.test_cli import GW, env, wait_for, write_config
from tests.hostile import corpus

# -- a node whose brokers are started and stopped by the test -------------------------


@dataclass
class Site:
    tmp: Path
    extra: str = ""
    brokers: list[Serve] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = write_config(self.tmp, extra=self.extra)
        self.root = self.tmp / "queues" / "demo"
        self.state = self.tmp / "state"
        for sub in ("inbox", "processing", "outbox", "failed"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def serve(self, fault: str | None = None) -> Serve:
        b = Serve(self.config, self.tmp / f"events-{len(self.brokers)}.jsonl", fault=fault)
        self.brokers.append(b)
        return b

    def path(self, sub: str, raw: bytes) -> bytes:
        return os.fsencode(self.root / sub) + b"/" + raw

    def exists(self, sub: str, raw: bytes) -> bool:
        return os.path.lexists(self.path(sub, raw))

    def place(self, sub: str, raw: bytes, data: bytes) -> None:
        """Put ``data`` in whole under exactly these name bytes (written beside the
        root, then renamed in: what a client does)."""
        tmp = self.tmp / f"placing-{time.monotonic_ns()}"
        tmp.write_bytes(data)
        os.rename(os.fsencode(tmp), self.path(sub, raw))

    def result(self, sub: str, raw: bytes) -> dict[str, dict[str, object]]:
        return read_result_bundle(Path(os.fsdecode(self.path(sub, raw))))

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e for b in self.brokers for e in b.events(kind)]

    def db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.state / "gpuwarden.db", timeout=10)
        db.row_factory = sqlite3.Row
        return db

    def job(self, job_id: str) -> sqlite3.Row | None:
        with contextlib.closing(self.db()) as db:
            row: sqlite3.Row | None = db.execute(
                "SELECT * FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            return row

    def cleanup(self) -> None:
        for b in self.brokers:
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait(30)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    s.cleanup()


def bundle(job_id: str, **params: object) -> bytes:
    """A valid bundle with one echo job."""
    doc = {
        "version": 1,
        "jobs": [{"id": job_id, "type": "echo.echo", "params": {"text": job_id, **params}}],
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", json.dumps(doc))
    return buf.getvalue()


def held(job_id: str, release: Path) -> bytes:
    """A bundle with one job that runs until ``release`` exists (testmods.hold)."""
    doc = {
        "version": 1,
        "jobs": [{"id": job_id, "type": "testmods.hold", "params": {"until": str(release)}}],
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", json.dumps(doc))
    return buf.getvalue()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(top: Path, *, skip: tuple[str, ...]) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``top`` (links not followed) except the ``skip`` names at
    the top: kind, size and, for files, a digest."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(os.fsencode(top)):
        rel_dir = os.path.relpath(dirpath, os.fsencode(top))
        names = dirnames + filenames
        if rel_dir == b".":
            dirnames[:] = [d for d in dirnames if os.fsdecode(d) not in skip]
            names = [n for n in names if os.fsdecode(n) not in skip]
        for name in names:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            data = ""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    data = hashlib.sha256(f.read()).hexdigest()
            out[os.fsdecode(os.path.relpath(p, os.fsencode(top)))] = (
                stat.S_IFMT(st.st_mode),
                st.st_size if stat.S_ISREG(st.st_mode) else 0,
                data,
            )
    return out


def broker_files(site: Site) -> tuple[str, ...]:
    """What a broker writes in the test's folder besides the root and its state:
    its log and stderr files (named by the test), and the config."""
    names = ["queues", "state", "gpuwarden.toml"]
    for i in range(len(site.brokers) + 4):
        names += [f"events-{i}.jsonl", f"events-{i}.stderr"]
    return tuple(names)


# -- the corpus ---------------------------------------------------------------------------


def test_the_hostile_corpus_through_a_live_broker(site: Site) -> None:
    b = site.serve()
    b.wait_started()
    outside = site.tmp / "outside"
    sockets = corpus.lay_out(site.root / "inbox", outside)
    try:
        # the attack is in place: every entry is what the corpus says it is
        for case in corpus.CASES:
            if case.expect == "ignored" or not site.exists("inbox", case.raw):
                continue  # the broker may already have taken it
            mode = os.lstat(site.path("inbox", case.raw)).st_mode
            assert stat.S_IFMT(mode) == corpus.kind_made(case), case
        before = tree(site.tmp, skip=broker_files(site))
        answered = [c for c in corpus.CASES if c.expect != "ignored"]

        def all_answered() -> bool:
            return all(
                site.exists("outbox" if c.expect == "done" else "failed", c.raw) for c in answered
            )

        wait_for(all_answered, "a result or a refusal for every entry", timeout=120)
        assert b.proc.poll() is None, b.stderr.read_text()  # the broker stayed up

        # the event log is written after the result file: wait for every refusal's event
        refused = {record_name(c.name) for c in corpus.CASES if c.expect == "refused"}

        def rejections() -> dict[str, dict[str, object]]:
            return {str(e["bundle"]): e for e in site.events("bundle_rejected")}

        wait_for(lambda: refused <= rejections().keys(), "every refusal in the event log", 30)
        rejected = rejections()
        for i, case in enumerate(corpus.CASES):
            if case.expect == "done":
                got = site.result("outbox", case.raw)
                assert got[corpus.job_id(i)]["status"] == "done", case
            elif case.expect == "refused":
                got = site.result("failed", case.raw)
                [body] = got.values()
                assert str(body["reason"]).strip(), case  # says why
                assert body["status"] == "failed", case
                kept = site.path("failed", os.fsencode(own_name(case.name, "input")))
                assert stat.S_IFMT(os.lstat(kept).st_mode) == corpus.kind_made(case), case
                event = rejected[record_name(case.name)]  # recorded, readably
                assert str(event["reason"]).strip(), case
            else:  # left alone, as it is
                mode = os.lstat(site.path("inbox", case.raw)).st_mode
                assert stat.S_IFMT(mode) == corpus.kind_made(case), case
        reasons = {
            c.content: str(next(iter(site.result("failed", c.raw).values()))["reason"])
            for c in corpus.CASES
            if c.expect == "refused"
        }
        assert "is a fifo, not a regular file" in reasons["fifo"]
        assert "is a symlink, not a regular file" in reasons["link-bundle"]
        assert "is a character device" in reasons["chardev"]
        assert "has 12001 entries, more than the limit of 10000" in reasons["forged-zip64"]
        assert "declare 5.0 GiB unpacked" in reasons["bomb"]
        assert "not valid UTF-8" in reasons["bundle"]
        assert not site.events("loop_error"), site.events("loop_error")  # no pass aborted

        # nothing written outside the queue root and the state directory
        assert tree(site.tmp, skip=broker_files(site)) == before
        for escape in corpus.ESCAPES:
            assert not os.path.lexists(escape)
        assert not list(site.tmp.rglob("pwned")) and not Path("pwned").exists()
        with contextlib.closing(site.db()) as db:
            stored = {r["id"] for r in db.execute("SELECT id FROM jobs")}
        done = {corpus.job_id(i) for i, c in enumerate(corpus.CASES) if c.expect == "done"}
        assert stored == done  # nothing of a refused entry was accepted

        # a valid bundle after them completes, and SIGTERM stops the broker
        site.place("inbox", b"after.zip", bundle("after-corpus"))
        wait_for(lambda: site.exists("outbox", b"after.zip"), "the bundle after the corpus")
        assert site.result("outbox", b"after.zip")["after-corpus"]["status"] == "done"
        assert b.stop() == 0, b.stderr.read_text()
    finally:
        for s in sockets:
            s.close()
    # and a restart looks at none of them again
    again = site.serve()
    again.wait_started()
    site.place("inbox", b"after-restart.zip", bundle("after-restart"))
    wait_for(lambda: site.exists("outbox", b"after-restart.zip"), "a bundle after the restart")
    assert again.stop() == 0, again.stderr.read_text()
    assert not again.events("bundle_rejected") and not again.events("loop_error")


# -- FIFOs and SIGTERM --------------------------------------------------------------------


def test_a_fifo_in_inbox_neither_blocks_the_broker_nor_sigterm(site: Site) -> None:
    fifo = site.root / "inbox" / "wait-for-me.zip"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # the attack is in place
    b = site.serve()
    b.wait_started()
    wait_for(lambda: site.exists("failed", b"wait-for-me.zip"), "the FIFO's refusal")
    assert stat.S_ISFIFO(os.lstat(site.root / "failed" / "wait-for-me.zip.input").st_mode)
    reason = site.result("failed", b"wait-for-me.zip")["bundle"]["reason"]
    assert "is a fifo, not a regular file" in str(reason)
    site.place("inbox", b"next.zip", bundle("after-fifo"))
    wait_for(lambda: site.exists("outbox", b"next.zip"), "the bundle after the FIFO")
    assert b.stop() == 0, b.stderr.read_text()  # SIGTERM still stops it

    # at a restart: a FIFO left in processing/ (claimed before a crash) and one
    # more in inbox/ are refused too; the restart neither blocks nor exits
    os.mkfifo(site.root / "processing" / "left.zip")
    os.mkfifo(site.root / "inbox" / "another.zip")
    again = site.serve()
    again.wait_started()
    wait_for(
        lambda: site.exists("failed", b"left.zip") and site.exists("failed", b"another.zip"),
        "the refusals at the restart",
    )
    site.place("inbox", b"last.zip", bundle("after-restart-fifo"))
    wait_for(lambda: site.exists("outbox", b"last.zip"), "the bundle after the restart")
    assert again.stop() == 0, again.stderr.read_text()
    assert not site.events("loop_error")


# -- names ---------------------------------------------------------------------------------


def test_names_of_251_to_255_bytes_get_results_and_restarts_stay_up(site: Site) -> None:
    valid = {n: b"v" * (n - 4) + b".zip" for n in range(251, 256)}
    refused = {n: b"r" * (n - 4) + b".zip" for n in (251, 255)}
    for n, raw in valid.items():
        site.place("inbox", raw, bundle(f"long-{n}"))
    for raw in refused.values():
        site.place("inbox", raw, b"not a zip")
    names = [os.fsdecode(r) for r in [*valid.values(), *refused.values()]]
    assert sorted(len(os.fsencode(n)) for n in names) == [251, 251, 252, 253, 254, 255, 255]
    # the old temporary names (".<name>.tmp") would not fit
    assert all(len(os.fsencode(f".{n}.tmp")) > NAME_MAX for n in names)
    b = site.serve()
    b.wait_started()
    wait_for(
        lambda: (
            all(site.exists("outbox", r) for r in valid.values())
            and all(site.exists("failed", r) for r in refused.values())
        ),
        "every long name's result",
    )
    for n, raw in valid.items():
        assert site.result("outbox", raw)[f"long-{n}"]["status"] == "done"
    for raw in refused.values():
        kept = own_name(os.fsdecode(raw), "input")
        assert len(os.fsencode(kept)) <= NAME_MAX and (site.root / "failed" / kept).exists()
    assert b.stop() == 0, b.stderr.read_text()

    # a long refused name claimed just before a crash: the next start refuses it
    # and stays up (it once made `serve` exit 1 at every start)
    crashed = b"c" * 251 + b".zip"
    site.place("inbox", crashed, b"not a zip either")
    dying = site.serve(fault="after_claim")
    assert dying.wait_dead(30) == -signal.SIGKILL
    assert site.exists("processing", crashed)  # the fault fired after the claim
    again = site.serve()
    again.wait_started()
    wait_for(lambda: site.exists("failed", crashed), "the refusal of the crashed long name")
    assert again.proc.poll() is None
    site.place("inbox", b"short.zip", bundle("after-long"))
    wait_for(lambda: site.exists("outbox", b"short.zip"), "a bundle after the long names")
    assert again.stop() == 0, again.stderr.read_text()
    assert not site.events("loop_error")


def test_x_zip_refused_then_x_input_zip(site: Site) -> None:
    b = site.serve()
    b.wait_started()
    site.place("inbox", b"X.zip", b"this is not a zip")
    kept = site.root / "failed" / "X.zip.input"
    # the result and the kept input are two writes: wait for both
    wait_for(lambda: site.exists("failed", b"X.zip") and kept.exists(), "the refusal of X.zip")
    assert kept.read_bytes() == b"this is not a zip"  # the input is kept
    site.place("inbox", b"X.input.zip", bundle("x-input"))
    wait_for(lambda: site.exists("outbox", b"X.input.zip"), "the result of X.input.zip")
    assert kept.read_bytes() == b"this is not a zip"  # not overwritten
    assert site.result("outbox", b"X.input.zip")["x-input"]["status"] == "done"
    assert "not a zip" in str(site.result("failed", b"X.zip")["bundle"]["reason"])
    assert b.stop() == 0, b.stderr.read_text()


# -- a .ZIP claimed just before a crash -------------------------------------------------


def test_an_upper_case_zip_claimed_before_a_crash_is_recovered(site: Site) -> None:
    assert "after_claim" in faults.POINTS
    site.place("inbox", b"CRASH.ZIP", bundle("upper-crash"))
    dying = site.serve(fault="after_claim")
    assert dying.wait_dead(30) == -signal.SIGKILL  # the fault fired
    assert site.exists("processing", b"CRASH.ZIP") and not site.exists("inbox", b"CRASH.ZIP")
    with contextlib.closing(site.db()) as db:
        assert db.execute("SELECT COUNT(*) FROM bundles").fetchone()[0] == 0
    b = site.serve()
    b.wait_started()
    wait_for(lambda: site.exists("outbox", b"CRASH.ZIP"), "the recovered .ZIP's result")
    assert site.result("outbox", b"CRASH.ZIP")["upper-crash"]["status"] == "done"
    [recovered] = b.events("bundle_recovered")
    assert recovered["bundle"] == "CRASH.ZIP"
    assert recovered["action"] == "never recorded: reading it again"
    assert b.stop() == 0, b.stderr.read_text()


# -- zips that lie -------------------------------------------------------------------------


def test_aforged_zip64_count_is_refused(site: Site) -> None:
    forged = corpus.forged_zip64("forged", hidden=20_000)
    raw_count = forged[forged.rindex(b"PK\x06\x06") + 32 : forged.rindex(b"PK\x06\x06") + 40]
    assert int.from_bytes(raw_count, "little") == 2  # the zip64 record says 2 entries
    b = site.serve()
    b.wait_started()
    site.place("inbox", b"forged.zip", forged)
    site.place("inbox", b"honest.zip", bundle("beside-forged"))
    wait_for(
        lambda: site.exists("failed", b"forged.zip") and site.exists("outbox", b"honest.zip"),
        "the forged and the honest bundle",
    )
    reason = str(site.result("failed", b"forged.zip")["bundle"]["reason"])
    assert "has 20001 entries, more than the limit of 10000" in reason
    assert site.job("forged") is None
    assert b.stop() == 0, b.stderr.read_text()


def test_a_bomb_is_refused_while_another_bundles_job_runs_and_completes(
    tmp_path: Path,
) -> None:
    site = Site(tmp_path, extra="[limits]\nmax_unpacked_mib = 16\n")
    try:
        b = site.serve()
        b.wait_started()
        release = tmp_path / "release-steady"
        site.place("inbox", b"steady.zip", held("steady", release))
        wait_for(lambda: (r := site.job("steady")) is not None and r["state"] == "running", "run")
        bomb = corpus.real_bomb("bomb", mib=64)
        assert len(bomb) < 200_000  # small on disk, 64 MiB inside
        site.place("inbox", b"bomb.zip", bomb)
        wait_for(lambda: site.exists("failed", b"bomb.zip"), "the bomb's refusal")
        steady = site.job("steady")
        assert steady is not None and steady["state"] == "running"  # it went on meanwhile
        reason = str(site.result("failed", b"bomb.zip")["bundle"]["reason"])
        assert "declare 64 MiB unpacked, more than the limit of 16 MiB" in reason
        assert "nothing was extracted" in reason
        release.touch()
        wait_for(lambda: site.exists("outbox", b"steady.zip"), "the steady job's result")
        assert site.result("outbox", b"steady.zip")["steady"]["status"] == "done"
        staging = site.state / "staging"
        assert not [p for p in staging.rglob("*") if p.is_file()]  # nothing left unpacked
        assert b.stop() == 0, b.stderr.read_text()
    finally:
        site.cleanup()


# -- the store lost its last commits -------------------------------------------------------


def test_results_are_not_overwritten_after_the_store_lost_commits(site: Site) -> None:
    """Bundle A's job was running when the store was copied; A's result was then
    written. The broker died right after writing bundle B's result. The older copy
    of the store comes back: it knows A as running and B not at all. Neither is
    run again, no result is overwritten, both are reported; A's job is judged
    from its supervisor's exit record (it finished)."""
    first = site.serve(fault="after_result_write@2")
    first.wait_started()
    release = site.tmp / "release-a1"  # a1 runs until the copy is taken, not for a sleep
    site.place("inbox", b"A.zip", held("a1", release))
    wait_for(lambda: (r := site.job("a1")) is not None and r["state"] == "running", "a1 running")
    snapshot = site.tmp / "older.db"
    with contextlib.closing(site.db()) as live, contextlib.closing(sqlite3.connect(snapshot)) as c:
        live.backup(c)  # the copy the store will fall back to
    release.touch()
    wait_for(lambda: site.exists("outbox", b"A.zip"), "A's result")
    site.place("inbox", b"B.zip", bundle("b1"))
    assert first.wait_dead(30) == -signal.SIGKILL  # died right after B's result
    assert site.exists("outbox", b"B.zip") and site.exists("processing", b"B.zip")

    a_digest, b_digest = digest(site.root / "outbox/A.zip"), digest(site.root / "outbox/B.zip")
    db = site.state / "gpuwarden.db"
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(snapshot, db)  # the store lost its last commits
    with contextlib.closing(site.db()) as older:
        states = {r["id"]: r["state"] for r in older.execute("SELECT id, state FROM jobs")}
        assert states == {"a1": "running"}  # the attack is in place: B unknown, A running

    b = site.serve()
    b.wait_started()
    wait_for(lambda: len(b.events("bundle_result_exists")) == 2, "both bundles reported")
    reported = {str(e["bundle"]): e for e in b.events("bundle_result_exists")}
    assert reported["A.zip"]["jobs_not_run"] == ["a1"]
    assert "processing/" in str(reported["B.zip"]["action"])
    site.place("inbox", b"C.zip", bundle("c1"))
    wait_for(lambda: site.exists("outbox", b"C.zip"), "a bundle after the lost commits")
    assert b.stop() == 0, b.stderr.read_text()

    assert digest(site.root / "outbox/A.zip") == a_digest  # not overwritten
    assert digest(site.root / "outbox/B.zip") == b_digest
    assert sorted(os.listdir(site.root / "outbox")) == ["A.zip", "B.zip", "C.zip"]
    assert site.exists("processing", b"B.zip")  # left for the operator
    a1 = site.job("a1")
    # its supervisor's exit record says it finished: judged from it, not run again
    assert [e["job"] for e in b.events("attempt_end_recovered")] == ["a1"]
    assert a1 is not None and a1["state"] == "done", a1
    assert a1["attempts"] == 1  # the attempt the older store knew; none after it
    assert site.job("b1") is None
    started = [e for e in b.events("transition") if e.get("to") == "running"]
    assert [e.get("job") for e in started] == ["c1"]  # nothing but C ran


# -- a damaged database --------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "a damaged page"])
def test_a_damaged_database_is_one_line_and_exit_2(tmp_path: Path, damage: str) -> None:
    site = Site(tmp_path)
    db = site.state / "gpuwarden.db"
    site.state.mkdir(parents=True, exist_ok=True)
    if damage == "garbage":
        db.write_bytes(b"SQLite format 3\x00" + os.urandom(20_000))
    else:
        made = sqlite3.connect(db)
        made.execute("CREATE TABLE t (x TEXT)")
        made.executemany("INSERT INTO t VALUES (?)", [("x" * 200,)] * 2000)
        made.commit()
        made.close()
        raw = bytearray(db.read_bytes())
        raw[4096 * 5 : 4096 * 5 + 3000] = b"\xab" * 3000
        db.write_bytes(bytes(raw))
    # the modes a broker leaves its state in: nothing for the start to tighten
    site.state.chmod(0o700)
    db.chmod(0o600)
    site.place("inbox", b"waiting.zip", bundle("waiting"))
    lock = "state/broker.lock"  # the state directory's lock: taken before the store opens
    before = tree(tmp_path, skip=("events.jsonl",))
    r = subprocess.run(
        [*GW, "--config", str(site.config), "serve", "--log", str(tmp_path / "events.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: the database {db} is damaged")
    assert "restore it from a backup" in lines[0] and "Traceback" not in r.stderr
    after = tree(tmp_path, skip=("events.jsonl",))
    after.pop(lock, None)
    assert after == before  # nothing written: not the database, not the queue root
    log = tmp_path / "events.jsonl"
    assert not log.exists() or log.read_text() == ""
