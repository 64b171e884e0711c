"""An attempt's folder, its environment and its launch request: the contract
between the broker and a job (SPEC.md section 7), written once.

- :class:`AttemptLayout`: where an attempt's files are in its folder (params,
  inputs, outputs, scratch, the message it may leave), as its job is told.
- :func:`job_env` and :func:`server_env`: the ``GPUWARDEN_*`` environment a job
  (or a warm server) starts with, over :func:`host_env` (the broker's own
  variables that pass on, and what makes the GPU visible).
- :class:`Launching`: how this node turns a started attempt (or a new warm
  server) into a launch request: which sandbox, whose folders, what GPU access,
  which mounts; and what the job's result holds beyond its row.

The broker loop, ``gpuwarden doctor`` (a sandboxed probe run as the broker runs
a job) and ``gpuwarden demo`` (jobs started by hand, as a broker would) all
build their jobs' environments here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.core import command
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.model import Job, JobType
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.gpu.sim import SimProbe
from gpuwarden.launch.base import (
    INSIDE,
    ImageBuild,
    Launcher,
    LaunchRequest,
    LaunchResult,
    Mount,
    RunAs,
    inside_path,
)
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.imagebuild import image_tag
from gpuwarden.launch.sandbox import SandboxLauncher, mounts_for
from gpuwarden.node import attemptfs
from gpuwarden.node.running import Emit, RunningAttempt
from gpuwarden.node.settings import NodeSettings
from gpuwarden.registry import Registry

#: the broker's log: its lines keep one name, whichever of its modules writes them
log = logging.getLogger("gpuwarden.node.loop")

#: the broker's environment variables that pass on to a job
PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "VIRTUAL_ENV")


# -- the contract -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptLayout:
    """An attempt's folder ``root``, as its job is told of it. A sandboxed job
    leaves its message in ``report/`` (the one folder it may write beside its
    outputs); a host job in the folder itself."""

    root: Path
    sandboxed: bool = False
    #: the job's own input folder (its bundle's, or fetched), else ``root/inputs``
    given_inputs: Path | None = None

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def inputs(self) -> Path:
        return self.given_inputs if self.given_inputs is not None else self.root / "inputs"

    @property
    def params(self) -> Path:
        return self.root / "params.json"

    @property
    def result(self) -> Path:
        """Where the job may write its ``message.json``."""
        return (self.report if self.sandboxed else self.root) / "message.json"

    def folders(self) -> list[Path]:
        """The folders made for the job inside ``root`` (its inputs only when it
        has no folder of its own)."""
        made = [self.out, self.scratch, *([self.report] if self.sandboxed else [])]
        if self.given_inputs is None:
            made.append(self.root / "inputs")
        return made


def host_env(
    gpu_env: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a job's environment starts from: the broker's own variables that pass
    on (:data:`PASS_ENV`), then what the probe says makes the GPU visible."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k in PASS_ENV}
    env.update(gpu_env)
    return env


def job_env(
    layout: AttemptLayout,
    *,
    job_id: str,
    job_type: str,
    attempt: int,
    base: Mapping[str, str],
    weights_dir: Path | None,
    resume: bool = False,
    model_dir: Path | None = None,
) -> dict[str, str]:
    """The environment a job starts with (SPEC.md section 7): ``base`` (see
    :func:`host_env`) and the ``GPUWARDEN_*`` variables that name its files;
    ``GPUWARDEN_MODEL_DIR`` when its module has a model folder
    (``[modules.<name>] model_dir``); ``GPUWARDEN_RESUME=1`` when it resumes (its
    output folder carried over from an attempt that was checkpointed or preempted)."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(
        {
            "GPUWARDEN_JOB_ID": job_id,
            "GPUWARDEN_JOB_TYPE": job_type,
            "GPUWARDEN_ATTEMPT_NUMBER": str(attempt),
            "GPUWARDEN_PARAMS": str(layout.params),
            "GPUWARDEN_INPUT_DIR": str(layout.inputs),
            "GPUWARDEN_OUTPUT_DIR": str(layout.out),
            "GPUWARDEN_SCRATCH_DIR": str(layout.scratch),
            "GPUWARDEN_RESULT": str(layout.result),
        }
    )
    if weights_dir is not None:
        env["GPUWARDEN_WEIGHTS_DIR"] = str(weights_dir)
    if model_dir is not None:
        env["GPUWARDEN_MODEL_DIR"] = str(model_dir)
    if resume:
        env["GPUWARDEN_RESUME"] = "1"
    return env


def server_env(
    *,
    job_type: str,
    base: Mapping[str, str],
    weights_dir: Path | None,
    model_dir: Path | None = None,
) -> dict[str, str]:
    """The environment a warm server starts with: a server outlives its jobs, so
    only its type is named (and its module's model folder, where it has one);
    each job's files reach it over its socket."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUWARDEN_JOB_TYPE"] = job_type
    if weights_dir is not None:
        env["GPUWARDEN_WEIGHTS_DIR"] = str(weights_dir)
    if model_dir is not None:
        env["GPUWARDEN_MODEL_DIR"] = str(model_dir)
    return env


def job_params(job: Job, jobtype: JobType, input_dir: Path) -> dict[str, Any]:
    """The job's parameters, its input parameters made paths under ``input_dir``."""
    params = dict(job.params)
    for spec in jobtype.params:
        if spec.type.value == "input" and spec.name in params:
            params[spec.name] = str(input_dir / params[spec.name])
    return params


def _is_input(jobtype: JobType, name: str) -> bool:
    spec = jobtype.param(name)
    return spec is not None and spec.type.value == "input"


def command_launch(
    cmd: CommandSpec, layout: AttemptLayout, env: Mapping[str, str], sandboxed: bool
) -> tuple[tuple[str, ...], str, dict[str, str], RunAs | None]:
    """A command job's argv, folder, environment and user (SPEC.md, "Command
    jobs"). ``env`` is the environment a module's job would get: a sandboxed
    command keeps it (its files are the sandbox's, as a bundle job's are) and
    runs in its output folder; a host command gets a clean one (a login's
    variables for its user, what its submitter passed, the GPU the plan gave
    it, its job id and attempt) and runs as its user in its own folder."""
    index = {} if cmd.array_index is None else {"GPUWARDEN_ARRAY_INDEX": str(cmd.array_index)}
    if sandboxed or cmd.uid is None:
        return cmd.argv, str(layout.out), {**env, **cmd.env, **index}, None
    try:
        entry = pwd.getpwuid(cmd.uid)
        home, name = entry.pw_dir, entry.pw_name
    except KeyError:  # a user with no passwd entry (a container's numeric uid)
        home, name = "/", str(cmd.uid)
    ours = {k: v for k, v in env.items() if not k.startswith("GPUWARDEN_") and k not in PASS_ENV}
    contract = {k: env[k] for k in COMMAND_ENV if k in env}
    full = {**command.base_env(home, name), **cmd.env, **ours, **contract, **index}
    gid = cmd.gid if cmd.gid is not None else cmd.uid
    return cmd.argv, cmd.cwd, full, RunAs(cmd.uid, gid, cmd.groups)


#: what a host command is told of its job (its files are its own: no folders)
COMMAND_ENV = (
    "GPUWARDEN_JOB_ID",
    "GPUWARDEN_JOB_TYPE",
    "GPUWARDEN_ATTEMPT_NUMBER",
    "GPUWARDEN_SIM_GPU",
)


# -- launching on this node ----------------------------------------------------------


class Launching:
    """How attempts and warm servers are laid out and launched on this node."""

    def __init__(
        self,
        *,
        settings: NodeSettings,
        probe: GpuProbe,
        registry: Registry,
        sandbox: SandboxLauncher | None,
        instance: str,
        emit: Emit,
    ) -> None:
        self.settings = settings
        self.rules = settings.rules
        self.probe = probe
        self.registry = registry
        #: sandboxed attempts (container types, and serve types' workers)
        self.sandbox = sandbox
        #: names this broker's processes (see ``Broker.instance``)
        self.instance = instance
        self.emit = emit
        self.jobs_dir = settings.state_dir / "jobs"

    def sandbox_for(self, jobtype: JobType) -> SandboxLauncher | None:
        """The sandbox attempts of ``jobtype`` run in, or None (a host process)."""
        return self.sandbox if self.rules.sandboxed(jobtype) else None

    def model_dir(self, jobtype: JobType) -> Path | None:
        """The model folder of ``jobtype``'s module (``[modules.<name>] model_dir``),
        or None: only that module's types are given it. A type from a commit is
        of a module of its own (``name@<commit>``) and gets none."""
        return self.settings.model_dirs.get(jobtype.module)

    def sandbox_owner(self, jobtype: JobType) -> tuple[int, int] | None:
        """Who owns the folders a sandboxed attempt (or warm server) writes: the
        sandbox's user and group when the broker runs as root (every runtime runs
        the job as that host user); None otherwise (nothing is chowned)."""
        sandbox = self.sandbox_for(jobtype)
        return None if sandbox is None else sandbox.job_owner

    def gpu_access(self, gpu: str | None) -> tuple[str | None, tuple[Mount, ...]]:
        """What a sandbox needs to reach ``gpu``: the real device's UUID, or for
        the simulated GPU the folder that holds its state (and nothing else)."""
        if gpu is None:
            return None, ()
        if isinstance(self.probe, SimProbe):
            folder = str(self.probe.path.parent)
            return None, (Mount(folder, folder, writable=True),)
        return gpu, ()

    def attempt_dir(self, job_id: str, number: int) -> Path:
        return self.jobs_dir / job_id / f"attempt-{number}"

    def make_attempt_dir(self, run: RunningAttempt, now: float) -> None:
        """Create the attempt's folder fresh; one already there is moved aside
        (never reused) and that is logged."""
        made = attemptfs.new_attempt_dir(self.jobs_dir, run.job.id, run.attempt.number, now=now)
        if made.moved_aside is not None:
            log.warning(
                "attempt folder %s was already there (the store lost commits?): moved to %s",
                made.path,
                made.moved_aside,
            )
            self.emit(
                "attempt_dir_moved_aside",
                job=run.job.id,
                attempt=run.attempt.number,
                moved_to=str(made.moved_aside),
            )

    def carry_outputs(
        self, run: RunningAttempt, layout: AttemptLayout, owner: tuple[int, int] | None
    ) -> None:
        """A resumed attempt starts with what the previous one left in its output
        folder (its checkpoint): copied, by descriptor, into this one's; links and
        other non-regular files are left out, and a sandboxed job's checkpoint is
        bounded by its output limit (past it the attempt cannot be prepared)."""
        assert run.resume_from is not None
        sandbox = self.sandbox_for(run.jobtype)
        limit = sandbox.limits.output_bytes if sandbox is not None else 0
        with safefs.opened_dir(layout.out) as out_fd:
            copied = safefs.copy_into(run.resume_from, out_fd, owner=owner, max_bytes=limit or None)
        self.emit(
            "outputs_carried_over",
            job=run.job.id,
            attempt=run.attempt.number,
            files=len(copied.files),
            refused=len(copied.refused),
        )

    def params(self, run: RunningAttempt) -> tuple[Path, dict[str, Any]]:
        """The job's input directory, and its parameters with inputs made absolute."""
        input_dir = AttemptLayout(run.attempt_dir, given_inputs=_given_inputs(run.job)).inputs
        return input_dir, job_params(run.job, run.jobtype, input_dir)

    def request(self, run: RunningAttempt, gpu: str | None, now: float) -> LaunchRequest:
        """Lay out the attempt's folder (fresh, mode 0700; what a sandboxed job
        writes belongs to the sandbox's user) and build its launch request."""
        job, jobtype = run.job, run.jobtype
        sandbox = self.sandbox_for(jobtype)
        layout = AttemptLayout(
            run.attempt_dir, sandboxed=sandbox is not None, given_inputs=_given_inputs(job)
        )
        self.make_attempt_dir(run, now)
        owner = self.sandbox_owner(jobtype)
        for d in layout.folders():
            safefs.make_dir(d, owner=owner)
        if run.resume_from is not None:
            self.carry_outputs(run, layout, owner)
        input_dir, params = self.params(run)
        weights = self.settings.weights_dir
        model = self.model_dir(jobtype)
        mounts: tuple[Mount, ...] = ()
        gpu_uuid: str | None = None
        if sandbox is not None:
            gpu_uuid, gpu_mounts = self.gpu_access(gpu)
            mounts = mounts_for(
                module_dir=jobtype.module_dir,
                input_dir=str(input_dir),
                output_dir=str(layout.out),
                scratch_dir=str(layout.scratch),
                report_dir=str(layout.report),
                params_file=str(layout.params),
                weights_dir=str(weights) if weights is not None else None,
                scratch_bytes=self.settings.scratch_bytes,
                extra=gpu_mounts,
                model_dir=str(model) if model is not None else None,
            )
            # the job reads its input parameters as paths it can open: where the
            # sandbox sees them
            params = {
                k: inside_path(mounts, v) if _is_input(jobtype, k) else v for k, v in params.items()
            }
        # readable by the sandbox's user through its mount (the folder is 0700)
        attemptfs.write_new_file(layout.params, json.dumps(params, indent=2).encode(), mode=0o644)
        env = job_env(
            layout,
            job_id=job.id,
            job_type=job.type,
            attempt=run.attempt.number,
            base=host_env(self.probe.job_env(gpu)),
            weights_dir=weights,
            resume=run.resume_from is not None,
            model_dir=model,
        )
        argv = self.registry.argv(jobtype, sandbox.python if sandbox else None)
        cwd, run_as = jobtype.module_dir, None
        if job.command is not None:
            argv, cwd, env, run_as = command_launch(job.command, layout, env, sandbox is not None)
        return LaunchRequest(
            job_id=job.id,
            attempt=run.attempt.number,
            argv=argv,
            cwd=cwd,
            run_as=run_as,
            env=env,
            attempt_dir=str(run.attempt_dir),
            timeout_s=jobtype.timeout_s,
            clip_chars=self.settings.clip_chars,
            kill_grace_s=self.settings.kill_grace_s,
            instance=self.instance,
            mounts=mounts,
            gpu_uuid=gpu_uuid,
            memory_bytes=jobtype.ram_bytes if sandbox is not None else 0,
            image_build=self.image_build(job, jobtype),
            command_env=dict(job.command.env) if job.command and sandbox else {},
        )

    def image_build(self, job: Job, jobtype: JobType) -> ImageBuild | None:
        """A job from a commit: the image its sandbox is built from (its tree)."""
        if job.source is None:
            return None
        return ImageBuild(
            context=jobtype.module_dir,
            tag=image_tag(job.source.commit),
            timeout_s=self.settings.source_build_timeout_s,
        )

    def server_request(
        self, jobtype: JobType, gpu: str, epoch: int, log_dir: Path, socket_path: Path
    ) -> tuple[Launcher, LaunchRequest]:
        """The launcher and request of a new warm server of ``jobtype`` on ``gpu``
        (its log folder ``log_dir`` made already, with its ``exchange/``)."""
        sandbox = self.sandbox_for(jobtype)
        env = server_env(
            job_type=jobtype.name,
            base=host_env(self.probe.job_env(gpu)),
            weights_dir=self.settings.weights_dir,
            model_dir=self.model_dir(jobtype),
        )
        request = LaunchRequest(
            job_id=f"warm-{jobtype.name}",
            attempt=epoch,
            argv=self.registry.argv(jobtype, sandbox.python if sandbox else None),
            cwd=jobtype.module_dir,
            env=env,
            attempt_dir=str(log_dir),
            timeout_s=math.inf,
            clip_chars=self.settings.clip_chars,
            kill_grace_s=self.settings.kill_grace_s,
            instance=self.instance,
        )
        if sandbox is None:
            # its load scratch (GPUWARDEN_SCRATCH_DIR), made as a sandboxed one's is:
            # a worker that caches there (speech.voxcpm2's HF_HOME) finds it (a
            # server adopted after a restart has it already)
            with contextlib.suppress(FileExistsError):
                safefs.make_dir(log_dir / "scratch", owner=None)
            return HostLauncher(), request
        return sandbox, self._sandboxed_server_request(request, gpu, socket_path, jobtype)

    def _sandboxed_server_request(
        self, request: LaunchRequest, gpu: str, socket_path: Path, jobtype: JobType
    ) -> LaunchRequest:
        """A warm server in a sandbox sees its module, its scratch, its socket and
        its exchange folder, through which each job's files pass (mounts cannot
        change while it runs, so the jobs' own folders are never mounted)."""
        log_dir = Path(request.attempt_dir)
        exchange = log_dir / "exchange"
        # its load scratch (a bind mount when [sandbox] scratch_mib = 0), the
        # sandbox's user's like an attempt's
        safefs.make_dir(log_dir / "scratch", owner=self.sandbox_owner(jobtype))
        weights, model = self.settings.weights_dir, self.model_dir(jobtype)
        gpu_uuid, gpu_mounts = self.gpu_access(gpu)
        mounts = mounts_for(
            module_dir=jobtype.module_dir,
            input_dir=None,
            output_dir=str(exchange),
            scratch_dir=str(log_dir / "scratch"),
            report_dir=None,
            params_file=None,
            weights_dir=str(weights) if weights is not None else None,
            scratch_bytes=self.settings.scratch_bytes,
            extra=(Mount(str(socket_path), str(INSIDE / "serve.sock"), writable=True), *gpu_mounts),
            model_dir=str(model) if model is not None else None,
        )
        return dataclasses.replace(
            request, mounts=mounts, gpu_uuid=gpu_uuid, memory_bytes=jobtype.ram_bytes
        )

    def result_extra(
        self,
        job: Job,
        run: RunningAttempt | None,
        result: LaunchResult | None,
        fields: dict[str, Any],
        *,
        listing: safefs.Listing | None = None,
    ) -> dict[str, Any]:
        """What a job's result.json holds beyond the job row itself. ``outputs``
        are the regular files of the attempt's ``out/``; ``refused`` names every
        entry that is not one (a link, a FIFO, a device, a folder too deep), why,
        and what its warm server's exchange folder refused."""
        jobtype = self.registry.types.get(job.type)
        extra: dict[str, Any] = dict(fields)
        if jobtype is not None and not command.is_command_type(jobtype.name):
            extra["module_fingerprint"] = self.registry.module_of(jobtype).fingerprint
        if run is not None and result is not None:
            extra["output_dir"] = str(run.attempt_dir / "out")
            if listing is None:
                listing = attemptfs.list_outputs(run.attempt_dir)
            extra["outputs"] = sorted(e.path for e in listing.files)
            extra["refused"] = [*listing.refused_json(), *run.exchange_refused]
            if listing.truncated:
                extra["outputs_truncated"] = listing.truncated
            extra["gpu"] = run.attempt.gpu_uuid
            if result.oom_killed is not None:
                extra["oom_killed"] = result.oom_killed
            sandbox = self.sandbox_for(run.jobtype)
            extra["sandbox"] = sandbox.runtime.value if sandbox is not None else "none"
            extra["started_at"] = result.started_at
            extra["ended_at"] = result.ended_at
        return extra


def _given_inputs(job: Job) -> Path | None:
    return Path(job.input_dir) if job.input_dir else None
