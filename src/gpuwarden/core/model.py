"""Job, job type and attempt values. Frozen, built from rows, changed by ``evolve``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self

from gpuwarden.core.command import CommandSpec
from gpuwarden.core.ramadmit import NO_RAM, RamNeed
from gpuwarden.core.sources import JobSource
from gpuwarden.core.states import JobState

GIB = 1024**3
MIB = 1024**2


class Lane(StrEnum):
    VRAM = "vram"  # needs a GPU and VRAM admission
    CPU = "cpu"  # runs beside, never admitted against VRAM


class LaunchMode(StrEnum):
    HOST = "host"
    CONTAINER = "container"
    SERVE = "serve"
    #: runs until stopped, listening on a port; sandboxed like a container type
    SERVICE = "service"


class ParamType(StrEnum):
    STRING = "string"
    INTEGER = "integer"
    NUMBER = "number"
    BOOLEAN = "boolean"
    #: a path to one of the job's input files; the job receives the absolute path
    INPUT = "input"


class Role(StrEnum):
    """What an API token may do (the permission matrix is ``gpuwarden.api.auth.MATRIX``)."""

    OWNER = "owner"  # everything, tokens included
    OPERATOR = "operator"  # every job, the audit log; no tokens
    SUBMITTER = "submitter"  # its own jobs only
    NODE = "node"  # an agent on a GPU host (the node endpoints)
    ENROLL = "enroll"  # a one-time token that enrols a node


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    type: ParamType
    required: bool = False
    default: Any = None
    description: str = ""
    choices: tuple[Any, ...] = ()
    #: its value changes how much VRAM a job takes (``sizes_vram``): a job that
    #: sets it to anything but the default is measured for itself, not its type
    sizes_vram: bool = False


@dataclass(frozen=True, slots=True)
class JobType:
    """One ``[types.NAME]`` table of a module's ``module.toml``."""

    name: str  # "module.type"
    module: str
    module_dir: str
    lane: Lane
    launch: LaunchMode
    command: tuple[str, ...]
    vram_bytes: int = 0
    ram_bytes: int = 0
    coresident: bool = False
    timeout_s: float = 3600.0
    max_retries: int = 2
    #: interruptions by the broker's own end before quarantine; None: the broker's
    #: ``[broker] max_interruptions``
    max_interruptions: int | None = None
    params: tuple[ParamSpec, ...] = ()
    description: str = ""
    # serve launch mode: the warm server's life
    keep_warm: bool = False
    idle_grace_s: float | None = None  # None: the broker's default
    load_timeout_s: float = 600.0
    #: how much of the model must sit in device memory after load (placement check)
    expected_device_bytes: int | None = None
    #: a runtime type: the managed runtime (``[[runtimes]]`` name, or kind) whose
    #: model its jobs use, and that model; None: not a runtime type
    runtime: str | None = None
    model: str | None = None
    #: its jobs may be asked to checkpoint and yield to a job of higher priority
    #: (``gpuwarden.core.preempt``): the signal they are sent, how long they have
    #: to exit 6 after it, and how long one must have run before it may be asked
    preemptible: bool = False
    checkpoint_signal: str = "SIGUSR1"
    checkpoint_grace_s: float = 60.0
    min_run_s: float = 300.0
    #: how many GPUs of one node each of its jobs holds at once, its ``vram_bytes``
    #: on each (a job's own ``gpus`` overrides it; :func:`gpu_count`)
    gpus: int = 1
    #: service launch mode (SPEC.md, "Service jobs"): the port its process listens
    #: on inside its sandbox, its health check (``"GET /path"`` or ``"tcp"``), how
    #: long it may be starting or failing the check, and how often it is checked
    port: int | None = None
    health: str = "tcp"
    health_grace_s: float = 60.0
    health_every_s: float = 2.0

    def param(self, name: str) -> ParamSpec | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a client submits: validated against the job type before it is stored."""

    id: str
    type: str
    params: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    priority: int = 0
    vram_bytes: int | None = None  # per-job footprint override (ad-hoc jobs)
    #: what the job asks of the host it runs on (``gpuwarden.core.placement.CONSTRAINT_KEYS``)
    constraints: dict[str, Any] = field(default_factory=dict)
    #: the jobs it waits for, each ``KIND:ID`` (``gpuwarden.core.dependencies``)
    after: tuple[str, ...] = ()
    #: how long the submitter expects it to run, in seconds (used for backfill while
    #: its type has no measured run time; ``gpuwarden.core.profile``)
    est_s: float | None = None
    #: how many GPUs of one node it holds at once (None: its type's ``gpus``)
    gpus: int | None = None
    #: what it asks of the host's RAM: its cap, its floor, its start minimum
    #: (``gpuwarden.core.ramadmit``; all 0: nothing asked)
    ram: RamNeed = NO_RAM
    #: a service type's job: its name in URLs (None: its id) and who besides its
    #: owner may reach it (token ids or role names)
    service: str | None = None
    share: tuple[str, ...] = ()
    #: the repository and commit its module comes from (None: a module the node
    #: has); its ``type`` is then ``<type>@<commit>`` once prepared
    source: JobSource | None = None
    #: a command job's command (``type`` is then ``command:NAME``; SPEC.md,
    #: "Command jobs"); None: a job of a module's type
    command: CommandSpec | None = None


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    type: str
    state: JobState
    priority: int
    params: dict[str, Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    vram_bytes: int | None
    submitted_at: float
    updated_at: float
    seq: int = 0  # arrival order, assigned by the store
    attempts: int = 0
    reason: str = ""
    exit_code: int | None = None
    bundle: str | None = None
    queue_root: str | None = None
    input_dir: str | None = None
    cancel_requested: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    #: the id of the API token that submitted it (None: the CLI on the host, a bundle)
    owner: str | None = None
    #: what the job asks of the host it runs on (SPEC.md section 4)
    constraints: dict[str, Any] = field(default_factory=dict)
    #: the jobs it waits for, each ``KIND:ID`` (SPEC.md section 1, "Dependencies")
    after: tuple[str, ...] = ()
    #: queued, but not to be planned or offered: a dependency does not hold yet
    held: bool = False
    #: how long the submitter expects it to run, in seconds (None: not declared)
    est_s: float | None = None
    #: how many GPUs of one node it holds at once (None: its type's ``gpus``)
    gpus: int | None = None
    #: what it asks of the host's RAM (SPEC.md section 11, "Host RAM")
    ram: RamNeed = NO_RAM
    #: a service type's job: its name (None: its id), who may reach it besides its
    #: owner, and who asked to stop it (``gpuwarden stop``; None: nobody)
    service: str | None = None
    share: tuple[str, ...] = ()
    stop_requested_by: str | None = None
    #: the repository and commit its module comes from (None: a module the node has)
    source: JobSource | None = None
    #: a command job's command (None: a job of a module's type)
    command: CommandSpec | None = None
    #: who holds it (``gpuwarden hold``; None: nobody): queued, but neither planned
    #: nor offered until released. Apart from ``held``: neither releases the other
    hold_by: str | None = None
    #: its attempts before its last requeue (0: never requeued): its retries count
    #: from the attempt after them (SPEC.md section 1, "Job control")
    requeued_after: int = 0

    @property
    def service_name(self) -> str:
        """Its name in URLs: its ``service``, else its id."""
        return self.service or self.id

    def evolve(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Attempt:
    job_id: str
    number: int
    node: str
    #: its GPU, or a multi-GPU job's GPUs comma-separated (as ``CUDA_VISIBLE_DEVICES``
    #: names them: :func:`gpu_list`); None: a cpu job
    gpu_uuid: str | None
    started_at: float
    ended_at: float | None = None
    exit_code: int | None = None
    outcome: str | None = None
    reason: str = ""
    stdout: str = ""
    stderr: str = ""
    pid: int | None = None
    #: the highest RAM its process tree was seen to use (None: not measured)
    ram_peak_bytes: int | None = None

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs it holds (one, several, or none)."""
        return gpu_list(self.gpu_uuid)

    def evolve(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Event:
    """One row of the event log: a transition, or something the broker did."""

    ts: float
    kind: str
    job_id: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ts": self.ts, "event": self.kind}
        if self.job_id is not None:
            out["job"] = self.job_id
        if self.from_state is not None:
            out["from"] = self.from_state
        if self.to_state is not None:
            out["to"] = self.to_state
        out.update(self.detail)
        return out


#: the most GPUs one job may ask for (on one node)
MAX_GPUS = 64


def gpu_count(jobtype: JobType, job_gpus: int | None) -> int:
    """How many GPUs a job holds: its own ``gpus``, else its type's."""
    return job_gpus if job_gpus is not None else jobtype.gpus


def gpu_list(gpus: str | None) -> tuple[str, ...]:
    """``"GPU-a,GPU-b"`` -> ``("GPU-a", "GPU-b")``: the one string that names an
    attempt's GPUs everywhere one GPU is named (a GPU's UUID holds no comma)."""
    return tuple(gpus.split(",")) if gpus else ()


def check_gpus(value: object, where: str = "gpus") -> int:
    """A job's or type's ``gpus``: an integer from 1 to :data:`MAX_GPUS`. Raise
    :class:`ValueError` saying what is wrong."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where} must be an integer (how many GPUs), got {value!r:.60}")
    if not 1 <= value <= MAX_GPUS:
        raise ValueError(f"{where} must be from 1 to {MAX_GPUS}, got {value}")
    return value


def format_bytes(n: int | float) -> str:
    """``25769803776`` -> ``"24.0 GiB"``."""
    if abs(n) >= GIB:
        return f"{n / GIB:.1f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{int(n)} B"
