"""Writing bundles: a client's job bundle (:func:`write_bundle`) and the broker's
result bundle (:func:`write_result_bundle`).

Each is written to a temporary file beside its final name, fsynced, then given
that name without ever replacing a file already there: a reader never sees a
partial bundle. A job's outputs are read through :mod:`gpuwarden.safefs`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gpuwarden import safefs
from gpuwarden.core.model import JobSpec
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import (
    CHUNK,
    FILE_MODE,
    INPUTS,
    JOB_ID_RE,
    MANIFEST,
    OUTPUTS,
    RESULT_JSON,
    bundle_name,
    manifest_doc,
    parse_manifest,
    path_problem,
    show,
)

__all__ = [
    "write_bundle",
    "write_new_file",
    "write_result_bundle",
]


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
    info.external_attr = (stat.S_IFREG | FILE_MODE) << 16
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
        shutil.copyfileobj(f, dst, CHUNK)


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


def _write_atomically(dest_dir: Path, name: str, fill: Callable[[IO[bytes]], None]) -> Path:
    """Write a file to a fresh temporary file ``dest_dir/.gw-<random>.tmp``, fsync
    it, then give it the name ``name``. Readers never see ``name`` until the file
    is complete, and a file already called ``name`` is never replaced: that
    raises FileExistsError and leaves nothing behind. When anything fails (a
    full or read-only disk) the temporary file is removed: no empty or partial
    file is left. The temporary name never passes NAME_MAX, however long
    ``name`` is."""
    final = dest_dir / name
    if os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, "a file of that name is already there", str(final))
    tmp = dest_dir / f".gw-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(dest_dir)
    return final


def _write_zip_atomically(
    dest_dir: Path, name: str, fill: Callable[[zipfile.ZipFile], None]
) -> Path:
    """A zip written as :func:`_write_atomically` writes a file."""

    def zipped(f: IO[bytes]) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            fill(zf)

    return _write_atomically(dest_dir, name, zipped)


def _write_all(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def write_new_file(dest_dir: Path, name: str, data: bytes) -> Path:
    """Write ``data`` as the new file ``dest_dir/name`` whole or not at all (a
    temporary file, fsynced, then given the name; FileExistsError when the name is
    taken). A broker's own small files in a queue root are written with this."""
    if "/" in name or "\0" in name or name.startswith(".") or not name:
        raise ValueError(f"file name {name!r} must be a plain, non-hidden file name")
    return _write_atomically(Path(dest_dir), name, lambda f: _write_all(f, data))


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
    manifest = json.dumps(manifest_doc(jobs), indent=2, ensure_ascii=False).encode() + b"\n"
    parse_manifest(manifest, where="new bundle manifest")  # never write what we would refuse
    for name in files:
        problem = path_problem(name)
        if problem is not None:
            raise BundleError(f"input file name {show(name)}: {problem}")
        parts = name.split("/")
        for n in range(1, len(parts)):
            if "/".join(parts[:n]) in files:
                raise BundleError(
                    f"input file name {show(name)}: {show('/'.join(parts[:n]))} is "
                    "also a file, so it cannot be a folder"
                )
    for job in jobs:
        for name in job.inputs:
            if name not in files:
                raise BundleError(f"job {job.id}: input {show(name)} has no file given")

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
        problem = path_problem(member)
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
            raise ValueError(f"result {show(result, 120)} has no valid job id under 'id'")
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
