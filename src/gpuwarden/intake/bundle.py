"""Job bundles: zip files of jobs and their inputs, and the result bundles sent back.

A bundle holds ``manifest.json`` and an ``inputs/`` folder::

    manifest.json   {"version": 1, "jobs": [{"id": ..., "type": ..., ...}]}
    inputs/a.txt
    inputs/sub/b.bin

Bundles come from clients the operator trusts, but a malformed or hostile zip
must never write outside its staging folder, fill the disk, or leave a partial
extraction behind. Everything read from a bundle is checked here; everything
refused is a :class:`~gpuwarden.errors.BundleError` that says which entry was
wrong and why.

A result bundle holds, per job, ``<job_id>/result.json`` and the job's files
under ``<job_id>/outputs/``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
import struct
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpuwarden import safefs
from gpuwarden.core.launchrules import widening_refusal
from gpuwarden.core.model import GIB, MIB, JobSpec, format_bytes
from gpuwarden.core.placement import check_constraints
from gpuwarden.errors import BundleError, GpuwardenError

__all__ = [
    "BundleLimits",
    "ExtractionCancelled",
    "bundle_name",
    "extract_bundle",
    "extract_outputs",
    "is_temp_name",
    "parse_manifest",
    "read_result_bundle",
    "write_bundle",
    "write_result_bundle",
]

MANIFEST = "manifest.json"
INPUTS = "inputs"
RESULT_JSON = "result.json"
OUTPUTS = "outputs"
MANIFEST_VERSION = 1

JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_JOB_ID_RULE = (
    "1 to 128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit"
)
_TYPE_RE = re.compile(r"[^.\s]+\.[^.\s]+")
_DRIVE_RE = re.compile(r"[A-Za-z]:")

_TOP_KEYS = ("version", "jobs")
_JOB_KEYS = ("id", "type", "params", "inputs", "outputs", "priority", "vram_gib", "constraints")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_VRAM_GIB = 2**20  # 1 PiB: anything above is a typo, and keeps vram_bytes in int64

_CHUNK = 1 * MIB
_MAX_NAME_BYTES = 1024  # a whole entry name
_MAX_COMPONENT_BYTES = 255  # one path component (NAME_MAX on Linux)
_MAX_RESULT_JSON_BYTES = 64 * MIB
_EOCD_SIZE = 22
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_EOCD_SIZE = 56
_CD_RECORD_SIZE = 46
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD_SIG = b"PK\x06\x06"
_CD_SIG = b"PK\x01\x02"
# a central directory record: 46 bytes, the name (we allow 1 KiB), and room for extras
_MAX_CD_BYTES_PER_ENTRY = 46 + _MAX_NAME_BYTES + 1024
_ENCRYPTED_FLAGS = 0x1 | 0x40  # traditional / strong encryption
_SUPPORTED_COMPRESSION = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_FILE_MODE = 0o644
_DIR_MODE = 0o755
# errors when creating an entry on disk that the bundle's content causes (not the host)
_ENTRY_ERRNOS = {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG}
# what zipfile and its decompressors raise on a damaged archive
_ZIP_READ_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    struct.error,
    ValueError,
    NotImplementedError,
    RuntimeError,
)


@dataclass(frozen=True)
class BundleLimits:
    """What an incoming bundle may hold; anything bigger is refused."""

    max_zip_bytes: int = 1 * GIB
    max_entries: int = 10_000
    max_unpacked_bytes: int = 4 * GIB
    max_jobs: int = 1000
    max_manifest_bytes: int = 1 * MIB


# --------------------------------------------------------------------------- names


def is_temp_name(name: str) -> bool:
    """True for a file still being written: a name starting with ``.`` or ending
    in ``.tmp`` or ``.part``. Such files are never picked up from an inbox."""
    return name.startswith(".") or name.endswith((".tmp", ".part"))


def bundle_name(first_job_id: str, now: float) -> str:
    """A fresh bundle file name: ``<first-job-id>-<UTC timestamp>-<6 random hex>.zip``,
    for example ``hello-1-20261129T074212Z-3fa9c1.zip``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"{first_job_id}-{stamp}-{secrets.token_hex(3)}.zip"


def _path_problem(name: str) -> str | None:
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
    if len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES:
        return f"the name is longer than {_MAX_NAME_BYTES} bytes"
    for part in name.split("/"):
        if part == "..":
            return "the name has a '..' component"
        if part in ("", "."):
            return "the name has an empty or '.' component"
        if len(part.encode("utf-8", "surrogateescape")) > _MAX_COMPONENT_BYTES:
            return f"a component of the name is longer than {_MAX_COMPONENT_BYTES} bytes"
    return None


# ------------------------------------------------------------------------ manifest


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


def _show(value: Any, limit: int = 60) -> str:
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
            raise _DuplicateKeyError(f"duplicate key {_show(key)} in an object")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _check_keys(obj: dict[str, Any], allowed: Sequence[str], at: str) -> None:
    for key in obj:
        if key not in allowed:
            raise BundleError(f"{at}unknown key {_show(key)} (allowed: {', '.join(allowed)})")


def _paths(value: Any, where: str, label: str) -> tuple[str, ...]:
    at = f"{where}: {label}"
    if not isinstance(value, list):
        raise BundleError(f"{at} must be an array of paths, got {_json_type(value)}")
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BundleError(f"{at}[{i}] must be a string, got {_show(item)}")
        problem = _path_problem(item)
        if problem is not None:
            raise BundleError(f"{at}[{i}] {_show(item)} is not a relative path: {problem}")
        if item in seen:
            raise BundleError(f"{at}[{i}] {_show(item)} repeats {label}[{seen[item]}]")
        seen[item] = i
    return tuple(value)


def _job(raw: Any, i: int, where: str) -> JobSpec:
    at = f"{where}: jobs[{i}]"
    if not isinstance(raw, dict):
        raise BundleError(f"{at} must be an object, got {_json_type(raw)}")
    for key, value in raw.items():
        if isinstance(key, str) and (why := widening_refusal(key, value)) is not None:
            raise BundleError(f"{at}: {why}")
    _check_keys(raw, _JOB_KEYS, f"{at}: ")
    for key in ("id", "type"):
        if key not in raw:
            raise BundleError(f"{at}: missing required key {_show(key)}")

    job_id = raw["id"]
    if not isinstance(job_id, str):
        raise BundleError(f"{at}.id must be a string, got {_show(job_id)}")
    if not JOB_ID_RE.fullmatch(job_id):
        raise BundleError(f"{at}.id {_show(job_id)} is not a valid job id ({_JOB_ID_RULE})")

    jtype = raw["type"]
    if not isinstance(jtype, str):
        raise BundleError(f"{at}.type must be a string, got {_show(jtype)}")
    if not _TYPE_RE.fullmatch(jtype):
        raise BundleError(f"{at}.type must look like 'module.type', got {_show(jtype)}")

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
        raise BundleError(f"{at}.priority must be an integer, got {_show(priority)}")
    if not _INT64_MIN <= priority <= _INT64_MAX:
        raise BundleError(f"{at}.priority is out of range (a 64-bit integer), got {priority}")

    vram_bytes: int | None = None
    if "vram_gib" in raw:
        vram = raw["vram_gib"]
        if not isinstance(vram, int | float) or isinstance(vram, bool):
            raise BundleError(f"{at}.vram_gib must be a number, got {_show(vram)}")
        if not math.isfinite(vram) or vram <= 0:
            raise BundleError(f"{at}.vram_gib must be greater than 0, got {_show(vram)}")
        if vram > _MAX_VRAM_GIB:
            raise BundleError(f"{at}.vram_gib must be at most {_MAX_VRAM_GIB}, got {_show(vram)}")
        vram_bytes = math.ceil(vram * GIB)

    constraints: dict[str, Any] = {}
    if "constraints" in raw:
        try:
            constraints = check_constraints(raw["constraints"])
        except ValueError as exc:
            raise BundleError(f"{at}.constraints: {exc}") from None

    return JobSpec(
        id=job_id,
        type=jtype,
        params=dict(params),
        inputs=inputs,
        outputs=outputs,
        priority=priority,
        vram_bytes=vram_bytes,
        constraints=constraints,
    )


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
        raise BundleError(f"{where}: version must be {MANIFEST_VERSION}, got {_show(version)}")
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
                f"{where}: jobs[{i}].id {_show(job.id)} repeats jobs[{first_seen[job.id]}].id"
            )
        first_seen[job.id] = i
        jobs.append(job)
    return tuple(jobs)


def _manifest_doc(jobs: Sequence[JobSpec]) -> dict[str, Any]:
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
        out.append(entry)
    return {"version": MANIFEST_VERSION, "jobs": out}


# ------------------------------------------------------------------ reading zips


@dataclass(frozen=True)
class _Entry:
    info: zipfile.ZipInfo
    name: str  # the full name as stored, trailing '/' removed for directories
    is_dir: bool


def _check_entry(info: zipfile.ZipInfo, prefix: str) -> _Entry:
    """Header-only checks of one entry: name, type, encryption, compression."""
    raw = info.orig_filename  # zipfile cuts ``filename`` at a NUL; the original keeps it
    shown = _show(raw)

    def bad(reason: str) -> BundleError:
        return BundleError(f"{prefix}entry {shown}: {reason}")

    is_dir = raw.endswith("/")
    name = raw[:-1] if is_dir else raw
    problem = _path_problem(name)
    if problem is not None:
        raise bad(problem)
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind:
        if stat.S_ISLNK(mode):
            raise bad("symbolic links are not allowed")
        if stat.S_ISDIR(mode):
            if not is_dir:
                raise bad("a directory entry whose name does not end in '/'")
        elif stat.S_ISREG(mode):
            if is_dir:
                raise bad("a file entry whose name ends in '/'")
        else:
            raise bad(
                f"a special file (mode {mode:#o}); only regular files and directories are allowed"
            )
    if info.flag_bits & _ENCRYPTED_FLAGS:
        raise bad("encrypted entries are not supported")
    if not is_dir and info.compress_type not in _SUPPORTED_COMPRESSION:
        raise bad(
            f"compression method {info.compress_type} is not supported (use stored or deflate)"
        )
    return _Entry(info=info, name=name, is_dir=is_dir)


def _scan(zf: zipfile.ZipFile, limits: BundleLimits, prefix: str) -> list[_Entry]:
    """Check every entry's header; refuse the archive before anything is written."""
    infos = zf.infolist()
    if len(infos) > limits.max_entries:
        raise BundleError(
            f"{prefix}has {len(infos)} entries, more than the limit of {limits.max_entries}"
        )
    entries: list[_Entry] = []
    seen: set[str] = set()
    for info in infos:
        entry = _check_entry(info, prefix)
        if entry.name in seen:
            raise BundleError(f"{prefix}entry {_show(info.orig_filename)}: duplicate name")
        seen.add(entry.name)
        entries.append(entry)
    return entries


@dataclass(frozen=True)
class _Directory:
    """Where zipfile will read the central directory, and what the end record says."""

    start: int  # file offset, computed as zipfile computes it
    size: int
    stated: int  # the entry count the end record (the zip64 one when present) states


def _end_record(fileobj: IO[bytes]) -> _Directory | None:
    """Find the end record exactly as zipfile does, so that the directory checked
    here is the one zipfile will read: the 22 bytes at the very end when there is
    no comment, else the last signature in the last 64 KiB; a zip64 end record
    right before its locator (zipfile ignores the locator's offset) replaces the
    counts and sizes. None where zipfile will refuse the file itself."""
    size = fileobj.seek(0, os.SEEK_END)
    if size < _EOCD_SIZE:
        return None
    fileobj.seek(size - _EOCD_SIZE)
    rec = fileobj.read(_EOCD_SIZE)
    pos = size - _EOCD_SIZE
    if not (rec[:4] == _EOCD_SIG and rec[-2:] == b"\0\0"):
        first = max(size - (1 << 16) - _EOCD_SIZE, 0)
        fileobj.seek(first)
        tail = fileobj.read()
        found = tail.rfind(_EOCD_SIG)
        if found < 0:
            return None
        rec = tail[found : found + _EOCD_SIZE]
        if len(rec) != _EOCD_SIZE:
            return None
        pos = first + found
    _, _, on_disk, total, cd_size, cd_offset, _ = struct.unpack("<4x4H2IH", rec)
    stated = max(on_disk, total)
    concat = pos - cd_size - cd_offset
    loc = pos - _ZIP64_LOCATOR_SIZE
    if loc >= 0:
        fileobj.seek(loc)
        locator = fileobj.read(_ZIP64_LOCATOR_SIZE)
        if locator[:4] == _ZIP64_LOCATOR_SIG:
            diskno, _reloff, disks = struct.unpack("<4xIQI", locator)
            if diskno != 0 or disks > 1:
                return None  # zipfile refuses archives spanning disks
            if loc - _ZIP64_EOCD_SIZE >= 0:
                fileobj.seek(loc - _ZIP64_EOCD_SIZE)
                z64 = fileobj.read(_ZIP64_EOCD_SIZE)
                if z64[:4] == _ZIP64_EOCD_SIG:
                    z_on_disk, z_total, cd_size, cd_offset = struct.unpack_from("<4Q", z64, 24)
                    stated = max(z_on_disk, z_total)
                    concat = pos - cd_size - cd_offset - _ZIP64_EOCD_SIZE - _ZIP64_LOCATOR_SIZE
    start = cd_offset + concat
    if start < 0:
        return None
    return _Directory(start=start, size=cd_size, stated=stated)


def _count_directory(fileobj: IO[bytes], directory: _Directory) -> int | None:
    """How many records the central directory really holds, walked the way
    zipfile walks it (record by record until its stated size is used up), keeping
    nothing but the count. None when a record is damaged: zipfile then refuses
    the file at that same record, so it never reads more records than counted."""
    fileobj.seek(directory.start)
    data = fileobj.read(directory.size)
    pos = count = 0
    while pos < directory.size:
        head = data[pos : pos + _CD_RECORD_SIZE]
        if len(head) != _CD_RECORD_SIZE or head[:4] != _CD_SIG:
            return None
        n, m, k = struct.unpack_from("<3H", head, 28)
        pos += _CD_RECORD_SIZE + n + m + k
        count += 1
    return count


def _check_directory(fileobj: IO[bytes], limits: BundleLimits, prefix: str) -> int | None:
    """Refuse a zip whose central directory passes the entry limit, or does not
    hold what its end record states, before zipfile builds an object per entry.
    Returns the number of entries (None: zipfile will say what is wrong)."""
    try:
        directory = _end_record(fileobj)
    except (OSError, struct.error):
        directory = None
    if directory is None:
        return None
    if directory.stated > limits.max_entries:
        raise BundleError(
            f"{prefix}has {directory.stated} entries, more than the limit of {limits.max_entries}"
        )
    if directory.size > limits.max_entries * _MAX_CD_BYTES_PER_ENTRY:
        raise BundleError(
            f"{prefix}its central directory is {format_bytes(directory.size)}, too big for "
            f"at most {limits.max_entries} entries"
        )
    count = _count_directory(fileobj, directory)
    if count is None:
        return None
    if count > limits.max_entries:
        raise BundleError(
            f"{prefix}has {count} entries, more than the limit of {limits.max_entries}"
        )
    if count != directory.stated:
        raise BundleError(
            f"{prefix}its end record states {directory.stated} entries, but its central "
            f"directory holds {count}: a damaged or forged zip"
        )
    return count


def _open_zip(fileobj: IO[bytes], limits: BundleLimits, prefix: str) -> zipfile.ZipFile:
    """Open a zip, refusing one whose central directory is too big to even read:
    zipfile builds an object per entry before anyone can count them. The real
    directory is walked (zip64 included), so a forged end record hides nothing."""
    count = _check_directory(fileobj, limits, prefix)
    fileobj.seek(0)
    try:
        zf = zipfile.ZipFile(fileobj)
    except (*_ZIP_READ_ERRORS, OSError) as exc:
        raise BundleError(f"{prefix}not a zip file, or a damaged one ({exc})") from None
    if count is not None and len(zf.infolist()) != count:  # pragma: no cover - zipfile's own walk
        zf.close()
        raise BundleError(f"{prefix}its central directory cannot be read consistently")
    return zf


class _Budget:
    """Counts the bytes actually decompressed, against a limit (headers are not trusted)."""

    def __init__(self, limit: int, what: str) -> None:
        self.left = limit
        self.limit = limit
        self.what = what


class ExtractionCancelled(GpuwardenError):
    """The caller asked an extraction to stop (the broker is shutting down)."""


def _check_declared(entries: Sequence[_Entry], limits: BundleLimits, prefix: str) -> None:
    """Refuse, before anything is extracted, entries whose declared sizes (zip64
    included) add up past the unpacked limit."""
    declared = sum(e.info.file_size for e in entries if not e.is_dir)
    if declared > limits.max_unpacked_bytes:
        raise BundleError(
            f"{prefix}its entries declare {format_bytes(declared)} unpacked, more than the "
            f"limit of {format_bytes(limits.max_unpacked_bytes)}; nothing was extracted"
        )


def _copy_member(
    zf: zipfile.ZipFile,
    entry: _Entry,
    sink: Callable[[bytes], object],
    budget: _Budget,
    prefix: str,
    *,
    cancelled: Callable[[], bool] | None = None,
) -> int:
    """Stream one entry into ``sink`` in chunks, stopping as soon as ``budget`` is passed.

    zipfile checks the CRC when the entry's data ends; a mismatch, a damaged
    stream or a truncated file is a BundleError naming the entry, and so is an
    entry whose data is not exactly as long as its header declares (the bytes
    are counted, the header is not trusted). ``cancelled()`` is asked between
    chunks; when it says yes, :class:`ExtractionCancelled` is raised."""
    shown = _show(entry.info.orig_filename)
    total = 0
    try:
        src = zf.open(entry.info)
    except _ZIP_READ_ERRORS as exc:
        raise BundleError(f"{prefix}entry {shown}: cannot be read ({exc})") from None
    with src:
        while True:
            if cancelled is not None and cancelled():
                raise ExtractionCancelled(f"{prefix}extraction stopped")
            try:
                chunk = src.read(min(_CHUNK, budget.left + 1))
            except _ZIP_READ_ERRORS as exc:
                reason = "bad CRC-32" if "CRC" in str(exc) else f"damaged data ({exc})"
                raise BundleError(f"{prefix}entry {shown}: {reason}") from None
            if not chunk:
                break
            total += len(chunk)
            budget.left -= len(chunk)
            if budget.left < 0:
                raise BundleError(
                    f"{prefix}entry {shown}: {budget.what} passes the limit of "
                    f"{format_bytes(budget.limit)} ({budget.limit} bytes)"
                )
            sink(chunk)
    if total != entry.info.file_size:
        raise BundleError(
            f"{prefix}entry {shown}: holds {total} bytes, but its header declares "
            f"{entry.info.file_size}: a damaged or forged zip"
        )
    return total


def _read_member(
    zf: zipfile.ZipFile, entry: _Entry, max_bytes: int, what: str, prefix: str
) -> bytes:
    parts: list[bytes] = []
    _copy_member(zf, entry, parts.append, _Budget(max_bytes, what), prefix)
    return b"".join(parts)


# ---------------------------------------------------------------- writing to disk


def _entry_os_error(exc: OSError, prefix: str, shown: str) -> BundleError | None:
    if exc.errno in _ENTRY_ERRNOS:
        return BundleError(
            f"{prefix}entry {shown}: cannot be created ({exc.strerror}); "
            "it clashes with another entry"
        )
    return None


def _make_dirs(root: Path, parts: Sequence[str], prefix: str, shown: str) -> Path:
    """Create ``root/parts...`` one level at a time, never through a symlink."""
    path = root
    for part in parts:
        path = path / part
        try:
            path.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise BundleError(
                    f"{prefix}entry {shown}: {str(path.relative_to(root))!r} is already "
                    "there and is not a directory (a file, or a symlink)"
                ) from None
        except OSError as exc:
            err = _entry_os_error(exc, prefix, shown)
            if err is None:
                raise
            raise err from None
    return path


def _inside(root: Path, path: Path) -> bool:
    """True when ``path``, with every symlink resolved, is ``root`` or below it."""
    real = Path(os.path.realpath(path))
    return real == root or real.is_relative_to(root)


def _open_new_file(
    root: Path, parts: Sequence[str], prefix: str, shown: str, *, exclusive: bool
) -> tuple[Path, int]:
    """Make the parents of ``root/parts`` and open the file for writing without
    following a symlink; ``exclusive`` refuses an existing file."""
    parent = _make_dirs(root, parts[:-1], prefix, shown)
    if not _inside(root, parent):
        raise BundleError(f"{prefix}entry {shown}: would be written outside {root}")
    target = parent / parts[-1]
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_EXCL if exclusive else os.O_TRUNC
    try:
        fd = os.open(target, flags, _FILE_MODE)
    except OSError as exc:
        err = _entry_os_error(exc, prefix, shown)
        if err is None:
            raise
        raise err from None
    return target, fd


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        path.rmdir()  # in case rmtree left an empty folder


def _prepare_staging(staging: Path) -> Path:
    try:
        staging.mkdir(parents=True, mode=_DIR_MODE)
    except FileExistsError:
        if staging.is_symlink() or not staging.is_dir() or any(staging.iterdir()):
            raise FileExistsError(
                errno.EEXIST, "staging folder exists and is not an empty folder", str(staging)
            ) from None
    return Path(os.path.realpath(staging))


def extract_bundle(
    zip_path: Path,
    staging: Path,
    limits: BundleLimits,
    *,
    fileobj: IO[bytes] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[JobSpec, ...]:
    """Extract the bundle at ``zip_path`` into ``staging`` and return its jobs.

    The bundle is read from ``fileobj`` when given (a regular file the caller
    opened with :func:`gpuwarden.safefs.open_file`), else ``zip_path`` is
    opened that way: a FIFO, a device, a socket, a folder or a link is refused
    and never opened. ``staging`` is created here; it must not exist yet, or be
    an empty folder (otherwise FileExistsError).

    Before anything is written: the zip's real central directory is walked and
    its entry count checked against the limit and against its end record (zip64
    included); every entry's header is checked; the sizes the entries declare
    must fit ``limits.max_unpacked_bytes``; the manifest is parsed. Then the
    entries are extracted, the bytes actually decompressed counted again, per
    entry against its declared size and in all against the limit. Inputs end up
    under ``staging/inputs``, which always exists afterwards. ``cancelled()`` is
    asked between chunks (:class:`ExtractionCancelled`).

    Any problem with the bundle raises :class:`BundleError` naming the entry and
    the reason; on any error ``staging`` is removed entirely, so a partial
    extraction never remains. Nothing is ever written outside ``staging``, and
    no symlink on disk is followed.
    """
    prefix = f"bundle {_shown_file_name(zip_path.name)}: "
    if fileobj is None:
        try:
            fd = safefs.open_file(zip_path)
        except safefs.UnsafePathError as exc:
            raise BundleError(f"{prefix}{exc.why}") from None
        with os.fdopen(fd, "rb") as f:
            return extract_bundle(zip_path, staging, limits, fileobj=f, cancelled=cancelled)
    root = _prepare_staging(staging)
    try:
        return _extract(fileobj, root, limits, prefix, cancelled)
    except BaseException:
        _remove_tree(staging)
        raise


def _shown_file_name(name: str) -> str:
    """A file name as a person reads it (bytes that are not UTF-8 as ``\\xNN``)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _extract(
    f: IO[bytes],
    root: Path,
    limits: BundleLimits,
    prefix: str,
    cancelled: Callable[[], bool] | None,
) -> tuple[JobSpec, ...]:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{prefix}is not a regular file")
    if st.st_size > limits.max_zip_bytes:
        raise BundleError(
            f"{prefix}is {format_bytes(st.st_size)}, more than the limit of "
            f"{format_bytes(limits.max_zip_bytes)}"
        )
    with _open_zip(f, limits, prefix) as zf:
        entries = _scan(zf, limits, prefix)
        for entry in entries:
            if entry.name == MANIFEST and entry.is_dir:
                raise BundleError(f"{prefix}entry {_show(MANIFEST + '/')}: must be a file")
            in_inputs = entry.name.startswith(f"{INPUTS}/") or (
                entry.is_dir and entry.name == INPUTS
            )
            if entry.name != MANIFEST and not in_inputs:
                raise BundleError(
                    f"{prefix}entry {_show(entry.info.orig_filename)}: unexpected; a "
                    f"bundle holds only {MANIFEST} and the {INPUTS}/ folder"
                )
        _check_declared(entries, limits, prefix)
        by_name = {e.name: e for e in entries}
        manifest = by_name.get(MANIFEST)
        if manifest is None:
            raise BundleError(f"{prefix}{MANIFEST} is missing")
        data = _read_member(zf, manifest, limits.max_manifest_bytes, "the manifest", prefix)
        jobs = parse_manifest(data, where=f"{prefix}{MANIFEST}", limits=limits)
        _check_inputs(jobs, by_name, root, prefix, on_disk=False)

        budget = _Budget(limits.max_unpacked_bytes, "the unpacked size")
        extracted = 0
        for entry in entries:
            _extract_entry(
                zf,
                entry,
                root,
                budget,
                prefix,
                data=data if entry is manifest else None,
                cancelled=cancelled,
            )
            extracted += 1
        if extracted != len(zf.infolist()):  # pragma: no cover - every entry was scanned
            raise BundleError(f"{prefix}its entries changed while it was extracted")
    (root / INPUTS).mkdir(mode=_DIR_MODE, exist_ok=True)
    _check_inputs(jobs, by_name, root, prefix, on_disk=True)
    return jobs


def _check_inputs(
    jobs: Sequence[JobSpec],
    by_name: Mapping[str, _Entry],
    root: Path,
    prefix: str,
    *,
    on_disk: bool,
) -> None:
    for i, job in enumerate(jobs):
        for k, name in enumerate(job.inputs):
            member = f"{INPUTS}/{name}"
            if on_disk:
                try:
                    ok = stat.S_ISREG(os.lstat(root / INPUTS / name).st_mode)
                except OSError:
                    ok = False
            else:
                entry = by_name.get(member)
                ok = entry is not None and not entry.is_dir
            if not ok:
                raise BundleError(
                    f"{prefix}{MANIFEST}: jobs[{i}].inputs[{k}] {_show(name)} is not in the "
                    f"bundle (expected a file {member})"
                )


def _extract_entry(
    zf: zipfile.ZipFile,
    entry: _Entry,
    root: Path,
    budget: _Budget,
    prefix: str,
    *,
    data: bytes | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Write one entry below ``root``; ``data`` is its content when already read."""
    shown = _show(entry.info.orig_filename)
    parts = entry.name.split("/")
    if entry.is_dir:
        path = _make_dirs(root, parts, prefix, shown)
        if not _inside(root, path):
            raise BundleError(f"{prefix}entry {shown}: would be written outside {root}")
        return
    _target, fd = _open_new_file(root, parts, prefix, shown, exclusive=True)
    with os.fdopen(fd, "wb") as out:
        if data is None:
            _copy_member(zf, entry, out.write, budget, prefix, cancelled=cancelled)
            return
        budget.left -= len(data)
        if budget.left < 0:
            raise BundleError(
                f"{prefix}entry {shown}: {budget.what} passes the limit of "
                f"{format_bytes(budget.limit)} ({budget.limit} bytes)"
            )
        out.write(data)


# ------------------------------------------------------------------ writing zips


def _zip_time(ts: float) -> tuple[int, int, int, int, int, int]:
    t = time.localtime(ts)
    if t.tm_year < 1980:
        return (1980, 1, 1, 0, 0, 0)
    if t.tm_year > 2107:
        return (2107, 12, 31, 23, 59, 58)
    return (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)


def _new_info(name: str, ts: float) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_zip_time(ts))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (stat.S_IFREG | _FILE_MODE) << 16
    info.create_system = 3  # unix, so the mode above is read as such
    return info


def _add_bytes(zf: zipfile.ZipFile, name: str, data: bytes, ts: float) -> None:
    with zf.open(_new_info(name, ts), "w") as dst:
        dst.write(data)


def _add_file(zf: zipfile.ZipFile, name: str, src: Path) -> None:
    """Add a client's own local file (``write_bundle``)."""
    with open(src, "rb") as f:  # noqa: PTH123 - need the file object for fstat
        _add_open_file(zf, name, f, str(src))


def _add_open_file(zf: zipfile.ZipFile, name: str, f: IO[bytes], shown: str) -> None:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{shown}: is not a regular file")
    info = _new_info(name, st.st_mtime)
    info.file_size = st.st_size  # lets zipfile decide whether it needs zip64
    with zf.open(info, "w") as dst:
        shutil.copyfileobj(f, dst, _CHUNK)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable; some file systems cannot, which is fine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


#: errors of ``link()`` on a file system that has no hard links
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def _publish(tmp: Path, final: Path) -> None:
    """Give the complete file ``tmp`` the name ``final`` without ever replacing
    what is there: ``link()`` fails when the name is taken (FileExistsError). On
    a file system without hard links, the name is checked and the file renamed."""
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if os.path.lexists(final):
            raise FileExistsError(
                errno.EEXIST, "a file of that name is already there", str(final)
            ) from None
        tmp.rename(final)
        return
    tmp.unlink()


def _write_zip_atomically(
    dest_dir: Path, name: str, fill: Callable[[zipfile.ZipFile], None]
) -> Path:
    """Write a zip to a fresh temporary file ``dest_dir/.gw-<random>.tmp``, fsync
    it, then give it the name ``name``. Readers never see ``name`` until the file
    is complete, and a file already called ``name`` is never replaced: that
    raises FileExistsError and leaves nothing behind. The temporary name never
    passes NAME_MAX, however long ``name`` is."""
    final = dest_dir / name
    if os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, "a file of that name is already there", str(final))
    tmp = dest_dir / f".gw-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                fill(zf)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(dest_dir)
    return final


def write_bundle(
    inbox: Path,
    jobs: Sequence[JobSpec],
    files: Mapping[str, Path] | None = None,
    *,
    now: float,
) -> Path:
    """Write a bundle of ``jobs`` into ``inbox`` and return its path (for clients).

    ``files`` maps input names (relative paths, as the jobs' ``inputs`` use
    them) to local files; each becomes ``inputs/<name>``. The bundle is written
    to ``.<name>.tmp`` in ``inbox``, fsynced, and renamed to its final name
    (see :func:`bundle_name`), so a broker never picks up a partial file.
    Raises :class:`BundleError` when the jobs would not pass
    :func:`parse_manifest`, or an input has no file.
    """
    if not jobs:
        raise BundleError("a bundle needs at least one job")
    files = dict(files or {})
    manifest = json.dumps(_manifest_doc(jobs), indent=2, ensure_ascii=False).encode() + b"\n"
    parse_manifest(manifest, where="new bundle manifest")  # never write what we would refuse
    for name in files:
        problem = _path_problem(name)
        if problem is not None:
            raise BundleError(f"input file name {_show(name)}: {problem}")
        parts = name.split("/")
        for n in range(1, len(parts)):
            if "/".join(parts[:n]) in files:
                raise BundleError(
                    f"input file name {_show(name)}: {_show('/'.join(parts[:n]))} is "
                    "also a file, so it cannot be a folder"
                )
    for job in jobs:
        for name in job.inputs:
            if name not in files:
                raise BundleError(f"job {job.id}: input {_show(name)} has no file given")

    def fill(zf: zipfile.ZipFile) -> None:
        _add_bytes(zf, MANIFEST, manifest, now)
        for name in sorted(files):
            _add_file(zf, f"{INPUTS}/{name}", Path(files[name]))

    name = bundle_name(jobs[0].id, now)
    for _ in range(10):  # a clash of the random part is unlikely; avoid it anyway
        if not (Path(inbox) / name).exists():
            break
        name = bundle_name(jobs[0].id, now)
    return _write_zip_atomically(Path(inbox), name, fill)


def _pack_outputs(zf: zipfile.ZipFile, job_id: str, outputs: Path) -> list[dict[str, str]]:
    """Add every regular file under ``outputs`` as ``<job_id>/outputs/<path>``, all
    read through :mod:`gpuwarden.safefs`: no link is followed, and a FIFO, a
    device, a socket or a link is never opened. Returns what was left out, as
    ``[{"path", "kind", "why"}]``."""
    try:
        listing = safefs.walk(outputs)
    except safefs.UnsafePathError as exc:
        return [{"path": ".", "kind": "folder", "why": exc.why}]
    refused = listing.refused_json()
    for entry in listing.files:
        member = f"{job_id}/{OUTPUTS}/{entry.path}"
        problem = _path_problem(member)
        if problem is not None:
            refused.append({"path": entry.path, "kind": "file", "why": f"not packed: {problem}"})
            continue
        try:
            fd = safefs.open_file(entry.path, under=outputs)
        except (safefs.UnsafePathError, FileNotFoundError) as exc:
            why = exc.why if isinstance(exc, safefs.UnsafePathError) else "it is gone"
            refused.append({"path": entry.path, "kind": "file", "why": f"changed: {why}"})
            continue
        with os.fdopen(fd, "rb") as f:
            _add_open_file(zf, member, f, entry.path)
    return refused


def write_result_bundle(
    dest_dir: Path, name: str, results: Sequence[tuple[dict[str, Any], Path | None]]
) -> Path:
    """Write a result bundle ``dest_dir/name`` and return its path.

    Each item of ``results`` is (result dict, outputs folder or None). The dict
    must hold the job's id under ``"id"``; it becomes ``<id>/result.json``
    (pretty JSON), and every regular file under the outputs folder becomes
    ``<id>/outputs/<relative path>``. The outputs are read through
    :mod:`gpuwarden.safefs`: links, FIFOs, sockets and devices are never opened;
    they, and names a zip cannot carry, are listed in the job's result.json under
    ``"refused_outputs"`` (``[{"path", "kind", "why"}]``). The zip is written to a
    temporary file in ``dest_dir``, fsynced, then given its name; a file already
    called ``name`` is never replaced (FileExistsError).
    """
    if "/" in name or "\0" in name or name.startswith(".") or not name:
        raise ValueError(f"result bundle name {name!r} must be a plain, non-hidden file name")
    seen: set[str] = set()
    for result, _outputs in results:
        job_id = result.get("id")
        if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"result {_show(result, 120)} has no valid job id under 'id'")
        if job_id in seen:
            raise ValueError(f"two results for job {job_id}")
        seen.add(job_id)

    def fill(zf: zipfile.ZipFile) -> None:
        now = time.time()
        for result, outputs in results:
            job_id = result["id"]
            body = dict(result)
            if outputs is not None:
                refused = _pack_outputs(zf, job_id, Path(outputs))
                if refused:
                    body["refused_outputs"] = refused
            text = json.dumps(body, indent=2, ensure_ascii=False) + "\n"
            _add_bytes(zf, f"{job_id}/{RESULT_JSON}", text.encode(), now)

    return _write_zip_atomically(Path(dest_dir), name, fill)


def _open_result_zip(path: Path, limits: BundleLimits) -> tuple[IO[bytes], zipfile.ZipFile, str]:
    prefix = f"result bundle {Path(path).name}: "
    f = open(path, "rb")  # noqa: PTH123, SIM115 - closed by the caller
    try:
        return f, _open_zip(f, limits, prefix), prefix
    except BaseException:
        f.close()
        raise


def read_result_bundle(path: Path) -> dict[str, dict[str, Any]]:
    """Read a result bundle: job id -> that job's ``result.json``.

    Raises :class:`BundleError` when the file is not a readable result bundle."""
    limits = BundleLimits()
    f, zf, prefix = _open_result_zip(path, limits)
    out: dict[str, dict[str, Any]] = {}
    with f, zf:
        for entry in _scan(zf, limits, prefix):
            parts = entry.name.split("/")
            if entry.is_dir or len(parts) != 2 or parts[1] != RESULT_JSON:
                continue
            if not JOB_ID_RE.fullmatch(parts[0]):
                raise BundleError(f"{prefix}entry {_show(entry.name)}: not a valid job id")
            data = _read_member(zf, entry, _MAX_RESULT_JSON_BYTES, "result.json", prefix)
            try:
                doc = json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise BundleError(f"{prefix}entry {_show(entry.name)}: not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise BundleError(f"{prefix}entry {_show(entry.name)}: not a JSON object")
            out[parts[0]] = doc
    return out


def extract_outputs(
    path: Path, job_id: str, dest: Path, limits: BundleLimits | None = None
) -> list[Path]:
    """Extract job ``job_id``'s output files from the result bundle at ``path``
    into ``dest`` (created if missing); return the files written, in zip order.

    The same path checks as :func:`extract_bundle` apply: nothing is written
    outside ``dest``, symlinks are neither extracted nor followed, and the bytes
    actually decompressed count against ``limits.max_unpacked_bytes``. Existing
    regular files of the same name are overwritten. On an error, the files this
    call wrote are removed again and :class:`BundleError` is raised.
    """
    if not JOB_ID_RE.fullmatch(job_id):
        raise BundleError(f"{_show(job_id)} is not a valid job id ({_JOB_ID_RULE})")
    limits = limits or BundleLimits()
    f, zf, prefix = _open_result_zip(path, limits)
    written: list[Path] = []
    want = f"{job_id}/{OUTPUTS}/"
    with f, zf:
        entries = _scan(zf, limits, prefix)
        names = {e.name for e in entries}
        if f"{job_id}/{RESULT_JSON}" not in names:
            raise BundleError(f"{prefix}has no result for job {job_id}")
        _check_declared([e for e in entries if e.name.startswith(want)], limits, prefix)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        root = Path(os.path.realpath(dest))
        budget = _Budget(limits.max_unpacked_bytes, "the unpacked size")
        try:
            for entry in entries:
                if entry.is_dir or not entry.name.startswith(want):
                    continue
                shown = _show(entry.info.orig_filename)
                parts = entry.name[len(want) :].split("/")
                target, fd = _open_new_file(root, parts, prefix, shown, exclusive=False)
                written.append(target)
                with os.fdopen(fd, "wb") as out:
                    _copy_member(zf, entry, out.write, budget, prefix)
        except BaseException:
            for p in written:
                with contextlib.suppress(OSError):
                    p.unlink()
            raise
    return written
