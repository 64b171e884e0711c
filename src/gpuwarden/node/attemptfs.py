"""The broker's own folders for attempts and warm servers, and what it reads back
from them.

An attempt's folder and a warm server's log folder belong to the broker (mode
0700, under a state directory of mode 0700); what a job or a server writes inside
them is hostile and is only ever touched through :mod:`gpuwarden.safefs`:

- :func:`new_attempt_dir` creates ``jobs/<job>/attempt-<N>/`` fresh. One that is
  already there (the store lost commits, and hands out an attempt number again)
  is never reused: it is moved aside to ``attempt-<N>.stale-<unix>-<hex>`` and
  the caller logs that.
- :func:`read_message` reads a job's ``message.json`` bounded, never following a
  link and never blocking on a FIFO; a file it refuses is noted, not read.
- :func:`host_disk_full` says whether the node's own disk under an attempt's
  folder was full when it ended (``statvfs``), or its stderr says a write into
  that folder failed with ENOSPC: a failure then is the host's, not the job's.
- :func:`list_outputs` lists an output folder without following links or
  recursing; what is not a regular file or a folder is listed as refused.
- :class:`ExchangeSlot` is one job's folder in a warm server's exchange folder,
  which the server can write: whatever it planted at the slot's name is removed
  without being followed, the slot is made fresh and held by its descriptor, the
  job's inputs are copied in, and the outputs are moved out by descriptor.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.errors import GpuwardenError
from gpuwarden.hostfaults import disk_full
from gpuwarden.safefs import UnsafePathError

__all__ = [
    "DIR_MODE",
    "EXCHANGE_MODE",
    "MESSAGE_FILES",
    "MESSAGE_LIMIT",
    "ExchangeError",
    "ExchangeSlot",
    "Message",
    "NewAttemptDir",
    "missing_outputs",
    "new_attempt_dir",
    "own_dir",
    "read_message",
    "write_new_file",
]

#: the broker's own folders: the state directory, jobs/, each job's and attempt's
DIR_MODE = 0o700
#: a warm server's exchange folder: the server may pass through it (its slots are
#: its own) but not list or change it
EXCHANGE_MODE = 0o711
#: a job's message file is read up to this size; a larger one is ignored
MESSAGE_LIMIT = 64 * 1024
#: where a job's message file may be, relative to its attempt folder: a host job
#: writes the first, a sandboxed one the second, a warm server's job the broker
MESSAGE_FILES = ("message.json", "report/message.json")
#: what a message becomes in the result, at most
MESSAGE_CHARS = 2000


class ExchangeError(GpuwardenError):
    """A warm server's exchange slot could not be used safely."""


def own_dir(path: Path, *, mode: int = DIR_MODE) -> None:
    """The broker's folder at ``path``: created with ``mode`` when missing. Anything
    but a real folder under that name (a link, a file) is refused."""
    try:
        safefs.make_dir(path, mode=mode)
    except FileExistsError:
        found = os.lstat(path).st_mode
        if not stat.S_ISDIR(found):
            raise UnsafePathError(path, f"is a {safefs.kind_of(found)}, not a folder") from None


@dataclass(frozen=True, slots=True)
class NewAttemptDir:
    path: Path
    #: where a folder found under the attempt's name was moved, or None
    moved_aside: Path | None = None


def new_attempt_dir(jobs_dir: Path, job_id: str, number: int, *, now: float) -> NewAttemptDir:
    """Create ``jobs_dir/<job_id>/attempt-<number>/`` fresh (mode 0700).

    An attempt folder is never reused: one already there (from a run whose
    commits the store lost) is renamed, as the entry it is (a link stays a link),
    to ``attempt-<number>.stale-<unix seconds>-<6 hex>`` first.
    """
    own_dir(jobs_dir)
    job_dir = jobs_dir / job_id
    own_dir(job_dir)
    path = job_dir / f"attempt-{number}"
    moved: Path | None = None
    try:
        safefs.make_dir(path, mode=DIR_MODE)
    except FileExistsError:
        moved = job_dir / f"attempt-{number}.stale-{int(now)}-{secrets.token_hex(3)}"
        path.rename(moved)  # the entry itself: a link stays a link
        safefs.make_dir(path, mode=DIR_MODE)
    return NewAttemptDir(path, moved)


def write_new_file(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write a file the broker creates in a folder of its own: created fresh
    (``O_EXCL``, never through a link), ``mode`` set on its descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Message:
    """What a job's message files said: the message (or None), and why a file that
    was there was not used (empty when none was refused)."""

    text: str | None = None
    notes: tuple[str, ...] = ()


def read_message(attempt_dir: Path) -> Message:
    """The ``message`` of the first of :data:`MESSAGE_FILES` that holds one.

    Each is opened through :func:`safefs.read_bytes` below ``attempt_dir``: a
    symlink (in any component), a FIFO, a device, a socket or a file larger than
    :data:`MESSAGE_LIMIT` is not read, and says so in ``notes``; so does a file
    that is not a JSON object. A missing file is no note.
    """
    notes: list[str] = []
    for rel in MESSAGE_FILES:
        try:
            data = safefs.read_bytes(rel, MESSAGE_LIMIT, under=attempt_dir)
        except FileNotFoundError:
            continue
        except safefs.TooLargeError:
            notes.append(f"{rel} is larger than {MESSAGE_LIMIT} bytes; ignored")
            continue
        except UnsafePathError as exc:
            notes.append(f"{rel} {exc.why}; ignored")
            continue
        except OSError as exc:
            notes.append(f"{rel} could not be read ({exc.strerror or exc}); ignored")
            continue
        try:
            parsed: Any = json.loads(data)
        except ValueError:
            notes.append(f"{rel} is not valid JSON; ignored")
            continue
        if not isinstance(parsed, dict):
            notes.append(f"{rel} holds no JSON object; ignored")
            continue
        if parsed.get("message") is not None:
            return Message(str(parsed["message"])[:MESSAGE_CHARS], tuple(notes))
    return Message(None, tuple(notes))


#: what a process's stderr says when a write failed for want of space
_ENOSPC_MARKERS = ("No space left on device", "ENOSPC", "Disk quota exceeded")


def host_disk_full(attempt_dir: Path, stderr: str) -> str | None:
    """The node's disk under ``attempt_dir`` (its state disk) is full now, or the
    job's stderr says a write into its attempt folder failed for want of space:
    said for a person (a fact for :mod:`gpuwarden.core.classify`); else None."""
    full = disk_full(attempt_dir)
    if full is not None:
        return full
    if str(attempt_dir) in stderr and any(m in stderr for m in _ENOSPC_MARKERS):
        return f"its write into its attempt folder {attempt_dir} failed: no space left"
    return None


def list_outputs(attempt_dir: Path) -> safefs.Listing:
    """The attempt's ``out/`` folder: its regular files, and what was refused."""
    return safefs.walk("out", under=attempt_dir)


def missing_outputs(wanted: Sequence[str], listing: safefs.Listing) -> tuple[str, ...]:
    """The wanted outputs that are not regular files of ``listing`` (a link, a FIFO
    or a folder under a wanted name counts as missing)."""
    files = {e.path for e in listing.files}
    return tuple(w for w in wanted if _normal(w) not in files)


def _normal(rel: str) -> str:
    return "/".join(p for p in rel.split("/") if p and p != ".")


@dataclass
class ExchangeSlot:
    """One job's folder ``<exchange>/<name>`` in a warm server's exchange folder.

    Used by one worker thread: :meth:`open` before the job is sent, then
    :meth:`collect` and :meth:`close` after its result (or failure).
    """

    exchange: Path
    name: str
    #: the owner of what the broker creates in it (the sandbox's user), or None
    owner: tuple[int, int] | None = None
    #: what the server had left under the slot's name, removed by :meth:`open`
    #: ("symlink", "folder", ...), or None when nothing was there
    cleared: str | None = None
    #: entries that could not be used, as ``{"path", "kind", "why"}``
    refused: list[dict[str, str]] = field(default_factory=list)
    _fd: int | None = None

    @property
    def path(self) -> Path:
        return self.exchange / self.name

    def open(self, input_dir: Path | None) -> None:
        """Clear the slot's name, make the slot fresh with ``in/``, ``out/`` and
        ``scratch/``, and copy the job's inputs into ``in/``.

        What is under the name (a link is removed as the link, never followed) is
        removed first; if that fails, or something appears under the name again
        before the slot is made, :class:`ExchangeError` says so and nothing is
        written. Everything below the slot is made through its descriptor, so a
        server that renames the slot or replaces it with a link meanwhile only
        ever moves the broker's writes around inside its own exchange folder.
        """
        try:
            self.cleared = safefs.kind_of(os.lstat(self.path).st_mode)
        except FileNotFoundError:
            self.cleared = None
        try:
            safefs.remove_tree(self.path)
        except (OSError, UnsafePathError) as exc:
            raise ExchangeError(
                f"the {self.cleared or 'entry'} its server left at {self.path} could not be "
                f"removed ({exc}); nothing was written through it"
            ) from None
        if self.cleared is not None:
            self.refused.append(
                {
                    "path": f"exchange/{self.name}",
                    "kind": self.cleared,
                    "why": "its warm server had left this under the job's slot name; "
                    "removed without being followed",
                }
            )
        with safefs.opened_dir(self.exchange) as exchange_fd:
            try:
                self._fd = safefs.make_dir_at(
                    exchange_fd, self.name, mode=DIR_MODE, owner=self.owner
                )
            except (FileExistsError, UnsafePathError) as exc:
                raise ExchangeError(
                    f"something appeared at {self.path} while the broker made the job's "
                    f"folder there ({exc}); nothing was written through it"
                ) from None
        for sub in ("in", "out", "scratch"):
            os.close(safefs.make_dir_at(self._fd, sub, mode=DIR_MODE, owner=self.owner))
        if input_dir is not None:
            in_fd = safefs.open_dir_at(self._fd, "in")
            try:
                copied = safefs.copy_into(input_dir, in_fd, owner=self.owner)
            finally:
                os.close(in_fd)
            for e in copied.refused:
                self.refused.append(
                    {"path": f"inputs/{e.path}", "kind": e.kind, "why": f"not copied: {e.why}"}
                )

    def collect(self, out_dir: Path) -> None:
        """Move what the job left in the slot's ``out/`` into ``out_dir`` (the
        attempt's own, same file system), by descriptor: each entry moves as what
        it is (a link as a link, to be refused when the outputs are listed).
        Entries that cannot be moved are listed in :attr:`refused`."""
        if self._fd is None:
            return
        try:
            out_fd = safefs.open_dir_at(self._fd, "out")
        except FileNotFoundError:
            self.refused.append(
                {"path": ".", "kind": "missing", "why": "the server removed the output folder"}
            )
            return
        except UnsafePathError as exc:
            self.refused.append(
                {"path": ".", "kind": "output folder", "why": f"{exc.why}; nothing taken from it"}
            )
            return
        try:
            left = safefs.move_entries(out_fd, out_dir)
        finally:
            os.close(out_fd)
        for name in left:
            shown = os.fsencode(name).decode("utf-8", "backslashreplace")
            self.refused.append(
                {
                    "path": shown,
                    "kind": "entry",
                    "why": "could not be moved out of the server's exchange folder",
                }
            )

    def close(self) -> None:
        """Remove the slot (never following a link); a failure raises
        :class:`ExchangeError`."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            safefs.remove_tree(self.path)
        except (OSError, UnsafePathError) as exc:
            raise ExchangeError(
                f"the job's folder {self.path} in its server's exchange folder could not be "
                f"removed ({exc})"
            ) from None
