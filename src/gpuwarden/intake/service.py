"""Queue-root intake and results: the half of the broker that reads bundles.

:class:`QueueIntake` takes bundles in from ``inbox/`` (claimed into
``processing/``, checked, their jobs accepted all or none into the store with
the bundle recorded, refusals to ``failed/`` with the reason), writes the result
bundle of each bundle whose jobs have all ended, and at start decides what
happens to the bundles an earlier run left in ``processing/``. The single-host
broker uses it in its loop; the coordinator runs it on a thread of its own
(:mod:`gpuwarden.cluster.queues`).

Extraction runs off the caller's thread. A bundle can take a long time to
unpack (up to ``limits.max_unpacked_mib``), and the loop that calls
:meth:`QueueIntake.intake` also starts jobs, passes cancels and writes results:
it must never wait for one bundle. So the loop only lists ``inbox/``, claims
(one rename) and decides; ``EXTRACT_WORKERS`` threads open each claimed bundle
through :mod:`gpuwarden.safefs` and extract it into its staging folder, touching
nothing else (never the store); the loop picks their outcomes up on its next
pass and does the rest (validation, the store, refusals), as before. A pass
waits at most ``INTAKE_WAIT_S`` for the bundles it has just handed over, so a
small bundle is still accepted in the pass that claimed it. The alternative,
bounded work per tick on the loop thread, would have to cut zipfile's reads
into slices and keep half-extracted state between ticks; threads keep the
extraction code straight and the loop's pass short.

One file because a bundle's life in a queue root is one state machine over one
store: its claim, extraction, acceptance or refusal, its result bundle and the
recovery after a crash each decide from what the others left (its staging
folder, its record, its name in ``processing/``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from gpuwarden import faults, safefs
from gpuwarden.core.model import Attempt, Event, Job, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import (
    BundleError,
    GpuwardenError,
    TransitionError,
    UserError,
    ValidationError,
)
from gpuwarden.hostfaults import Backoff, Waiting, host_fault
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake import bundlewrite
from gpuwarden.intake.jobs import prepare
from gpuwarden.intake.manifest import BundleLimits
from gpuwarden.intake.queueroot import (
    INPUT_TAG,
    REASON_TAG,
    Arrival,
    QueueRoot,
    is_utf8,
    own_name,
    record_name,
    shown_name,
    unique_tag,
)
from gpuwarden.intake.zipread import ExtractionCancelled
from gpuwarden.registry import Registry
from gpuwarden.store.base import (
    BundleRecord,
    DuplicateBundleError,
    DuplicateJobError,
    Store,
    Submission,
)

__all__ = ["EXTRACT_WORKERS", "OUTPUTS_NOTE", "QueueIntake", "result_json"]

log = logging.getLogger("gpuwarden.intake")

#: every open bundle is looked at this often (the owner's own changes are seen at once)
FULL_BUNDLE_SCAN_S = 2.0

#: a result bundle that cannot be written this many times gives its input to failed/
#: (a fault of the host, a full or read-only disk, never counts: it waits, section 3)
RESULT_TRIES = 3

#: a bundle that fails to be read for reasons not its own is refused after this many
#: tries (a fault of the host, or a store that is unavailable for now, never counts)
INTAKE_TRIES = 3

#: bundles extracted at once, each on a thread of its own beside the loop
EXTRACT_WORKERS = 2

#: a pass of :meth:`QueueIntake.intake` waits at most this long for the bundles
#: it has just handed to the extractors (most take a few milliseconds)
INTAKE_WAIT_S = 0.05

#: in a coordinator's result bundle, beside a job's result.json when its outputs
#: stayed on the agent that ran it
OUTPUTS_NOTE = "OUTPUTS.txt"

Emit = Callable[..., None]
OnError = Callable[[str, Exception], None]
Check = Callable[[list[JobSpec]], None]
Writer = Callable[[Path, str, list[tuple[dict[str, Any], Path | None]]], Path]
#: (queue root, bundle name)
Key = tuple[str, str]


def _shown(path: Path | str) -> str:
    """A path as text a person, JSON and the store can hold (not UTF-8 as ``\\xNN``)."""
    return shown_name(str(path))


# -- extraction off the loop ---------------------------------------------------


@dataclass(frozen=True)
class _Task:
    root: QueueRoot
    path: Path  # processing/<name>
    staging: Path
    limits: BundleLimits

    @property
    def key(self) -> tuple[str, str]:
        return str(self.root.path), self.path.name


@dataclass(frozen=True)
class _Outcome:
    task: _Task
    specs: tuple[JobSpec, ...] = ()
    #: why the bundle is refused (its own fault), or None
    refusal: str | None = None
    #: what failed that is not the bundle's fault (the disk, the host), or None
    error: Exception | None = None
    cancelled: bool = False


def _extract(task: _Task, cancelled: Callable[[], bool]) -> _Outcome:
    """Open the claimed bundle (a regular file only: anything else is never
    opened) and extract it into its staging folder. Touches nothing else."""
    shown = shown_name(task.path.name)
    try:
        if os.path.lexists(task.staging):
            safefs.remove_tree(task.staging)  # a partial extraction from a crashed run
        task.staging.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = safefs.open_file(task.path)
        except safefs.UnsafePathError as exc:
            return _Outcome(
                task,
                refusal=f"bundle {shown}: {exc.why}; only regular files are read "
                "(it was moved aside, never opened)",
            )
        with os.fdopen(fd, "rb") as f:
            specs = bundles.extract_bundle(
                task.path, task.staging, task.limits, fileobj=f, cancelled=cancelled
            )
    except BundleError as exc:
        return _Outcome(task, refusal=exc.message)
    except ExtractionCancelled:
        return _Outcome(task, cancelled=True)
    except Exception as exc:  # not the bundle's fault: the loop decides
        return _Outcome(task, error=exc)
    return _Outcome(task, specs=specs)


class _Extractors:
    """Threads that extract claimed bundles; their outcomes wait in a queue for
    the loop. Daemon threads: a process that exits does not wait for them (what
    they left is cleaned up and read again at the next start)."""

    def __init__(self, workers: int, on_done: Callable[[], None] | None) -> None:
        self._workers = workers
        self._on_done = on_done
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._done: queue.Queue[_Outcome] = queue.Queue()
        self._cond = threading.Condition()
        self._finished = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def submit(self, task: _Task) -> None:
        if not self._threads:
            self._stop = threading.Event()  # a fresh start after close()
            for i in range(self._workers):
                t = threading.Thread(
                    target=self._run,
                    args=(self._stop,),
                    name=f"gpuwarden-extract-{i}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
        self._tasks.put(task)

    def _run(self, stop: threading.Event) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if stop.is_set():
                outcome = _Outcome(task, cancelled=True)
            else:
                outcome = _extract(task, stop.is_set)
            self._done.put(outcome)
            with self._cond:
                self._finished += 1
                self._cond.notify_all()
            if self._on_done is not None:
                with contextlib.suppress(Exception):
                    self._on_done()

    @property
    def finished(self) -> int:
        with self._cond:
            return self._finished

    def wait(self, until: int, timeout: float) -> None:
        """Wait until ``until`` extractions have finished in all, or ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished >= until, timeout)

    def outcomes(self) -> list[_Outcome]:
        out: list[_Outcome] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop: running extractions end at their next chunk, queued ones are not run."""
        self._stop.set()
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()


class QueueIntake:
    """Bundles in from queue roots, result bundles out, for one store.

    ``emit(kind, **detail)`` records an event (``job=`` names the job);
    ``on_error(where, exc)`` records a failing step; ``check(specs)`` may refuse
    prepared jobs with a :class:`GpuwardenError` (the broker: a footprint no GPU
    here can hold). With ``remote_outputs`` (the coordinator), a job whose
    outputs are not on this host's disk gets ``"outputs_on": NODE`` in its
    result.json and a note beside it instead of its outputs. ``wake()``, when
    given, is called from an extraction thread when a bundle has been extracted,
    so the caller's loop can pass again at once.
    """

    def __init__(
        self,
        *,
        store: Store,
        registry: Registry,
        staging_dir: Path,
        limits: BundleLimits,
        roots: Iterable[QueueRoot],
        emit: Emit,
        on_error: OnError,
        check: Check | None = None,
        clock: Callable[[], float] = time.time,
        remote_outputs: bool = False,
        wake: Callable[[], None] | None = None,
        commands: bool = False,
    ) -> None:
        self.store = store
        #: ``[commands] bundles``: whether a bundle may hold command jobs (sandboxed)
        self.commands = commands
        self.registry = registry
        self.limits = limits
        self.roots = list(roots)
        self.emit = emit
        self.on_error = on_error
        self.check = check
        self.clock = clock
        self.remote_outputs = remote_outputs
        self._staging_dir = staging_dir
        #: (queue root, bundle name) -> how often reading it failed for reasons not its own
        self._intake_failures: dict[tuple[str, str], int] = {}
        #: bundles (queue root, name) whose jobs changed since the last look
        self._touched: set[tuple[str, str]] = set()
        self._last_bundle_check = 0.0
        self._result_failures: dict[str, int] = {}
        self._extractors = _Extractors(EXTRACT_WORKERS, wake)
        #: bundles handed to the extractors and not picked up yet
        self._in_flight: dict[tuple[str, str], _Task] = {}
        #: bundles (and queue roots, name "") waiting for the host (a full, read-only
        #: or failing disk; a store unavailable for now) before they are tried again
        self._waits: Backoff[Key] = Backoff()
        #: of those, the ones waiting in processing/ (claimed): begun again when due
        self._held: dict[Key, tuple[QueueRoot, Path]] = {}
        #: results waiting for the host, and those written whose record is not yet
        self._result_waits: Backoff[Key] = Backoff()
        self._results_written: dict[Key, Path] = {}

    def touch(self, queue_root: str, bundle: str) -> None:
        """A job of this bundle changed: look at the bundle on the next finish."""
        self._touched.add((queue_root, bundle))

    def staging_for(self, root: QueueRoot, name: str) -> Path:
        return self._staging_of(root) / name

    def _staging_of(self, root: QueueRoot) -> Path:
        """The folder of a queue root's staging folders (one per bundle)."""
        return self._staging_dir / sha256(str(root.path).encode()).hexdigest()[:12]

    def _remove_staging(self, staging: Path) -> None:
        """Remove a bundle's staging folder (the broker extracted it; removed all
        the same without following a link). A failure is reported, not raised: the
        bundle's own outcome stands, and the next start sweeps what is left."""
        try:
            safefs.remove_tree(staging)
        except OSError as exc:
            self.on_error(f"removing the staging folder {staging}", exc)

    def _sweep_staging(self, root: QueueRoot, in_processing: set[str]) -> None:
        """Remove the staging folders of bundles no longer in ``processing/``: a
        bundle's inputs are needed only while it is open there (a crash between
        finishing a bundle and removing its staging folder leaves one)."""
        try:
            names = [p.name for p in self._staging_of(root).iterdir()]
        except FileNotFoundError:
            return
        for name in names:
            if name not in in_processing:
                self.emit("staging_removed", bundle=shown_name(name), why="its bundle has ended")
                self._remove_staging(self._staging_of(root) / name)

    @property
    def extracting(self) -> int:
        """Bundles being extracted now (or waiting for a thread)."""
        return len(self._in_flight)

    def close(self) -> None:
        """Stop the extraction threads. A bundle being extracted stays in
        ``processing/`` unrecorded and is read again at the next start."""
        self._extractors.close()

    # -- recovery -----------------------------------------------------------

    def recover(self, now: float, roots: Iterable[QueueRoot] | None = None) -> None:
        """Decide what happens to every bundle left in ``processing/`` (each logged):
        never recorded, read again (or, if its result is already there, left for
        the operator); result written, removed; else continued. Then the open
        bundles of the store whose result is already in ``outbox/`` or
        ``failed/`` (the store lost that it was written) are not run again."""
        for root in self.roots if roots is None else roots:
            try:
                root.remove_own_temporaries()
            except OSError as exc:
                self.on_error(f"removing temporary files in queue root {root.path}", exc)
            seen: set[str] = set()
            for arrival in root.in_processing():
                seen.add(arrival.name)
                if (key := (str(root.path), arrival.name)) in self._in_flight or key in self._held:
                    continue
                try:
                    self._recover_one(root, arrival, now)
                except Exception as exc:  # one bundle must not stop the start
                    self.on_error(f"recovering bundle {shown_name(arrival.name)}", exc)
            try:
                self._recover_open_bundles(root, seen, now)
            except Exception as exc:
                self.on_error(f"checking the open bundles of queue root {root.path}", exc)
            self._sweep_staging(root, {a.name for a in root.in_processing()})

    def _recover_one(self, root: QueueRoot, arrival: Arrival, now: float) -> None:
        name = arrival.name
        shown = record_name(name)
        rec = self.store.get_bundle(str(root.path), shown)
        if rec is None:
            existing = root.result_of(name)
            if existing is not None and is_utf8(name) and arrival.kind == "file":
                self._hold(root, name, existing)
                return
            action = (
                "never recorded: reading it again"
                if is_utf8(name) and arrival.kind == "file"
                else "never recorded: refusing it"
            )
            self.emit("bundle_recovered", bundle=shown, action=action)
            self._begin(root, arrival.path, arrival.kind, now)
        elif rec.finished_at is not None:
            self.emit("bundle_recovered", bundle=shown, action="result already written: removed")
            safefs.remove_tree(arrival.path)
            self._remove_staging(self.staging_for(root, name))
        else:
            existing = root.result_of(name)
            if existing is not None:
                self._result_stands(root, rec, existing, now)
                return
            self.emit(
                "bundle_recovered", bundle=shown, action="its jobs are in the store: continuing"
            )

    def _recover_open_bundles(self, root: QueueRoot, seen: set[str], now: float) -> None:
        for rec in self.store.open_bundles():
            if rec.queue_root != str(root.path) or rec.name in seen:
                continue
            existing = root.result_of(rec.name)
            if existing is not None:
                self._result_stands(root, rec, existing, now)

    def _hold(self, root: QueueRoot, name: str, existing: Path) -> None:
        """A bundle the store does not know, whose result is already there: it is
        not read, and stays in ``processing/`` for the operator."""
        self.emit(
            "bundle_result_exists",
            bundle=name,
            result=_shown(existing),
            left=_shown(root.processing / name),
            action="not read: the store does not know this bundle, but its result is "
            "already there (the store lost commits?). It stays in processing/: delete it "
            "to keep that result, or move the result away and the bundle back to inbox/ "
            "to run it again",
        )

    def _result_stands(
        self, root: QueueRoot, rec: BundleRecord, existing: Path, now: float
    ) -> None:
        """An open bundle whose result file is already there: the result was
        written and its record lost (a crash right after writing it, or a store
        that lost commits). The result stands: the bundle is recorded finished
        with it, and its jobs that have not ended are cancelled, never run again."""
        folder = existing.parent.name
        why = (
            f"not run again: the result of its bundle {rec.name} is already in {folder}/ "
            "(the store had lost that it was written)"
        )
        not_run: list[str] = []
        for job_id in rec.job_ids:
            job = self.store.get_job(job_id)
            if job is None or job.state.terminal:
                continue
            not_run.append(job_id)
            try:
                if job.state is JobState.QUEUED:
                    self.store.transition(job_id, JobState.CANCELLED, now=now, reason=why)
                else:
                    self.store.request_cancel(job_id, now=now)
            except (TransitionError, UserError) as exc:
                self.on_error(f"cancelling job {job_id} of bundle {rec.name}", exc)
        outcome = "done" if folder == "outbox" else "failed"
        self.store.finish_bundle(
            rec.queue_root, rec.name, now=now, outcome=outcome, result_path=str(existing)
        )
        safefs.remove_tree(root.processing / rec.name)
        self._remove_staging(self.staging_for(root, rec.name))
        if not_run:
            self.emit(
                "bundle_result_exists",
                bundle=rec.name,
                result=str(existing),
                jobs_not_run=not_run,
                action="its result is already there: it stands, and the jobs that had not "
                "ended are cancelled, never run again",
            )
        else:
            self.emit(
                "bundle_recovered", bundle=rec.name, action="result already written: recorded"
            )

    # -- intake -------------------------------------------------------------

    def intake(self, now: float, roots: Iterable[QueueRoot] | None = None) -> int:
        """Take in what is in the roots' ``inbox/``: claim each bundle, refuse at
        once what is not a regular file or has a name that is not UTF-8, and hand
        the others to the extraction threads (at most ``EXTRACT_WORKERS`` at a
        time; the rest wait in ``inbox/``); pick up the extractions that ended.
        Returns how many bundles were decided."""
        count = self._collect(now)
        finished = self._extractors.finished
        handed = self._begin_held(now)
        for root in self.roots if roots is None else roots:
            for arrival in self._arrivals(root, now):
                extract = arrival.kind == "file" and is_utf8(arrival.name)
                if extract and len(self._in_flight) >= EXTRACT_WORKERS:
                    continue  # waits in inbox/ for a free thread
                if self._waits.waits((str(root.path), arrival.name), now):
                    continue  # it waits for the host
                try:
                    step = self._take(root, arrival, now)
                except Exception as exc:  # one entry must never abort the pass
                    self.on_error(f"taking in bundle {shown_name(arrival.name)}", exc)
                    continue
                handed += step == "extracting"
                count += step == "decided"
        if handed:
            self._extractors.wait(finished + handed, INTAKE_WAIT_S)
            count += self._collect(now)
        return count

    def _take(self, root: QueueRoot, arrival: Arrival, now: float) -> str:
        try:
            claimed = root.claim(arrival.path)
            faults.point("after_claim")
        except BundleError as exc:
            self._refuse(root, arrival.path, (), str(exc), now, duplicate=True)
            return "decided"
        except FileNotFoundError:
            return "gone"  # another reader took it
        except OSError as exc:
            why = host_fault(exc)
            if why is None:
                raise
            self._wait_for_host((str(root.path), arrival.name), why, now, "claiming it")
            return "waiting"  # it stays in inbox/
        return self._begin(root, claimed, arrival.kind, now)

    # -- waiting for the host --------------------------------------------------

    def _transient(self, exc: BaseException) -> str | None:
        """What ``exc`` waits for when it is a fault of the host (a full, read-only or
        failing disk) or a store that is unavailable for now; None otherwise."""
        why = host_fault(exc)
        if why is None and isinstance(exc, Exception) and self.store.unavailable(exc):
            why = f"the store to be available again: {exc}"
        return why

    def _arrivals(self, root: QueueRoot, now: float) -> list[Arrival]:
        """``inbox/``'s bundles; none while the queue root waits for the host."""
        key = (str(root.path), "")
        if self._waits.waits(key, now):
            return []
        try:
            found = root.arrivals()
        except OSError as exc:
            why = host_fault(exc)
            if why is None:
                raise
            self._wait_for_host(key, why, now, "listing inbox/")
            return []
        self._waited(key, now)
        return found

    def _wait_for_host(self, key: Key, why: str, now: float, where: str) -> None:
        """``key`` (a bundle, or a queue root with the name "") waits for the host:
        it is tried again after a wait that doubles each time (1 s to 60 s), never
        refused for it. Logged and said as a ``bundle_waiting`` event."""
        waiting = self._waits.hold(key, now, why)
        self._say_waiting(key, "bundle_waiting", where, waiting)

    def _say_waiting(self, key: Key, kind: str, where: str, waiting: Waiting) -> None:
        why, wait_s, tries = waiting.why, waiting.wait_s, waiting.tries
        root, name = key
        log.warning(
            "%s %s: waits for %s (%s, try %d); tried again in %g s",
            "bundle" if name else "queue root",
            shown_name(name) if name else root,
            why,
            where,
            tries,
            wait_s,
        )
        try:  # the store may be what the host's fault stops
            self.emit(
                kind,
                queue_root=root,
                bundle=record_name(name) if name else None,
                where=where,
                waits_for=why,
                retry_in_s=wait_s,
                tries=tries,
            )
        except Exception as exc:
            log.warning("the %s event could not be written either: %s", kind, exc)

    def _waited(self, key: Key, now: float) -> None:
        """``key`` went through: if it had waited for the host, say for how long."""
        waited = self._waits.clear(key)
        if waited is None:
            return
        root, name = key
        with contextlib.suppress(Exception):
            self.emit(
                "bundle_wait_over",
                queue_root=root,
                bundle=record_name(name) if name else None,
                waited_s=round(now - waited.since, 3),
                tries=waited.tries,
            )

    def _hold_claimed(self, root: QueueRoot, path: Path, why: str, now: float, where: str) -> None:
        """A claimed bundle met a fault of the host: it waits in ``processing/`` and is
        begun again (extracted, checked) when its wait is over."""
        key = (str(root.path), path.name)
        self._held[key] = (root, path)
        self._wait_for_host(key, why, now, where)

    def _begin_held(self, now: float) -> int:
        """Begin again the bundles of ``processing/`` whose wait for the host is
        over; returns how many went to the extractors."""
        handed = 0
        for key in self._waits.due(now):
            if key not in self._held or len(self._in_flight) >= EXTRACT_WORKERS:
                continue
            root, path = self._held.pop(key)
            if not os.path.lexists(path):
                self._waits.clear(key)  # gone meanwhile (an operator moved it)
                continue
            try:
                handed += self._begin(root, path, "file", now) == "extracting"
            except Exception as exc:
                self._hold_claimed(
                    root, path, self._transient(exc) or str(exc), now, "beginning it again"
                )
        return handed

    def _begin(self, root: QueueRoot, path: Path, kind: str, now: float) -> str:
        """A claimed entry of ``processing/``: refuse it, hold it, or extract it."""
        name = path.name
        if not is_utf8(name):
            self._refuse(
                root,
                path,
                (),
                f"bundle {shown_name(name)}: its name is not valid UTF-8 (shown here with "
                "\\xNN for the bytes that are not); rename it to a UTF-8 name and drop it again",
                now,
            )
            return "decided"
        if kind != "file":
            self._refuse(
                root,
                path,
                (),
                f"bundle {name}: is a {kind}, not a regular file; only regular files are read "
                "(it was moved aside, never opened)",
                now,
            )
            return "decided"
        if self.store.get_bundle(str(root.path), name) is None:
            existing = root.result_of(name)
            if existing is not None:
                self._hold(root, name, existing)
                return "decided"
        task = _Task(root, path, self.staging_for(root, name), self.limits)
        self._in_flight[task.key] = task
        self._extractors.submit(task)
        return "extracting"

    def _collect(self, now: float) -> int:
        """Pick up the extractions that ended and decide each bundle."""
        count = 0
        for outcome in self._extractors.outcomes():
            task = outcome.task
            self._in_flight.pop(task.key, None)
            if outcome.cancelled:
                continue  # stays in processing/: read again at the next start
            count += 1
            try:
                if outcome.refusal is not None:
                    self._refuse(task.root, task.path, (), outcome.refusal, now)
                elif outcome.error is not None:
                    why = self._transient(outcome.error)
                    if why is None:
                        self._read_failed(task.root, task.path, (), outcome.error, now)
                    else:
                        self._remove_staging(task.staging)  # what it wrote, freed at once
                        self._hold_claimed(task.root, task.path, why, now, "extracting it")
                else:
                    self._accept(task, outcome.specs, now)
            except Exception as exc:
                self.on_error(f"taking in bundle {shown_name(task.path.name)}", exc)
        return count

    def _accept(self, task: _Task, specs: tuple[JobSpec, ...], now: float) -> None:
        """Validate the extracted bundle's jobs and accept them all, or none."""
        root, path, staging = task.root, task.path, task.staging
        try:
            prepared = [prepare(self.registry, self._command_allowed(s)) for s in specs]
            if self.check is not None:
                self.check(prepared)
            self.store.submit(
                prepared,
                now=now,
                origin=Submission(
                    input_dir=str(staging / "inputs"),
                    queue_root=str(root.path),
                    bundle=path.name,
                ),
            )
            faults.point("after_bundle_commit")
        except (DuplicateJobError, DuplicateBundleError) as exc:
            self._remove_staging(staging)
            self._refuse(root, path, specs, f"duplicate: {exc}", now, duplicate=True)
        except GpuwardenError as exc:
            self._remove_staging(staging)
            self._refuse(root, path, specs, exc.message, now)
        except Exception as exc:
            self._remove_staging(staging)
            why = self._transient(exc)
            if why is None:
                self._read_failed(root, path, specs, exc, now)
            else:
                self._hold_claimed(root, path, why, now, "submitting its jobs")
        else:
            self._intake_failures.pop(task.key, None)
            self._waited(task.key, now)
            self.emit("bundle_accepted", bundle=path.name, jobs=[s.id for s in specs])

    def _command_allowed(self, spec: JobSpec) -> JobSpec:
        """``spec``, unless it is a command job and ``[commands] bundles`` is off:
        then :class:`ValidationError` naming the rule (the bundle is refused)."""
        if spec.command is not None and not self.commands:
            raise ValidationError(
                f"job {spec.id}: this node takes no command jobs from bundles: "
                "[commands] bundles = false in its config; its operator may set it to true "
                "(they then run sandboxed), or give the job a module's type"
            )
        return spec

    def _read_failed(
        self, root: QueueRoot, path: Path, specs: tuple[JobSpec, ...], exc: Exception, now: float
    ) -> None:
        """Not the bundle's fault (the store is locked, the disk is full): give it
        back to inbox/ to be read again, and refuse it only if that keeps failing."""
        key = (str(root.path), path.name)
        tries = self._intake_failures.get(key, 0) + 1
        self._intake_failures[key] = tries
        shown = shown_name(path.name)
        self.on_error(f"reading bundle {shown} (try {tries})", exc)
        if tries >= INTAKE_TRIES:
            self._refuse(root, path, specs, f"could not be read {tries} times: {exc}", now)
        elif os.path.lexists(root.inbox / path.name):
            self.on_error(
                f"giving bundle {shown} back to inbox/",
                FileExistsError(f"inbox/ holds another {shown}; this one stays in processing/"),
            )
        else:
            path.rename(root.inbox / path.name)

    def _refuse(
        self,
        root: QueueRoot,
        path: Path,
        specs: tuple[JobSpec, ...],
        reason: str,
        now: float,
        *,
        duplicate: bool = False,
    ) -> None:
        """:meth:`_reject`, and when even that fails, say so: the bundle stays where
        it is. For a fault of the host it is tried again when its wait is over;
        otherwise it is looked at again at the next start."""
        key = (str(root.path), path.name)
        # a claim's duplicate is refused from inbox/ while its namesake is in processing/
        claimed = path.parent == root.processing
        try:
            self._reject(root, path, specs, reason, now, duplicate=duplicate)
        except Exception as exc:
            why = self._transient(exc)
            if why is not None and claimed:
                self._hold_claimed(root, path, why, now, "refusing it")
            elif why is not None:
                self._wait_for_host(key, why, now, "refusing it")
            else:
                self.on_error(
                    f"refusing bundle {shown_name(path.name)} (it stays in "
                    f"{path.parent.name}/ until the next start)",
                    exc,
                )
        else:
            if claimed:
                self._held.pop(key, None)
                self._waited(key, now)

    def _reject(
        self,
        root: QueueRoot,
        path: Path,
        specs: tuple[JobSpec, ...],
        reason: str,
        now: float,
        *,
        duplicate: bool = False,
    ) -> None:
        """Fail every job of an unreadable bundle into ``failed/``, touching nothing
        already accepted; the input bundle (whatever it is: it is moved, never
        opened) is kept beside the result."""
        name = path.name
        recorded_as = record_name(name)
        if not duplicate and self.store.get_bundle(str(root.path), recorded_as) is not None:
            duplicate = True  # received before: never recorded twice
        results: list[tuple[dict[str, Any], Path | None]] = [
            (
                {
                    "id": s.id,
                    "type": s.type,
                    # a duplicate leaves the accepted job untouched: this copy was refused
                    "status": "refused" if duplicate else "failed",
                    "reason": f"the bundle was refused: {reason}",
                    "attempts": 0,
                },
                None,
            )
            for s in specs
        ] or [({"id": "bundle", "status": "failed", "reason": reason, "attempts": 0}, None)]
        if duplicate:
            # two copies refused in the same second must not overwrite each other
            tag = unique_tag("duplicate", now)
            result_name, input_name = own_name(name, tag), own_name(name, f"{tag}-{INPUT_TAG}")
        else:
            result_name, input_name = name, own_name(name, INPUT_TAG)
        result = self._write_unique(
            bundlewrite.write_result_bundle, root.failed, result_name, results, bundle=name, now=now
        )
        kept = root.move_to_failed(path, input_name)
        if not duplicate:
            self.store.record_rejected_bundle(
                str(root.path), recorded_as, now=now, reason=reason, result_path=_shown(result)
            )
        else:
            self.store.add_event(
                Event(
                    ts=now,
                    kind="bundle_rejected",
                    detail={
                        "queue_root": str(root.path),
                        "bundle": recorded_as,
                        "reason": reason,
                        "result": _shown(result),
                        "input": _shown(kept),
                    },
                )
            )

    def _write_unique(
        self,
        write: Writer,
        dest: Path,
        name: str,
        results: list[tuple[dict[str, Any], Path | None]],
        *,
        bundle: str,
        now: float,
    ) -> Path:
        """Write a result as ``dest/name``; when a file of that name is already
        there it is left as it is, and the result gets a name of the broker's own
        (``<base>.result-<unix seconds>-<6 hex>``) and a ``result_renamed`` event."""
        try:
            return write(dest, name, results)
        except FileExistsError:
            pass
        path = write(dest, own_name(bundle, unique_tag("result", now)), results)
        self.emit(
            "result_renamed",
            bundle=record_name(bundle),
            wanted=_shown(dest / name),
            result=_shown(path),
            reason="a file of that name is already there; it was left as it is",
        )
        return path

    # -- results ------------------------------------------------------------

    def finish_bundles(
        self, now: float, *, force: bool = False, roots: Iterable[QueueRoot] | None = None
    ) -> None:
        """Write the result of each bundle whose jobs have all ended. Touched bundles
        are looked at at once; all open ones every few seconds, since a client's
        cancel in another process touches a bundle without the owner's loop."""
        by_path = {str(r.path): r for r in (self.roots if roots is None else roots)}
        if force or now - self._last_bundle_check >= FULL_BUNDLE_SCAN_S:
            self._last_bundle_check = now
            candidates = self.store.open_bundles()
        elif self._touched:
            candidates = [
                rec
                for key in sorted(self._touched)
                if (rec := self.store.get_bundle(*key)) is not None and rec.finished_at is None
            ]
        else:
            return
        self._touched.clear()
        for rec in candidates:
            root = by_path.get(rec.queue_root)
            if root is None or self._result_waits.waits((rec.queue_root, rec.name), now):
                continue
            if self.store.terminal_count(rec.job_ids) < len(rec.job_ids):
                continue  # one count per look, not a read of every job
            jobs = [self.store.get_job(i) for i in rec.job_ids]
            if not all(j is not None and j.state.terminal for j in jobs):
                continue
            try:  # one bundle that cannot be written must not hold up the others
                self._write_result(root, rec, [j for j in jobs if j is not None], now)
            except Exception as exc:
                if (why := self._transient(exc)) is not None:
                    # the host's fault: it waits, tried again with backoff, never given up
                    key = (rec.queue_root, rec.name)
                    waiting = self._result_waits.hold(key, now, why)
                    self._say_waiting(key, "result_waiting", "writing its result", waiting)
                    continue
                tries = self._result_failures.get(rec.name, 0) + 1
                self._result_failures[rec.name] = tries
                self.on_error(f"writing the result of bundle {rec.name} (try {tries})", exc)
                if tries >= RESULT_TRIES:
                    self._give_up_result(root, rec, exc, now)

    def _give_up_result(
        self, root: QueueRoot, rec: BundleRecord, exc: Exception, now: float
    ) -> None:
        """A result that can never be written: the input goes to failed/, with why."""
        why = (
            f"the result of bundle {rec.name} could not be written {RESULT_TRIES} times: "
            f"{exc}. Its jobs' results are in the store: `gpuwarden show JOB`.\n"
        )
        try:
            reason_path = _write_new_text(root.failed, own_name(rec.name, REASON_TAG), why)
            if os.path.lexists(root.processing / rec.name):
                root.move_to_failed(root.processing / rec.name, own_name(rec.name, INPUT_TAG))
        except OSError as again:
            self.on_error(f"moving bundle {rec.name} to failed/", again)
            return
        self.store.finish_bundle(
            rec.queue_root, rec.name, now=now, outcome="unwritable", result_path=str(reason_path)
        )
        self._result_failures.pop(rec.name, None)
        self.emit("bundle_unwritable", bundle=rec.name, reason=why.strip())

    def _job_result(self, job: Job) -> tuple[dict[str, Any], Path | None]:
        """One job's result.json and the outputs folder to pack with it (or None)."""
        body = result_json(job, self.store.attempts(job.id))
        out = job.result.get("output_dir")
        outputs = Path(out) if out and job.state is JobState.DONE else None
        if self.remote_outputs:
            node = job.result.get("node")
            if node is not None:
                body["node"] = node
            if outputs is not None and not outputs.is_dir():
                # the agent that ran it keeps them: the coordinator cannot reach them
                body["outputs_on"] = node or "the node that ran it"
                body["output_dir"] = str(outputs)
                outputs = None
        return body, outputs

    def _write_result(
        self, root: QueueRoot, rec: BundleRecord, jobs: list[Job], now: float
    ) -> None:
        results = [self._job_result(job) for job in jobs]
        all_done = all(j.state is JobState.DONE for j in jobs)
        dest = root.outbox if all_done else root.failed
        write: Writer = (
            _write_with_note
            if any("outputs_on" in body for body, _ in results)
            else bundlewrite.write_result_bundle
        )
        key = (rec.queue_root, rec.name)
        # written on an earlier try whose record failed (the store was unavailable):
        # recorded now, never written twice
        path = self._results_written.get(key) or self._write_unique(
            write, dest, rec.name, results, bundle=rec.name, now=now
        )
        self._results_written[key] = path
        faults.point("after_result_write")
        self.store.finish_bundle(
            rec.queue_root,
            rec.name,
            now=now,
            outcome="done" if all_done else "failed",
            result_path=str(path),
        )
        del self._results_written[key]
        faults.point("after_bundle_finish")
        root.remove_from_processing(rec.name)
        self._remove_staging(self.staging_for(root, rec.name))
        self.emit("bundle_finished", bundle=rec.name, result=str(path))
        if (waited := self._result_waits.clear(key)) is not None:
            self.emit(
                "result_wait_over",
                queue_root=rec.queue_root,
                bundle=rec.name,
                waited_s=round(now - waited.since, 3),
                tries=waited.tries,
            )


def _write_new_text(folder: Path, name: str, text: str) -> Path:
    """Write ``folder/name`` fresh and whole (a temporary file given the name once
    written: never an empty or partial file, nothing left when it fails); when that
    name is taken, ``-<6 hex>`` is added."""
    path = folder / name
    for _ in range(10):
        try:
            return bundlewrite.write_new_file(folder, path.name, text.encode("utf-8"))
        except FileExistsError:
            path = folder / f"{name}-{os.urandom(3).hex()}"
    raise FileExistsError(f"{folder}: no free name for {name}")


def _write_with_note(
    dest: Path, name: str, results: list[tuple[dict[str, Any], Path | None]]
) -> Path:
    """A result bundle where some jobs' outputs stayed on their agents: each such
    job gets ``<id>/outputs/OUTPUTS.txt`` saying where they are."""
    with tempfile.TemporaryDirectory(prefix="gpuwarden-note-") as tmp:
        packed: list[tuple[dict[str, Any], Path | None]] = []
        for body, outputs in results:
            if "outputs_on" in body and outputs is None:
                folder = Path(tmp) / str(body["id"])
                folder.mkdir()
                listed = "".join(f"  {name}\n" for name in body.get("outputs", []))
                (folder / OUTPUTS_NOTE).write_text(
                    f"The outputs of job {body['id']} stay on node {body['outputs_on']}, "
                    "the agent that ran it; the coordinator cannot reach that disk.\n"
                    f"They are in {body.get('output_dir') or 'its attempt folder'} there:\n"
                    f"{listed}"
                )
                packed.append((body, folder))
            else:
                packed.append((body, outputs))
        return bundlewrite.write_result_bundle(dest, name, packed)


def result_json(job: Job, attempts: list[Attempt]) -> dict[str, Any]:
    """The ``result.json`` of one job: status, message or reason, attempts, timings,
    exit code, clipped output, and the fingerprint of the module's ``src/``."""
    last = attempts[-1] if attempts else None
    done = job.state is JobState.DONE
    started = job.result.get("started_at")
    ended = job.result.get("ended_at")
    return {
        "id": job.id,
        "type": job.type,
        "status": job.state.value,
        "message": job.result.get("message", job.reason) if done else job.reason,
        "reason": job.reason,
        "attempts": len(attempts),
        "exit_code": job.exit_code,
        "timings": {
            "submitted_at": job.submitted_at,
            "started_at": started,
            "ended_at": ended,
            "finished_at": job.updated_at,
            "queued_s": round(started - job.submitted_at, 3) if started else None,
            "run_s": round(ended - started, 3) if started and ended else None,
        },
        "stdout": last.stdout if last else "",
        "stderr": last.stderr if last else "",
        "outputs": job.result.get("outputs", []) if done else [],
        # what the broker would not take from the job's folders (SPEC.md section 7)
        "refused": job.result.get("refused", []),
        "message_file": job.result.get("message_file"),
        "module_fingerprint": job.result.get("module_fingerprint"),
        "gpu": job.result.get("gpu"),
    }
