"""Reading bundles: a job bundle checked and extracted into its staging folder
(:func:`extract_bundle`), and a result bundle's results and output files read
back (:func:`read_result_bundle`, :func:`extract_outputs`).

A malformed or hostile zip must never write outside its staging folder, fill the
disk, or leave a partial extraction behind: the zip is read through
:mod:`gpuwarden.intake.zipread`, and every name is checked again as it is
created on disk. Everything refused is a :class:`~gpuwarden.errors.BundleError`
that says which entry was wrong and why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gpuwarden import safefs
from gpuwarden.core.model import MIB, JobSpec, format_bytes
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import (
    FILE_MODE,
    INPUTS,
    JOB_ID_RE,
    JOB_ID_RULE,
    MANIFEST,
    OUTPUTS,
    RESULT_JSON,
    BundleLimits,
    parse_manifest,
    show,
)
from gpuwarden.intake.zipread import (
    Budget,
    ZipEntry,
    check_declared,
    copy_member,
    open_zip,
    read_member,
    scan_entries,
)

__all__ = [
    "extract_bundle",
    "extract_outputs",
    "read_result_bundle",
]

_MAX_RESULT_JSON_BYTES = 64 * MIB


_DIR_MODE = 0o755
# errors when creating an entry on disk that the bundle's content causes (not the host)
_ENTRY_ERRNOS = {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG}


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
        fd = os.open(target, flags, FILE_MODE)
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
    with open_zip(f, limits, prefix) as zf:
        entries = scan_entries(zf, limits, prefix)
        for entry in entries:
            if entry.name == MANIFEST and entry.is_dir:
                raise BundleError(f"{prefix}entry {show(MANIFEST + '/')}: must be a file")
            in_inputs = entry.name.startswith(f"{INPUTS}/") or (
                entry.is_dir and entry.name == INPUTS
            )
            if entry.name != MANIFEST and not in_inputs:
                raise BundleError(
                    f"{prefix}entry {show(entry.info.orig_filename)}: unexpected; a "
                    f"bundle holds only {MANIFEST} and the {INPUTS}/ folder"
                )
        check_declared(entries, limits, prefix)
        by_name = {e.name: e for e in entries}
        manifest = by_name.get(MANIFEST)
        if manifest is None:
            raise BundleError(f"{prefix}{MANIFEST} is missing")
        data = read_member(zf, manifest, limits.max_manifest_bytes, "the manifest", prefix)
        jobs = parse_manifest(data, where=f"{prefix}{MANIFEST}", limits=limits)
        _check_inputs(jobs, by_name, root, prefix, on_disk=False)

        budget = Budget(limits.max_unpacked_bytes, "the unpacked size")
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
    by_name: Mapping[str, ZipEntry],
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
                    f"{prefix}{MANIFEST}: jobs[{i}].inputs[{k}] {show(name)} is not in the "
                    f"bundle (expected a file {member})"
                )


def _extract_entry(
    zf: zipfile.ZipFile,
    entry: ZipEntry,
    root: Path,
    budget: Budget,
    prefix: str,
    *,
    data: bytes | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Write one entry below ``root``; ``data`` is its content when already read."""
    shown = show(entry.info.orig_filename)
    parts = entry.name.split("/")
    if entry.is_dir:
        path = _make_dirs(root, parts, prefix, shown)
        if not _inside(root, path):
            raise BundleError(f"{prefix}entry {shown}: would be written outside {root}")
        return
    _target, fd = _open_new_file(root, parts, prefix, shown, exclusive=True)
    with os.fdopen(fd, "wb") as out:
        if data is None:
            copy_member(zf, entry, out.write, budget, prefix, cancelled=cancelled)
            return
        budget.left -= len(data)
        if budget.left < 0:
            raise BundleError(
                f"{prefix}entry {shown}: {budget.what} passes the limit of "
                f"{format_bytes(budget.limit)} ({budget.limit} bytes)"
            )
        out.write(data)


def _open_result_zip(path: Path, limits: BundleLimits) -> tuple[IO[bytes], zipfile.ZipFile, str]:
    prefix = f"result bundle {Path(path).name}: "
    f = open(path, "rb")  # noqa: PTH123, SIM115 - closed by the caller
    try:
        return f, open_zip(f, limits, prefix), prefix
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
        for entry in scan_entries(zf, limits, prefix):
            parts = entry.name.split("/")
            if entry.is_dir or len(parts) != 2 or parts[1] != RESULT_JSON:
                continue
            if not JOB_ID_RE.fullmatch(parts[0]):
                raise BundleError(f"{prefix}entry {show(entry.name)}: not a valid job id")
            data = read_member(zf, entry, _MAX_RESULT_JSON_BYTES, "result.json", prefix)
            try:
                doc = json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise BundleError(f"{prefix}entry {show(entry.name)}: not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise BundleError(f"{prefix}entry {show(entry.name)}: not a JSON object")
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
        raise BundleError(f"{show(job_id)} is not a valid job id ({JOB_ID_RULE})")
    limits = limits or BundleLimits()
    f, zf, prefix = _open_result_zip(path, limits)
    written: list[Path] = []
    want = f"{job_id}/{OUTPUTS}/"
    with f, zf:
        entries = scan_entries(zf, limits, prefix)
        names = {e.name for e in entries}
        if f"{job_id}/{RESULT_JSON}" not in names:
            raise BundleError(f"{prefix}has no result for job {job_id}")
        check_declared([e for e in entries if e.name.startswith(want)], limits, prefix)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        root = Path(os.path.realpath(dest))
        budget = Budget(limits.max_unpacked_bytes, "the unpacked size")
        try:
            for entry in entries:
                if entry.is_dir or not entry.name.startswith(want):
                    continue
                shown = show(entry.info.orig_filename)
                parts = entry.name[len(want) :].split("/")
                target, fd = _open_new_file(root, parts, prefix, shown, exclusive=False)
                written.append(target)
                with os.fdopen(fd, "wb") as out:
                    copy_member(zf, entry, out.write, budget, prefix)
        except BaseException:
            for p in written:
                with contextlib.suppress(OSError):
                    p.unlink()
            raise
    return written
