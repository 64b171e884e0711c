"""The one way the broker touches a path that a job, a warm server or a client controls.

The broker runs as root beside code it did not write. A job's output and report
folders, a warm server's exchange folder, a bundle in ``inbox/`` and an upload's
name are hostile: any entry in them may be a symlink, a FIFO, a device, a socket,
a folder a thousand levels deep, or a file that never ends. Everything here works
on file descriptors, so a link swapped in between a check and a use is never
followed:

- :func:`open_file` opens a regular file and nothing else (an ``O_PATH`` look
  first: a FIFO or a device is never opened), following no link in any component
  below a trusted folder; :func:`read_bytes` / :func:`read_text` read at most a
  stated size.
- :func:`open_dir` / :func:`open_dir_at` open a folder for ``*at`` calls, no
  link followed below the trusted part.
- :func:`walk` lists a tree iteratively (no recursion limit), never following a
  link, bounded in entries and depth; anything that is not a regular file or a
  folder is listed as refused, never opened.
- :func:`make_dir` / :func:`make_dir_at` create a folder fresh (it fails if
  anything is there, a link included) and set its mode and owner on its
  descriptor; :func:`make_dirs` makes the missing folders of a hostile relative
  path below a trusted one.
- :func:`remove_tree` removes a tree without following links and fails loudly.
- :func:`copy_tree` / :func:`copy_into` copy the regular files and folders of a
  hostile tree into a folder the broker owns, by descriptor on both sides;
  :func:`move_entries` renames entries out of a held folder.
- :func:`write_file` replaces a small file of the broker's own whole, at once (a
  fresh temporary file beside it, renamed over it), following no link.

Nothing else in gpuwarden opens such a path.

One file on purpose: it is the whole list of the ways a hostile path is
touched, all built on the same opening rules (:func:`_open_at`), so that a
review of that list is a review of one module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.errors import GpuwardenError

__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "Entry",
    "Listing",
    "TooLargeError",
    "UnsafePathError",
    "copy_into",
    "copy_tree",
    "kind_of",
    "make_dir",
    "make_dir_at",
    "make_dirs",
    "move_entries",
    "open_dir",
    "open_dir_at",
    "open_file",
    "opened_dir",
    "read_bytes",
    "read_text",
    "remove_tree",
    "walk",
    "write_file",
]

#: default bounds of :func:`walk` and :func:`copy_tree`
MAX_ENTRIES = 100_000
MAX_DEPTH = 64

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
#: :func:`remove_tree` keeps at most this many folders open; a deeper folder is
#: moved up to the top of the tree and removed from there
_OPEN_DIRS = 32


class UnsafePathError(GpuwardenError):
    """A path that a job or a client controls is not something the broker may use."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(f"{os.fspath(path)}: {why}")
        self.path = os.fspath(path)
        self.why = why


class TooLargeError(UnsafePathError):
    """A file or a tree is larger than the broker reads."""


def kind_of(mode: int) -> str:
    """What an ``st_mode`` names, in words a person reads."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown file type"


def _parts(rel: str | os.PathLike[str]) -> list[str]:
    """The components of a relative path; ``..``, ``.`` and absolute paths are refused."""
    text = os.fspath(rel)
    if text.startswith("/"):
        raise UnsafePathError(text, "is an absolute path, not one below its folder")
    parts = [p for p in text.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UnsafePathError(text, "names '.' or '..'")
    return parts


def _refusal(path: str, exc: OSError) -> UnsafePathError | None:
    """The refusal an ``open`` error means for a hostile path, or None if it means
    nothing about the path (a missing file, a full disk: raised as it is)."""
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return UnsafePathError(path, "is a symlink; links are not followed")
    if exc.errno == errno.ENOTDIR:
        return UnsafePathError(path, "has a component that is not a folder")
    if exc.errno == errno.ENXIO:
        return UnsafePathError(path, "is a socket or a device without a reader")
    return None


def _open_at(dir_fd: int | None, name: str, flags: int, shown: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            # say what is really there: O_DIRECTORY|O_NOFOLLOW on a link is ENOTDIR
            with contextlib.suppress(OSError):
                mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    raise UnsafePathError(shown, "is a symlink; links are not followed") from None
                if flags & os.O_DIRECTORY and not stat.S_ISDIR(mode):
                    raise UnsafePathError(shown, f"is a {kind_of(mode)}, not a folder") from None
        refusal = _refusal(shown, exc)
        if refusal is not None:
            raise refusal from None
        raise


def open_dir(path: str | os.PathLike[str], *, under: str | os.PathLike[str] | None = None) -> int:
    """Open a folder for ``*at`` calls and return its descriptor.

    With ``under`` (a folder the broker trusts), ``path`` is relative to it and no
    component below ``under`` may be a link. Without it, only the last component of
    ``path`` is checked. Raises :class:`UnsafePathError` for a link or a non-folder.
    """
    if under is None:
        return _open_at(None, os.fspath(path), _O_DIR, os.fspath(path))
    top = _open_at(None, os.fspath(under), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, "")
    try:
        return open_dir_at(top, path, shown=os.fspath(under))
    finally:
        os.close(top)


def open_dir_at(dir_fd: int, rel: str | os.PathLike[str], *, shown: str = "") -> int:
    """Open the folder ``rel`` below the open folder ``dir_fd`` and return its
    descriptor; no component may be a link (:class:`UnsafePathError`, naming the
    component, after ``shown``: how ``dir_fd`` is named in errors). An empty
    ``rel`` gives a new descriptor of ``dir_fd`` itself."""
    fd = os.dup(dir_fd)
    done = [shown] if shown else []
    try:
        for part in _parts(rel):
            done.append(part)
            nxt = _open_at(fd, part, _O_DIR, "/".join(done))
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Replace the file ``path`` with ``data`` at once: written to a fresh file beside
    it (``O_EXCL``, never through a link, ``mode``), flushed to disk, then renamed
    over it, so a reader sees the old content or the new, never part of it. The
    folder is opened without following a link in its last component."""
    head, _, name = os.fspath(path).rpartition("/")
    if not name:
        raise UnsafePathError(path, "names no file")
    dir_fd = open_dir(head or ".")
    tmp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        fd = _open_at(dir_fd, tmp, _O_NEW, f"{head}/{tmp}")
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)


def _parent_of(
    path: str | os.PathLike[str], under: str | os.PathLike[str] | None
) -> tuple[int | None, str, str]:
    """(descriptor of the folder holding ``path`` or None for the working folder,
    the last name, the path as shown): with ``under``, no component below it may
    be a link."""
    text = os.fspath(path)
    if under is None:
        head, _, name = text.rpartition("/")
        if not (head or text.startswith("/")):
            return None, name, text
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        return _open_at(None, head or "/", flags, head), name, text
    parts = _parts(text)
    if not parts:
        raise UnsafePathError(text, "names no file")
    return open_dir("/".join(parts[:-1]), under=under), parts[-1], f"{os.fspath(under)}/{text}"


def open_file(path: str | os.PathLike[str], *, under: str | os.PathLike[str] | None = None) -> int:
    """Open a regular file for reading and return its descriptor, never following
    a link and never opening anything else, not even without blocking (opening a
    device can do something).

    With ``under`` (a folder the broker trusts), ``path`` is relative to it and no
    component below ``under`` may be a link. The entry is first opened with
    ``O_PATH | O_NOFOLLOW``, which opens nothing and follows no link, and checked
    with ``fstat``; only a regular file is then opened for reading, through that
    descriptor (``/proc/self/fd``), so it is the same inode even if the name was
    swapped meanwhile (where ``/proc`` is not mounted, the name is opened with
    ``O_NOFOLLOW | O_NONBLOCK`` and checked again). A FIFO, a device, a socket, a
    folder or a link is refused with :class:`UnsafePathError` naming what it is.
    """
    dir_fd, name, shown = _parent_of(path, under)
    try:
        pfd = _open_at(dir_fd, name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, shown)
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(shown, f"is a {kind_of(st.st_mode)}, not a regular file")
            try:
                fd = os.open(f"/proc/self/fd/{pfd}", _O_READ & ~os.O_NOFOLLOW)
            except FileNotFoundError:  # no /proc here
                fd = _open_at(dir_fd, name, _O_READ, shown)
        finally:
            os.close(pfd)
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    try:
        again = os.fstat(fd)
        if not stat.S_ISREG(again.st_mode) or (again.st_dev, again.st_ino) != (
            st.st_dev,
            st.st_ino,
        ):
            raise UnsafePathError(shown, "changed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_fd(fd: int, limit: int, shown: str) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, min(_CHUNK, limit + 1 - got))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            raise TooLargeError(shown, f"is larger than {limit} bytes")


def read_bytes(
    path: str | os.PathLike[str], limit: int, *, under: str | os.PathLike[str] | None = None
) -> bytes:
    """The content of a regular file of at most ``limit`` bytes (:func:`open_file`
    rules); a larger one raises :class:`TooLargeError` after reading ``limit + 1``."""
    fd = open_file(path, under=under)
    try:
        return _read_fd(fd, limit, os.fspath(path))
    finally:
        os.close(fd)


def read_text(
    path: str | os.PathLike[str], limit: int, *, under: str | os.PathLike[str] | None = None
) -> str:
    """:func:`read_bytes` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_bytes(path, limit, under=under).decode("utf-8", "replace")


def _shown_name(name: str) -> tuple[str, bool]:
    """A name as a person and JSON can read it, and whether it was valid UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace"), False
    return name, True


@dataclass(frozen=True)
class Entry:
    """One entry of a :class:`Listing`: its path relative to the top, with ``/``."""

    path: str
    kind: str
    size: int = 0
    why: str = ""


@dataclass
class Listing:
    """What :func:`walk` found: regular files, folders, and what it refused."""

    files: list[Entry] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    refused: list[Entry] = field(default_factory=list)
    total_bytes: int = 0
    #: why the walk stopped before the end (too many entries), or None
    truncated: str | None = None

    def refused_json(self) -> list[dict[str, str]]:
        """The refused entries as ``[{"path", "kind", "why"}]`` for a result."""
        return [{"path": e.path, "kind": e.kind, "why": e.why} for e in self.refused]


def _entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """The entries of an open folder, sorted, each with its ``lstat``."""
    out: list[tuple[str, os.stat_result]] = []
    with os.scandir(dir_fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we looked: not there
        out.append((name, st))
    return out


def _walk_fd(
    top_fd: int, *, max_entries: int, max_depth: int
) -> Iterator[tuple[str, str, os.stat_result, int | None, str]]:
    """Yield (relative path, name, lstat, parent fd, why-refused) depth first.

    ``why`` is empty for an entry that may be used; the parent fd is valid only
    until the next item. Folders are yielded before their content.
    """
    stack: list[tuple[int, str, int, Iterator[tuple[str, os.stat_result]]]] = [
        (top_fd, "", 0, iter(_entries(top_fd)))
    ]
    seen = 0
    try:
        while stack:
            fd, prefix, depth, it = stack[-1]
            item = next(it, None)
            if item is None:
                stack.pop()
                if fd != top_fd:
                    os.close(fd)
                continue
            name, st = item
            shown, utf8 = _shown_name(name)
            rel = f"{prefix}{shown}"
            seen += 1
            if seen > max_entries:
                yield rel, name, st, fd, f"more than {max_entries} entries"
                return
            if not utf8:
                yield rel, name, st, fd, "its name is not valid UTF-8"
                continue
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if depth + 1 > max_depth:
                    yield rel, name, st, fd, f"a folder more than {max_depth} levels deep"
                    continue
                try:
                    sub = _open_at(fd, name, _O_DIR, rel)
                except (UnsafePathError, FileNotFoundError):
                    continue  # swapped for something else, or gone, while we looked
                yield rel, name, st, fd, ""
                stack.append((sub, f"{rel}/", depth + 1, iter(_entries(sub))))
            elif stat.S_ISREG(mode):
                yield rel, name, st, fd, ""
            else:
                yield rel, name, st, fd, f"a {kind_of(mode)}, not a regular file or folder"
    finally:
        for fd, *_ in stack:
            if fd != top_fd:
                os.close(fd)


def walk(
    top: str | os.PathLike[str],
    *,
    under: str | os.PathLike[str] | None = None,
    max_entries: int = MAX_ENTRIES,
    max_depth: int = MAX_DEPTH,
) -> Listing:
    """List the tree at ``top`` without following links, without recursion.

    A missing ``top`` is an empty listing. Symlinks, FIFOs, sockets, devices,
    non-UTF-8 names and folders deeper than ``max_depth`` are listed in
    ``refused`` (never opened); past ``max_entries`` the walk stops and says so.
    """
    listing = Listing()
    try:
        top_fd = open_dir(top, under=under)
    except FileNotFoundError:
        return listing
    try:
        for rel, _name, st, _fd, why in _walk_fd(
            top_fd, max_entries=max_entries, max_depth=max_depth
        ):
            if why.startswith("more than"):
                listing.truncated = f"stopped after {max_entries} entries"
                listing.refused.append(Entry(rel, kind_of(st.st_mode), 0, why))
            elif why:
                listing.refused.append(Entry(rel, kind_of(st.st_mode), 0, why))
            elif stat.S_ISDIR(st.st_mode):
                listing.dirs.append(rel)
            else:
                listing.files.append(Entry(rel, "file", st.st_size))
                listing.total_bytes += st.st_size
    finally:
        os.close(top_fd)
    return listing


def make_dir(
    path: str | os.PathLike[str],
    *,
    mode: int = 0o700,
    owner: tuple[int, int] | None = None,
) -> None:
    """Create the folder ``path`` fresh: it fails with ``FileExistsError`` if
    anything is there (a link, a file, a folder). Mode (not reduced by the umask)
    and, given, owner are set on the new folder's descriptor, so only what was just
    created is changed (:func:`make_dir_at`)."""
    text = os.fspath(path).rstrip("/") or "/"
    head, _, name = text.rpartition("/")
    parent = _open_at(
        None, head or ("/" if text.startswith("/") else "."), os.O_RDONLY | os.O_DIRECTORY, text
    )
    try:
        os.close(make_dir_at(parent, name, mode=mode, owner=owner))
    finally:
        os.close(parent)


def _empty(top_fd: int, shown: str) -> None:
    """Remove everything inside the open folder ``top_fd``, iteratively.

    At most ``_OPEN_DIRS`` folders are open at once: a folder deeper than that is
    moved up into ``top_fd`` under a fresh name and removed on a later pass, so
    any depth is removed with bounded descriptors and no recursion.
    """
    for _ in range(10_000):
        entries = _entries(top_fd)
        if not entries:
            return
        stack: list[tuple[int, str, Iterator[tuple[str, os.stat_result]]]] = [
            (top_fd, "", iter(entries))
        ]
        try:
            while stack:
                fd, name, it = stack[-1]
                item = next(it, None)
                if item is None:
                    stack.pop()
                    if stack:
                        os.close(fd)
                        os.rmdir(name, dir_fd=stack[-1][0])
                    continue
                child, st = item
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(child, dir_fd=fd)
                elif len(stack) >= _OPEN_DIRS:
                    os.rename(child, f".rm-{uuid.uuid4().hex}", src_dir_fd=fd, dst_dir_fd=top_fd)
                else:
                    try:
                        sub = _open_at(fd, child, _O_DIR, f"{shown}/{child}")
                    except UnsafePathError:
                        os.unlink(child, dir_fd=fd)  # swapped for a link: remove the link
                        continue
                    stack.append((sub, child, iter(_entries(sub))))
        finally:
            for fd, _name, _it in stack[1:]:
                os.close(fd)
    raise OSError(errno.ENOTEMPTY, "entries keep appearing while it is removed", shown)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and everything below it, following no link.

    A link at ``path`` is removed itself, never its target; a missing path is
    fine. Any entry that cannot be removed raises (``OSError``): a removal that
    fails never fails quietly.
    """
    text = os.fspath(path)
    try:
        st = os.lstat(text)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(text)
        return
    fd = _open_at(None, text, _O_DIR, text)
    try:
        _empty(fd, text)
    finally:
        os.close(fd)
    os.rmdir(text)


def copy_tree(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    under: str | os.PathLike[str] | None = None,
    owner: tuple[int, int] | None = None,
    max_bytes: int | None = None,
    max_entries: int = MAX_ENTRIES,
    max_depth: int = MAX_DEPTH,
    dir_mode: int = 0o700,
    file_mode: int = 0o600,
) -> Listing:
    """Copy the regular files and folders of the tree at ``src`` into ``dst``,
    created fresh (:func:`make_dir`, so it fails if anything is there); the rest is
    :func:`copy_into`. Past ``max_bytes`` it raises :class:`TooLargeError` and
    ``dst`` stays, with what was copied so far, for the caller to remove."""
    make_dir(dst, mode=dir_mode, owner=owner)
    with opened_dir(dst) as dst_fd:
        return copy_into(
            src,
            dst_fd,
            under=under,
            owner=owner,
            max_bytes=max_bytes,
            max_entries=max_entries,
            max_depth=max_depth,
            dir_mode=dir_mode,
            file_mode=file_mode,
        )


def _copy_fd(
    in_fd: int,
    dir_fd: int,
    name: str,
    *,
    budget: int | None,
    owner: tuple[int, int] | None,
    mode: int,
) -> int | None:
    """Copy an open file into a new file ``name`` in ``dir_fd``; None past ``budget``."""
    out_fd = os.open(name, _O_NEW, 0o600, dir_fd=dir_fd)
    copied = 0
    try:
        if owner is not None:
            os.fchown(out_fd, *owner)
        os.fchmod(out_fd, mode)
        while chunk := os.read(in_fd, _CHUNK):
            copied += len(chunk)
            if budget is not None and copied > budget:
                return None
            view = memoryview(chunk)
            while view:
                view = view[os.write(out_fd, view) :]
    finally:
        os.close(out_fd)
    return copied


@contextlib.contextmanager
def opened_dir(
    path: str | os.PathLike[str], *, under: str | os.PathLike[str] | None = None
) -> Iterator[int]:
    """:func:`open_dir` as a context manager that closes the descriptor."""
    fd = open_dir(path, under=under)
    try:
        yield fd
    finally:
        os.close(fd)


def move_entries(src_fd: int, dst: Path) -> list[str]:
    """Rename every entry of the open folder ``src_fd`` into the folder ``dst``
    (same filesystem), never following a link: a link or a FIFO moves as the
    entry itself. Returns the names that could not be moved (a name already in
    ``dst`` is never replaced)."""
    left: list[str] = []
    with opened_dir(dst) as dst_fd:
        for name, _st in _entries(src_fd):
            if os.path.lexists(dst / name):
                left.append(name)
                continue
            try:
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            except OSError:
                left.append(name)
    return left


def make_dirs(
    rel: str | os.PathLike[str],
    *,
    under: str | os.PathLike[str],
    mode: int = 0o700,
    owner: tuple[int, int] | None = None,
) -> int:
    """Open the folder ``under/rel``, making each missing folder of ``rel`` on the
    way, and return its descriptor (the caller closes it).

    ``under`` is a folder the broker trusts; ``rel`` is hostile (:func:`open_dir`
    rules: no ``..``, not absolute). No component below ``under`` is followed if
    it is a link; one that exists as anything but a folder raises
    :class:`UnsafePathError` naming it (``is a file, not a folder``). A folder made
    here gets ``mode`` (not reduced by the umask) and, given, ``owner``, on its
    descriptor; a folder that was already there is left as it is. An empty
    ``rel`` opens ``under`` itself.
    """
    parts = _parts(rel)
    fd = _open_at(None, os.fspath(under), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, "")
    shown = os.fspath(under)
    try:
        for part in parts:
            shown = f"{shown}/{part}"
            made = False
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                made = True
            except FileExistsError:
                pass
            nxt = _open_at(fd, part, _O_DIR, shown)
            os.close(fd)
            fd = nxt
            if made:
                if owner is not None:
                    os.fchown(fd, *owner)
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir_at(
    dir_fd: int,
    name: str,
    *,
    mode: int = 0o700,
    owner: tuple[int, int] | None = None,
) -> int:
    """Create the folder ``name`` fresh in the open folder ``dir_fd`` and return its
    descriptor (the caller closes it).

    It fails with ``FileExistsError`` if anything is there (a link included). The
    new folder is opened without following a link and must belong to this
    process's user: a folder swapped in by someone else between the creation and
    the open is refused (:class:`UnsafePathError`), never chowned. Mode (not
    reduced by the umask) and owner are set on the descriptor.
    """
    if not name or "/" in name or name in (".", ".."):
        raise UnsafePathError(name, "is not a plain name")
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = _open_at(dir_fd, name, _O_DIR, name)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise UnsafePathError(name, "was replaced by someone else's folder as it was created")
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_into(
    src: str | os.PathLike[str],
    dst_fd: int,
    *,
    under: str | os.PathLike[str] | None = None,
    owner: tuple[int, int] | None = None,
    max_bytes: int | None = None,
    max_entries: int = MAX_ENTRIES,
    max_depth: int = MAX_DEPTH,
    dir_mode: int = 0o700,
    file_mode: int = 0o600,
) -> Listing:
    """Copy the regular files and folders of the tree at ``src`` into the open
    folder ``dst_fd``, by descriptor on both sides (:func:`copy_tree` into a folder
    that already exists).

    Every folder and file it creates is new, with ``owner`` and the modes set on
    its descriptor. A name already in the destination is never replaced: an
    existing real folder is entered (its mode and owner left alone), anything
    else there keeps its place and the entry is listed in ``refused``
    (``already in the destination``). What is not a regular file or a folder in
    ``src`` is listed in ``refused`` too. Past ``max_bytes`` it stops with
    :class:`TooLargeError`. A missing ``src`` copies nothing.
    """
    listing = Listing()
    try:
        src_fd = open_dir(src, under=under)
    except FileNotFoundError:
        return listing
    dst_fds: dict[str, int] = {}
    try:
        dst_fds[""] = os.dup(dst_fd)
        for rel, name, st, parent_fd, why in _walk_fd(
            src_fd, max_entries=max_entries, max_depth=max_depth
        ):
            if why:
                if why.startswith("more than"):
                    listing.truncated = f"stopped after {max_entries} entries"
                listing.refused.append(Entry(rel, kind_of(st.st_mode), 0, why))
                continue
            out_parent = dst_fds.get(rel.rpartition("/")[0])
            if out_parent is None:
                continue  # its folder was refused
            if stat.S_ISDIR(st.st_mode):
                sub = _enter_or_make(out_parent, name, rel, owner=owner, mode=dir_mode)
                if sub is None:
                    listing.refused.append(
                        Entry(rel, "folder", 0, "already in the destination, not as a folder")
                    )
                    continue
                dst_fds[rel] = sub
                listing.dirs.append(rel)
                continue
            within_budget = _copy_file(
                parent_fd,
                name,
                rel,
                out_parent,
                listing,
                max_bytes=max_bytes,
                owner=owner,
                mode=file_mode,
            )
            if not within_budget:
                raise TooLargeError(os.fspath(src), f"holds more than {max_bytes} bytes")
    finally:
        os.close(src_fd)
        for fd in dst_fds.values():
            os.close(fd)
    return listing


def _copy_file(
    parent_fd: int | None,
    name: str,
    rel: str,
    out_parent: int,
    listing: Listing,
    *,
    max_bytes: int | None,
    owner: tuple[int, int] | None,
    mode: int,
) -> bool:
    """Copy the regular file ``name`` of ``parent_fd`` into ``out_parent`` for
    :func:`copy_into`, listing it in ``listing`` as copied or refused. False when
    it would take the copy past ``max_bytes`` (what was written of it stays)."""
    try:
        in_fd = _open_at(parent_fd, name, _O_READ, rel)
    except (UnsafePathError, FileNotFoundError):
        listing.refused.append(Entry(rel, "file", 0, "changed while it was copied"))
        return True
    try:
        in_st = os.fstat(in_fd)
        if not stat.S_ISREG(in_st.st_mode):
            listing.refused.append(
                Entry(rel, kind_of(in_st.st_mode), 0, "changed while it was copied")
            )
            return True
        budget = None if max_bytes is None else max_bytes - listing.total_bytes
        try:
            copied = _copy_fd(in_fd, out_parent, name, budget=budget, owner=owner, mode=mode)
        except FileExistsError:
            listing.refused.append(
                Entry(rel, "file", 0, "already in the destination; left as it was")
            )
            return True
    finally:
        os.close(in_fd)
    if copied is None:
        return False
    listing.files.append(Entry(rel, "file", copied))
    listing.total_bytes += copied
    return True


def _enter_or_make(
    parent_fd: int, name: str, rel: str, *, owner: tuple[int, int] | None, mode: int
) -> int | None:
    """A descriptor of the folder ``name`` in ``parent_fd``: created fresh, or the
    real folder already there; None when something else has the name."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        try:
            return _open_at(parent_fd, name, _O_DIR, rel)
        except UnsafePathError:
            return None
    fd = _open_at(parent_fd, name, _O_DIR, rel)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd
