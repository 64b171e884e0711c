"""Checks every job spec against the registry before anything is stored."""

from __future__ import annotations

import re
import secrets
from dataclasses import replace
from pathlib import PurePosixPath

from gpuwarden.core import command
from gpuwarden.core.dependencies import DependencyError, parse_all
from gpuwarden.core.model import JobSpec, JobType, Lane, LaunchMode, check_gpus
from gpuwarden.core.params import validate_params
from gpuwarden.core.placement import GPU_CONSTRAINTS, check_constraints
from gpuwarden.core.profile import check_est_s
from gpuwarden.core.ramadmit import RAM_KEYS
from gpuwarden.core.service import check_service_name, check_share
from gpuwarden.core.sources import TYPE_SEP
from gpuwarden.errors import ValidationError
from gpuwarden.registry import Registry

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: a job id of this form belongs to the API submitter token whose id are its 12
#: hex digits (``<token id>-<id>``): no one else may choose one, so that a submit
#: over HTTP never meets, and tells of, another's job
SUBMITTER_ID = re.compile(r"^([0-9a-f]{12})-")


def new_job_id(type_name: str) -> str:
    """``echo-3f9a1c0b``: the module's name and 32 random bits."""
    return f"{type_name.split('.', 1)[0]}-{secrets.token_hex(4)}"


def safe_relpath(path: str, what: str) -> str:
    """A relative POSIX path with no ``..``, no absolute start, no backslash or NUL."""
    if not path or "\\" in path or "\0" in path:
        raise ValidationError(f"{what} {path!r} is not a valid relative path")
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts:
        raise ValidationError(f"{what} {path!r} must be a relative path without '..'")
    if not p.parts or str(p) == ".":
        raise ValidationError(f"{what} {path!r} must name a file, not the folder itself")
    return str(p)


def prepare(registry: Registry, spec: JobSpec, *, owner: str | None = None) -> JobSpec:
    """Validate ``spec`` for its job type and return it with defaults filled in;
    ``owner`` is the API token that submits it, if any. Raise
    :class:`ValidationError` saying what is wrong and what to do."""
    if not JOB_ID.fullmatch(spec.id):
        raise ValidationError(
            f"job id {spec.id!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    reserved = SUBMITTER_ID.match(spec.id)
    if reserved is not None and reserved.group(1) != owner:
        raise ValidationError(
            f"job id {spec.id!r}: ids that begin with 12 hex digits and '-' belong to the "
            "API token with that id; choose another id"
        )
    jobtype = _jobtype(registry, spec)
    if spec.source is not None:
        spec = replace(spec, type=jobtype.name)
    refused = registry.rules.refusal(jobtype)
    if refused is not None:
        raise ValidationError(f"job {spec.id}: refused by this node's launch rules: {refused}")
    inputs = tuple(safe_relpath(p, "input") for p in spec.inputs)
    outputs = tuple(safe_relpath(p, "output") for p in spec.outputs)
    params = validate_params(jobtype, spec.params, inputs)
    if spec.vram_bytes is not None:
        if jobtype.lane is not Lane.VRAM:
            raise ValidationError(
                f"job {spec.id}: a VRAM footprint was given, but {jobtype.name} runs on the "
                "cpu lane and never takes GPU memory"
            )
        if spec.vram_bytes <= 0:
            raise ValidationError(f"job {spec.id}: the VRAM footprint must be > 0")
    try:
        constraints = check_constraints(spec.constraints)
    except ValueError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
    gpu_only = sorted(GPU_CONSTRAINTS & constraints.keys())
    if gpu_only and jobtype.lane is not Lane.VRAM:
        raise ValidationError(
            f"job {spec.id}: constraint {', '.join(gpu_only)} asks for a GPU, but "
            f"{jobtype.name} runs on the cpu lane and never uses one"
        )
    try:
        after = tuple(str(d) for d in parse_all(spec.after))
    except DependencyError as exc:
        raise DependencyError(f"job {spec.id}: {exc}") from None
    try:
        est_s = None if spec.est_s is None else check_est_s(spec.est_s)
    except ValueError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
    _check_gpus(spec, jobtype)
    _check_ram(spec, jobtype)
    _check_service(spec, jobtype, owner)
    spec = _check_command(spec, jobtype)
    return replace(
        spec,
        params=params,
        inputs=inputs,
        outputs=outputs,
        constraints=constraints,
        after=after,
        est_s=est_s,
    )


def _jobtype(registry: Registry, spec: JobSpec) -> JobType:
    """The job's type: a module the node has, or the type of the module at its
    source's commit (fetched now unless the node has it; SPEC.md, "Jobs from a
    pinned commit")."""
    if spec.source is None:
        if TYPE_SEP in spec.type:
            raise ValidationError(
                f"job {spec.id}: type {spec.type!r} names a commit; give the type without it "
                "and the commit as the job's source = {repo = URL, commit = SHA}"
            )
        return registry.get(spec.type)
    if TYPE_SEP in spec.type:
        raise ValidationError(
            f"job {spec.id}: with a source, type names a type of its module.toml "
            f"(mymod.train), not {spec.type!r}"
        )
    try:
        jobtype = registry.from_source(spec.source, spec.type)
    except ValidationError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
    if jobtype.launch is not LaunchMode.CONTAINER:
        raise ValidationError(
            f"job {spec.id}: {spec.type} at commit {spec.source.commit} is a "
            f"{jobtype.launch.value} type; a job from a commit runs in its image: "
            'launch = "container"'
        )
    return jobtype


def _check_gpus(spec: JobSpec, jobtype: JobType) -> None:
    """A job's own ``gpus``: a count, for a type whose jobs are processes of their
    own on the vram lane (a warm server and a runtime's model hold one GPU)."""
    if spec.gpus is None:
        return
    try:
        check_gpus(spec.gpus)
    except ValueError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
    if spec.gpus == 1:
        return
    if jobtype.lane is not Lane.VRAM:
        raise ValidationError(
            f"job {spec.id}: gpus = {spec.gpus} asks for GPUs, but {jobtype.name} runs on the "
            "cpu lane and never uses one"
        )
    if jobtype.launch is LaunchMode.SERVE or jobtype.runtime is not None:
        kind = "a warm server" if jobtype.launch is LaunchMode.SERVE else "a managed runtime"
        raise ValidationError(
            f"job {spec.id}: gpus = {spec.gpus}, but {jobtype.name} runs in {kind}, which "
            "holds one GPU; only jobs that run as processes of their own may span GPUs"
        )


def _check_ram(spec: JobSpec, jobtype: JobType) -> None:
    """A job's RAM keys: each a size or 0 (the manifest, the API and the CLI
    convert GiB); a cap only where the job is a process of its own (a warm server
    runs the jobs of its type one after another in one process: its memory is the
    type's ``ram_gib``)."""
    ram = spec.ram
    for key, value in zip(
        RAM_KEYS, (ram.cap_bytes, ram.floor_bytes, ram.start_min_bytes), strict=True
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValidationError(f"job {spec.id}: {key} must be a size in bytes, got {value!r}")
    if ram.cap_bytes and jobtype.launch is LaunchMode.SERVE:
        raise ValidationError(
            f"job {spec.id}: ram_gib caps the job's own processes, but {jobtype.name} runs "
            "in a warm server that serves every job of its type; its memory is the type's "
            "ram_gib (module.toml). Leave ram_gib out, or use ram_floor_gib / "
            "ram_start_min_gib"
        )


def _check_command(spec: JobSpec, jobtype: JobType) -> JobSpec:
    """A command job's command (SPEC.md, "Command jobs"): there exactly when its type
    is ``command:...``; a host command's with its user (set by the submission path
    from the kernel's word, never by the client), a sandboxed one's without."""
    cmd = spec.command
    if not command.is_command_type(jobtype.name):
        if cmd is not None:
            raise ValidationError(
                f"job {spec.id}: a command was given, but {jobtype.name} is a module's type; "
                "give either a type or a command"
            )
        return spec
    if cmd is None:
        raise ValidationError(
            f"job {spec.id}: {jobtype.name} is a command job's type: give its command "
            "(gpuwarden submit -- CMD ...)"
        )
    sandboxed = jobtype.launch is not LaunchMode.HOST
    if sandboxed != (cmd.uid is None):
        raise ValidationError(
            f"job {spec.id}: a host command runs as the user who submitted it, a sandboxed "
            "one as the sandbox's user; this one's user does not match its type"
        )
    if spec.params or (spec.inputs and not sandboxed):
        raise ValidationError(
            f"job {spec.id}: a command job takes no parameters (and a host command no "
            "inputs: it reads its own files): pass them on its command line"
        )
    try:
        argv, env, cwd = command.check_command(cmd.argv, cmd.env, cmd.cwd, sandboxed=sandboxed)
    except ValueError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
    return replace(spec, command=replace(cmd, argv=argv, env=env, cwd=cwd))


def _check_service(spec: JobSpec, jobtype: JobType, owner: str | None) -> None:
    """A job's ``service`` and ``share``: for a service type's job only, each
    checked (the rules of a job id; token ids or role names). A name that begins
    as a submitter's (12 hex digits and '-') is that token's alone, as its job ids
    are: a submitter's service names are ``<token id>-<name>``."""
    if spec.service is None and not spec.share:
        return
    reserved = SUBMITTER_ID.match(spec.service or "")
    if reserved is not None and reserved.group(1) != owner:
        raise ValidationError(
            f"job {spec.id}: service name {spec.service!r}: names that begin with 12 hex "
            "digits and '-' belong to the API token with that id; choose another name"
        )
    if jobtype.launch is not LaunchMode.SERVICE:
        raise ValidationError(
            f"job {spec.id}: service and share name and share a service, but {jobtype.name} "
            f'is a {jobtype.launch.value} type (launch = "service" types only)'
        )
    try:
        if spec.service is not None:
            check_service_name(spec.service)
        check_share(spec.share)
    except ValueError as exc:
        raise ValidationError(f"job {spec.id}: {exc}") from None
