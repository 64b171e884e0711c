"""Reading a zip nobody vouches for, before and while anything of it is used.

Bundles come from clients the operator trusts, but a malformed or hostile zip
must never make the broker build an object per entry of a forged central
directory, decompress past a limit, or read an entry it did not check. So the
central directory is walked the way :mod:`zipfile` will walk it and counted
before :mod:`zipfile` opens the file (:func:`open_zip`); every entry's name,
kind, encryption and compression is checked before anything is written
(:func:`scan_entries`); and the bytes actually decompressed are counted against
a budget, headers not trusted (:func:`copy_member`). Everything refused is a
:class:`~gpuwarden.errors.BundleError` that says which entry was wrong and why.
"""

from __future__ import annotations

import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from gpuwarden.core.model import format_bytes
from gpuwarden.errors import BundleError, GpuwardenError
from gpuwarden.intake.manifest import CHUNK, MAX_NAME_BYTES, BundleLimits, path_problem, show

__all__ = [
    "Budget",
    "ExtractionCancelled",
    "ZipEntry",
    "check_declared",
    "copy_member",
    "open_zip",
    "read_member",
    "scan_entries",
]

_EOCD_SIZE = 22
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_EOCD_SIZE = 56
_CD_RECORD_SIZE = 46
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD_SIG = b"PK\x06\x06"
_CD_SIG = b"PK\x01\x02"
# a central directory record: 46 bytes, the name (we allow 1 KiB), and room for extras
_MAX_CD_BYTES_PER_ENTRY = 46 + MAX_NAME_BYTES + 1024
_ENCRYPTED_FLAGS = 0x1 | 0x40  # traditional / strong encryption
_SUPPORTED_COMPRESSION = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}


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
class ZipEntry:
    """One entry of a zip whose header passed :func:`scan_entries`."""

    info: zipfile.ZipInfo
    name: str  # the full name as stored, trailing '/' removed for directories
    is_dir: bool


def _check_entry(info: zipfile.ZipInfo, prefix: str) -> ZipEntry:
    """Header-only checks of one entry: name, type, encryption, compression."""
    raw = info.orig_filename  # zipfile cuts ``filename`` at a NUL; the original keeps it
    shown = show(raw)

    def bad(reason: str) -> BundleError:
        return BundleError(f"{prefix}entry {shown}: {reason}")

    is_dir = raw.endswith("/")
    name = raw[:-1] if is_dir else raw
    problem = path_problem(name)
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
    return ZipEntry(info=info, name=name, is_dir=is_dir)


def scan_entries(zf: zipfile.ZipFile, limits: BundleLimits, prefix: str) -> list[ZipEntry]:
    """Check every entry's header; refuse the archive before anything is written."""
    infos = zf.infolist()
    if len(infos) > limits.max_entries:
        raise BundleError(
            f"{prefix}has {len(infos)} entries, more than the limit of {limits.max_entries}"
        )
    entries: list[ZipEntry] = []
    seen: set[str] = set()
    for info in infos:
        entry = _check_entry(info, prefix)
        if entry.name in seen:
            raise BundleError(f"{prefix}entry {show(info.orig_filename)}: duplicate name")
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


def open_zip(fileobj: IO[bytes], limits: BundleLimits, prefix: str) -> zipfile.ZipFile:
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


class Budget:
    """Counts the bytes actually decompressed, against a limit (headers are not trusted)."""

    def __init__(self, limit: int, what: str) -> None:
        self.left = limit
        self.limit = limit
        self.what = what


class ExtractionCancelled(GpuwardenError):
    """The caller asked an extraction to stop (the broker is shutting down)."""


def check_declared(entries: Sequence[ZipEntry], limits: BundleLimits, prefix: str) -> None:
    """Refuse, before anything is extracted, entries whose declared sizes (zip64
    included) add up past the unpacked limit."""
    declared = sum(e.info.file_size for e in entries if not e.is_dir)
    if declared > limits.max_unpacked_bytes:
        raise BundleError(
            f"{prefix}its entries declare {format_bytes(declared)} unpacked, more than the "
            f"limit of {format_bytes(limits.max_unpacked_bytes)}; nothing was extracted"
        )


def copy_member(
    zf: zipfile.ZipFile,
    entry: ZipEntry,
    sink: Callable[[bytes], object],
    budget: Budget,
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
    shown = show(entry.info.orig_filename)
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
                chunk = src.read(min(CHUNK, budget.left + 1))
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


def read_member(
    zf: zipfile.ZipFile, entry: ZipEntry, max_bytes: int, what: str, prefix: str
) -> bytes:
    parts: list[bytes] = []
    copy_member(zf, entry, parts.append, Budget(max_bytes, what), prefix)
    return b"".join(parts)
