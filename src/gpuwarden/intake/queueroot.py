"""Queue roots: a directory tree ``inbox/ processing/ outbox/ failed/``.

Clients write a bundle into ``inbox/`` under a temporary name (one starting
with ``.`` or ending in ``.tmp`` or ``.part``) and rename it when it is whole.
The broker claims a bundle by renaming it into ``processing/``, and finally
puts a result bundle of the same name into ``outbox/``, or the bundle itself
into ``failed/``. Every move is a rename within the root, so each is atomic on
one file system.

Names. A bundle is any entry of ``inbox/`` whose name ends in ``.zip`` (any
letter case) and is not a temporary name; any other byte string the file
system takes is possible (spaces, a newline, a backslash, a leading dash,
bytes that are not UTF-8). Every name the broker chooses for a file of its own
in a queue root (:func:`own_name`) is ``<base>.<tag>``, and no tag ends in
``.zip``: no bundle, and so no result named like its bundle, can ever have
such a name. ``<base>`` is the bundle's name when the whole name fits
``NAME_MAX``; a long name, or one that is not UTF-8, is shortened to a readable
prefix and ``~`` and 16 hex digits of its SHA-256 (:func:`short_name`), which
no bundle name ends in either. The broker's temporary files are
``.gw-<random hex>.tmp``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from gpuwarden.errors import BundleError, QueueRootError
from gpuwarden.intake.manifest import is_temp_name
from gpuwarden.safefs import kind_of

__all__ = [
    "NAME_MAX",
    "SUBFOLDERS",
    "Arrival",
    "QueueRoot",
    "is_bundle_name",
    "is_utf8",
    "own_name",
    "record_name",
    "short_name",
    "shown_name",
]

SUBFOLDERS = ("inbox", "processing", "outbox", "failed")

#: the longest file name (in bytes) Linux file systems take
NAME_MAX = 255
#: bytes kept free after a base name for ``.`` and the longest tag
_TAG_ROOM = 48
_HASH_HEX = 16
#: a shortened base: the prefix, "~" and the hash, at most as long as a kept name
_PREFIX_BYTES = NAME_MAX - 1 - _TAG_ROOM - 1 - _HASH_HEX

#: the tag of a refused bundle's input, kept in ``failed/`` beside its result
INPUT_TAG = "input"
#: the tag of the reason file of a result that could never be written
REASON_TAG = "reason.txt"


def is_bundle_name(name: str) -> bool:
    """True for the name of a bundle: it ends in ``.zip`` in any letter case and is
    not a temporary name. Intake and recovery use this one test."""
    return not is_temp_name(name) and name.lower().endswith(".zip")


def is_utf8(name: str) -> bool:
    """True when the name (as ``os.listdir`` gives it) is valid UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown_name(name: str) -> str:
    """The name as a person and JSON can read it: bytes that are not UTF-8 are
    written ``\\xNN``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def short_name(name: str) -> str:
    """A readable prefix of ``name`` (bytes that are not UTF-8 as ``_``), ``~`` and
    16 hex digits of the SHA-256 of the whole name: at most 206 bytes, valid
    UTF-8, never ending in ``.zip``, and different for different names."""
    raw = os.fsencode(name)
    readable = raw.decode("utf-8", "replace").replace("\ufffd", "_")
    prefix = readable.encode("utf-8")[:_PREFIX_BYTES].decode("utf-8", "ignore")
    return f"{prefix}~{sha256(raw).hexdigest()[:_HASH_HEX]}"


def _base(name: str) -> str:
    if is_utf8(name) and len(os.fsencode(name)) + 1 + _TAG_ROOM <= NAME_MAX:
        return name
    return short_name(name)


def own_name(bundle: str, tag: str) -> str:
    """The name of a file the broker writes for ``bundle``: ``<base>.<tag>``.

    It never passes ``NAME_MAX`` and never ends in ``.zip`` (``tag`` must not), so
    no client's bundle can be named like it; distinct bundles and tags give
    distinct names."""
    if tag.lower().endswith(".zip") or "/" in tag or len(tag.encode()) >= _TAG_ROOM:
        raise ValueError(f"{tag!r} is not a tag for a name of the broker's own")
    return f"{_base(bundle)}.{tag}"


def record_name(name: str) -> str:
    """The name a bundle is recorded under in the store and shown in events: its
    own name when that is UTF-8, else :func:`short_name` (which no bundle name can
    be, since it does not end in ``.zip``)."""
    return name if is_utf8(name) else short_name(name)


def unique_tag(what: str, now: float) -> str:
    """``<what>-<unix seconds>-<6 hex>``: a tag that two refusals in the same second
    do not share."""
    return f"{what}-{int(now)}-{secrets.token_hex(3)}"


def _plain_name(name: str) -> str:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{shown_name(name)!r} is not a plain file name")
    return name


#: how a missing queue root or subfolder gets made, as a person does it: the
#: broker's config key (callers that are not the broker say their own way)
CREATE_HINT = "create_queue_roots = true in the broker's config (the default) makes it"


def _check_writable(root: Path, folder: Path, how_to_create: str) -> None:
    """Raise QueueRootError unless ``folder`` is a directory we can create files in."""
    if not folder.is_dir():
        if folder.exists() or folder.is_symlink():
            raise QueueRootError(
                f"queue root {root}: {folder} is not a directory; move it away so the "
                f"folder can be created ({how_to_create})"
            )
        raise QueueRootError(
            f"queue root {root}: folder {folder} is missing; create it, or: {how_to_create}"
        )
    hint = "fix its permissions or ownership, or mount the share read-write"
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QueueRootError(f"queue root {root}: folder {folder} is not writable; {hint}")
    probe = folder / f".probe-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        # an empty file: a full disk is writable (its bundles wait for space), a
        # read-only one or one without permission is not
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return
        raise QueueRootError(
            f"queue root {root}: folder {folder} is not writable ({exc.strerror}); {hint}"
        ) from None


@dataclass(frozen=True)
class Arrival:
    """An entry with a bundle's name in a folder, as its listing showed it
    (``lstat``: nothing was opened)."""

    path: Path
    #: what the entry is (:func:`gpuwarden.safefs.kind_of`): "file" for a regular one
    kind: str
    mtime: float

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class QueueRoot:
    """One queue root directory; use :meth:`open` to get a checked one."""

    path: Path

    @property
    def inbox(self) -> Path:
        """Where clients drop whole bundles."""
        return self.path / "inbox"

    @property
    def processing(self) -> Path:
        """Bundles the broker has claimed and not finished."""
        return self.path / "processing"

    @property
    def outbox(self) -> Path:
        """Result bundles, named like the bundles they answer."""
        return self.path / "outbox"

    @property
    def failed(self) -> Path:
        """Bundles that could not be read."""
        return self.path / "failed"

    @classmethod
    def open(cls, path: Path, *, create: bool, how_to_create: str = CREATE_HINT) -> QueueRoot:
        """Check the queue root at ``path`` and return it.

        With ``create`` the root and any missing subfolder are made. Raises
        :class:`QueueRootError`, naming the path and what to do, when the root is
        missing (without ``create``), or the root or a subfolder is not a
        directory or not writable (tested by creating and removing a probe file).
        ``how_to_create`` ends the message of a missing one: how the person who
        reads it gets it made.
        """
        root = Path(path)
        if not root.exists():
            if not create:
                raise QueueRootError(
                    f"queue root {root} does not exist; create it with its folders inbox/, "
                    f"processing/, outbox/ and failed/, or: {how_to_create}"
                )
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise QueueRootError(
                    f"queue root {root} cannot be created ({exc.strerror}); "
                    "check the parent folder's permissions"
                ) from None
        if not root.is_dir():
            raise QueueRootError(f"queue root {root} is not a directory; choose another path")
        qr = cls(root)
        for sub in SUBFOLDERS:
            folder = qr.path / sub
            if create and not folder.exists() and not folder.is_symlink():
                try:
                    folder.mkdir()
                except OSError as exc:
                    raise QueueRootError(
                        f"queue root folder {folder} cannot be created ({exc.strerror}); "
                        "fix the queue root's permissions"
                    ) from None
            _check_writable(root, folder, how_to_create)
        return qr

    def _entries(self, folder: Path) -> list[Arrival]:
        """Every entry with a bundle's name in ``folder``, whatever it is, by ``lstat``."""
        out: list[Arrival] = []
        try:
            it = os.scandir(folder)
        except FileNotFoundError:
            return out
        with it:
            for entry in it:
                if not is_bundle_name(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # claimed or removed meanwhile
                    continue
                out.append(Arrival(Path(entry.path), kind_of(st.st_mode), st.st_mtime))
        return out

    def arrivals(self) -> list[Arrival]:
        """Every entry with a bundle's name in ``inbox/``, oldest first (by mtime,
        then name), whatever it is: the caller refuses what is not a regular file.
        Temporary names and names not ending in ``.zip`` are left out."""
        return sorted(self._entries(self.inbox), key=lambda a: (a.mtime, a.name))

    def in_processing(self) -> list[Arrival]:
        """Every entry with a bundle's name in ``processing/``, by name."""
        return sorted(self._entries(self.processing), key=lambda a: a.name)

    def pending(self) -> list[Path]:
        """Whole bundles in ``inbox/`` that are regular files, oldest first (by
        mtime, then name). Temporary names (``.x``, ``x.tmp``, ``x.part``),
        directories, symlinks, other special files and files not ending in
        ``.zip`` are left out."""
        return [a.path for a in self.arrivals() if a.kind == "file"]

    def claim(self, path: Path) -> Path:
        """Move the entry ``path`` from ``inbox/`` to ``processing/`` by one
        atomic rename (a link or a FIFO moves as itself; nothing is opened);
        return its new path.

        Raises :class:`BundleError` when an entry of that name already sits in
        ``processing/`` (a duplicate bundle name: the caller rejects it), and
        FileNotFoundError when the bundle is gone (another broker claimed it)."""
        name = _plain_name(Path(path).name)
        src = self.inbox / name
        dst = self.processing / name
        if os.path.lexists(dst):
            raise BundleError(
                f"bundle {shown_name(name)}: duplicate bundle name, a bundle of that name is "
                "already being processed (in processing/); give each bundle a unique name"
            )
        src.rename(dst)
        return dst

    def result_of(self, name: str) -> Path | None:
        """``outbox/<name>`` or ``failed/<name>`` when anything of that name is there."""
        name = _plain_name(name)
        for folder in (self.outbox, self.failed):
            if os.path.lexists(folder / name):
                return folder / name
        return None

    def depth(self) -> dict[str, int]:
        """How many bundles (regular files named ``*.zip`` in any letter case,
        temporary names left out) each subfolder holds. The broker's own files in
        ``failed/`` (kept inputs, reasons, refusals of duplicates) never end in
        ``.zip`` and are not counted."""
        return {
            sub: sum(1 for a in self._entries(self.path / sub) if a.kind == "file")
            for sub in SUBFOLDERS
        }

    def _own(self, path: Path) -> Path:
        path = Path(path)
        parent = Path(os.path.realpath(path.parent))
        for sub in SUBFOLDERS:
            if parent == Path(os.path.realpath(self.path / sub)):
                return path
        raise ValueError(f"{path} is not in a folder of queue root {self.path}")

    def move_to_failed(self, path: Path, name: str | None = None) -> Path:
        """Move ``path`` (an entry in one of this root's folders, whatever it is;
        a link moves as itself) to ``failed/``, as ``name`` or under its own name;
        return the new path. Nothing already in ``failed/`` is replaced: when the
        name is taken, ``-<6 hex>`` is added to it."""
        src = self._own(path)
        wanted = _plain_name(name or src.name)
        dst = self.failed / wanted
        for _ in range(10):
            if not os.path.lexists(dst):
                break
            dst = self.failed / f"{wanted}-{secrets.token_hex(3)}"
        src.rename(dst)
        return dst

    def remove_from_processing(self, name: str) -> None:
        """Delete ``processing/<name>``; nothing happens when it is already gone."""
        (self.processing / _plain_name(name)).unlink(missing_ok=True)

    def remove_own_temporaries(self) -> list[str]:
        """Remove what a broker that died while writing a result left: regular
        files ``.gw-*.tmp`` in ``outbox/`` and ``failed/`` (clients never write
        there). Returns the paths removed."""
        removed: list[str] = []
        for folder in (self.outbox, self.failed):
            with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:
                for entry in it:
                    if not (entry.name.startswith(".gw-") and entry.name.endswith(".tmp")):
                        continue
                    with contextlib.suppress(OSError):
                        if stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                            Path(entry.path).unlink()
                            removed.append(entry.path)
        return removed

    def wait_for_result(self, name: str, timeout_s: float, poll_s: float = 0.1) -> Path | None:
        """Wait until ``outbox/<name>`` or ``failed/<name>`` appears and return it;
        None after ``timeout_s`` seconds. Looks at least once."""
        name = _plain_name(name)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            for folder in (self.outbox, self.failed):
                candidate = folder / name
                if candidate.is_file():
                    return candidate
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(max(poll_s, 0.001), left))
