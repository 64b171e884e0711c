"""The attempts a broker runs: started on worker threads, ended by the loop.

:class:`AttemptRunner` holds the attempts this broker started and has not
drained yet. It begins an attempt in the store, launches it (host and container
launch modes; warm servers are :mod:`gpuwarden.node.warm`'s) on a worker thread
that only runs the launcher and posts the result, and when the loop drains that
result, ends the attempt: judges it (:func:`gpuwarden.core.classify.classify` on
what it did and left), records the end, and lets the node's own state follow
(its warm server freed, its memory measured, its footprint raised, its run time
noted, its bundle looked at).

Everything here runs on the loop's thread, except :meth:`AttemptRunner.work`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden import faults
from gpuwarden.core import jobcontrol, policy, ramadmit
from gpuwarden.core.classify import (
    INFRASTRUCTURE,
    AttemptFacts,
    Outcome,
    Verdict,
    checkpoints_before,
    classify,
    internal_error,
    interruptions_before,
    is_cuda_oom,
)
from gpuwarden.core.lease import is_lease, ttl_of
from gpuwarden.core.model import Job, JobType, LaunchMode
from gpuwarden.core.ramadmit import RamNeed, RamView
from gpuwarden.errors import GpuwardenError, TransitionError
from gpuwarden.launch.base import Launcher, LaunchRequest, LaunchResult, Starter
from gpuwarden.node import attemptfs, leases
from gpuwarden.node.attempts import AttemptLayout, Launching
from gpuwarden.node.gpulocks import release
from gpuwarden.node.hostram import HostRam, RunningRam, effective_need, ram_view
from gpuwarden.node.measured import Footprints, RamPeaks, RunTimes, sized_by_job, tree_shows_ram
from gpuwarden.node.running import Emit, ExchangeNote, Mailbox, OnError, RunningAttempt, Started
from gpuwarden.node.stats import NodeStats
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warmpool import ServerState
from gpuwarden.store.base import Store

#: the port a service job's process listens on (its type's ``port``)
SERVICE_PORT_ENV = "GPUWARDEN_SERVICE_PORT"

#: the broker's log: its lines keep one name, whichever of its modules writes them
log = logging.getLogger("gpuwarden.node.loop")


@dataclass(frozen=True, slots=True)
class Recorded:
    """An attempt whose end is written (in the loop's open batch) and whose node
    state has not followed yet (:meth:`AttemptRunner.follow`, once committed)."""

    run: RunningAttempt
    result: LaunchResult
    verdict: Verdict
    holder: str


@dataclass(frozen=True, slots=True)
class _Pending:
    """A launch that waits for the commit of its attempt's start."""

    run: RunningAttempt
    launcher: Launcher
    decision: policy.Start
    now: float


class AttemptRunner:
    """The node's running attempts, from their start in the store to their end."""

    def __init__(
        self,
        *,
        node: str,
        store: Store,
        vram: VramBook,
        launching: Launching,
        footprints: Footprints,
        run_times: RunTimes,
        mailbox: Mailbox,
        emit: Emit,
        on_error: OnError,
        touch: Callable[[str, str], None],
        max_interruptions: int,
        clock: Callable[[], float],
        stats: NodeStats | None = None,
        host_ram: HostRam | None = None,
        ram_floor_bytes: int = 0,
    ) -> None:
        self.node = node
        self.store = store
        self.vram = vram
        self.launching = launching
        self.footprints = footprints
        self.run_times = run_times
        self.mailbox = mailbox
        self.emit = emit
        self.on_error = on_error
        #: a job of a bundle changed: its queue intake looks at the bundle again
        self.touch = touch
        #: the broker's limit on interruptions, for types that set none
        self.default_max_interruptions = max_interruptions
        self.clock = clock
        #: what the node counts (attempts, their waits and run times): ``/metrics``
        self.stats = stats if stats is not None else NodeStats()
        #: per job id, its attempt that runs here (loop-owned)
        self.by_job: dict[str, RunningAttempt] = {}
        #: the RAM peaks of the running attempts (sampled on the loop's ticks)
        self.ram = RamPeaks()
        #: MemAvailable, for RAM admission (``[broker] ram_floor_gib`` is the node's floor)
        self.host_ram = host_ram if host_ram is not None else HostRam()
        self.ram_floor_bytes = ram_floor_bytes
        #: while the loop plans (:meth:`launches_after_commit`): the launches that
        #: wait for their starts' commit; None: a launch happens at once
        self._pending: list[_Pending] | None = None

    def __len__(self) -> int:
        return len(self.by_job)

    def __iter__(self) -> Iterator[RunningAttempt]:
        return iter(list(self.by_job.values()))

    def max_interruptions(self, jobtype: JobType) -> int:
        """How often a job of ``jobtype`` may be interrupted by this broker's own
        end before it is quarantined: the type's own limit, else the broker's."""
        if jobtype.max_interruptions is not None:
            return jobtype.max_interruptions
        return self.default_max_interruptions

    # -- host RAM -----------------------------------------------------------------

    def ram_view(self, available: int | None, *, but: str | None = None) -> RamView:
        """Host RAM as admission sees it beside the running attempts (but ``but``)."""
        running = [
            RunningRam(effective_need(r.jobtype, r.job.ram), self.ram.current(r.holder))
            for r in self.by_job.values()
            if r.job.id != but
        ]
        return ram_view(available, self.ram_floor_bytes, running, self.host_ram.total_bytes)

    def ram_gated(self, *needs: RamNeed) -> bool:
        """Whether jobs with ``needs`` are judged against host RAM at all: where one
        asks something of it, or a floor holds on the node (its own, or a running
        job's)."""
        return (
            self.ram_floor_bytes > 0
            or any(n.asks for n in needs)
            or any(r.job.ram.floor_bytes for r in self.by_job.values())
        )

    def ram_short(self, run: RunningAttempt, now: float) -> str | None:
        """Right before a launch: why host RAM does not allow it now (a fresh
        sample of MemAvailable against the same rule the plan used), or None."""
        need = effective_need(run.jobtype, run.job.ram)
        if not self.ram_gated(need):
            return None
        view = self.ram_view(self.host_ram.fresh(now), but=run.job.id)
        return ramadmit.admit(view, need)

    # -- start --------------------------------------------------------------------

    def begin(
        self, job: Job, jobtype: JobType, gpu: str | None, now: float
    ) -> RunningAttempt | None:
        """Start the job's next attempt in the store; None when the store refuses
        (a client cancelled it between the plan and now). From here on the attempt
        is this broker's: whatever fails, it ends through a posted result (so it is
        never left running, and a cancel reaches it)."""
        # a first attempt waited since its submission; a retry since it was queued again
        queued_since = job.submitted_at if job.attempts == 0 else job.updated_at
        try:
            job, attempt = self.store.start_attempt(job.id, node=self.node, gpu_uuid=gpu, now=now)
        except TransitionError:
            return None
        self.stats.attempt_started(jobtype.name, attempt.started_at - queued_since)
        if jobtype.launch is LaunchMode.SERVE:
            self.store.commit()  # its warm server is handed the job at once
        attempt_dir = self.launching.attempt_dir(job.id, attempt.number)
        run = RunningAttempt(job=job, attempt=attempt, jobtype=jobtype, attempt_dir=attempt_dir)
        run.resume_from = self._resumes_from(run)
        self.by_job[job.id] = run
        return run

    def _resumes_from(self, run: RunningAttempt) -> Path | None:
        """A preemptible job's attempt after one that ended checkpointed or
        preempted resumes: that attempt's output folder is carried into this one's."""
        number = run.attempt.number
        if not run.jobtype.preemptible or number < 2:
            return None
        before = [a for a in self.store.attempts(run.job.id) if a.number == number - 1]
        if before and before[0].outcome in (Outcome.CHECKPOINTED.value, Outcome.PREEMPTED.value):
            return AttemptLayout(self.launching.attempt_dir(run.job.id, number - 1)).out
        return None

    @contextlib.contextmanager
    def launches_after_commit(self) -> Iterator[None]:
        """The launches asked for in the block wait for its end; then the store
        commits the starts (one commit for all of them) and they happen at once,
        in the order asked. If the commit fails, none happens and those attempts
        are no longer this broker's (the store still has them queued)."""
        self._pending = pending = list[_Pending]()
        try:
            yield
        finally:
            self._pending = None
            try:
                self.store.commit()
            except Exception:
                for p in pending:
                    self.by_job.pop(p.run.job.id, None)
                    release(p.run.locks)
                raise
            for p in pending:
                self._launch_now(p.run, p.launcher, p.decision, p.now)

    def launch(
        self, run: RunningAttempt, launcher: Launcher, decision: policy.Start, now: float
    ) -> None:
        """Hold the attempt's memory, lay out its folder and run it: once its start
        is committed (at the end of :meth:`launches_after_commit`, or now)."""
        if self._pending is not None:
            self._pending.append(_Pending(run, launcher, decision, now))
            return
        self.store.commit()
        self._launch_now(run, launcher, decision, now)

    def _launch_now(
        self, run: RunningAttempt, launcher: Launcher, decision: policy.Start, now: float
    ) -> None:
        """Hold the attempt's memory, lay out its folder and start it: through the
        launcher's reaper where it has one (:class:`Starter`), else on a worker
        thread."""
        faults.point("after_start_attempt")
        job, jobtype, gpu = run.job, run.jobtype, decision.gpu_uuid
        if (short := self.ram_short(run, self.clock())) is not None:
            self._not_launched(
                run, now, f"{short}; checked again right before the launch, so it was not started"
            )
            return
        try:
            if gpu is not None:
                # a runtime job whose model the runtime has loaded adds no memory
                warm = run.runtime is not None and decision.warm
                self.vram.start(
                    run.holder,
                    gpu,
                    type_name=jobtype.name,
                    job_id=job.id,
                    nbytes=0 if warm else self.footprints.of(jobtype, job.vram_bytes),
                    coresident=jobtype.coresident or run.runtime is not None,
                    now=now,
                    expected_s=self.run_times.holding_s(jobtype.name, job.est_s),
                    backfill_for=decision.backfill_for,
                    runtime=run.runtime,
                )
            # a runtime job's own process is the runtime's client: it gets no GPU
            request = self.launching.request(run, None if run.runtime else gpu, now)
            request = dataclasses.replace(request, ram_cap_bytes=cap_for(run, launcher))
            if is_lease(job.type):  # its deadline, before its supervisor looks (wall clock)
                leases.grant(run.attempt_dir, ttl_of(job.params), time.time())
            if jobtype.launch is LaunchMode.SERVICE:  # it runs until stopped
                env = {**request.env, SERVICE_PORT_ENV: str(jobtype.port)}
                request = dataclasses.replace(
                    request, timeout_s=math.inf, env=env, outlives_broker=True
                )
            run.ram_measured = tree_shows_ram(launcher)
            if isinstance(launcher, Starter):
                run.thread = launcher.start(
                    request,
                    run.stop,
                    # recorded with the next drain's batch: no commit of its own
                    lambda pid: self.mailbox.put(Started(job.id, run.attempt.number, pid)),
                    self.mailbox.post,
                )
            else:
                thread = threading.Thread(
                    target=self.work,
                    args=(launcher, request, run.stop),
                    name=f"attempt-{job.id}-{run.attempt.number}",
                    daemon=True,
                )
                run.thread = thread
                thread.start()
        except Exception as exc:
            if not isinstance(exc, OSError | GpuwardenError):
                log.exception("could not prepare attempt %s", run.holder)
            self._not_launched(run, now, f"could not prepare the attempt: {exc}")
            return
        faults.point("after_launch")

    def _not_launched(self, run: RunningAttempt, now: float, why: str) -> None:
        """End the attempt as a launch error: its process never ran."""
        run.thread = None
        self.mailbox.post(
            LaunchResult(
                job_id=run.job.id,
                attempt=run.attempt.number,
                exit_code=None,
                started_at=now,
                ended_at=self.clock(),
                launch_error=why,
            )
        )

    def work(self, launcher: Launcher, request: LaunchRequest, stop: threading.Event) -> None:
        """Worker thread: run the attempt, post the result. Touches nothing else."""

        def started(pid: int) -> None:
            self.mailbox.put(Started(request.job_id, request.attempt, pid))

        try:
            result = launcher.run(request, stop, started)
        except Exception as exc:  # a launcher bug must still end the attempt
            result = LaunchResult(
                job_id=request.job_id,
                attempt=request.attempt,
                exit_code=None,
                started_at=self.clock(),
                ended_at=self.clock(),
                launch_error=f"the launcher failed: {exc!r}",
            )
        self.mailbox.post(result)

    # -- what the worker threads posted ---------------------------------------------

    def on_started(self, note: Started) -> None:
        run = self.by_job.get(note.job_id)
        if run is not None and run.attempt.number == note.attempt:
            run.pid = note.pid
            self.vram.set_pid(run.holder, note.pid)
            self.store.set_attempt_pid(run.job.id, run.attempt.number, note.pid)
            if run.ram_measured:
                self.ram.watch(run.holder, note.pid)

    def on_exchange(self, note: ExchangeNote) -> None:
        run = self.by_job.get(note.job_id)
        if run is not None and run.attempt.number == note.attempt:
            run.exchange_refused = list(note.refused)
        if note.cleared is not None:
            self.emit(
                "exchange_slot_cleared",
                job=note.job_id,
                attempt=note.attempt,
                type=note.type,
                epoch=note.epoch,
                found=note.cleared,
            )

    def pop(self, result: LaunchResult) -> RunningAttempt | None:
        """The attempt ``result`` ends, no longer running here; None (and the
        report dropped, logged) when it is not an attempt that runs here."""
        run = self.by_job.get(result.job_id)
        if run is None or run.attempt.number != result.attempt:
            self.emit("stale_report", job=result.job_id, attempt=result.attempt, action="dropped")
            return None
        del self.by_job[result.job_id]
        return run

    # -- end ------------------------------------------------------------------------

    def complete(self, run: RunningAttempt, result: LaunchResult, now: float) -> None:
        """Record the attempt's end, then let the node's own state follow.

        Whatever goes wrong while judging the attempt (an output folder no walk can
        list, a bug), the attempt still ends: ``internal_error``, the job failed
        with the error named. Only a store that is unavailable for now (locked,
        unreachable) keeps it for the next tick.
        """
        recorded = self.record(run, result, now)
        self.store.commit()
        self.follow(recorded, now)

    def record(self, run: RunningAttempt, result: LaunchResult, now: float) -> Recorded:
        """Judge the attempt and write its end (in the open batch, if any); the
        node's own state follows only once that is committed (:meth:`follow`)."""
        holder = run.server.holder if run.server is not None else run.holder
        try:
            verdict, reason, extra = self.judge(run, result, holder)
        except Exception as exc:
            log.exception("judging attempt %s failed", run.holder)
            verdict = internal_error(repr(exc))
            reason = verdict.reason
            extra = {"message": reason, "outcome": verdict.outcome.value}
        self._record_end(run, result, verdict, reason=reason, extra=extra, now=now)
        return Recorded(run, result, verdict, holder)

    def unrecord(self, recorded: Recorded) -> None:
        """Its end was not committed after all (the batch's commit failed): the
        attempt runs here again and its report is drained again next tick."""
        self.by_job[recorded.run.job.id] = recorded.run
        self.mailbox.put(recorded.result)

    def follow(self, recorded: Recorded, now: float) -> None:
        """The attempt's end is committed: now the node's own state follows, each
        step on its own, so that one failing (a bug) does not leave a server busy
        or memory held."""
        faults.point("after_finish_attempt")
        run, result, verdict, holder = (
            recorded.run,
            recorded.result,
            recorded.verdict,
            recorded.holder,
        )
        steps: list[tuple[str, Callable[[], None]]] = [
            ("releasing its GPU locks", lambda: release(run.locks)),
            ("freeing its warm server", lambda: _free_server(run, result, now)),
            ("raising its footprint", lambda: self._after_cuda_oom(run, verdict, holder, now)),
            ("measuring its memory", lambda: self._measure(run, now)),
            ("noting its run time", lambda: self._note_run_time(run, result, verdict)),
            ("forgetting its RAM samples", lambda: self.ram.end(run.holder)),
            ("counting it", lambda: self._count(run, result, verdict)),
            ("saying its preemption ended", lambda: self._preemption_ended(run, verdict)),
            ("touching its bundle", lambda: self._touch_bundle(run)),
        ]
        for where, step in steps:
            try:
                step()
            except Exception as exc:
                self.on_error(f"completing {run.holder}: {where}", exc)

    def judge(
        self, run: RunningAttempt, result: LaunchResult, holder: str
    ) -> tuple[Verdict, str, dict[str, Any]]:
        """Classify the ended attempt; its reason, and its result (outputs, message)."""
        listing = attemptfs.list_outputs(run.attempt_dir)
        stderr_tail = next(
            (ln.strip() for ln in reversed(result.stderr.splitlines()) if ln.strip()), ""
        )[:300]
        lease_end, lease_expired = leases.end_of(run, result.fenced)
        facts = AttemptFacts(
            exit_code=result.exit_code,
            worker_error=result.worker_error,
            lease_end=lease_end,
            lease_expired=lease_expired,
            interrupted=(result.fenced and lease_end is None) or result.supervisor_lost is not None,
            interrupted_why=_interrupted_why(result),
            cuda_oom=run.attempt.gpu_uuid is not None and is_cuda_oom(result.stderr),
            gpu_alone=self.vram.alone(holder),
            gpu_fault=run.fault if run.stop_reason == "gpu_fault" else None,
            app_error=run.fault if run.stop_reason == "app_error" else None,
            timed_out=result.timed_out,
            stopped=result.stopped,
            cancel_requested=run.stop_reason == "cancel",
            shutting_down=run.stop_reason == "shutdown",
            preempted_for=run.preempting_for or _asked_before(run, result),
            service_unhealthy=run.fault if run.stop_reason == "service_unhealthy" else None,
            stopped_by=run.fault if run.stop_reason == "service_stop" else None,
            checkpoint_signal=run.jobtype.checkpoint_signal,
            launch_error=result.launch_error,
            oom_killed=result.oom_killed,
            ram_cap_bytes=result.ram_cap_bytes,
            limit_exceeded=result.limit_exceeded,
            missing_outputs=attemptfs.missing_outputs(run.job.outputs, listing),
            timeout_s=run.jobtype.timeout_s,
            stderr_tail=stderr_tail,
            host_disk_full=attemptfs.host_disk_full(run.attempt_dir, result.stderr),
        )
        # counted from its last requeue: the attempts before it spend no retry
        number = jobcontrol.attempt_in_round(run.attempt.number, run.job.requeued_after)
        max_retries = run.jobtype.max_retries
        most = self.max_interruptions(run.jobtype)
        verdict = classify(facts, attempt=number, max_retries=max_retries, max_interruptions=most)
        if (
            verdict.outcome in INFRASTRUCTURE or verdict.outcome is Outcome.PREEMPTED
        ) and number > 1:
            # earlier interruptions by the broker's own end spend no retry (rare:
            # the store is asked only for a retried infrastructure failure)
            earlier = jobcontrol.round_attempts(
                ((a.number, a.outcome) for a in self.store.attempts(run.job.id)),
                run.job.requeued_after,
                before=run.attempt.number,
            )
            verdict = classify(
                facts,
                attempt=number,
                max_retries=max_retries,
                interruptions=interruptions_before(earlier),
                max_interruptions=most,
                checkpoints=checkpoints_before(earlier),
            )
        reason = verdict.reason
        if result.survivors:
            reason += f"; processes {list(result.survivors)} survived SIGKILL (check the host)"
        message = attemptfs.read_message(run.attempt_dir)
        extra = self.launching.result_extra(
            run.job,
            run,
            result,
            {"message": message.text or reason, "outcome": verdict.outcome.value},
            listing=listing,
        )
        if message.notes:
            extra["message_file"] = "; ".join(message.notes)
        return verdict, reason, extra

    def _record_end(
        self,
        run: RunningAttempt,
        result: LaunchResult,
        verdict: Verdict,
        *,
        reason: str,
        extra: dict[str, Any],
        now: float,
    ) -> None:
        """Write the attempt's end. One the store refuses as not this attempt's to
        end (a stale report) is logged; the node's own state follows either way."""
        try:
            if (ram := self.ram.peak(run.holder)) is not None:
                self.store.record_ram_peak(
                    run.job.id, run.attempt.number, run.jobtype.name, ram, now=now
                )
            self.store.finish_attempt(
                run.job.id,
                run.attempt.number,
                target=verdict.target,
                now=now,
                outcome=verdict.outcome.value,
                reason=reason,
                exit_code=result.exit_code,
                stdout=result.stdout,
                stderr=result.stderr,
                result=extra,
                detail=self._source_detail(run, result),
            )
        except TransitionError as exc:
            self.emit("stale_report", job=run.job.id, attempt=run.attempt.number, why=exc.message)
        except Exception as exc:
            if not self.store.unavailable(exc):
                self._record_internal_end(run, result, exc, now)
                return
            # the store cannot take it now (locked, unreachable): keep the attempt
            # and its report, and try again on the next tick; nothing local changed
            self.by_job[run.job.id] = run
            self.mailbox.put(result)
            raise

    def _source_detail(self, run: RunningAttempt, result: LaunchResult) -> dict[str, Any]:
        """What the end event of a job from a commit adds: its node and image."""
        if run.job.source is None:
            return {}
        return {"node": self.node, "image_id": result.image_id, "image_reused": result.image_reused}

    def _record_internal_end(
        self, run: RunningAttempt, result: LaunchResult, exc: Exception, now: float
    ) -> None:
        """The store refused the attempt's end as it was given (a bug): end it with
        the least a record needs, saying why."""
        log.error("the store refused the end of %s: %r", run.holder, exc)
        verdict = internal_error(f"the store refused the attempt's result: {exc!r}")
        try:
            self.store.finish_attempt(
                run.job.id,
                run.attempt.number,
                target=verdict.target,
                now=now,
                outcome=verdict.outcome.value,
                reason=verdict.reason,
                exit_code=result.exit_code,
                result={"message": verdict.reason, "outcome": verdict.outcome.value},
            )
        except TransitionError as again:
            self.emit("stale_report", job=run.job.id, attempt=run.attempt.number, why=again.message)
        except Exception:
            self.by_job[run.job.id] = run  # tried again on the next tick
            self.mailbox.put(result)
            raise

    def _after_cuda_oom(
        self, run: RunningAttempt, verdict: Verdict, holder: str, now: float
    ) -> None:
        if verdict.outcome is Outcome.CUDA_OOM:
            # it ran out with the GPU to itself: what it asked for is wrong
            self.footprints.out_of_memory(
                run.jobtype,
                self.vram.peak(holder),
                override=run.job.vram_bytes,
                source=run.job.id,
                gpus=self.vram.views(),
                now=now,
                own=sized_by_job(run.jobtype, run.job),
            )

    def _measure(self, run: RunningAttempt, now: float) -> None:
        """End the attempt's VRAM holding (it now waits for the reclaim gate) and,
        if the job had its GPU to itself and used more than its footprint, raise the
        type's stored footprint so the next jobs are admitted against it."""
        if run.attempt.gpu_uuid is None:
            return
        m = self.vram.end(run.holder, now)
        # a lease holds what its holder asked for, each its own: no type footprint
        if m is not None and m.alone and not is_lease(run.job.type):
            self.footprints.measure(
                run.jobtype,
                m.peak_bytes,
                override=run.job.vram_bytes,
                source=run.job.id,
                gpus=self.vram.views(),
                now=now,
                own=sized_by_job(run.jobtype, run.job),
            )

    def _note_run_time(self, run: RunningAttempt, result: LaunchResult, verdict: Verdict) -> None:
        if verdict.outcome is Outcome.SUCCEEDED:
            self.run_times.note(run.jobtype.name, result.ended_at - result.started_at)

    def _count(self, run: RunningAttempt, result: LaunchResult, verdict: Verdict) -> None:
        run_s = result.ended_at - result.started_at
        self.stats.attempt_ended(run.jobtype.name, verdict.outcome.value, run_s)

    def _preemption_ended(self, run: RunningAttempt, verdict: Verdict) -> None:
        if verdict.outcome in (Outcome.CHECKPOINTED, Outcome.PREEMPTED):
            self.emit(
                verdict.outcome.value,
                job=run.job.id,
                attempt=run.attempt.number,
                for_job=run.preempting_for,
                signal=run.jobtype.checkpoint_signal,
                target=verdict.target.value,
            )

    def _touch_bundle(self, run: RunningAttempt) -> None:
        if run.job.bundle and run.job.queue_root:
            self.touch(run.job.queue_root, run.job.bundle)


def _asked_before(run: RunningAttempt, result: LaunchResult) -> str | None:
    """An adopted attempt's preemption: its supervisor passed on its checkpoint
    signal, asked by the broker that started it (this one does not know for whom)."""
    if run.jobtype.checkpoint_signal and run.jobtype.checkpoint_signal in result.signals:
        return "the job it was preempted for (asked before the broker restarted)"
    return None


def _interrupted_why(result: LaunchResult) -> str | None:
    """Why an attempt ended interrupted though the broker did not stop: its
    supervisor died, or fenced it (no outcome of the job's own)."""
    if result.supervisor_lost is not None:
        return f"{result.supervisor_lost}; the job was stopped"
    if result.fenced:
        return (
            "its lease ran out without renewal (its agent was gone or cut off), so its "
            "supervisor stopped the job at the lease's end (self-fencing)"
        )
    return None


def _free_server(run: RunningAttempt, result: LaunchResult, now: float) -> None:
    """The attempt's warm server goes on serving, unless it failed or is stopping."""
    server = run.server
    if (
        server is not None
        and result.worker_error is None
        and server.state is not ServerState.STOPPING
    ):
        server.job_done(now)


def cap_for(run: RunningAttempt, launcher: Launcher) -> int:
    """The RAM cap the kernel enforces for the attempt: its own ``ram_gib`` (a
    launcher that cannot enforce it refuses the launch; the broker refuses such a
    job before, :func:`cap_refusal`), else its type's ``ram_gib`` where the
    launcher enforces caps; 0: none."""
    need = effective_need(run.jobtype, run.job.ram)
    if run.job.ram.cap_bytes:
        return need.cap_bytes
    return need.cap_bytes if need.cap_bytes and launcher.memory_caps().enforced else 0


def cap_refusal(job: Job, launcher: Launcher) -> str | None:
    """Why a job that asks for a RAM cap of its own cannot run with this launcher
    (it cannot enforce one), or None."""
    if not job.ram.cap_bytes:
        return None
    caps = launcher.memory_caps()
    if caps.enforced:
        return None
    return (
        f"ram_gib asks for a RAM cap of {ramadmit.gib_text(job.ram.cap_bytes)}, but this node "
        f"cannot enforce one: {caps.how}"
    )
