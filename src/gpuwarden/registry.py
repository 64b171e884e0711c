"""The module registry: reads every ``modules/<name>/module.toml`` at start.

The broker reads a module's metadata and never imports its code: a job runs the
type's ``command`` as a process under the contract in ``docs/MODULE_GUIDE.md``.
Errors name the file and the key.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import GIB, JobType, Lane, LaunchMode, ParamSpec, ParamType
from gpuwarden.core.params import value_fits
from gpuwarden.errors import ModuleError, ValidationError

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _ParamToml(_Strict):
    type: Literal["string", "integer", "number", "boolean", "input"]
    required: bool = False
    default: str | int | float | bool | None = None
    description: str = ""
    choices: list[str | int | float | bool] = Field(default_factory=list)


class _TypeToml(_Strict):
    lane: Literal["vram", "cpu"]
    launch: Literal["host", "container", "serve"] = "host"
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


class _ModuleMeta(_Strict):
    name: str
    description: str = ""
    version: str = "0"


class _ModuleToml(_Strict):
    module: _ModuleMeta
    types: Annotated[dict[str, _TypeToml], Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: Path
    description: str
    fingerprint: str  # sha256 over src/: names and contents
    types: tuple[JobType, ...]


def parse_module(path: Path) -> Module:
    """Parse and validate ``path/module.toml``. Raise :class:`ModuleError` naming the key."""
    toml_path = path / "module.toml"
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
        meta = _ModuleToml.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"key {'.'.join(str(p) for p in e['loc'])!r}: {e['msg']}" for e in exc.errors()
        )
        raise ModuleError(f"{toml_path}: {problems}") from None
    if meta.module.name != path.name:
        raise ModuleError(
            f"{toml_path}: key 'module.name' is {meta.module.name!r} but the folder is "
            f"{path.name!r}; they must match"
        )
    if not _NAME.fullmatch(meta.module.name):
        raise ModuleError(
            f"{toml_path}: key 'module.name' must be lower-case letters, digits and _ "
            f"(got {meta.module.name!r})"
        )
    types: list[JobType] = []
    for tname, t in meta.types.items():
        where = f"{toml_path}: [types.{tname}]"
        if not _NAME.fullmatch(tname):
            raise ModuleError(f"{where}: a type name must be lower-case letters, digits and _")
        if t.lane == "vram" and t.vram_gib <= 0:
            raise ModuleError(f"{where}: key 'vram_gib' must be > 0 on the vram lane")
        if t.lane == "cpu" and t.vram_gib > 0:
            raise ModuleError(
                f"{where}: key 'vram_gib' must be 0 on the cpu lane (got {t.vram_gib})"
            )
        if t.coresident and t.lane != "vram":
            raise ModuleError(f"{where}: key 'coresident' only makes sense on the vram lane")
        serve_only = [
            k
            for k in ("keep_warm", "idle_grace_s", "load_timeout_s", "expected_device_gib")
            if k in t.model_fields_set
        ]
        if serve_only and t.launch != "serve":
            raise ModuleError(
                f'{where}: key {serve_only[0]!r} applies only to launch = "serve" types'
            )
        if t.launch == "serve" and t.lane != "vram":
            raise ModuleError(f'{where}: a serve type holds a model on a GPU: use lane = "vram"')
        params = tuple(_param(where, pname, p) for pname, p in t.params.items())
        types.append(
            JobType(
                name=f"{meta.module.name}.{tname}",
                module=meta.module.name,
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
                expected_device_bytes=(
                    int(t.expected_device_gib * GIB) if t.expected_device_gib else None
                ),
            )
        )
    return Module(
        name=meta.module.name,
        path=path.resolve(),
        description=meta.module.description,
        fingerprint=fingerprint(path / "src"),
        types=tuple(types),
    )


def _param(where: str, name: str, p: _ParamToml) -> ParamSpec:
    if not _NAME.fullmatch(name):
        raise ModuleError(f"{where}: parameter name {name!r} must be lower-case letters, digits, _")
    spec = ParamSpec(
        name=name,
        type=ParamType(p.type),
        required=p.required,
        default=p.default,
        description=p.description,
        choices=tuple(p.choices),
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


class Registry:
    """Every job type of every module found on the module paths, and the node's
    launch rules: which of them may run here (checked at submission)."""

    def __init__(self, modules: list[Module], rules: LaunchRules | None = None) -> None:
        self.modules = {m.name: m for m in modules}
        self.types = {t.name: t for m in modules for t in m.types}
        self.rules = rules or LaunchRules()

    @classmethod
    def load(cls, paths: list[Path], rules: LaunchRules | None = None) -> Registry:
        """Load every module under ``paths``. Folders starting with ``_`` or ``.``
        (``_TEMPLATE``) are skipped. The first path that has a module wins."""
        modules: dict[str, Module] = {}
        for root in paths:
            if not root.is_dir():
                raise ModuleError(
                    f"module path {root} is not a directory (config key module_paths)"
                )
            for sub in sorted(root.iterdir()):
                if not sub.is_dir() or sub.name.startswith(("_", ".")) or sub.name in modules:
                    continue
                if not (sub / "module.toml").exists():
                    continue
                modules[sub.name] = parse_module(sub)
        return cls(list(modules.values()), rules)

    def get(self, name: str) -> JobType:
        try:
            return self.types[name]
        except KeyError:
            known = ", ".join(sorted(self.types)) or "none (check module_paths)"
            close = difflib.get_close_matches(name, list(self.types), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValidationError(
                f"unknown job type {name!r}{hint}; known types: {known}"
            ) from None

    def module_of(self, jobtype: JobType) -> Module:
        return self.modules[jobtype.module]

    def argv(self, jobtype: JobType, python: str | None = None) -> tuple[str, ...]:
        """The command with ``{python}`` replaced by ``python`` (default: this
        interpreter; a sandbox image has its own)."""
        python = python or sys.executable
        return tuple(python if a == "{python}" else a for a in jobtype.command)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "type": t.name,
                "lane": t.lane.value,
                "launch": t.launch.value,
                "vram_bytes": t.vram_bytes,
                "runs_here": self.rules.refusal(t) is None,
            }
            for t in sorted(self.types.values(), key=lambda t: t.name)
        ]
