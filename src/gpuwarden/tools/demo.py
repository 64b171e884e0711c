"""``gpuwarden demo``: the problem and its cure, side by side, on a simulated GPU.

A mixed workload of ``burn`` jobs (model-shaped loads: a big LLM, a vision
model, small embedding and speech models) runs twice on a fresh simulated
24 GiB GPU:

1. *on their own*: every job's process starts at once (within half a second),
   each loading whenever it likes, as services that share a card do. The card
   runs out of memory and jobs crash with CUDA's message, as PyTorch jobs do.
2. *through gpuwarden*: the same jobs are submitted to a real broker (in this
   process, with its own state directory), which admits each against the GPU's
   memory. None crashes.

Both runs start the same ``gpuwarden/modules/burn/src/burn.py`` with the environment a
broker gives a job (SPEC.md section 7). A sampler reads the device every 50 ms
for the peak. The demo ends with a table of jobs done, jobs crashed by
out-of-memory, peak VRAM, model loads and wall time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from gpuwarden.app import open_node
from gpuwarden.config import Config, default_module_paths
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuProbeError, UserError
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.gpu.sim import SimDevice, SimGpuConfig, SimProbe
from gpuwarden.intake.jobs import prepare
from gpuwarden.launch.base import ATTEMPT_ENV
from gpuwarden.node.attempts import AttemptLayout, host_env, job_env
from gpuwarden.registry import BUILTIN_DIR, Registry

#: what a job's stderr says when it died of a (simulated or real) CUDA out-of-memory
OOM_TEXT = "CUDA out of memory"
#: the simulated GPU: one card of this size
GPU_GIB = 24.0
#: memory of an exited process returns this long after its exit is noticed
RELEASE_DELAY_S = 0.05
#: how often the device is read for the peak
SAMPLE_S = 0.05
#: how often the demo looks at its processes (run 1) or ticks the broker (run 2)
POLL_S = 0.03
#: jobs of run 1 start within this many seconds of each other
MAX_OFFSET_S = 0.5
MIN_JOBS, MAX_JOBS = 4, 64

LABEL_OWN = "on their own"
LABEL_GW = "through gpuwarden"


@dataclass(frozen=True, slots=True)
class DemoJob:
    """One job of the workload: its burn type, its parameters, and (run 1) when it starts."""

    id: str
    type: str
    params: dict[str, Any]
    offset_s: float


@dataclass(slots=True)
class RunStats:
    """What one run did: the figures of the table."""

    label: str
    jobs: int
    done: int = 0
    oom: int = 0
    other_failed: int = 0
    loads: int = 0
    peak_bytes: int = 0
    total_bytes: int = 0
    wall_s: float = 0.0
    finished: bool = True
    oom_jobs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_gib"] = round(self.peak_bytes / GIB, 2)
        data["total_gib"] = round(self.total_bytes / GIB, 2)
        data["wall_s"] = round(self.wall_s, 2)
        return data


def workload(seed: int, jobs: int) -> list[DemoJob]:
    """A fixed mix for ``seed``: about 15 % LLMs (at least two, which alone overfill
    24 GiB), 15 % vision models (at least one), the rest embedding and speech
    models; each holds its memory 1-3 s after a 0.2-0.8 s load."""
    if not MIN_JOBS <= jobs <= MAX_JOBS:
        raise UserError(f"--jobs must be between {MIN_JOBS} and {MAX_JOBS} (got {jobs})")
    rng = random.Random(seed)
    llm = max(2, round(jobs * 0.15))
    vision = max(1, round(jobs * 0.15))
    rest = jobs - llm - vision
    embed = (rest + 1) // 2
    kinds = ["llm"] * llm + ["vision"] * vision + ["embed"] * embed + ["whisper"] * (rest - embed)
    rng.shuffle(kinds)
    out: list[DemoJob] = []
    for i, kind in enumerate(kinds, 1):
        params = {
            "seconds": round(rng.uniform(1.0, 3.0), 1),
            "ramp_s": round(rng.uniform(0.2, 0.8), 1),
        }
        offset = round(rng.uniform(0.0, MAX_OFFSET_S), 2)
        out.append(DemoJob(f"{kind}-{i:02d}", f"burn.{kind}", params, offset))
    return out


class _Sampler(threading.Thread):
    """Reads the simulated GPU every ``SAMPLE_S`` and keeps the peak of used memory."""

    def __init__(self, device: SimDevice) -> None:
        super().__init__(name="demo-sampler", daemon=True)
        self.device = device
        self.peak = 0
        self.used = 0
        self.total = 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            readings = self.device.readings(time.time())
        except GpuProbeError:
            return
        self.used = sum(r.used_bytes for r in readings)
        self.total = sum(r.total_bytes for r in readings)
        self.peak = max(self.peak, self.used)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


@contextlib.contextmanager
def _sampling(device: SimDevice) -> Iterator[_Sampler]:
    sampler = _Sampler(device)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()


def _running_text(types: Iterable[str], extra: str = "") -> str:
    counts = Counter(t.removeprefix("burn.") for t in types)
    running = " ".join(f"{n}x{k}" if n > 1 else k for k, n in sorted(counts.items()))
    return f"running: {running or '-'}" + (f" · {extra}" if extra else "")


def _vram_text(sampler: _Sampler) -> str:
    return f"VRAM {sampler.used / GIB:4.1f}/{sampler.total / GIB:g} GiB"


# -- run 1: every job at once ---------------------------------------------------------


@dataclass
class _Proc:
    job: DemoJob
    proc: subprocess.Popen[bytes]
    job_dir: Path


def _job_env(job: DemoJob, layout: AttemptLayout, gpu_env: dict[str, str]) -> dict[str, str]:
    """The environment a broker gives a job (SPEC.md section 7), and the marker
    that names the demo's own processes."""
    env = job_env(
        layout,
        job_id=job.id,
        job_type=job.type,
        attempt=1,
        base=host_env(gpu_env),
        weights_dir=None,
    )
    env[ATTEMPT_ENV] = f"demo-on-their-own/{job.id}/1"
    return env


def _spawn(registry: Registry, spec: JobSpec, job: DemoJob, base: Path, probe: SimProbe) -> _Proc:
    jobtype = registry.get(job.type)
    job_dir = base / "jobs" / job.id
    layout = AttemptLayout(job_dir)
    for folder in layout.folders():
        folder.mkdir(parents=True, exist_ok=True)
    layout.params.write_text(json.dumps(spec.params, indent=2))
    gpu = probe.device.uuids()[0]
    with (job_dir / "stdout.log").open("wb") as out, (job_dir / "stderr.log").open("wb") as err:
        proc = subprocess.Popen(
            registry.argv(jobtype),
            cwd=jobtype.module_dir,
            env=_job_env(job, layout, probe.job_env(gpu)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return _Proc(job, proc, job_dir)


def _kill(procs: Iterable[_Proc]) -> None:
    """Stop the process groups this demo started (each led by its own job process)."""
    for p in procs:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait()


def run_on_their_own(
    registry: Registry,
    specs: dict[str, JobSpec],
    jobs: list[DemoJob],
    base: Path,
    *,
    progress: Progress,
    deadline_s: float,
) -> RunStats:
    """Start every job at once (within ``MAX_OFFSET_S``) on a fresh simulated GPU."""
    stats = RunStats(LABEL_OWN, len(jobs))
    probe = SimProbe(
        base / "simgpu.json",
        SimGpuConfig(count=1, vram_bytes=int(GPU_GIB * GIB), release_delay_s=RELEASE_DELAY_S),
    )
    task = progress.add_task(LABEL_OWN, total=len(jobs), info="starting")
    pending = sorted(jobs, key=lambda j: j.offset_s)
    running: list[_Proc] = []
    ended = 0
    with _sampling(probe.device) as sampler:
        start = time.monotonic()
        try:
            while pending or running:
                now = time.monotonic() - start
                if now > deadline_s:
                    stats.finished = False
                    break
                while pending and pending[0].offset_s <= now:
                    job = pending.pop(0)
                    running.append(_spawn(registry, specs[job.id], job, base, probe))
                    stats.loads += 1
                for p in [p for p in running if p.proc.poll() is not None]:
                    running.remove(p)
                    ended += 1
                    stderr = (p.job_dir / "stderr.log").read_text(errors="replace")
                    if p.proc.returncode == 0:
                        stats.done += 1
                    elif OOM_TEXT in stderr:
                        stats.oom += 1
                        stats.oom_jobs.append(p.job.id)
                    else:
                        stats.other_failed += 1
                extra = f"crashed {stats.oom}" if stats.oom else ""
                progress.update(
                    task,
                    completed=ended,
                    info=f"{_vram_text(sampler)} · "
                    + _running_text((p.job.type for p in running), extra),
                )
                time.sleep(POLL_S)
        finally:
            _kill(running)
        stats.wall_s = time.monotonic() - start
    stats.peak_bytes, stats.total_bytes = sampler.peak, sampler.total
    progress.update(task, completed=ended, info=_summary(stats))
    return stats


# -- run 2: through a broker -------------------------------------------------------------


def run_through_gpuwarden(
    module_paths: list[Path],
    specs: list[JobSpec],
    base: Path,
    *,
    progress: Progress,
    deadline_s: float,
) -> RunStats:
    """Submit every job to a real broker on a fresh simulated GPU; tick it until all end."""
    stats = RunStats(LABEL_GW, len(specs))
    config = Config.model_validate(
        {
            "state_dir": base,
            "node_name": "demo",
            "gpu": "sim",
            "module_paths": module_paths,
            "queue_roots": [],
            "sim_gpu": {"count": 1, "vram_gib": GPU_GIB, "release_delay_s": RELEASE_DELAY_S},
            "broker": {"poll_interval_s": POLL_S, "kill_grace_s": 1.0},
            # burn's types are container types; the demo runs them as host
            # processes (they are gpuwarden's own code) so it needs no runtime
            "allow_unsandboxed_containers": True,
        }
    )
    task = progress.add_task(LABEL_GW, total=len(specs), info="starting")
    ids = [s.id for s in specs]
    ended = 0
    with _quiet_unsandboxed(), open_node(config, mock_gpu=True) as node:
        store, broker = node.store, node.broker
        device = SimDevice.open(config.state_dir / SIM_STATE_FILE)
        with _sampling(device) as sampler:
            start = time.monotonic()
            store.submit(specs, now=time.time())
            try:
                while True:
                    broker.tick()
                    jobs = [store.get_job(i) for i in ids]
                    ended = sum(1 for j in jobs if j is not None and j.state.terminal)
                    queued = sum(1 for j in jobs if j is not None and j.state is JobState.QUEUED)
                    running = [
                        j.type for j in jobs if j is not None and j.state is JobState.RUNNING
                    ]
                    progress.update(
                        task,
                        completed=ended,
                        info=f"{_vram_text(sampler)} · "
                        + _running_text(running, f"queued {queued}" if queued else ""),
                    )
                    if ended == len(ids):
                        break
                    if time.monotonic() - start > deadline_s:
                        stats.finished = False
                        break
                    time.sleep(POLL_S)
            finally:
                broker.shutdown(0.0)
            stats.wall_s = time.monotonic() - start
        for job_id in ids:
            job = store.get_job(job_id)
            attempts = store.attempts(job_id)
            stats.loads += len(attempts)
            if any(OOM_TEXT in a.stderr for a in attempts):
                stats.oom += 1
                stats.oom_jobs.append(job_id)
            if job is not None and job.state is JobState.DONE:
                stats.done += 1
            elif not any(OOM_TEXT in a.stderr for a in attempts):
                stats.other_failed += 1
    stats.peak_bytes, stats.total_bytes = sampler.peak, sampler.total
    progress.update(task, completed=ended, info=_summary(stats))
    return stats


# -- the demo ------------------------------------------------------------------------------


def _summary(s: RunStats) -> str:
    crashed = f"[red]{s.oom} crashed (out of memory)[/]" if s.oom else "[green]none crashed[/]"
    return f"{s.done} done · {crashed} · {s.wall_s:.1f} s"


def _table(jobs: int, seed: int, own: RunStats, gw: RunStats) -> Table:
    table = Table(
        title=f"{jobs} jobs on one simulated {GPU_GIB:g} GiB GPU (seed {seed})",
        title_justify="left",
    )
    table.add_column("")
    table.add_column(LABEL_OWN, justify="right")
    table.add_column(LABEL_GW, justify="right")

    def crashed(s: RunStats) -> str:
        return f"[bold red]{s.oom}[/]" if s.oom else "[bold green]0[/]"

    def done(s: RunStats) -> str:
        return f"{s.done} of {s.jobs}"

    def peak(s: RunStats) -> str:
        return f"{s.peak_bytes / GIB:.1f} of {s.total_bytes / GIB:g} GiB"

    table.add_row("jobs done", done(own), done(gw))
    table.add_row("jobs crashed by out-of-memory", crashed(own), crashed(gw))
    if own.other_failed or gw.other_failed:
        table.add_row("jobs failed otherwise", str(own.other_failed), str(gw.other_failed))
    table.add_row("peak VRAM", peak(own), peak(gw))
    table.add_row("model loads", str(own.loads), str(gw.loads))
    table.add_row("wall time", f"{own.wall_s:.1f} s", f"{gw.wall_s:.1f} s")
    return table


def _conclusion(own: RunStats, gw: RunStats) -> str:
    n = gw.jobs
    if gw.oom == 0 and gw.done == n:
        first = (
            f"On their own, {own.oom} of {n} jobs crashed with CUDA out of memory"
            if own.oom
            else f"On their own, no job crashed this time ({own.done} of {n} done)"
        )
        redo = f", and {own.oom} would have to be run again" if own.oom else ""
        return (
            f"[bold]{first}; through gpuwarden all {n} finished and none crashed[/] "
            f"({gw.wall_s:.1f} s instead of {own.wall_s:.1f} s{redo})."
        )
    return (
        f"[bold red]Through gpuwarden, {gw.done} of {n} jobs finished and {gw.oom} crashed "
        f"with out-of-memory: that should not happen.[/] "
        f"Failed otherwise: {gw.other_failed}; all ended: {gw.finished}."
    )


def _module_paths() -> list[Path]:
    """The shipped modules (where burn lives) first, then the usual paths: a
    ``burn`` folder of one's own does not change the demo."""
    return [BUILTIN_DIR, *(p for p in default_module_paths() if p.resolve() != BUILTIN_DIR)]


class _DropUnsandboxed(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("UNSANDBOXED")


@contextlib.contextmanager
def _quiet_unsandboxed() -> Iterator[None]:
    """The broker's UNSANDBOXED warning, once per type, would cut through the demo's
    progress bars; the demo says it once, above them."""
    logger = logging.getLogger("gpuwarden.node.loop")
    quiet = _DropUnsandboxed()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def run_demo(
    console: Console,
    *,
    seed: int = 1,
    jobs: int = 16,
    module_paths: list[Path] | None = None,
    json_out: TextIO | None = None,
    keep: bool = False,
) -> int:
    """Run the workload on its own, then through gpuwarden; print the table.

    Returns 0 when every job finished through gpuwarden and none crashed, else 1.
    ``json_out`` gets the figures as one JSON line; ``keep`` keeps the temporary
    directory (its path is printed).
    """
    paths = module_paths if module_paths is not None else _module_paths()
    registry = Registry.load(paths, LaunchRules(allow_unsandboxed_containers=True))
    if "burn.llm" not in registry.types:
        raise UserError(
            "the demo needs the burn module (shipped in gpuwarden/modules/burn), which is not on "
            "the module paths: " + (", ".join(str(p) for p in paths) or "none")
        )
    work = workload(seed, jobs)
    specs = [prepare(registry, JobSpec(id=j.id, type=j.type, params=j.params)) for j in work]
    by_id = {s.id: s for s in specs}
    deadline_s = 60.0 + 10.0 * jobs
    counts = Counter(j.type.removeprefix("burn.") for j in work)
    console.print(
        f"[bold]gpuwarden demo[/]: {jobs} jobs ("
        + ", ".join(f"{n} {k}" for k, n in counts.most_common())
        + f") on one simulated {GPU_GIB:g} GiB GPU, "
        f"{sum(s.params['gib'] for s in specs):g} GiB asked for in all\n"
        "[dim](burn's types are container types; the demo runs them as plain host "
        "processes: they are gpuwarden's own code)[/]"
    )
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-demo-"))
    try:
        columns = (
            TextColumn("{task.description:<18}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=console, refresh_per_second=10) as progress:
            own = run_on_their_own(
                registry, by_id, work, tmp / "own", progress=progress, deadline_s=deadline_s
            )
            gw = run_through_gpuwarden(
                paths, specs, tmp / "gpuwarden", progress=progress, deadline_s=deadline_s
            )
    finally:
        if keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    console.print(_table(jobs, seed, own, gw))
    console.print(_conclusion(own, gw))
    ok = gw.finished and gw.oom == 0 and gw.done == gw.jobs
    if json_out is not None:
        figures = {
            "jobs": jobs,
            "seed": seed,
            "gpu_gib": GPU_GIB,
            "ok": ok,
            "on_their_own": own.to_json(),
            "through_gpuwarden": gw.to_json(),
        }
        json_out.write(json.dumps(figures) + "\n")
        json_out.flush()
    return 0 if ok else 1
