"""The configuration: one TOML file, validated at start.

Relative paths in a config file resolve against the directory that holds the
file; with no config file they resolve against the current directory. Errors
name the key and what is allowed.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from gpuwarden.core.classify import DEFAULT_MAX_INTERRUPTIONS
from gpuwarden.core.fairshare import DEFAULT_HALF_LIFE_S
from gpuwarden.core.launchrules import LaunchRules, Runtime, image_is_pinned
from gpuwarden.core.model import GIB, MIB
from gpuwarden.core.runtime import RuntimeKind
from gpuwarden.core.sources import check_allow
from gpuwarden.errors import ConfigError
from gpuwarden.gpu.lockfile import GpuLockError, LockTemplate, check_group
from gpuwarden.launch.detect import detect_runtime
from gpuwarden.registry import MODULE_NAME

CONFIG_ENV = "GPUWARDEN_CONFIG"
STATE_DIR_ENV = "GPUWARDEN_STATE_DIR"
MODULES_ENV = "GPUWARDEN_MODULES"

#: what a ``database`` URL may start with (libpq's two URI forms)
DATABASE_URL_PREFIXES = ("postgresql://", "postgres://")

ProbeKind = Literal["auto", "nvml", "nvidia-smi", "sim", "none"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimGpuSettings(_Section):
    """``[sim_gpu]``: the simulated GPU used with ``--mock-gpu`` or ``gpu = "sim"``."""

    count: Annotated[int, Field(ge=1, le=64)] = 1
    vram_gib: Annotated[float, Field(gt=0, le=4096)] = 24.0
    name: str = "gpuwarden simulated GPU"
    release_delay_s: Annotated[float, Field(ge=0, le=600)] = 0.2


class BrokerSettings(_Section):
    """``[broker]``: the broker loop."""

    poll_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.1
    cpu_slots: Annotated[int, Field(ge=1, le=1024)] = 4
    shutdown_grace_s: Annotated[float, Field(ge=0, le=3600)] = 20.0
    #: what a routine stop (SIGTERM, ``systemctl stop``) does with running jobs:
    #: "leave" them running under their supervisors (the next broker takes them
    #: back), or "stop-jobs": give them ``shutdown_grace_s``, then stop them
    on_stop: Literal["leave", "stop-jobs"] = "leave"
    kill_grace_s: Annotated[float, Field(ge=0, le=600)] = 5.0
    status_interval_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    clip_chars: Annotated[int, Field(ge=256, le=10_000_000)] = 16384
    #: times a job may be interrupted by the broker's own end (crash, SIGKILL)
    #: before it is quarantined; interruptions spend no retry
    max_interruptions: Annotated[int, Field(ge=0, le=100)] = DEFAULT_MAX_INTERRUPTIONS
    #: fair share: the half-life of an owner's use in VRAM GiB-hours (0: off)
    fair_share_half_life_s: Annotated[float, Field(ge=0, le=10 * 365 * 86400)] = DEFAULT_HALF_LIFE_S
    #: host RAM that must stay available beside every job (GiB; 0: none): a job
    #: starts only where MemAvailable less this still holds its cap (SPEC section 11)
    ram_floor_gib: Annotated[float, Field(ge=0, le=65536)] = 0.0


class VramSettings(_Section):
    """``[vram]``: admission against each GPU's memory."""

    #: kept free on every GPU (driver, CUDA context growth, fragmentation)
    reserve_gib: Annotated[float, Field(ge=0, le=1024)] = 0.5
    #: how long the memory of an ended job may take to show free before the GPU
    #: is marked degraded (reclaim gate)
    reclaim_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    #: memory differences below this are noise, not a leak
    tolerance_mib: Annotated[float, Field(ge=0, le=65536)] = 64.0
    #: a measured peak is rounded up to a multiple of this before it is stored
    measure_granularity_mib: Annotated[float, Field(gt=0, le=65536)] = 64.0


class WarmSettings(_Section):
    """``[warm]``: warm model servers (job types with ``launch = "serve"``)."""

    #: an idle server is stopped after this long without a job (a type may override)
    idle_grace_s: Annotated[float, Field(ge=0, le=30 * 24 * 3600)] = 300.0
    #: seconds a server gets to finish its current reply when it is stopped
    stop_grace_s: Annotated[float, Field(ge=0, le=600)] = 5.0


class LimitSettings(_Section):
    """``[limits]``: what a bundle may hold."""

    max_bundle_mib: Annotated[float, Field(gt=0)] = 1024.0
    max_entries: Annotated[int, Field(ge=1)] = 10_000
    max_unpacked_mib: Annotated[float, Field(gt=0)] = 4096.0
    max_jobs_per_bundle: Annotated[int, Field(ge=1)] = 1000


class SourceSettings(_Section):
    """``[sources]``: jobs from a pinned commit (SPEC.md, "Jobs from a pinned commit")."""

    #: globs (fnmatch) a job's source repository URL must match; empty: no sources
    allow: list[str] = Field(default_factory=list)
    #: seconds one git fetch of a commit may take
    fetch_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    #: seconds one image build from a commit's Containerfile may take
    build_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 1800.0

    @pydantic.field_validator("allow")
    @classmethod
    def _allow(cls, value: list[str]) -> list[str]:
        return list(check_allow(value))


class PriorityLimits(_Section):
    """``[api.max_priority]``: the highest priority each role may give a job or a
    lease over the API (submit, ``POST /v1/leases``). Priority goes before fair
    share, so a submitter's bound is what keeps one tenant from jumping every
    other's queue; a job asking for more is refused, naming the bound."""

    submitter: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 10
    operator: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 2**63 - 1
    owner: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 2**63 - 1


class ApiSettings(_Section):
    """``[api]``: the HTTP API (``gpuwarden serve --api``)."""

    #: a request body larger than this is refused with 413 before it is read
    max_body_mib: Annotated[float, Field(gt=0, le=4096)] = 16.0
    #: an output file an agent uploads (``PUT /v1/node/jobs/{id}/outputs/{path}``)
    #: larger than this is refused with 413
    max_output_mib: Annotated[float, Field(gt=0, le=1_048_576)] = 4096.0
    #: the most the coordinator keeps of each stream an agent sends of a running
    #: attempt (``POST /v1/node/jobs/{id}/logs/{stream}``): past it the oldest is cut
    max_log_mib: Annotated[float, Field(gt=0, le=1_048_576)] = 64.0
    #: the coordinator removes those copies once their attempt has ended and they
    #: were not written for this many days
    log_keep_days: Annotated[float, Field(gt=0, le=36_500)] = 14.0
    #: requests per second each token may make on average (token bucket)
    rate_per_s: Annotated[float, Field(gt=0, le=1_000_000)] = 20.0
    #: requests a token may make at once before the rate applies
    burst: Annotated[int, Field(ge=1, le=1_000_000)] = 40
    #: the highest priority each role may ask for (``[api.max_priority]``)
    max_priority: PriorityLimits = Field(default_factory=PriorityLimits)
    #: the addresses (or networks, CIDR) of reverse proxies in front of the API
    #: whose ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are believed; from any
    #: other peer, loopback included, they are ignored (the peer's address is the
    #: client's: rate limits, sign-in throttling and sessions go by it)
    trusted_proxies: Annotated[list[str], Field(max_length=64)] = Field(default_factory=list)
    #: GET /metrics answers without a token (Prometheus scrapes without one); off:
    #: it takes an owner's or operator's token (a scrape config's bearer token)
    metrics_public: bool = False
    #: the host name browsers reach services at (``/run/NAME/``), apart from the
    #: API's own, so that a service's pages cannot act as the person viewing them;
    #: ``{name}`` in it: a host per service. "": browsers are not served services
    #: (tokens still are). SPEC section 15, "Services at /run/"
    services_host: Annotated[
        str,
        Field(
            max_length=253, pattern=r"^$|^(?:[a-z0-9-]+|\{name\})(?:\.(?:[a-z0-9-]+|\{name\}))*$"
        ),
    ] = ""

    @pydantic.field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {item!r} is not an IP address or network "
                    "(e.g. 10.0.0.5 or 10.0.0.0/24)"
                ) from None
        return value


class ClusterSettings(_Section):
    """``[cluster]``: several hosts (``gpuwarden coordinator`` and ``gpuwarden agent``)."""

    #: seconds a lease lasts unless the agent's heartbeat renews it
    lease_s: Annotated[float, Field(gt=0, le=3600)] = 90.0
    #: coordinator: seconds after a lease's end before its job may go to another
    #: node (a silent agent's supervisors stop its jobs at the lease's end: signal,
    #: the job's stop grace, kill); keep it above the job types' stop grace
    fence_grace_s: Annotated[float, Field(ge=0, le=3600)] = 15.0
    #: an agent not heard from for this long is offline
    offline_after_s: Annotated[float, Field(gt=0, le=86400)] = 120.0
    #: a job whose model is warm on another node waits this long for that node
    affinity_wait_s: Annotated[float, Field(ge=0, le=86400)] = 30.0
    #: how often the coordinator holding the maintenance lock sweeps
    sweep_every_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    #: agent: how often it asks for work while it has room (it also asks when a job ends)
    claim_every_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    #: agent: the most jobs it holds at once (running and waiting in its own queue)
    max_jobs: Annotated[int, Field(ge=1, le=10_000)] = 4
    #: agent: labels offered for job constraints, e.g. {rack = "a"}
    labels: dict[str, str] = Field(default_factory=dict)
    #: the coordinator's URL as agents reach it (http://HOST:PORT): the coordinator
    #: prints it in `node invite`; an agent enrols with it when no --coordinator
    coordinator_url: str = ""
    #: agent (and ``serve``): the address its service forwarders listen on, the one
    #: the coordinator reaches them at (``/run/<name>/``); 127.0.0.1 on one host
    service_address: str = "127.0.0.1"

    @pydantic.field_validator("service_address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                "must be an IP address of this host that the coordinator can reach, "
                "e.g. 10.0.0.5 (127.0.0.1 on one host)"
            ) from None
        return value

    @pydantic.field_validator("coordinator_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if value == "":
            return value
        m = re.fullmatch(r"(https?)://([^/@\s?#]+)(/[^\s?#]*)?", value)
        if m is None or m.group(2).startswith(":"):
            raise ValueError(
                "must be an http:// or https:// URL with a host, e.g. http://10.0.0.1:8765 "
                "(no user, query or fragment)"
            )
        return value.rstrip("/")


class SandboxSettings(_Section):
    """``[sandbox]``: what every sandboxed attempt gets (see SPEC.md, "Sandbox")."""

    #: the user and group the job runs as inside the sandbox (never root)
    uid: Annotated[int, Field(ge=1, le=2**31 - 1)] = 65534
    gid: Annotated[int, Field(ge=1, le=2**31 - 1)] = 65534
    #: most processes per sandbox (podman/docker: --pids-limit; bubblewrap: a pids
    #: cgroup of its own, or RLIMIT_NPROC, shared by every sandbox, without one)
    pids: Annotated[int, Field(ge=8, le=1_000_000)] = 512
    #: most open files
    nofile: Annotated[int, Field(ge=64, le=1_048_576)] = 4096
    #: CPUs (podman/docker: a rate; bubblewrap: CPU seconds = cpus x the timeout)
    cpus: Annotated[float, Field(gt=0, le=4096)] = 4.0
    #: memory when the job type declares no ram_gib (podman/docker, with cgroups)
    memory_gib: Annotated[float, Field(gt=0, le=65536)] = 16.0
    #: size of the job's scratch directory, a tmpfs (0: a folder on disk, no limit)
    scratch_mib: Annotated[float, Field(ge=0, le=1_048_576)] = 2048.0
    #: size of the sandbox's /tmp, a tmpfs (in memory: keep it small)
    tmp_mib: Annotated[float, Field(ge=1, le=1_048_576)] = 256.0
    #: most MiB in the job's own folders on disk (output, report; scratch when
    #: scratch_mib = 0), checked every second while it runs and at its end: past
    #: it the job is stopped and fails (0: not checked)
    output_mib: Annotated[float, Field(ge=0, le=16_777_216)] = 16384.0
    #: false on hosts where the runtime cannot use cgroups (a mixed v1/v2 layout):
    #: podman then runs with --cgroups=disabled, and memory, pids and CPU-rate
    #: limits are not enforced (ulimits still are)
    cgroups: bool = True
    #: model weights, mounted read-only at /gpuwarden/weights (GPUWARDEN_WEIGHTS_DIR)
    weights_dir: Path | None = None
    #: the Python interpreter inside the sandbox image ({python} in a command)
    python: str = "python3"


class CommandSettings(_Section):
    """``[commands]``: who may run a command job (SPEC.md, "Command jobs")."""

    #: local users (names or uids) whose commands this node runs on the host, as
    #: themselves; empty: root and the owner of the state directory
    users: list[str] = Field(default_factory=list)
    #: local groups whose members may too
    groups: list[str] = Field(default_factory=list)
    #: API roles whose tokens may submit command jobs over HTTP, through a bundle
    #: or to a cluster's agents: those run only sandboxed; empty: none
    roles: list[Literal["owner", "operator", "submitter"]] = Field(default_factory=list)
    #: bundles dropped in a queue root may hold command jobs (sandboxed)
    bundles: bool = False
    #: the node's local socket (``gpuwarden run`` as any allowed user); empty: the
    #: state directory's ``gpuwarden.sock`` (the state directory must then be
    #: searchable by those users)
    socket: Path | None = None


class ModuleSettings(_Section):
    """``[modules.<name>]``: what the broker gives every job and warm server of the
    types of one module (SPEC.md, "[modules.<name>]"); a table per module."""

    #: a folder staged for the module (its model): mounted read-only at
    #: /gpuwarden/model in a sandbox, ``GPUWARDEN_MODEL_DIR`` in the job's
    #: environment; jobs of other modules never see it
    model_dir: Path | None = None


class RuntimeCall(_Section):
    """One HTTP call of a ``generic`` runtime (``[runtimes.busy]``, ``.release``)."""

    method: Literal["GET", "POST"] = "GET"
    #: a path on the runtime's ``url``, starting with "/"
    path: Annotated[str, Field(pattern=r"^/[^\s]*$", max_length=1000)]
    #: ``busy``: the JSON key whose value says it works (true, or a non-empty list or a
    #: number above 0); ``release``: unused
    busy_key: str = ""
    body: dict[str, Any] | None = None


class RuntimeSettings(_Section):
    """A managed runtime (``[[runtimes]]``): a model server the broker owns beside
    its own jobs, never kills, and asks to release its memory through its own API."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    kind: RuntimeKind
    #: where its API answers: http(s)://HOST:PORT
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=1000)]
    #: a file holding the bearer token its API wants (read at start; mode 0600)
    credential_file: Path | None = None
    #: the GPU UUIDs it runs on (empty: wherever its processes show)
    gpus: list[str] = Field(default_factory=list)
    idle_grace_s: Annotated[float, Field(ge=0, le=30 * 24 * 3600)] = 300.0
    #: how long a release may take to show on the device before it is ineffective
    release_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 15.0
    #: ``generic`` only: how to tell it works and how to ask it to release
    busy: RuntimeCall | None = None
    release: RuntimeCall | None = None

    @pydantic.model_validator(mode="after")
    def _generic_calls(self) -> RuntimeSettings:
        if self.kind is not RuntimeKind.GENERIC and (self.busy or self.release):
            raise ValueError(
                f'runtime {self.name!r}: busy and release are for kind = "generic" only '
                f"(a {self.kind.value} runtime is spoken to through its own API)"
            )
        if self.busy is not None and not self.busy.busy_key:
            raise ValueError(f"runtime {self.name!r}: busy needs busy_key (the JSON key to read)")
        return self


class Config(_Section):
    """The whole configuration. See SPEC.md, "Configuration", for every key."""

    state_dir: Path = Path()
    #: where the store lives: "" for SQLite in the state directory, or a PostgreSQL
    #: URL (postgresql://USER@HOST:PORT/DBNAME) for a database nodes can share
    database: str = ""
    node_name: str = Field(default_factory=socket.gethostname, min_length=1)
    gpu: ProbeKind = "auto"
    module_paths: list[Path] = Field(default_factory=list)
    queue_roots: list[Path] = Field(default_factory=list)
    create_queue_roots: bool = True
    sim_gpu: SimGpuSettings = SimGpuSettings()
    broker: BrokerSettings = BrokerSettings()
    vram: VramSettings = VramSettings()
    warm: WarmSettings = WarmSettings()
    limits: LimitSettings = LimitSettings()
    sources: SourceSettings = SourceSettings()
    api: ApiSettings = ApiSettings()
    cluster: ClusterSettings = ClusterSettings()
    #: "local" (no sandbox), "podman", "docker", "bubblewrap", or "auto": bubblewrap
    #: where it is installed and starts a sandbox here, else "local" (found when the
    #: config is loaded; the value here is then the one found)
    container_runtime: Runtime = Runtime.LOCAL
    #: with container_runtime = "auto": what it found, in words (never in a file)
    container_runtime_auto: str = Field(default="", exclude=True)
    #: the image sandboxed attempts run in (podman, docker): pinned by digest or id
    sandbox_image: str = ""
    allow_unpinned_images: bool = False
    #: with container_runtime = "local": run container and serve types as host processes
    allow_unsandboxed_containers: bool = False
    #: with a real runtime: run host types too (unsandboxed)
    allow_host_jobs: bool = False
    sandbox: SandboxSettings = SandboxSettings()
    commands: CommandSettings = CommandSettings()
    #: the managed runtimes (issue 15: registered, not yet driven by the broker)
    runtimes: list[RuntimeSettings] = Field(default_factory=list)
    #: the GPU lock file's path template ("/run/gpuwarden/<uuid>.lock"), "": off
    gpu_lock: str = ""
    #: the group whose members may take a GPU's lock (lock files are 0660, this
    #: group's); "": the broker's own (root's)
    gpu_lock_group: str = ""
    #: ``[modules.<name>]``: per module settings (its model folder), by module name
    modules: dict[str, ModuleSettings] = Field(default_factory=dict)

    @pydantic.field_validator("modules")
    @classmethod
    def _module_names(cls, value: dict[str, ModuleSettings]) -> dict[str, ModuleSettings]:
        if bad := sorted(n for n in value if not MODULE_NAME.fullmatch(n)):
            raise ValueError(
                f"[modules.<name>]: {', '.join(repr(n) for n in bad)} is not a module name "
                "(a lower-case letter, then up to 63 lower-case letters, digits or _)"
            )
        return value

    @pydantic.field_validator("gpu_lock")
    @classmethod
    def _lock_template(cls, value: str) -> str:
        if value:
            try:
                LockTemplate(value)
            except GpuLockError as exc:
                raise ValueError(str(exc)) from None
        return value

    @pydantic.field_validator("gpu_lock_group")
    @classmethod
    def _lock_group(cls, value: str) -> str:
        try:
            check_group(value)
        except GpuLockError as exc:
            raise ValueError(str(exc)) from None
        return value

    @pydantic.field_validator("runtimes")
    @classmethod
    def _unique_runtimes(cls, value: list[RuntimeSettings]) -> list[RuntimeSettings]:
        names = [r.name for r in value]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"runtime names must be unique; given twice: {', '.join(dupes)}")
        return value

    @pydantic.model_validator(mode="before")
    @classmethod
    def _resolve_auto_runtime(cls, data: Any) -> Any:
        """``container_runtime = "auto"``: take bubblewrap where it works here, else
        ``local``; what was found goes to ``container_runtime_auto``."""
        if not isinstance(data, dict):
            return data
        if "container_runtime_auto" in data:
            raise ConfigError(
                "config key 'container_runtime_auto' is set by gpuwarden, not in a config "
                'file: write container_runtime = "auto"'
            )
        if data.get("container_runtime") != "auto":
            return data
        try:
            sandbox = SandboxSettings.model_validate(data.get("sandbox", {}))
        except pydantic.ValidationError:
            sandbox = SandboxSettings()  # the whole validation says what is wrong
        found = detect_runtime(sandbox.uid, sandbox.gid)
        return {
            **data,
            "container_runtime": found.runtime.value,
            "container_runtime_auto": found.detail,
        }

    @pydantic.field_serializer("container_runtime")
    def _dump_runtime(self, value: Runtime) -> str:
        # what the file said: loading it again finds out again
        return "auto" if self.container_runtime_auto else value.value

    @property
    def runtime_shown(self) -> str:
        """The runtime in words, with what ``auto`` found (doctor, ``types``)."""
        if self.container_runtime_auto:
            return (
                f'{self.container_runtime.value} (container_runtime = "auto": '
                f"{self.container_runtime_auto})"
            )
        return self.container_runtime.value

    @pydantic.field_validator("database")
    @classmethod
    def _check_database(cls, value: str) -> str:
        if value == "" or value.startswith(DATABASE_URL_PREFIXES):
            return value
        # ConfigError, not ValueError: pydantic's message would repeat the value,
        # and a database URL may hold a password
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", value)
        got = f"a {scheme.group(1)}:// URL" if scheme else "a value that is not a URL"
        raise ConfigError(
            f"config key 'database' must be \"\" (SQLite in the state directory) or a "
            f"PostgreSQL URL postgresql://USER@HOST:PORT/DBNAME; got {got}"
        )

    @property
    def launch_rules(self) -> LaunchRules:
        return LaunchRules(
            runtime=self.container_runtime,
            allow_unsandboxed_containers=self.allow_unsandboxed_containers,
            allow_host_jobs=self.allow_host_jobs,
            auto=self.container_runtime_auto,
        )

    @property
    def source_refusal(self) -> str | None:
        """Why this node runs no job from a commit (None: it may): their images
        are built and run by podman or docker."""
        if self.container_runtime.needs_image:
            return None
        return (
            "jobs from a repository are built into an image and run by podman or docker; "
            f'this node\'s container_runtime is "{self.container_runtime.value}"'
        )

    def check_sandbox(self) -> None:
        """Raise :class:`ConfigError` when the sandbox settings cannot work together."""
        runtime = self.container_runtime
        if not runtime.needs_image:
            return
        if not self.sandbox_image:
            raise ConfigError(
                f'container_runtime = "{runtime.value}" needs sandbox_image: build one with '
                f"`images/build.sh --runtime {runtime.value} --pin` and set the id it prints"
            )
        if not image_is_pinned(self.sandbox_image) and not self.allow_unpinned_images:
            raise ConfigError(
                f"sandbox_image {self.sandbox_image!r} is not pinned: a tag can be moved to "
                f"another image. Use a digest (name@sha256:...) or a local image id "
                f"(`images/build.sh --pin` prints one), or set allow_unpinned_images = true"
            )

    def check_modules(self) -> None:
        """Raise :class:`ConfigError` when a ``[modules.<name>] model_dir`` is not a
        folder (missing, a file, or not reachable): checked when a node starts."""
        for name, settings in sorted(self.modules.items()):
            folder = settings.model_dir
            if folder is None:
                continue
            key = f"[modules.{name}] model_dir"
            try:
                if folder.is_dir():
                    continue
                what = "is not a folder" if folder.exists() else "does not exist"
            except OSError as exc:
                what = f"cannot be reached ({exc.strerror})"
            raise ConfigError(
                f"{key} {folder} {what}: stage the module's model there (a folder, "
                f"readable by the sandbox's user), or remove the key"
            )

    @property
    def sim_vram_bytes(self) -> int:
        return int(self.sim_gpu.vram_gib * GIB)

    @property
    def db_path(self) -> Path:
        return self.state_dir / "gpuwarden.db"

    def bundle_limits_bytes(self) -> tuple[int, int, int, int]:
        lim = self.limits
        return (
            int(lim.max_bundle_mib * MIB),
            lim.max_entries,
            int(lim.max_unpacked_mib * MIB),
            lim.max_jobs_per_bundle,
        )


def default_state_dir() -> Path:
    if env := os.environ.get(STATE_DIR_ENV):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuwarden"


def default_module_paths() -> list[Path]:
    """``$GPUWARDEN_MODULES`` (colon-separated), else ``./modules`` if it exists. The
    shipped modules and those installed with pip (entry point ``gpuwarden.modules``)
    come on top of these: :meth:`gpuwarden.registry.Registry.load`."""
    if env := os.environ.get(MODULES_ENV):
        return [Path(p) for p in env.split(os.pathsep) if p]
    cwd_modules = Path.cwd() / "modules"
    return [cwd_modules] if cwd_modules.is_dir() else []


def absolute_path(base: Path, path: Path) -> Path:
    """``path`` against ``base``, made absolute and normalised by its text alone
    (``.`` and ``..`` dropped as written), following no link: for a path the broker
    later opens following none (:func:`Path.resolve` would follow every link on it
    at load, and the later no-follow open would see only where they led)."""
    return Path(os.path.normpath(base / path))


def load_config(path: Path | None, *, state_dir: Path | None = None, check: bool = True) -> Config:
    """Read and validate ``path`` (or the defaults when None). ``state_dir``, when
    given (``--state-dir``), wins over the file. ``check=False`` skips
    :meth:`Config.check_sandbox` (``doctor`` reports it as one check of many)."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
        base = path.resolve().parent
    try:
        config = Config.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(_explain(exc, path)) from None
    updates: dict[str, Any] = {}
    if state_dir is not None:
        updates["state_dir"] = state_dir.resolve()
    elif "state_dir" in raw:
        updates["state_dir"] = (base / config.state_dir).resolve()
    else:
        updates["state_dir"] = default_state_dir().resolve()
    if "module_paths" in raw:
        updates["module_paths"] = [(base / p).resolve() for p in config.module_paths]
    else:
        updates["module_paths"] = default_module_paths()
    updates["queue_roots"] = [(base / p).resolve() for p in config.queue_roots]
    if config.runtimes:
        # never resolved: the file is read following no link in any component
        # (gpuwarden.app.runtime_token); resolving here would follow them all now
        updates["runtimes"] = [
            r
            if r.credential_file is None
            else r.model_copy(update={"credential_file": absolute_path(base, r.credential_file)})
            for r in config.runtimes
        ]
    if config.sandbox.weights_dir is not None:
        weights = (base / config.sandbox.weights_dir).resolve()
        updates["sandbox"] = config.sandbox.model_copy(update={"weights_dir": weights})
    if config.modules:
        updates["modules"] = {
            name: m
            if m.model_dir is None
            else m.model_copy(update={"model_dir": (base / m.model_dir).resolve()})
            for name, m in config.modules.items()
        }
    config = config.model_copy(update=updates)
    if check:
        config.check_sandbox()
    return config


def _explain(exc: pydantic.ValidationError, path: Path | None) -> str:
    where = f"config {path}" if path else "config"
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            section = _section_for(err["loc"][:-1])
            fields = section.model_fields if section else {}
            allowed = ", ".join(sorted(k for k in fields if k != "container_runtime_auto")) or "?"
            lines.append(f"unknown key {loc!r}; allowed keys here: {allowed}")
        elif loc == "container_runtime" and err["type"] == "enum":
            lines.append(
                f"key {loc!r}: must be one of auto, local, podman, docker, bubblewrap "
                f"(got {err.get('input')!r})"
            )
        else:
            lines.append(f"key {loc!r}: {err['msg']} (got {err.get('input')!r})")
    return f"{where} is not valid:\n  " + "\n  ".join(lines)


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    keyed = False
    for part in loc:
        # an item of a list of sections (``[[runtimes]]``), or the key of a table
        # of sections (``[modules.<name>]``)
        if isinstance(part, int) or keyed:
            keyed = False
            continue
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        keyed = get_origin(annotation) is dict
        # a list or table of sections, or an optional one: the one section type it holds
        inner = [
            a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if len(inner) != 1:
            return None
        model = inner[0]
    return model
