"""A corpus of hostile bundle names and file types for a queue root's ``inbox/``.

Each :class:`Case` is one entry a client (or an attacker with write access to the
share) can put into ``inbox/``: a name (raw bytes: anything the file system
takes) and what is under it (a valid bundle, junk, a bomb, a FIFO, a device, a
link...). ``expect`` says what the broker must do with it:

- ``done``: a valid bundle; its result lands in ``outbox/<name>``;
- ``refused``: a refusal with a reason lands in ``failed/<name>``;
- ``ignored``: not a bundle name (a temporary name, no ``.zip`` at the end); the
  broker leaves it in ``inbox/`` as it is and never opens it.

:func:`lay_out` puts the whole corpus into a folder. Used by the live-broker
acceptance test (``tests/acceptance/test_hostile_queue.py``).
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

#: files an escaping entry would write; the test checks none of them appears
ESCAPES = ("/tmp/gpuwarden-hostile-escape", "/tmp/gpuwarden-hostile-abs")


@dataclass(frozen=True)
class Case:
    raw: bytes  # the name in inbox/, as bytes
    content: str  # what is under it: see _make
    expect: str  # "done", "refused" or "ignored"
    why: str  # what the case attacks

    @property
    def name(self) -> str:
        """The name as ``os.listdir`` gives it (bytes that are not UTF-8 escaped)."""
        return os.fsdecode(self.raw)


def _long(n: int, fill: bytes = b"L") -> bytes:
    return fill * (n - 4) + b".zip"


CASES: tuple[Case, ...] = (
    Case(b"plain.zip", "bundle", "done", "the control"),
    Case(b"back\\slash.zip", "bundle", "done", "a backslash once aborted every pass"),
    Case(b"new\nline.zip", "bundle", "done", "a newline in log lines and events"),
    Case(b"-rf.zip", "bundle", "done", "a leading dash (an option to a careless tool)"),
    Case(b"--help.zip", "bundle", "done", "a leading double dash"),
    Case(b" spaces  inside .zip", "bundle", "done", "spaces, leading and doubled"),
    Case(b"tab\there.zip", "bundle", "done", "a tab"),
    Case(b"UPPER.ZIP", "bundle", "done", "the suffix in capitals"),
    Case(b"Mixed.ZiP", "bundle", "done", "the suffix in mixed case"),
    Case(b"quote'\"`$(touch pwned)`.zip", "bundle", "done", "shell metacharacters"),
    Case(b"glob*?[a-z].zip", "bundle", "done", "glob characters"),
    Case(b"%s%n%x%%.zip", "bundle", "done", "printf directives"),
    Case(b"\x1b[31mred\x1b[0m.zip", "bundle", "done", "terminal escapes"),
    Case(b"nul\\x00.zip", "bundle", "done", "a NUL written out as text"),
    Case("unicode-✓-😀.zip".encode(), "bundle", "done", "multi-byte UTF-8"),
    Case("\ufeffbom.zip".encode(), "bundle", "done", "a byte-order mark"),
    Case("rtl-\u202egpj.zip".encode(), "bundle", "done", "a right-to-left override"),
    Case(b"a.zip.zip", "bundle", "done", "a doubled suffix"),
    Case(b"dot..zip", "bundle", "done", "two dots before the suffix"),
    Case(b"X.input.zip", "bundle", "done", "once named like a refusal's kept input"),
    Case(b"X.zip.input.zip", "bundle", "done", "a kept input's name, made a bundle"),
    Case(b"Y.duplicate-1795938132-abcdef.zip", "bundle", "done", "a refusal's name"),
    Case(b"Z.zip.result-1795938132-abcdef.zip", "bundle", "done", "a renamed result's name"),
    Case(b"R.zip.reason.txt.zip", "bundle", "done", "a reason file's name"),
    Case(b"h~0123456789abcdef.zip", "bundle", "done", "a shortened name's look"),
    Case(_long(251), "bundle", "done", "251 bytes: the old temporary name passed NAME_MAX"),
    Case(_long(252, b"M"), "bundle", "done", "252 bytes"),
    Case(_long(253, b"N"), "bundle", "done", "253 bytes"),
    Case(_long(254, b"O"), "bundle", "done", "254 bytes"),
    Case(_long(255, b"P"), "bundle", "done", "255 bytes, NAME_MAX itself"),
    Case(_long(255, b"Q"), "junk", "refused", "255 bytes, refused: once exit 1 at every start"),
    Case(_long(255, "é".encode()[:1]), "bundle", "refused", "255 bytes, not UTF-8"),
    Case(b"caf\xe9.zip", "bundle", "refused", "Latin-1, not UTF-8"),
    Case(b"\xc3\x28-broken.zip", "bundle", "refused", "a broken UTF-8 sequence"),
    Case(b"\xff\xfe.zip", "bundle", "refused", "bytes that are never UTF-8"),
    Case(b"junk.zip", "junk", "refused", "not a zip"),
    Case(b"empty.zip", "empty", "refused", "an empty file"),
    Case(b"traversal.zip", "traversal", "refused", "an entry ../../ out of staging"),
    Case(b"absolute.zip", "absolute", "refused", "an absolute entry name"),
    Case(b"linkentry.zip", "link-entry", "refused", "a symlink entry in the zip"),
    Case(b"forged64.zip", "forged-zip64", "refused", "a zip64 end record hiding entries"),
    Case(b"bomb.zip", "bomb", "refused", "a zip bomb (declares 5 GiB)"),
    Case(b"fifo.zip", "fifo", "refused", "a FIFO once blocked the broker for good"),
    Case(b"dir.zip", "folder", "refused", "a folder with a manifest in it"),
    Case(b"link-zero.zip", "link-zero", "refused", "a link to /dev/zero"),
    Case(b"link-bundle.zip", "link-bundle", "refused", "a link to a valid bundle elsewhere"),
    Case(b"dangling.zip", "dangling", "refused", "a dangling link"),
    Case(b"socket.zip", "socket", "refused", "a unix socket"),
    Case(b"chardev.zip", "chardev", "refused", "a character device (/dev/zero)"),
    Case(b"blockdev.zip", "blockdev", "refused", "a block device"),
    Case(b".hidden.zip", "bundle", "ignored", "a temporary name (leading dot)"),
    Case(b"writing.zip.tmp", "bundle", "ignored", "a temporary name (.tmp)"),
    Case(b"writing.zip.part", "bundle", "ignored", "a temporary name (.part)"),
    Case(b"trailing-space.zip ", "bundle", "ignored", "not ending in .zip"),
    Case(b"notes.txt", "fifo", "ignored", "a FIFO without a bundle's name"),
)


def job_id(index: int) -> str:
    return f"hostile-{index}"


def _manifest(jid: str) -> bytes:
    doc = {"version": 1, "jobs": [{"id": jid, "type": "echo.echo", "params": {"text": jid}}]}
    return json.dumps(doc).encode()


def _zip(entries: list[tuple[str | zipfile.ZipInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return buf.getvalue()


def valid_bundle(jid: str) -> bytes:
    return _zip([("manifest.json", _manifest(jid))])


def forged_zip64(jid: str, hidden: int = 12_000) -> bytes:
    """The zip64 end record zipfile reads says 2 entries; the directory holds more
    than the entry limit."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", _manifest(jid))
        for i in range(hidden):
            zf.writestr(f"inputs/{i}", b"")
    raw = buf.getvalue()
    eocd = raw.rindex(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<2I", raw, eocd + 12)
    body = raw[:eocd]
    z64 = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 2, 2, cd_size, cd_offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, len(body), 1)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return body + z64 + locator + end


def real_bomb(jid: str, mib: int) -> bytes:
    """A real bomb: ``mib`` MiB of zeros in one entry, a few KiB on disk."""
    buf = io.BytesIO()
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.json", _manifest(jid))
        with zf.open("inputs/zeros", "w") as dst:
            for _ in range(mib):
                dst.write(chunk)
    return buf.getvalue()


def _bomb(jid: str) -> bytes:
    """Five entries that declare 1 GiB each (5 GiB, past the default 4 GiB limit);
    their data is a few bytes (a real 5 GiB of zeros takes a minute to deflate)."""
    raw = bytearray(
        _zip([("manifest.json", _manifest(jid))] + [(f"inputs/z{i}", b"") for i in range(5)])
    )
    pos = raw.rindex(b"PK\x05\x06")
    count, _size, cd = struct.unpack_from("<H2I", raw, pos + 10)
    for _ in range(count):
        n, m, k = struct.unpack_from("<3H", raw, cd + 28)
        name = bytes(raw[cd + 46 : cd + 46 + n])
        if name.startswith(b"inputs/z"):
            local = struct.unpack_from("<I", raw, cd + 42)[0]
            struct.pack_into("<I", raw, cd + 24, 1 << 30)
            struct.pack_into("<I", raw, local + 22, 1 << 30)
        cd += 46 + n + m + k
    return bytes(raw)


def _link_entry(jid: str) -> bytes:
    info = zipfile.ZipInfo("inputs/passwd")
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return _zip([("manifest.json", _manifest(jid)), (info, b"/etc/passwd")])


def content_bytes(case: Case, index: int, cache: dict[str, bytes]) -> bytes | None:
    """The bytes of a regular-file case (None for the other kinds)."""
    jid = job_id(index)
    if case.content == "bundle":
        return valid_bundle(jid)
    if case.content == "junk":
        return b"this is not a zip file\n" * 10
    if case.content == "empty":
        return b""
    if case.content == "traversal":
        return _zip([("manifest.json", _manifest(jid)), ("inputs/../../../../" + ESCAPES[0], b"x")])
    if case.content == "absolute":
        return _zip([("manifest.json", _manifest(jid)), (ESCAPES[1], b"x")])
    if case.content == "link-entry":
        return _link_entry(jid)
    if case.content in ("forged-zip64", "bomb"):
        if case.content not in cache:
            cache[case.content] = (forged_zip64 if case.content == "forged-zip64" else _bomb)(jid)
        return cache[case.content]
    return None


def lay_out(inbox: Path, outside: Path) -> list[socket.socket]:
    """Put every case of the corpus into ``inbox``, each whole (written elsewhere
    first, then moved in), the special files made in place. ``outside`` is a
    folder beside the queue root for link targets. Returns the bound sockets
    (keep them open while the broker looks)."""
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / "elsewhere.zip"
    target.write_bytes(valid_bundle("hostile-link-target"))
    cache: dict[str, bytes] = {}
    sockets: list[socket.socket] = []
    base = os.fsencode(inbox)
    staging = outside / "staging"
    staging.mkdir(exist_ok=True)
    for i, case in enumerate(CASES):
        path = base + b"/" + case.raw
        data = content_bytes(case, i, cache)
        if data is not None:
            tmp = os.fsencode(staging / f"case-{i}")
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        elif case.content == "fifo":
            os.mkfifo(path)
        elif case.content == "folder":
            os.mkdir(path)
            with open(path + b"/manifest.json", "wb") as f:
                f.write(_manifest(job_id(i)))
        elif case.content == "link-zero":
            os.symlink(b"/dev/zero", path)
        elif case.content == "link-bundle":
            os.symlink(os.fsencode(target), path)
        elif case.content == "dangling":
            os.symlink(b"/nonexistent/gpuwarden-hostile", path)
        elif case.content == "socket":
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            sockets.append(s)
        elif case.content == "chardev":
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        elif case.content == "blockdev":
            os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 0))
        else:  # pragma: no cover - a new kind must be made here
            raise AssertionError(f"no way to make {case.content}")
    return sockets


def kind_made(case: Case) -> int:
    """The ``S_IFMT`` the case's entry has in ``inbox/``."""
    return {
        "fifo": stat.S_IFIFO,
        "folder": stat.S_IFDIR,
        "link-zero": stat.S_IFLNK,
        "link-bundle": stat.S_IFLNK,
        "dangling": stat.S_IFLNK,
        "socket": stat.S_IFSOCK,
        "chardev": stat.S_IFCHR,
        "blockdev": stat.S_IFBLK,
    }.get(case.content, stat.S_IFREG)
