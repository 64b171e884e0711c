"""The bundle format: its names and limits, the rule every path in a bundle meets,
and the strict reading of a bundle's ``manifest.json``.

A bundle holds ``manifest.json`` and an ``inputs/`` folder::

    manifest.json   {"version": 1, "jobs": [{"id": ..., "type": ..., ...}]}
    inputs/a.txt
    inputs/sub/b.bin

A result bundle holds, per job, ``<job_id>/result.json`` and the job's files
under ``<job_id>/outputs/``. Reading a bundle is :mod:`gpuwarden.intake.bundle`;
writing one is :mod:`gpuwarden.intake.bundlewrite`.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.core import command
from gpuwarden.core.command import CommandSpec
from gpuwarden.core.dependencies import DependencyError, parse_all
from gpuwarden.core.launchrules import widening_refusal
from gpuwarden.core.model import GIB, MIB, JobSpec, check_gpus, format_bytes
from gpuwarden.core.placement import check_constraints
from gpuwarden.core.profile import check_est_s
from gpuwarden.core.ramadmit import RAM_KEYS, RamNeed, check_ram_gib
from gpuwarden.core.service import check_service_name, check_share
from gpuwarden.core.sources import JobSource, check_source, split_type
from gpuwarden.errors import BundleError

__all__ = [
    "BundleLimits",
    "bundle_name",
    "is_temp_name",
    "manifest_doc",
    "parse_manifest",
    "path_problem",
    "show",
]

MANIFEST = "manifest.json"
INPUTS = "inputs"
RESULT_JSON = "result.json"
OUTPUTS = "outputs"
MANIFEST_VERSION = 1


JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
JOB_ID_RULE = (
    "1 to 128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit"
)
_TYPE_RE = re.compile(r"[^.\s]+\.[^.\s]+")
_DRIVE_RE = re.compile(r"[A-Za-z]:")


_TOP_KEYS = ("version", "jobs")
_COMMAND_KEYS = ("command", "name", "env", "share_gpu", "preempt", "timeout_s")
#: what a host command has and a bundle's never does
_HOST_COMMAND_KEYS = ("uid", "gid", "groups", "cwd", "user")
_JOB_KEYS = (
    "id",
    "type",
    "params",
    "inputs",
    "outputs",
    "priority",
    "vram_gib",
    "constraints",
    "after",
    "est_s",
    "gpus",
    *RAM_KEYS,
    "service",
    "share",
    "source",
    # a command job (SPEC.md, "Command jobs over HTTP, bundles and agents"): command
    # instead of type, with its own options
    *_COMMAND_KEYS,
)
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_VRAM_GIB = 2**20  # 1 PiB: anything above is a typo, and keeps vram_bytes in int64


CHUNK = 1 * MIB
MAX_NAME_BYTES = 1024  # a whole entry name
_MAX_COMPONENT_BYTES = 255  # one path component (NAME_MAX on Linux)


FILE_MODE = 0o644


@dataclass(frozen=True)
class BundleLimits:
    """What an incoming bundle may hold; anything bigger is refused."""

    max_zip_bytes: int = 1 * GIB
    max_entries: int = 10_000
    max_unpacked_bytes: int = 4 * GIB
    max_jobs: int = 1000
    max_manifest_bytes: int = 1 * MIB


def is_temp_name(name: str) -> bool:
    """True for a file still being written: a name starting with ``.`` or ending
    in ``.tmp`` or ``.part``. Such files are never picked up from an inbox."""
    return name.startswith(".") or name.endswith((".tmp", ".part"))


def bundle_name(first_job_id: str, now: float) -> str:
    """A fresh bundle file name: ``<first-job-id>-<UTC timestamp>-<6 random hex>.zip``,
    for example ``hello-1-20261129T074212Z-3fa9c1.zip``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"{first_job_id}-{stamp}-{secrets.token_hex(3)}.zip"


def path_problem(name: str) -> str | None:
    """Why ``name`` is not a safe relative POSIX path, or None when it is.

    A trailing ``/`` (a directory entry) is allowed; callers strip it first."""
    if not name:
        return "the name is empty"
    if "\x00" in name:
        return "the name contains a NUL byte"
    if name.startswith(("/", "\\")) or _DRIVE_RE.match(name):
        return "the name is an absolute path"
    if "\\" in name:
        return "the name contains a backslash (zip names use '/')"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        return f"the name is longer than {MAX_NAME_BYTES} bytes"
    for part in name.split("/"):
        if part == "..":
            return "the name has a '..' component"
        if part in ("", "."):
            return "the name has an empty or '.' component"
        if len(part.encode("utf-8", "surrogateescape")) > _MAX_COMPONENT_BYTES:
            return f"a component of the name is longer than {_MAX_COMPONENT_BYTES} bytes"
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def show(value: Any, limit: int = 60) -> str:
    """A value as JSON text, shortened for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(f"duplicate key {show(key)} in an object")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _check_keys(obj: dict[str, Any], allowed: Sequence[str], at: str) -> None:
    for key in obj:
        if key not in allowed:
            raise BundleError(f"{at}unknown key {show(key)} (allowed: {', '.join(allowed)})")


def _paths(value: Any, where: str, label: str) -> tuple[str, ...]:
    at = f"{where}: {label}"
    if not isinstance(value, list):
        raise BundleError(f"{at} must be an array of paths, got {_json_type(value)}")
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BundleError(f"{at}[{i}] must be a string, got {show(item)}")
        problem = path_problem(item)
        if problem is not None:
            raise BundleError(f"{at}[{i}] {show(item)} is not a relative path: {problem}")
        if item in seen:
            raise BundleError(f"{at}[{i}] {show(item)} repeats {label}[{seen[item]}]")
        seen[item] = i
    return tuple(value)


def _job(raw: Any, i: int, where: str) -> JobSpec:
    at = f"{where}: jobs[{i}]"
    if not isinstance(raw, dict):
        raise BundleError(f"{at} must be an object, got {_json_type(raw)}")
    for key, value in raw.items():
        if key == "env" and "command" in raw:
            continue  # a command's own environment: checked as one (core/command.py)
        if isinstance(key, str) and (why := widening_refusal(key, value)) is not None:
            raise BundleError(f"{at}: {why}")
    _check_job_keys(raw, at)

    job_id = raw["id"]
    if not isinstance(job_id, str):
        raise BundleError(f"{at}.id must be a string, got {show(job_id)}")
    if not JOB_ID_RE.fullmatch(job_id):
        raise BundleError(f"{at}.id {show(job_id)} is not a valid job id ({JOB_ID_RULE})")

    jtype, cmd = _command(raw, at) if "command" in raw else (raw["type"], None)
    if not isinstance(jtype, str):
        raise BundleError(f"{at}.type must be a string, got {show(jtype)}")
    if cmd is None and not _TYPE_RE.fullmatch(jtype):
        raise BundleError(f"{at}.type must look like 'module.type', got {show(jtype)}")

    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise BundleError(f"{at}.params must be an object, got {_json_type(params)}")
    for key in params:
        if not isinstance(key, str):  # pragma: no cover - JSON keys are always strings
            raise BundleError(f"{at}.params has a key that is not a string: {key!r}")

    inputs = _paths(raw.get("inputs", []), where, f"jobs[{i}].inputs")
    outputs = _paths(raw.get("outputs", []), where, f"jobs[{i}].outputs")

    priority = raw.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise BundleError(f"{at}.priority must be an integer, got {show(priority)}")
    if not _INT64_MIN <= priority <= _INT64_MAX:
        raise BundleError(f"{at}.priority is out of range (a 64-bit integer), got {priority}")

    vram_bytes: int | None = None
    if "vram_gib" in raw:
        vram = raw["vram_gib"]
        if not isinstance(vram, int | float) or isinstance(vram, bool):
            raise BundleError(f"{at}.vram_gib must be a number, got {show(vram)}")
        if not math.isfinite(vram) or vram <= 0:
            raise BundleError(f"{at}.vram_gib must be greater than 0, got {show(vram)}")
        if vram > _MAX_VRAM_GIB:
            raise BundleError(f"{at}.vram_gib must be at most {_MAX_VRAM_GIB}, got {show(vram)}")
        vram_bytes = math.ceil(vram * GIB)

    constraints, est_s, gpus = _scheduling(raw, at)

    return JobSpec(
        id=job_id,
        type=jtype,
        params=dict(params),
        inputs=inputs,
        outputs=outputs,
        priority=priority,
        vram_bytes=vram_bytes,
        constraints=constraints,
        after=_after(raw.get("after", []), at),
        est_s=est_s,
        gpus=gpus,
        ram=_ram(raw, at),
        service=_service(raw, at),
        share=_share(raw, at),
        source=_source(raw, at),
        command=cmd,
    )


def _check_job_keys(raw: dict[str, Any], at: str) -> None:
    """A job's keys: the known ones, ``id``, and ``type`` or ``command`` (never the
    keys of a host command)."""
    if given := [k for k in _HOST_COMMAND_KEYS if k in raw]:
        raise BundleError(
            f"{at}: {', '.join(given)}: a bundle's command runs sandboxed, in its output "
            "folder; a host command (as a user, in their folder) comes only through the "
            "node's local socket (`gpuwarden run -- CMD` on the host)"
        )
    _check_keys(raw, _JOB_KEYS, f"{at}: ")
    if "command" in raw and "type" in raw:
        raise BundleError(f"{at}: give a type or a command, not both")
    for key in ("id", "type"):
        if key not in raw and not (key == "type" and "command" in raw):
            raise BundleError(f"{at}: missing required key {show(key)}")
    if "command" not in raw and (extra := [k for k in _COMMAND_KEYS if k in raw]):
        raise BundleError(f"{at}: {', '.join(extra)} are for a command job (command: [...])")


def _command(raw: dict[str, Any], at: str) -> tuple[str, CommandSpec]:
    """A command job's type (``command:NAME[...,sandbox]``) and command: it runs
    sandboxed, in its output folder, as the sandbox's user."""
    preempt = raw.get("preempt")
    timeout = raw.get("timeout_s")
    try:
        argv, env, _cwd = command.check_command(raw["command"], raw.get("env"), "", sandboxed=True)
        name = raw.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name must be a string, got {show(name)}")
        if preempt is not None and preempt not in command.SIGNALS:
            raise ValueError(f"preempt is one of {', '.join(command.SIGNALS)}, got {show(preempt)}")
        if timeout is not None and (
            not isinstance(timeout, int | float) or isinstance(timeout, bool)
        ):
            raise ValueError(f"timeout_s must be a number of seconds, got {show(timeout)}")
        share = raw.get("share_gpu", False)
        if not isinstance(share, bool):
            raise ValueError(f"share_gpu must be true or false, got {show(share)}")
        options = command.CommandOptions(share, preempt, timeout, sandbox=True)
        type_name = command.type_name(name or command.default_name(argv), options)
        command.parse_type(type_name)  # the timeout's range
    except ValueError as exc:
        raise BundleError(f"{at}: {exc}") from None
    return type_name, CommandSpec(argv, "", env)


def _service(raw: dict[str, Any], at: str) -> str | None:
    """A service job's ``service`` (its name in URLs), checked."""
    if "service" not in raw:
        return None
    try:
        return check_service_name(raw["service"])
    except ValueError as exc:
        raise BundleError(f"{at}.{exc}") from None


def _source(raw: dict[str, Any], at: str) -> JobSource | None:
    """A job's ``source = {repo, commit}`` (SPEC.md, "Jobs from a pinned commit"),
    checked by the rules of its form; the node checks its ``[sources] allow``."""
    if "source" not in raw:
        return None
    try:
        return check_source(raw["source"], None)
    except ValueError as exc:
        raise BundleError(f"{at}.{exc}") from None


def _share(raw: dict[str, Any], at: str) -> tuple[str, ...]:
    """A service job's ``share`` (token ids or role names), checked."""
    try:
        return check_share(raw.get("share", []))
    except ValueError as exc:
        raise BundleError(f"{at}.{exc}") from None


def _ram(raw: dict[str, Any], at: str) -> RamNeed:
    """A job's ``ram_gib``, ``ram_floor_gib`` and ``ram_start_min_gib`` (each
    optional), in bytes."""
    values = []
    for key in RAM_KEYS:
        try:
            values.append(check_ram_gib(raw[key], key) if key in raw else 0)
        except ValueError as exc:
            raise BundleError(f"{at}.{exc}") from None
    return RamNeed(*values)


def _scheduling(raw: dict[str, Any], at: str) -> tuple[dict[str, Any], float | None, int | None]:
    """A job's ``constraints``, ``est_s`` and ``gpus`` (each optional), checked."""
    constraints: dict[str, Any] = {}
    if "constraints" in raw:
        try:
            constraints = check_constraints(raw["constraints"])
        except ValueError as exc:
            raise BundleError(f"{at}.constraints: {exc}") from None
    est_s: float | None = None
    if "est_s" in raw:
        try:
            est_s = check_est_s(raw["est_s"])
        except ValueError as exc:
            raise BundleError(f"{at}.{exc}") from None
    gpus: int | None = None
    if "gpus" in raw:
        try:
            gpus = check_gpus(raw["gpus"], f"{at}.gpus")
        except ValueError as exc:
            raise BundleError(str(exc)) from None
    return constraints, est_s, gpus


def _after(value: Any, at: str) -> tuple[str, ...]:
    """A job's ``after``: an array of ``KIND:ID`` strings (SPEC.md section 4)."""
    if not isinstance(value, list):
        raise BundleError(f"{at}.after must be an array of strings, got {_json_type(value)}")
    try:
        return tuple(str(d) for d in parse_all(value))
    except DependencyError as exc:
        raise BundleError(f"{at}.after: {exc}") from None


def parse_manifest(
    data: bytes, *, where: str = MANIFEST, limits: BundleLimits | None = None
) -> tuple[JobSpec, ...]:
    """Parse and check a bundle's ``manifest.json``; return its jobs in order.

    Strict: the version must be 1, unknown keys at any level are errors, job ids
    must be valid and unique. Parameter values are not checked here (the module
    registry does that). Every problem raises :class:`BundleError` that names
    ``where`` and the place in the manifest, for example
    ``manifest.json: jobs[2].priority must be an integer, got "high"``.
    ``limits`` bounds the manifest's size and job count (defaults: BundleLimits()).
    """
    limits = limits or BundleLimits()
    if len(data) > limits.max_manifest_bytes:
        raise BundleError(
            f"{where}: is {format_bytes(len(data))}, more than the limit of "
            f"{format_bytes(limits.max_manifest_bytes)}"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BundleError(
            f"{where}: is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except _DuplicateKeyError as exc:
        raise BundleError(f"{where}: {exc}") from None
    except RecursionError:
        raise BundleError(f"{where}: is nested too deeply") from None
    except ValueError as exc:
        raise BundleError(f"{where}: is not valid JSON: {exc}") from None

    if not isinstance(doc, dict):
        raise BundleError(f"{where}: must be a JSON object, got {_json_type(doc)}")
    _check_keys(doc, _TOP_KEYS, f"{where}: ")
    if "version" not in doc:
        raise BundleError(f'{where}: missing required key "version" (it must be 1)')
    version = doc["version"]
    if type(version) is not int or version != MANIFEST_VERSION:
        raise BundleError(f"{where}: version must be {MANIFEST_VERSION}, got {show(version)}")
    if "jobs" not in doc:
        raise BundleError(f'{where}: missing required key "jobs"')
    raw_jobs = doc["jobs"]
    if not isinstance(raw_jobs, list):
        raise BundleError(f"{where}: jobs must be an array, got {_json_type(raw_jobs)}")
    if not raw_jobs:
        raise BundleError(f"{where}: jobs is empty; a bundle holds at least one job")
    if len(raw_jobs) > limits.max_jobs:
        raise BundleError(
            f"{where}: has {len(raw_jobs)} jobs, more than the limit of {limits.max_jobs}"
        )

    jobs: list[JobSpec] = []
    first_seen: dict[str, int] = {}
    for i, raw in enumerate(raw_jobs):
        job = _job(raw, i, where)
        if job.id in first_seen:
            raise BundleError(
                f"{where}: jobs[{i}].id {show(job.id)} repeats jobs[{first_seen[job.id]}].id"
            )
        first_seen[job.id] = i
        jobs.append(job)
    return tuple(jobs)


def manifest_doc(jobs: Sequence[JobSpec]) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for job in jobs:
        entry: dict[str, Any] = {
            "id": job.id,
            "type": job.type,
            "params": dict(job.params),
            "inputs": list(job.inputs),
            "outputs": list(job.outputs),
            "priority": job.priority,
        }
        if job.vram_bytes is not None:
            gib = job.vram_bytes / GIB  # exact: GIB is a power of two
            entry["vram_gib"] = int(gib) if gib.is_integer() else gib
        if job.constraints:
            entry["constraints"] = dict(job.constraints)
        if job.after:
            entry["after"] = list(job.after)
        if job.est_s is not None:
            entry["est_s"] = job.est_s
        if job.gpus is not None:
            entry["gpus"] = job.gpus
        entry.update(job.ram.gib_keys())
        if job.service is not None:
            entry["service"] = job.service
        if job.share:
            entry["share"] = list(job.share)
        if job.source is not None:  # the type as its module.toml names it
            entry["type"] = split_type(job.type)[0]
            entry["source"] = job.source.to_json()
        if job.command is not None:
            entry.pop("type")
            entry.update(_command_doc(job.type, job.command))
        out.append(entry)
    return {"version": MANIFEST_VERSION, "jobs": out}


def _command_doc(type_name: str, cmd: CommandSpec) -> dict[str, Any]:
    """A sandboxed command job's keys in a manifest (:func:`_command` reads them)."""
    name, options = command.parse_type(type_name)
    entry: dict[str, Any] = {"command": list(cmd.argv), "name": name}
    if cmd.env:
        entry["env"] = dict(cmd.env)
    if options.share:
        entry["share_gpu"] = True
    if options.preempt is not None:
        entry["preempt"] = options.preempt
    if options.timeout_s is not None:
        entry["timeout_s"] = options.timeout_s
    return entry
