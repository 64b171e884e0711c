"""Files over HTTP: the names a client or an agent gives, uploads written and
downloads read through :mod:`gpuwarden.safefs`.

A file's name in a URL (an output's path, an input's name) is hostile. Before
anything touches a disk it is checked here, and every mistake is a 422 that
says what was wrong: not UTF-8, empty, absolute, ``.`` or ``..``, an empty part
(``a//b``, ``a/``), a backslash or a control character, a part longer than
``NAME_MAX`` (255 bytes), more than 4096 bytes in all, or more than
:data:`MAX_PARTS` levels deep.

An upload (:func:`receive`) is streamed into a fresh file in a folder of the
coordinator's own (``.parts``, beside the job folders, where no name a node
chooses can collide with it), then renamed into place: its folders are made or
opened by descriptor below the attempt's folder, never through a link, and a
name that is a file where a folder is needed (``a.txt/b``) or a folder where the
file goes is refused with 422. A download (:func:`open_below` and
:func:`fd_response`) opens the file by descriptor below its folder: a link, a
FIFO, a device or a socket is never served.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote_to_bytes

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from gpuwarden import safefs
from gpuwarden.api.errors import HttpError
from gpuwarden.errors import GpuwardenError

#: the longest name of one file or folder, in bytes of UTF-8 (Linux's NAME_MAX)
NAME_MAX = 255
#: the longest path, in bytes of UTF-8 (Linux's PATH_MAX)
PATH_MAX = 4096
#: the most parts (folders and the file) a path may have: result bundles and
#: output listings walk no deeper (:data:`gpuwarden.safefs.MAX_DEPTH`)
MAX_PARTS = safefs.MAX_DEPTH
#: the folder, beside the job folders, where uploads are written before they are
#: renamed into place (a job id never starts with '.')
PARTS = ".parts"

_O_PART = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


def shown(text: str, keep: int = 60) -> str:
    """A name as an error message shows it: quoted, and cut when it is long."""
    if len(text) <= keep + 20:
        return repr(text)
    return f"{text[:keep]!r}... ({len(text)} characters)"


def check_name(path: str, what: str, *, raw_path: bytes | None = None) -> str:
    """``path`` if it is a relative file name the broker may use, else 422 saying
    what is wrong with it. ``raw_path`` (the request's URL path as sent, still
    percent-encoded) tells bytes that are not UTF-8 from a real U+FFFD."""
    not_utf8 = (
        f"{what} is not valid UTF-8 (the URL has percent-encoded bytes that are not UTF-8, "
        "such as %FF): name files in UTF-8"
    )
    if raw_path is not None:
        try:
            unquote_to_bytes(raw_path).decode("utf-8")
        except UnicodeDecodeError:
            raise HttpError(422, not_utf8) from None
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise HttpError(422, not_utf8) from None
    if not path:
        raise HttpError(
            422, f"{what} is empty: give the file's path below its folder, e.g. out.txt or a/b.txt"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise HttpError(
            422,
            f"{what} {shown(path)} has a control character (such as NUL or a newline): "
            "use a name without one",
        )
    if "\\" in path:
        raise HttpError(422, f"{what} {shown(path)} has a backslash: use '/' between folders")
    if path.startswith("/"):
        raise HttpError(
            422, f"{what} {shown(path)} is absolute: give it relative to its folder, without '/'"
        )
    if len(encoded) > PATH_MAX:
        raise HttpError(
            422,
            f"{what} {shown(path)} is {len(encoded)} bytes long; a path may have at most "
            f"{PATH_MAX} bytes (UTF-8)",
        )
    parts = path.split("/")
    if any(p in (".", "..") for p in parts):
        raise HttpError(
            422, f"{what} {shown(path)} names '.' or '..': give a path inside its folder"
        )
    if any(not p for p in parts):
        raise HttpError(
            422,
            f"{what} {shown(path)} has an empty part ('//', or '/' at the end): name a file, "
            "e.g. a/b.txt",
        )
    if len(parts) > MAX_PARTS:
        raise HttpError(
            422,
            f"{what} {shown(path)} is {len(parts)} levels deep; at most {MAX_PARTS} are taken",
        )
    for p in parts:
        size = len(p.encode("utf-8"))
        if size > NAME_MAX:
            which = "is" if p == path else f"has a part ({shown(p, 30)}) that is"
            raise HttpError(
                422,
                f"{what} {shown(path)} {which} {size} bytes long; a file or folder name may "
                f"have at most {NAME_MAX} bytes (UTF-8): use a shorter name",
            )
    return path


def _inside(exc: safefs.UnsafePathError, root: Path) -> str:
    """The part of a refused path below ``root``: never a host path in an answer."""
    prefix = f"{root}/"
    return exc.path[len(prefix) :] if exc.path.startswith(prefix) else ""


# -- uploads ----------------------------------------------------------------------


def _open_leaf(root: Path, rel: str, what: str) -> int:
    """The folder the file ``rel`` goes in, made below ``root`` as needed."""
    parent = rel.rpartition("/")[0]
    try:
        fd = safefs.make_dirs(parent, under=root)
    except safefs.UnsafePathError as exc:
        hint = " (a file cannot hold other files)" if exc.why.endswith("not a folder") else ""
        raise HttpError(
            422,
            f"{what} {shown(rel)} cannot be written: {shown(_inside(exc, root))} {exc.why}{hint}",
        ) from None
    except OSError as exc:
        raise _cannot_store(exc) from None
    name = rel.rpartition("/")[2]
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return fd
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise HttpError(422, _is_a_folder(rel, what))
    return fd


def _is_a_folder(rel: str, what: str) -> str:
    return (
        f"{what} {shown(rel)} exists as a folder (other files were sent below it): "
        "a file cannot take its place"
    )


async def receive(
    request: Request,
    *,
    root: Path,
    rel: str,
    parts_dir: Path,
    limit: int,
    what: str = "output path",
) -> int:
    """Stream the request's body into ``root/rel`` (``rel`` checked by
    :func:`check_name`; ``root`` a folder the coordinator made); return its size.
    The body goes first into a fresh file in ``parts_dir`` (the coordinator's own,
    on the same filesystem). 413 past ``limit`` bytes (nothing is kept); 422 when
    ``rel`` cannot be a file there. A file that was sent before under the same
    name (an agent that did not get the answer sends it again) is replaced, as a
    whole, by the rename; nothing else is."""
    leaf_fd = await run_in_threadpool(_open_leaf, root, rel, what)
    try:
        parts_dir.mkdir(mode=0o700, exist_ok=True)
        parts_fd = safefs.open_dir(parts_dir)
    except safefs.UnsafePathError as exc:
        os.close(leaf_fd)
        # the coordinator's own folder: not the sender's fault
        raise _cannot_store(f"its folder for uploads {exc.why}") from None
    except OSError as exc:
        os.close(leaf_fd)
        raise _cannot_store(exc) from None
    except BaseException:
        os.close(leaf_fd)
        raise
    tmp = f"{secrets.token_hex(8)}.part"
    written = 0
    try:
        out = os.open(tmp, _O_PART, 0o600, dir_fd=parts_fd)
        try:
            try:
                async for chunk in request.stream():
                    written += len(chunk)
                    if written > limit:
                        raise HttpError(
                            413,
                            f"{what} {shown(rel)} is larger than the coordinator accepts "
                            f"({limit} bytes, api.max_output_mib in its config)",
                        )
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view) :]
            except ClientDisconnect:
                raise HttpError(413, "the upload was cut short") from None
        finally:
            os.close(out)
        name = rel.rpartition("/")[2]
        try:
            os.rename(tmp, name, src_dir_fd=parts_fd, dst_dir_fd=leaf_fd)
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise HttpError(422, _is_a_folder(rel, what)) from None
            raise _cannot_store(exc) from None
    except OSError as exc:
        raise _cannot_store(exc) from None
    finally:
        try:
            os.unlink(tmp, dir_fd=parts_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(parts_fd)
            os.close(leaf_fd)
    return written


def _cannot_store(exc: OSError | str) -> HttpError:
    """The coordinator's own disk failed (full, read-only): not the sender's fault.
    Says why without a host path."""
    why = exc if isinstance(exc, str) else (exc.strerror or type(exc).__name__)
    return HttpError(
        503,
        f"the coordinator could not store the file ({why}): try again later",
        {"Retry-After": "30"},
    )


# -- downloads ----------------------------------------------------------------------


class NotServed(GpuwardenError):
    """The file is not there, or is not a regular file reached without a link."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def open_below(root: Path, rel: str) -> tuple[int, os.stat_result]:
    """Open the regular file ``root/rel`` for reading by descriptor (no link in
    any part below ``root``, never blocking on a FIFO), with its ``fstat``;
    :class:`NotServed` saying why not."""
    try:
        fd = safefs.open_file(rel, under=root)
    except safefs.UnsafePathError as exc:
        where = _inside(exc, root)
        raise NotServed(
            f"{shown(where)} {exc.why}" if where not in ("", rel) else exc.why
        ) from None
    except FileNotFoundError:
        raise NotServed("is not there (any more)") from None
    except OSError as exc:
        raise NotServed(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    return fd, os.fstat(fd)


def fd_response(fd: int, st: os.stat_result, filename: str) -> StreamingResponse:
    """Stream an open file (at most the size it had when opened), then close it."""
    f = os.fdopen(fd, "rb", buffering=0)

    def chunks() -> Iterator[bytes]:
        left = st.st_size
        try:
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk
        finally:
            f.close()

    quoted = quote(filename)
    disposition = (
        f"attachment; filename*=utf-8''{quoted}"
        if quoted != filename
        else f'attachment; filename="{filename}"'
    )
    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={"content-length": str(st.st_size), "content-disposition": disposition},
        background=BackgroundTask(f.close),
    )
