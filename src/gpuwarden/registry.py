"""The module registry: reads every module's ``module.toml`` at start.

Modules come from three places, in this order (the first module of a name wins;
``types`` says where each came from and which were passed over):

1. the folders on ``module_paths`` (each holds ``<name>/module.toml`` folders);
2. packages installed with pip that declare an entry point in the group
   ``gpuwarden.modules``: ``<module name> = "<package>"``, the package's folder
   holding ``module.toml`` and ``src/``. The package is found without being
   imported: nothing of it runs in the broker;
3. the modules shipped inside gpuwarden (``gpuwarden/modules/``, wherever the
   package is installed).

The broker reads a module's metadata and never imports its code: a job runs the
type's ``command`` as a process under the contract in ``docs/MODULE_GUIDE.md``.
Errors name the file and the key.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from gpuwarden.core import command
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.lease import LEASE_MODULE, lease_job_type
from gpuwarden.core.model import (
    GIB,
    MAX_GPUS,
    JobType,
    Lane,
    LaunchMode,
    ParamSpec,
    ParamType,
)
from gpuwarden.core.params import value_fits
from gpuwarden.core.preempt import DEFAULT_GRACE_S, DEFAULT_MIN_RUN_S, DEFAULT_SIGNAL
from gpuwarden.core.service import parse_health
from gpuwarden.core.sources import TYPE_SEP, JobSource, source_type
from gpuwarden.errors import ModuleError, ValidationError

#: a module's name (and a type's, after the dot); also a ``[modules.<name>]`` table's key
MODULE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

#: the modules that ship inside the package: found wherever gpuwarden is installed
BUILTIN_DIR = Path(__file__).resolve().parent / "modules"
#: the entry-point group a package installed with pip registers its modules in
ENTRY_POINT_GROUP = "gpuwarden.modules"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _ParamToml(_Strict):
    type: Literal["string", "integer", "number", "boolean", "input"]
    required: bool = False
    default: str | int | float | bool | None = None
    description: str = ""
    choices: list[str | int | float | bool] = Field(default_factory=list)
    sizes_vram: bool = False


class _TypeToml(_Strict):
    lane: Literal["vram", "cpu"]
    launch: Literal["host", "container", "serve", "service"] = "host"
    command: Annotated[list[str], Field(min_length=1)]
    vram_gib: Annotated[float, Field(ge=0, le=4096)] = 0.0
    ram_gib: Annotated[float, Field(ge=0, le=65536)] = 0.0
    coresident: bool = False
    timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 3600.0
    max_retries: Annotated[int, Field(ge=0, le=100)] = 2
    max_interruptions: Annotated[int, Field(ge=0, le=100)] | None = None
    description: str = ""
    params: dict[str, _ParamToml] = Field(default_factory=dict)
    # serve launch mode only
    keep_warm: bool = False
    idle_grace_s: Annotated[float, Field(ge=0, le=30 * 24 * 3600)] | None = None
    load_timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 600.0
    expected_device_gib: Annotated[float, Field(gt=0, le=4096)] | None = None
    # runtime types only: the managed runtime whose model the jobs use
    runtime: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")] | None = None
    model: Annotated[str, Field(pattern=r"^[^\x00-\x20\x7f]{1,200}$")] | None = None
    # preemption at a safe point (gpuwarden.core.preempt)
    preemptible: bool = False
    #: one of ``gpuwarden.core.preempt.SIGNALS``
    checkpoint_signal: Literal[
        "SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGWINCH"
    ] = DEFAULT_SIGNAL
    checkpoint_grace_s: Annotated[float, Field(gt=0, le=24 * 3600)] = DEFAULT_GRACE_S
    min_run_s: Annotated[float, Field(ge=0, le=30 * 24 * 3600)] = DEFAULT_MIN_RUN_S
    # how many GPUs of one node each job holds at once (vram_gib on each)
    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS)] = 1
    # service launch mode only (SPEC.md, "Service jobs")
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    health: str = "tcp"
    health_grace_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 60.0
    health_every_s: Annotated[float, Field(gt=0, le=3600)] = 2.0


class _ModuleMeta(_Strict):
    name: str
    description: str = ""
    version: str = "0"


class _ModuleToml(_Strict):
    module: _ModuleMeta
    types: Annotated[dict[str, _TypeToml], Field(min_length=1)]


class SourceKind(StrEnum):
    PATH = "module_paths"
    ENTRY_POINT = "entry point"
    BUILTIN = "built-in"
    #: a job's ``source``: one commit of a repository, fetched by the node
    COMMIT = "commit"


@dataclass(frozen=True, slots=True)
class ModuleSource:
    """Where a module was found."""

    kind: SourceKind
    #: the module_paths folder that holds it; the package an entry point names
    #: (``pkg.sub``); for a shipped module, the shipped folder
    where: str = ""
    #: the installed distribution that declares the entry point: ``name version``
    dist: str = ""

    def __str__(self) -> str:
        if self.kind is SourceKind.PATH:
            return f"module_paths {self.where}"
        if self.kind is SourceKind.ENTRY_POINT:
            return f"pip package {self.dist} (entry point {self.where})"
        if self.kind is SourceKind.COMMIT:
            return f"commit {self.dist} of {self.where}"
        return "built-in"

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind.value, "where": self.where}
        if self.dist:
            out["dist"] = self.dist
        return out


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: Path
    description: str
    fingerprint: str  # sha256 over src/: names and contents
    types: tuple[JobType, ...]
    source: ModuleSource = ModuleSource(SourceKind.PATH)


def parse_module(
    path: Path, *, name: str | None = None, source: ModuleSource | None = None
) -> Module:
    """Parse and validate ``path/module.toml``. Raise :class:`ModuleError` naming the key.

    The module's name must be its folder's name, or ``name`` where one is given
    (an entry point's name: a package's folder is named for Python, not for us)."""
    toml_path = path / "module.toml"
    meta = _read_module_toml(toml_path)
    _check_module_name(toml_path, meta.module.name, folder=path.name, entry_point=name)
    types = tuple(
        _job_type(f"{toml_path}: [types.{tname}]", meta.module.name, path, tname, t)
        for tname, t in meta.types.items()
    )
    return Module(
        name=meta.module.name,
        path=path.resolve(),
        description=meta.module.description,
        fingerprint=fingerprint(path / "src"),
        types=types,
        source=source or ModuleSource(SourceKind.PATH, str(path.resolve().parent)),
    )


def parse_source_module(path: Path, source: JobSource) -> Module:
    """The module of one commit of a repository (a job's ``source``), its tree
    exported at ``path``. Its name and its types' names end in ``@<commit>``, so
    that two commits of one module, and a shipped module of the same name, never
    meet. Raise :class:`ModuleError` naming the key."""
    toml_path = path / "module.toml"
    meta = _read_module_toml(toml_path)
    declared = meta.module.name
    if not MODULE_NAME.fullmatch(declared):
        raise ModuleError(
            f"{toml_path}: key 'module.name' must be lower-case letters, digits and _ "
            f"(got {declared!r})"
        )
    module = f"{declared}{TYPE_SEP}{source.commit}"
    types = tuple(
        replace(
            _job_type(f"{toml_path}: [types.{tname}]", declared, path, tname, t),
            name=source_type(f"{declared}.{tname}", source.commit),
            module=module,
        )
        for tname, t in meta.types.items()
    )
    return Module(
        name=module,
        path=path.resolve(),
        description=meta.module.description,
        fingerprint=f"git:{source.commit}",
        types=types,
        source=ModuleSource(SourceKind.COMMIT, where=source.repo, dist=source.commit),
    )


def _read_module_toml(toml_path: Path) -> _ModuleToml:
    """``module.toml`` read and checked against its schema, or :class:`ModuleError`."""
    try:
        raw = tomllib.loads(toml_path.read_text())
    except FileNotFoundError:
        raise ModuleError(f"{toml_path}: missing (every module folder needs one)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ModuleError(f"{toml_path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ModuleError(f"{toml_path}: not UTF-8 text") from None
    except OSError as exc:
        raise ModuleError(f"{toml_path}: cannot be read: {exc.strerror}") from None
    try:
        return _ModuleToml.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"key {'.'.join(str(p) for p in e['loc'])!r}: {e['msg']}" for e in exc.errors()
        )
        raise ModuleError(f"{toml_path}: {problems}") from None


def _check_module_name(
    toml_path: Path, declared: str, *, folder: str, entry_point: str | None
) -> None:
    """The declared name must be the entry point's (if one names the folder), else
    the folder's, and a valid name."""
    if entry_point is not None and declared != entry_point:
        raise ModuleError(
            f"{toml_path}: key 'module.name' is {declared!r} but the entry point "
            f"({ENTRY_POINT_GROUP}) that names this folder is {entry_point!r}; they must match"
        )
    if entry_point is None and declared != folder:
        raise ModuleError(
            f"{toml_path}: key 'module.name' is {declared!r} but the folder is "
            f"{folder!r}; they must match"
        )
    if not MODULE_NAME.fullmatch(declared):
        raise ModuleError(
            f"{toml_path}: key 'module.name' must be lower-case letters, digits and _ "
            f"(got {declared!r})"
        )


def _job_type(where: str, module: str, path: Path, tname: str, t: _TypeToml) -> JobType:
    """The job type ``[types.<tname>]`` declares, checked (``where`` names it)."""
    if not MODULE_NAME.fullmatch(tname):
        raise ModuleError(f"{where}: a type name must be lower-case letters, digits and _")
    if t.lane == "vram" and t.vram_gib <= 0:
        raise ModuleError(f"{where}: key 'vram_gib' must be > 0 on the vram lane")
    if t.lane == "cpu" and t.vram_gib > 0:
        raise ModuleError(f"{where}: key 'vram_gib' must be 0 on the cpu lane (got {t.vram_gib})")
    if t.coresident and t.lane != "vram":
        raise ModuleError(f"{where}: key 'coresident' only makes sense on the vram lane")
    serve_only = [
        k
        for k in ("keep_warm", "idle_grace_s", "load_timeout_s", "expected_device_gib")
        if k in t.model_fields_set
    ]
    if serve_only and t.launch != "serve":
        raise ModuleError(f'{where}: key {serve_only[0]!r} applies only to launch = "serve" types')
    if t.launch == "serve" and t.lane != "vram":
        raise ModuleError(f'{where}: a serve type holds a model on a GPU: use lane = "vram"')
    _check_runtime_type(where, t)
    _check_service(where, t)
    _check_preemptible(where, t)
    _check_gpus(where, t)
    params = tuple(_param(where, pname, p) for pname, p in t.params.items())
    return JobType(
        name=f"{module}.{tname}",
        module=module,
        module_dir=str(path.resolve()),
        lane=Lane(t.lane),
        launch=LaunchMode(t.launch),
        command=tuple(t.command),
        vram_bytes=int(t.vram_gib * GIB),
        ram_bytes=int(t.ram_gib * GIB),
        coresident=t.coresident,
        timeout_s=t.timeout_s,
        max_retries=t.max_retries,
        max_interruptions=t.max_interruptions,
        params=params,
        description=t.description,
        keep_warm=t.keep_warm,
        idle_grace_s=t.idle_grace_s,
        load_timeout_s=t.load_timeout_s,
        expected_device_bytes=(int(t.expected_device_gib * GIB) if t.expected_device_gib else None),
        runtime=t.runtime,
        model=t.model,
        preemptible=t.preemptible,
        checkpoint_signal=t.checkpoint_signal,
        checkpoint_grace_s=t.checkpoint_grace_s,
        min_run_s=t.min_run_s,
        gpus=t.gpus,
        port=t.port,
        health=t.health,
        health_grace_s=t.health_grace_s,
        health_every_s=t.health_every_s,
    )


def _check_service(where: str, t: _TypeToml) -> None:
    """A service type declares its port and a health check it can be asked; the
    service keys belong to service types only."""
    keys = [
        k for k in ("port", "health", "health_grace_s", "health_every_s") if k in t.model_fields_set
    ]
    if t.launch != "service":
        if keys:
            raise ModuleError(f'{where}: key {keys[0]!r} applies only to launch = "service" types')
        return
    if t.port is None:
        raise ModuleError(
            f"{where}: a service type declares the port its process listens on "
            "(key 'port', 1-65535)"
        )
    try:
        parse_health(t.health)
    except ValueError as exc:
        raise ModuleError(f"{where}: key 'health': {exc}") from None
    if t.runtime is not None:
        raise ModuleError(f"{where}: a service type is not a runtime type (leave out 'runtime')")


def _check_gpus(where: str, t: _TypeToml) -> None:
    """A multi-GPU type's jobs are processes of their own on the vram lane (a warm
    server and a runtime's model live on one GPU)."""
    if t.gpus == 1:
        return
    if t.lane != "vram":
        raise ModuleError(f"{where}: key 'gpus' asks for GPUs: use lane = \"vram\"")
    if t.launch == "serve" or t.runtime is not None:
        raise ModuleError(
            f"{where}: key 'gpus' > 1 applies to jobs that run as processes of their own "
            '(launch = "host" or "container"); a warm server or a runtime type holds one GPU'
        )


def _check_preemptible(where: str, t: _TypeToml) -> None:
    """The checkpoint keys belong to a preemptible type; a preemptible type's jobs
    are processes of their own on a GPU (a warm server or a runtime's client
    holds memory that is not the job's to checkpoint)."""
    keys = [
        k
        for k in ("checkpoint_signal", "checkpoint_grace_s", "min_run_s")
        if k in t.model_fields_set
    ]
    if keys and not t.preemptible:
        raise ModuleError(f"{where}: key {keys[0]!r} applies only to preemptible = true types")
    if not t.preemptible:
        return
    if t.lane != "vram":
        raise ModuleError(f'{where}: preemption frees a GPU: a preemptible type uses lane = "vram"')
    if t.launch == "serve" or t.runtime is not None:
        raise ModuleError(
            f"{where}: a preemptible type's jobs run as processes of their own "
            '(launch = "host" or "container"; not serve or runtime types)'
        )


def _check_runtime_type(where: str, t: _TypeToml) -> None:
    """A runtime type names both its runtime and its model, holds that model on a
    GPU (through the runtime), and runs as the runtime's client on the host."""
    if (t.runtime is None) != (t.model is None):
        given, missing = ("runtime", "model") if t.model is None else ("model", "runtime")
        raise ModuleError(
            f"{where}: key {given!r} needs key {missing!r} too (a runtime type names the "
            "managed runtime and the model its jobs use)"
        )
    if t.runtime is None:
        return
    if t.lane != "vram":
        raise ModuleError(
            f'{where}: a runtime type holds its model on a GPU (in the runtime): use lane = "vram"'
        )
    if t.launch != "host":
        raise ModuleError(
            f'{where}: a runtime type is a client of the runtime on this host: use launch = "host" '
            "(a container has no network to reach the runtime; serve types load their own model)"
        )


def _param(where: str, name: str, p: _ParamToml) -> ParamSpec:
    if not MODULE_NAME.fullmatch(name):
        raise ModuleError(f"{where}: parameter name {name!r} must be lower-case letters, digits, _")
    spec = ParamSpec(
        name=name,
        type=ParamType(p.type),
        required=p.required,
        default=p.default,
        description=p.description,
        choices=tuple(p.choices),
        sizes_vram=p.sizes_vram,
    )
    if p.required and p.default is not None:
        raise ModuleError(f"{where}.params.{name}: a required parameter cannot have a default")
    if p.default is not None and not value_fits(spec, p.default):
        raise ModuleError(f"{where}.params.{name}: key 'default' {p.default!r} is not a {p.type}")
    if p.default is not None and p.choices and p.default not in p.choices:
        raise ModuleError(
            f"{where}.params.{name}: key 'default' {p.default!r} is not one of its "
            f"choices {p.choices!r}"
        )
    return spec


def fingerprint(src: Path) -> str:
    """sha256 over every file under ``src`` (relative names and contents), sorted."""
    h = hashlib.sha256()
    if src.is_dir():
        for f in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(f.relative_to(src)).encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


class SourceReader(Protocol):
    """What fetches a job's source and reads its module (``intake/sources.py``):
    ``allow``, the host's ``[sources] allow``; ``refusal``, why it runs no job
    from a commit at all (None: it may)."""

    allow: tuple[str, ...]
    refusal: str | None

    def module(self, source: JobSource) -> Module:
        """The module of ``source``'s commit, fetched if it is not cached; raise
        :class:`~gpuwarden.errors.ValidationError` saying why not."""
        ...


def command_job_type(type_name: str) -> JobType:
    """The type of a command job (``command:NAME[options]``, SPEC.md "Command
    jobs"): no module; its command is the job's own. :class:`ValueError` when
    ``type_name`` is not a valid command type."""
    _name, options = command.parse_type(type_name)
    return JobType(
        name=type_name,
        module="command",
        module_dir="",  # none: nothing of a module is mounted in its sandbox
        lane=Lane.VRAM,
        launch=LaunchMode.CONTAINER if options.sandbox else LaunchMode.HOST,
        command=(),
        coresident=options.share,
        timeout_s=options.timeout_s or command.DEFAULT_TIMEOUT_S,
        preemptible=options.preempt is not None,
        checkpoint_signal=options.preempt or DEFAULT_SIGNAL,
        description="a command job (gpuwarden run / submit -- CMD)",
    )


class _Types(dict[str, JobType]):
    """The types by name; a command job's type (``command:...``) is made the
    first time it is asked for, so that every reader of a job's type finds it."""

    def __missing__(self, key: str) -> JobType:
        if not command.is_command_type(key):
            raise KeyError(key)
        try:
            jobtype = command_job_type(key)
        except ValueError:
            raise KeyError(key) from None
        self[key] = jobtype
        return jobtype

    def get(self, key: str, default: JobType | None = None) -> JobType | None:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


class Registry:
    """Every job type of every module found, and the node's launch rules: which
    of them may run here (checked at submission)."""

    #: fetches the module of a job's source (None: this registry takes none)
    sources: SourceReader | None = None

    def __init__(
        self,
        modules: list[Module],
        rules: LaunchRules | None = None,
        passed_over: tuple[str, ...] = (),
    ) -> None:
        self.modules = {m.name: m for m in modules}
        self.types = _Types((t.name, t) for m in modules for t in m.types)
        self.add(lease_module())  # a VRAM lease's built-in type (core/lease.py)
        self.rules = rules or LaunchRules()
        #: modules not used because one of the same name came first, in words
        self.passed_over = passed_over

    @classmethod
    def load(
        cls,
        paths: list[Path],
        rules: LaunchRules | None = None,
        *,
        installed: bool = True,
        builtin: bool = True,
    ) -> Registry:
        """Load every module under ``paths``, then those installed with pip
        (``installed``), then the shipped ones (``builtin``). Folders starting
        with ``_`` or ``.`` (``_TEMPLATE``) are skipped. The first module of a name
        wins; the others are listed in :attr:`passed_over`."""
        found: dict[str, Module] = {}
        passed: list[str] = []

        def first(name: str, path: Path, source: ModuleSource) -> bool:
            kept = found.get(name)
            if kept is None:
                return True
            if kept.path != path.resolve():
                passed.append(f"{name} from {source} (the one from {kept.source} comes first)")
            return False

        for root in paths:
            _load_root(root, found, first)
        if installed:
            _load_installed(found, first)
        if builtin:
            _load_root(BUILTIN_DIR, found, first)
        return cls(list(found.values()), rules, tuple(passed))

    def get(self, name: str) -> JobType:
        if command.is_command_type(name):
            try:
                return command_job_type(name)
            except ValueError as exc:
                raise ValidationError(str(exc)) from None
        try:
            return self.types[name]
        except KeyError:
            known = ", ".join(sorted(self.types)) or "none (check module_paths)"
            close = difflib.get_close_matches(name, list(self.types), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValidationError(
                f"unknown job type {name!r}{hint}; known types: {known}"
            ) from None

    def add(self, module: Module) -> None:
        """Add a module found after the start (a job's source commit)."""
        self.modules[module.name] = module
        self.types.update((t.name, t) for t in module.types)

    def from_source(self, source: JobSource, type_name: str) -> JobType:
        """The type ``type_name`` (``mymod.train``) of the module at ``source``'s
        commit, fetched and read once; raise :class:`ValidationError` saying why
        not."""
        if self.sources is None:
            raise ValidationError(
                "this node takes no jobs from a repository (source): set [sources] allow "
                "in its config"
            )
        stored = source_type(type_name, source.commit)
        # every time: the URL is checked against [sources] allow even when another
        # job already brought the commit here (its tree is read from the cache)
        module = self.sources.module(source)
        if stored not in self.types:
            self.add(module)
        if stored not in self.types:
            known = sorted(
                t.name.partition(TYPE_SEP)[0]
                for t in self.types.values()
                if t.name.endswith(TYPE_SEP + source.commit)
            )
            raise ValidationError(
                f"commit {source.commit} of {source.repo} has no job type {type_name!r}; "
                f"its module.toml declares: {', '.join(known) or 'none'}"
            )
        return self.types[stored]

    def module_of(self, jobtype: JobType) -> Module:
        return self.modules[jobtype.module]

    def argv(self, jobtype: JobType, python: str | None = None) -> tuple[str, ...]:
        """The command with ``{python}`` replaced by ``python`` (default: this
        interpreter; a sandbox image has its own)."""
        python = python or sys.executable
        return tuple(python if a == "{python}" else a for a in jobtype.command)

    def describe(self) -> list[dict[str, Any]]:
        """Every type, what it is, where it came from and whether (and how) it runs
        here under the launch rules (``gpuwarden types --json``)."""
        rules = self.rules
        out = []
        for t in sorted(self.types.values(), key=lambda t: t.name):
            refused = rules.refusal(t)
            out.append(
                {
                    "type": t.name,
                    "module": t.module,
                    "description": t.description,
                    "lane": t.lane.value,
                    "launch": t.launch.value,
                    "vram_bytes": t.vram_bytes,
                    "coresident": t.coresident,
                    "timeout_s": t.timeout_s,
                    "gpus": t.gpus,
                    "preemptible": t.preemptible,
                    "preemption": (
                        {
                            "checkpoint_signal": t.checkpoint_signal,
                            "checkpoint_grace_s": t.checkpoint_grace_s,
                            "min_run_s": t.min_run_s,
                        }
                        if t.preemptible
                        else None
                    ),
                    "runs_here": refused is None,
                    "refused": refused,
                    "runs_as": rules.where(t),
                    "sandboxed": refused is None and rules.sandboxed(t),
                    "unsandboxed": rules.unsandboxed_reason(t),
                    "source": self.modules[t.module].source.to_json(),
                    "params": [
                        {
                            "name": p.name,
                            "type": p.type.value,
                            "required": p.required,
                            "default": p.default,
                            "description": p.description,
                            **({"choices": list(p.choices)} if p.choices else {}),
                            **({"sizes_vram": True} if p.sizes_vram else {}),
                        }
                        for p in t.params
                    ],
                }
            )
        return out


_First = Callable[[str, Path, ModuleSource], bool]


def lease_module() -> Module:
    """The built-in module of VRAM leases: the ``lease`` type, no folder."""
    return Module(
        name=LEASE_MODULE,
        path=Path("/"),
        description="VRAM leases (built in)",
        fingerprint="",
        types=(lease_job_type(),),
        source=ModuleSource(SourceKind.BUILTIN, "gpuwarden"),
    )


def _load_root(root: Path, found: dict[str, Module], first: _First) -> None:
    if not root.is_dir():
        raise ModuleError(f"module path {root} is not a directory (config key module_paths)")
    shipped = root.resolve() == BUILTIN_DIR
    source = ModuleSource(SourceKind.BUILTIN if shipped else SourceKind.PATH, str(root.resolve()))
    for sub in sorted(root.iterdir()):
        if not sub.is_dir() or sub.name.startswith(("_", ".")):
            continue
        if (sub / "module.toml").exists() and first(sub.name, sub, source):
            found[sub.name] = parse_module(sub, source=source)


def _load_installed(found: dict[str, Module], first: _First) -> None:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(eps, key=lambda e: (e.name, _dist(e))):
        dist = _dist(ep)
        where = (
            f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP}, "
            f"from {dist or 'an unknown distribution'})"
        )
        if not MODULE_NAME.fullmatch(ep.name):
            raise ModuleError(
                f"{where}: the name must be the module's name: lower-case letters, digits and _"
            )
        path = _package_dir(where, ep.value)
        source = ModuleSource(SourceKind.ENTRY_POINT, ep.value, dist)
        if first(ep.name, path, source):
            found[ep.name] = parse_module(path, name=ep.name, source=source)


def _dist(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else ""


def _package_dir(where: str, dotted: str) -> Path:
    """The folder of the package ``dotted``, found the way ``import`` would find it
    but without running any of it (a parent package's ``__init__`` included): the
    top-level package through the import system's finders (which execute
    nothing), then each sub-package as a folder inside it."""
    parts = dotted.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ModuleError(
            f"{where}: the value must name a package (a folder holding module.toml), "
            f"e.g. mymod = \"mypackage.gpuwarden_module\"; no ':' or attribute"
        )
    try:
        spec = importlib.util.find_spec(parts[0])
    except Exception as exc:  # a finder's own failure: say it, never a traceback
        raise ModuleError(f"{where}: package {parts[0]!r} cannot be found: {exc}") from None
    if spec is None:
        raise ModuleError(
            f"{where}: package {dotted!r} is not installed here; reinstall the "
            f"distribution, or uninstall it"
        )
    locations = [Path(p) for p in (spec.submodule_search_locations or ())]
    if not locations:
        raise ModuleError(
            f"{where}: {parts[0]!r} is a module, not a package: name the folder that holds "
            f"module.toml"
        )
    for part in parts[1:]:
        locations = [loc / part for loc in locations if (loc / part).is_dir()]
        if not locations:
            raise ModuleError(
                f"{where}: package {dotted!r} is not installed here (no folder {part!r}); "
                f"reinstall the distribution, or uninstall it"
            )
    for folder in locations:
        if (folder / "module.toml").is_file():
            return folder
    raise ModuleError(f"{where}: {locations[0]} has no module.toml")
