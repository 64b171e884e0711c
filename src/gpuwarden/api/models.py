"""Request and response bodies of the HTTP API. Requests are strict: an unknown
field, a wrong type, ``NaN`` or a string that is not valid Unicode is a 422 that
names the field."""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuwarden.core import command as commands
from gpuwarden.core.faultlatch import CLEAR_REASON_MAX
from gpuwarden.core.model import GIB, MAX_GPUS, Attempt, Event, Job, Role
from gpuwarden.core.profile import MAX_EST_S
from gpuwarden.core.ramadmit import MAX_RAM_GIB, RamNeed
from gpuwarden.core.service import ServiceView
from gpuwarden.core.sources import MAX_URL, JobSource, check_commit, check_repo
from gpuwarden.store.base import AuditRow, TokenRecord

#: the largest integer a job's priority may be (64-bit signed, as in a manifest)
INT64 = 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _check_json_value(value: Any, where: str) -> None:
    """Only finite numbers and encodable strings, all the way down."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: numbers must be finite (no NaN or Infinity)")
    if isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(str(k), where)
            _check_json_value(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}[{i}]")


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: text must be valid Unicode (a lone surrogate?)") from None


class SourceIn(_Request):
    """Where a job's module comes from: one commit of a repository (SPEC.md, "Jobs
    from a pinned commit")."""

    repo: Annotated[str, Field(min_length=1, max_length=MAX_URL)] = Field(
        description="an https://, ssh:// or file:// URL the node's [sources] allow matches"
    )
    commit: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        description="the full 40-hex-digit commit (branches, tags and short ids are refused)"
    )

    @field_validator("repo", mode="after")
    @classmethod
    def _repo(cls, value: str) -> str:
        return check_repo(value, None)

    @field_validator("commit", mode="after")
    @classmethod
    def _commit(cls, value: str) -> str:
        return check_commit(value)

    def spec(self) -> JobSource:
        return JobSource(repo=self.repo, commit=self.commit)


#: what a host command has that a sandboxed one never does: a client that sends
#: them over HTTP is refused, saying where host commands come from
HOST_COMMAND_KEYS = frozenset({"uid", "gid", "groups", "cwd", "user"})


class JobIn(_Request):
    """A job, with the fields of a bundle manifest's job (SPEC.md section 4), less
    ``inputs``: file inputs are not taken over HTTP yet."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"type": "echo.echo", "params": {"text": "hello"}},
                {"id": "hello-2", "type": "echo.echo", "params": {"text": "hi"}, "priority": 5},
            ]
        }
    )

    id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        default=None, description="1-128 letters, digits, '.', '_', '-' (default: generated)"
    )
    type: Annotated[str, Field(min_length=1, max_length=200)] | None = Field(
        default=None, description="module.type (GET /v1/types lists them); or give command"
    )
    command: Annotated[list[str], Field(min_length=1, max_length=commands.MAX_ARGS)] | None = Field(
        default=None,
        description="instead of type: a command line, run sandboxed (bubblewrap or "
        "podman) in its output folder where [commands] roles allows the token's role "
        "(SPEC.md, Command jobs over HTTP, bundles and agents)",
        examples=[["python3", "-c", "print('hi')"]],
    )
    name: str | None = Field(
        default=None,
        description="a command job's name: its measurements are kept under it (default: "
        "the program's name)",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="a command job's environment variables"
    )
    share_gpu: bool = Field(
        default=False, description="a command job may share its GPU with co-resident jobs"
    )
    preempt: str | None = Field(
        default=None,
        description="a command job is preemptible: the signal it is asked to checkpoint "
        f"with ({', '.join(commands.SIGNALS)})",
    )
    timeout_s: Annotated[float, Field(gt=0, lt=1e9)] | None = Field(
        default=None, description="a command job's timeout in seconds (default: a week)"
    )
    params: dict[str, Any] = Field(default_factory=dict)
    outputs: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=1000)] = (
        Field(default_factory=list, description="files the job must write")
    )
    priority: Annotated[int, Field(ge=-INT64 - 1, le=INT64)] = 0
    vram_gib: Annotated[float, Field(gt=0, le=1_048_576)] | None = Field(
        default=None, description="this job's VRAM footprint (vram lane only)"
    )
    constraints: dict[str, Any] = Field(
        default_factory=dict,
        description="what the job asks of the node it runs on: min_gpu_vram_gib, gpu_model "
        "(vram lane only), labels, node (SPEC.md section 4)",
    )
    after: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=64)] = Field(
        default_factory=list,
        description="jobs this one waits for, each afterok:ID, afterany:ID or afternotok:ID "
        "(all must hold; SPEC.md section 1, Dependencies)",
        examples=[["afterok:prep-1"]],
    )
    est_s: Annotated[float, Field(gt=0, le=MAX_EST_S)] | None = Field(
        default=None,
        description="how long the job is expected to run, in seconds: used for backfill "
        "while its type has no measured run time (SPEC.md section 11)",
    )
    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS)] | None = Field(
        default=None,
        description="how many GPUs of one node it holds at once, its footprint on each "
        "(default: its type's gpus; SPEC.md section 4)",
    )
    ram_gib: Annotated[float, Field(gt=0, le=MAX_RAM_GIB)] | None = Field(
        default=None,
        description="its RAM cap in GiB, enforced by the kernel (a memory cgroup with swap "
        "off, or the container runtime's limit); a node that cannot enforce one refuses "
        "the job (SPEC.md section 11, Host RAM)",
    )
    ram_floor_gib: Annotated[float, Field(gt=0, le=MAX_RAM_GIB)] | None = Field(
        default=None,
        description="host RAM (GiB) that must stay available beside it while it runs",
    )
    ram_start_min_gib: Annotated[float, Field(gt=0, le=MAX_RAM_GIB)] | None = Field(
        default=None,
        description="MemAvailable (GiB) it needs right before it starts",
    )
    service: str | None = Field(
        default=None,
        description="a service type's job: its name in URLs (default: its id; the rules of "
        "a job id; SPEC.md, Service jobs)",
    )
    share: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="a service type's job: token ids or role names that may reach it "
        "besides its owner",
    )
    source: SourceIn | None = Field(
        default=None,
        description="the commit its module comes from; type then names a type of that "
        "commit's module.toml (SPEC.md, Jobs from a pinned commit)",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_host_command(cls, data: Any) -> Any:
        """A host command (one that runs as a user of the node, in a folder of its)
        never comes over HTTP: the user is the kernel's word on the local socket."""
        if isinstance(data, dict) and (given := sorted(HOST_COMMAND_KEYS & data.keys())):
            raise ValueError(
                f"{', '.join(given)}: a command over HTTP runs sandboxed, in its output "
                "folder, as the sandbox's user; a host command (as a user of the node, in "
                "their folder) comes only through the node's local socket: `gpuwarden run "
                "-- CMD` on the host"
            )
        return data

    @model_validator(mode="after")
    def _type_or_command(self) -> Self:
        if (self.type is None) == (self.command is None):
            raise ValueError("give a job type (type) or a command line (command), one of them")
        return self

    def ram(self) -> RamNeed:
        """Its RAM keys in bytes (``gpuwarden.core.ramadmit``)."""
        values = (self.ram_gib, self.ram_floor_gib, self.ram_start_min_gib)
        return RamNeed(*(0 if v is None else math.ceil(v * GIB) for v in values))

    @field_validator("params", mode="after")
    @classmethod
    def _params_are_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_json_value(value, "params")
        return value

    @field_validator("constraints", mode="after")
    @classmethod
    def _constraints_are_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_json_value(value, "constraints")
        return value

    @field_validator("command", mode="after")
    @classmethod
    def _command_text(cls, value: list[str] | None) -> list[str] | None:
        _check_json_value(value, "command")
        return value

    @field_validator("env", mode="after")
    @classmethod
    def _env_text(cls, value: dict[str, str]) -> dict[str, str]:
        _check_json_value(value, "env")
        return value

    @field_validator("id", "type", "name", mode="after")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        if value is not None:
            _check_text(value, "text")
        return value

    @field_validator("outputs", mode="after")
    @classmethod
    def _outputs(cls, value: list[str]) -> list[str]:
        _check_json_value(value, "outputs")
        return value


class AttemptOut(BaseModel):
    number: int
    node: str
    gpu: str | None
    started_at: float
    ended_at: float | None
    exit_code: int | None
    outcome: str | None
    reason: str

    @classmethod
    def of(cls, a: Attempt) -> AttemptOut:
        return cls(
            number=a.number,
            node=a.node,
            gpu=a.gpu_uuid,
            started_at=a.started_at,
            ended_at=a.ended_at,
            exit_code=a.exit_code,
            outcome=a.outcome,
            reason=a.reason,
        )


class JobOut(BaseModel):
    id: str
    type: str
    state: str
    priority: int
    params: dict[str, Any]
    outputs: list[str]
    vram_bytes: int | None
    attempts: int
    submitted_at: float
    updated_at: float
    reason: str
    exit_code: int | None
    cancel_requested: bool
    bundle: str | None
    owner: str | None
    constraints: dict[str, Any] = {}
    #: the jobs it waits for (``KIND:ID``), and whether it still waits for them
    after: list[str] = []
    held: bool = False
    #: who holds it (`gpuwarden hold`; null: nobody): it waits until released
    hold_by: str | None = None
    est_s: float | None = None
    gpus: int | None = None
    #: what it asks of the host's RAM, in bytes (null: nothing)
    ram_cap_bytes: int | None = None
    ram_floor_bytes: int | None = None
    ram_start_min_bytes: int | None = None
    #: a service job's name and who it is shared with (SPEC.md, "Service jobs")
    service: str | None = None
    share: list[str] = Field(default_factory=list)
    #: a service job's state (starting, healthy, unhealthy, stopped; null: not a
    #: service job, or not known now) and where it is served (``/run/<name>/``)
    service_state: str | None = None
    service_url_path: str | None = None
    #: since when it is in that state, when it last passed its health check, and
    #: what its last failed check said
    service_since: float | None = None
    service_last_ok: float | None = None
    service_error: str = ""
    #: the commit its module comes from, {repo, commit} (null: a module the node has)
    source: dict[str, str] | None = None

    def with_service(self, view: ServiceView | None) -> Self:
        """This job with its service's view (None: not a service job)."""
        if view is not None:
            for key, value in view.to_json().items():
                setattr(self, key, value)
        return self

    @classmethod
    def of(cls, j: Job) -> Self:
        return cls(
            id=j.id,
            type=j.type,
            state=j.state.value,
            priority=j.priority,
            params=j.params,
            outputs=list(j.outputs),
            vram_bytes=j.vram_bytes,
            attempts=j.attempts,
            submitted_at=j.submitted_at,
            updated_at=j.updated_at,
            reason=j.reason,
            exit_code=j.exit_code,
            cancel_requested=j.cancel_requested,
            bundle=j.bundle,
            owner=j.owner,
            constraints=j.constraints,
            after=list(j.after),
            held=j.held,
            hold_by=j.hold_by,
            est_s=j.est_s,
            gpus=j.gpus,
            ram_cap_bytes=j.ram.cap_bytes or None,
            ram_floor_bytes=j.ram.floor_bytes or None,
            ram_start_min_bytes=j.ram.start_min_bytes or None,
            service=j.service,
            share=list(j.share),
            source=None if j.source is None else j.source.to_json(),
        )


class PriorityIn(_Request):
    """The body of ``POST /v1/jobs/{id}/priority`` (SPEC.md section 1, "Job control")."""

    priority: Annotated[
        int,
        Field(
            ge=-INT64 - 1,
            le=INT64,
            description="the job's new priority, an integer; a submitter may only lower "
            "its own job's",
        ),
    ]


class WaitOut(BaseModel):
    """How a submit's ``wait`` went."""

    asked_s: float = Field(description="the wait the request named (seconds)")
    waited_s: float = Field(description="how long the request waited for the job")
    ended: bool = Field(
        description="true: the job ended within the wait and its result is in `result`; "
        "false: it had not (it is queued or running, see `state`)"
    )


class SubmitOut(JobOut):
    """A submitted job; with ``wait``, how the wait went and the job's result."""

    wait: WaitOut | None = Field(default=None, description="only when `wait` was named")
    result: dict[str, Any] | None = Field(
        default=None,
        description="the job's result.json (as GET /v1/jobs/{id}/result) when it ended "
        "within the wait",
    )


class JobDetail(JobOut):
    attempts_detail: list[AttemptOut]
    events: list[dict[str, Any]]

    @classmethod
    def full(cls, j: Job, attempts: list[Attempt], events: list[Event]) -> JobDetail:
        return cls(
            **JobOut.of(j).model_dump(),
            attempts_detail=[AttemptOut.of(a) for a in attempts],
            events=[e.to_json() for e in events],
        )


class Explanation(BaseModel):
    job: str
    lines: list[str]


class PreviewOut(BaseModel):
    """``GET /v1/preview``: what would become of one more job of ``type``."""

    type: str
    lines: list[str]


class TokenIn(_Request):
    name: Annotated[
        str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$", description="who holds it")
    ]
    role: Annotated[
        Role, Field(strict=False, description="owner, operator, submitter, node, enroll")
    ]
    expires_in_s: Annotated[float, Field(gt=0, le=10 * 366 * 86400)] | None = Field(
        default=None, description="seconds until it expires (default: never)"
    )
    node: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")] | None = Field(
        default=None, description="the node a node or enroll token is bound to"
    )


class GpuClearIn(_Request):
    reason: Annotated[
        str,
        Field(
            min_length=1,
            max_length=CLEAR_REASON_MAX,
            pattern=r"\S",
            description="what was done about the fault (recorded with who cleared it)",
        ),
    ]


class TokenOut(BaseModel):
    id: str
    name: str
    role: Role
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    node: str | None
    active: bool

    @classmethod
    def of(cls, t: TokenRecord, now: float) -> TokenOut:
        return cls(
            id=t.id,
            name=t.name,
            role=t.role,
            created_at=t.created_at,
            created_by=t.created_by,
            expires_at=t.expires_at,
            revoked_at=t.revoked_at,
            node=t.node,
            active=t.active(now),
        )


class NewToken(TokenOut):
    token: str = Field(description="the token; shown this once, never again")


class AuditOut(BaseModel):
    id: int
    ts: float
    actor: str
    actor_name: str
    role: str
    action: str
    target: str
    outcome: str
    detail: dict[str, Any]

    @classmethod
    def of(cls, r: AuditRow) -> AuditOut:
        return cls(
            id=r.id or 0,
            ts=r.ts,
            actor=r.actor,
            actor_name=r.actor_name,
            role=r.role,
            action=r.action,
            target=r.target,
            outcome=r.outcome,
            detail=r.detail,
        )


class ParamOut(BaseModel):
    name: str
    type: str
    required: bool
    default: Any = None
    choices: list[Any] = []
    description: str = ""


class ShareOut(BaseModel):
    """One owner's fair share (``GET /v1/share``, ``gpuwarden share``)."""

    #: the token's id; null for the CLI on the host and bundles
    owner: str | None
    name: str
    #: VRAM GiB-hours used, decayed with ``[broker] fair_share_half_life_s``
    gib_h: float
    queued: int
    running: int
    #: its rank among owners: 1 goes first among jobs of equal priority
    standing: int


class TypeOut(BaseModel):
    type: str
    module: str
    lane: str
    launch: str
    vram_bytes: int
    coresident: bool
    timeout_s: float
    max_retries: int
    #: how many GPUs of one node each of its jobs holds at once
    gpus: int = 1
    preemptible: bool = False
    #: a preemptible type's ``checkpoint_signal``, ``checkpoint_grace_s``, ``min_run_s``
    preemption: dict[str, Any] | None = None
    runs_here: bool
    #: why this host's launch rules refuse it (a broker's API), else None
    refused: str | None = None
    #: how it runs here, in a few words (`sandboxed: bubblewrap`, `UNSANDBOXED`, ...)
    runs_as: str | None = None
    #: why it runs unsandboxed here, else None
    unsandboxed: str | None = None
    #: where its module came from (`{"kind": "built-in" | "module_paths" | "entry_point", ...}`)
    source: dict[str, Any] = {}
    description: str
    params: list[ParamOut]
    #: what its runs showed: ``vram_declared_bytes``, ``vram_measured_bytes``,
    #: ``ram_peak_bytes``, ``wall`` (``runs``, ``median_s``, ``p90_s``, ``longest_s``
    #: of its latest succeeded runs; null before any), as ``types --json`` shows it
    profile: dict[str, Any] | None = None


class StatusOut(BaseModel):
    nodes: list[dict[str, Any]]
    jobs: dict[str, int]
    #: on a coordinator: every enrolled node as its agent last reported it (absent
    #: from a broker's own API)
    cluster: list[dict[str, Any]] | None = None


class Health(BaseModel):
    ok: bool
    version: str


class ErrorOut(BaseModel):
    error: str


# -- VRAM leases (SPEC.md section 11, "VRAM leases"; api/routers/leases.py) ----------


class LeaseIn(_Request):
    """The body of ``POST /v1/leases``."""

    vram_bytes: Annotated[int, Field(gt=0, le=INT64, description="how much VRAM, in bytes")]
    gpu: Annotated[
        str | None,
        Field(max_length=128, description="pin it to this GPU (its UUID); any GPU when absent"),
    ] = None
    ttl_s: Annotated[
        float,
        Field(description="seconds it lives without a renewal (5 to 86400; default 60)"),
    ] = 60.0
    priority: Annotated[int, Field(ge=-INT64 - 1, le=INT64)] = 0
    holder: Annotated[
        str | None,
        Field(max_length=200, description="who holds it, in words (default: the token's name)"),
    ] = None


class RenewIn(_Request):
    """The body of ``POST /v1/leases/{id}/renew`` (optional)."""

    ttl_s: Annotated[
        float | None, Field(description="this renewal's ttl (default: the lease's own)")
    ] = None


class PidsIn(_Request):
    """The body of ``POST /v1/leases/{id}/pids``."""

    pids: Annotated[
        list[int],
        Field(min_length=1, max_length=64, description="process ids on the node's host"),
    ]


class LeaseOut(BaseModel):
    """A lease as the API shows it (SPEC.md section 11, "VRAM leases")."""

    id: str
    state: str
    granted: bool
    vram_bytes: int | None
    ttl_s: float
    holder: str
    owner: str | None
    submitted_at: float
    gpu: str | None
    pinned_gpu: str | None = None
    granted_at: float | None
    until: float | None
    reason: str
    pids: list[int] = []
    #: why it waits, while it is queued (explain's words)
    waiting: str | None = None
