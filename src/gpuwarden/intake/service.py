"""Queue-root intake and results: the half of the broker that reads bundles.

:class:`QueueIntake` takes bundles in from ``inbox/`` (claimed into
``processing/``, checked, their jobs accepted all or none into the store with
the bundle recorded, refusals to ``failed/`` with the reason), writes the result
bundle of each bundle whose jobs have all ended, and at start decides what
happens to the bundles an earlier run left in ``processing/``. The single-host
broker uses it in its loop; the coordinator runs it on a thread of its own
(:mod:`gpuwarden.cluster.queues`).
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from hashlib import sha256
from pathlib import Path
from typing import Any

from gpuwarden import faults
from gpuwarden.config import Config
from gpuwarden.core.model import Attempt, Event, Job, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import BundleError, GpuwardenError
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake.jobs import prepare
from gpuwarden.intake.queueroot import KEPT_INPUT, QueueRoot
from gpuwarden.registry import Registry
from gpuwarden.store.base import (
    BundleRecord,
    DuplicateBundleError,
    DuplicateJobError,
    Store,
    Submission,
)

__all__ = ["OUTPUTS_NOTE", "QueueIntake", "result_json"]

#: every open bundle is looked at this often (the owner's own changes are seen at once)
FULL_BUNDLE_SCAN_S = 2.0

#: a result bundle that cannot be written this many times gives its input to failed/
RESULT_TRIES = 3

#: a bundle that fails to be read for reasons not its own is refused after this many tries
INTAKE_TRIES = 3

#: in a coordinator's result bundle, beside a job's result.json when its outputs
#: stayed on the agent that ran it
OUTPUTS_NOTE = "OUTPUTS.txt"

Emit = Callable[..., None]
OnError = Callable[[str, Exception], None]
Check = Callable[[list[JobSpec]], None]


class QueueIntake:
    """Bundles in from queue roots, result bundles out, for one store.

    ``emit(kind, **detail)`` records an event (``job=`` names the job);
    ``on_error(where, exc)`` records a failing step; ``check(specs)`` may refuse
    prepared jobs with a :class:`GpuwardenError` (the broker: a footprint no GPU
    here can hold). With ``remote_outputs`` (the coordinator), a job whose
    outputs are not on this host's disk gets ``"outputs_on": NODE`` in its
    result.json and a note beside it instead of its outputs.
    """

    def __init__(
        self,
        *,
        store: Store,
        registry: Registry,
        config: Config,
        roots: Iterable[QueueRoot],
        emit: Emit,
        on_error: OnError,
        check: Check | None = None,
        clock: Callable[[], float] = time.time,
        remote_outputs: bool = False,
    ) -> None:
        self.store = store
        self.registry = registry
        self.config = config
        self.roots = list(roots)
        self.emit = emit
        self.on_error = on_error
        self.check = check
        self.clock = clock
        self.remote_outputs = remote_outputs
        self._staging_dir = config.state_dir / "staging"
        #: bundle name -> how often reading it failed for reasons not its own
        self._intake_failures: dict[str, int] = {}
        #: bundles (queue root, name) whose jobs changed since the last look
        self._touched: set[tuple[str, str]] = set()
        self._last_bundle_check = 0.0
        self._result_failures: dict[str, int] = {}

    def touch(self, queue_root: str, bundle: str) -> None:
        """A job of this bundle changed: look at the bundle on the next finish."""
        self._touched.add((queue_root, bundle))

    def staging_for(self, root: QueueRoot, name: str) -> Path:
        tag = sha256(str(root.path).encode()).hexdigest()[:12]
        return self._staging_dir / tag / name

    # -- recovery -----------------------------------------------------------

    def recover(self, now: float, roots: Iterable[QueueRoot] | None = None) -> None:
        """Decide what happens to every bundle left in ``processing/`` (each logged):
        never recorded, read again; result written, removed; else continued."""
        for root in self.roots if roots is None else roots:
            for path in sorted(root.processing.glob("*.zip")):
                rec = self.store.get_bundle(str(root.path), path.name)
                if rec is None:
                    self.emit(
                        "bundle_recovered",
                        bundle=path.name,
                        action="never recorded: reading it again",
                    )
                    self.ingest(root, path, now)
                elif rec.finished_at is not None:
                    self.emit(
                        "bundle_recovered",
                        bundle=path.name,
                        action="result already written: removed",
                    )
                    path.unlink(missing_ok=True)
                    shutil.rmtree(self.staging_for(root, path.name), ignore_errors=True)
                else:
                    self.emit(
                        "bundle_recovered",
                        bundle=path.name,
                        action="its jobs are in the store: continuing",
                    )

    # -- intake -------------------------------------------------------------

    def intake(self, now: float, roots: Iterable[QueueRoot] | None = None) -> int:
        """Take in every whole bundle in the roots' ``inbox/``; how many were read."""
        count = 0
        for root in self.roots if roots is None else roots:
            for path in root.pending():
                try:
                    claimed = root.claim(path)
                    faults.point("after_claim")
                except BundleError as exc:
                    self._reject(root, path, (), str(exc), now, duplicate=True)
                    count += 1
                    continue
                except FileNotFoundError:
                    continue  # another reader took it
                self.ingest(root, claimed, now)
                count += 1
        return count

    def ingest(self, root: QueueRoot, path: Path, now: float) -> None:
        """Read one bundle from ``processing/`` and accept its jobs, all or none."""
        staging = self.staging_for(root, path.name)
        if staging.exists():
            shutil.rmtree(staging)  # a partial extraction from a crashed run
        specs: tuple[JobSpec, ...] = ()
        try:
            staging.parent.mkdir(parents=True, exist_ok=True)
            specs = bundles.extract_bundle(path, staging, self._limits())
            prepared = [prepare(self.registry, s) for s in specs]
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
            shutil.rmtree(staging, ignore_errors=True)
            self._reject(root, path, specs, f"duplicate: {exc}", now, duplicate=True)
        except GpuwardenError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            self._reject(root, path, specs, exc.message, now)
        except Exception as exc:
            # not the bundle's fault (the store is locked, the disk is full): give it
            # back to inbox/ to be read again, and refuse it only if that keeps failing
            shutil.rmtree(staging, ignore_errors=True)
            tries = self._intake_failures.get(path.name, 0) + 1
            self._intake_failures[path.name] = tries
            self.on_error(f"reading bundle {path.name} (try {tries})", exc)
            if tries >= INTAKE_TRIES:
                self._reject(root, path, specs, f"could not be read {tries} times: {exc}", now)
            else:
                path.replace(root.inbox / path.name)
        else:
            self._intake_failures.pop(path.name, None)
            self.emit("bundle_accepted", bundle=path.name, jobs=[s.id for s in specs])

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
        already accepted; the input bundle is kept beside the result."""
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
        stem = path.name.removesuffix(".zip")
        # two copies refused in the same second must not overwrite each other
        unique = f"{int(now)}-{secrets.token_hex(3)}"
        result_name = f"{stem}.duplicate-{unique}.zip" if duplicate else path.name
        result = bundles.write_result_bundle(root.failed, result_name, results)
        root.move_to_failed(path, result_name.removesuffix(".zip") + KEPT_INPUT)
        if not duplicate:
            self.store.record_rejected_bundle(
                str(root.path), path.name, now=now, reason=reason, result_path=str(result)
            )
        else:
            self.store.add_event(
                Event(
                    ts=now, kind="bundle_rejected", detail={"bundle": path.name, "reason": reason}
                )
            )

    def _limits(self) -> bundles.BundleLimits:
        zip_bytes, entries, unpacked, jobs = self.config.bundle_limits_bytes()
        return bundles.BundleLimits(
            max_zip_bytes=zip_bytes,
            max_entries=entries,
            max_unpacked_bytes=unpacked,
            max_jobs=jobs,
        )

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
            if root is None:
                continue
            jobs = [self.store.get_job(i) for i in rec.job_ids]
            if not all(j is not None and j.state.terminal for j in jobs):
                continue
            try:  # one bundle that cannot be written must not hold up the others
                self._write_result(root, rec, [j for j in jobs if j is not None], now)
            except Exception as exc:
                tries = self._result_failures.get(rec.name, 0) + 1
                self._result_failures[rec.name] = tries
                self.on_error(f"writing the result of bundle {rec.name} (try {tries})", exc)
                if tries >= RESULT_TRIES:
                    self._give_up_result(root, rec, exc, now)

    def _give_up_result(
        self, root: QueueRoot, rec: BundleRecord, exc: Exception, now: float
    ) -> None:
        """A result that can never be written: the input goes to failed/, with why."""
        stem = rec.name.removesuffix(".zip")
        why = (
            f"the result of bundle {rec.name} could not be written {RESULT_TRIES} times: "
            f"{exc}. Its jobs' results are in the store: `gpuwarden show JOB`.\n"
        )
        reason_path = root.failed / f"{stem}.reason.txt"
        try:
            reason_path.write_text(why)
            if (root.processing / rec.name).exists():
                root.move_to_failed(root.processing / rec.name, stem + KEPT_INPUT)
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
        if any("outputs_on" in body for body, _ in results):
            path = _write_with_note(dest, rec.name, results)
        else:
            path = bundles.write_result_bundle(dest, rec.name, results)
        faults.point("after_result_write")
        self.store.finish_bundle(
            rec.queue_root,
            rec.name,
            now=now,
            outcome="done" if all_done else "failed",
            result_path=str(path),
        )
        faults.point("after_bundle_finish")
        root.remove_from_processing(rec.name)
        shutil.rmtree(self.staging_for(root, rec.name), ignore_errors=True)
        self.emit("bundle_finished", bundle=rec.name, result=str(path))


def _write_with_note(
    dest: Path, name: str, results: list[tuple[dict[str, Any], Path | None]]
) -> Path:
    """A result bundle where some jobs' outputs stayed on their agents: each such
    job gets ``<id>/outputs/OUTPUTS.txt`` saying where they are."""
    import tempfile

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
        return bundles.write_result_bundle(dest, name, packed)


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
