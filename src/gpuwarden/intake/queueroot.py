"""Queue roots: a directory tree ``inbox/ processing/ outbox/ failed/``.

Clients write a bundle into ``inbox/`` under a temporary name (one starting
with ``.`` or ending in ``.tmp`` or ``.part``) and rename it when it is whole.
The broker claims a bundle by renaming it into ``processing/``, and finally
puts a result bundle of the same name into ``outbox/``, or the bundle itself
into ``failed/``. Every move is a rename within the root, so each is atomic on
one file system.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.errors import BundleError, QueueRootError
from gpuwarden.intake.bundle import is_temp_name

__all__ = ["SUBFOLDERS", "QueueRoot"]

SUBFOLDERS = ("inbox", "processing", "outbox", "failed")


#: suffix of a refused bundle's input, kept in ``failed/`` beside its result
KEPT_INPUT = ".input.zip"


def _is_bundle_name(name: str) -> bool:
    return not is_temp_name(name) and name.lower().endswith(".zip")


def _plain_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")
    return name


def _check_writable(root: Path, folder: Path) -> None:
    """Raise QueueRootError unless ``folder`` is a directory we can create files in."""
    if not folder.is_dir():
        if folder.exists() or folder.is_symlink():
            raise QueueRootError(
                f"queue root {root}: {folder} is not a directory; move it away so the "
                "folder can be created (open the queue root with create=True)"
            )
        raise QueueRootError(
            f"queue root {root}: folder {folder} is missing; create it, or open the queue "
            "root with create=True"
        )
    hint = "fix its permissions or ownership, or mount the share read-write"
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QueueRootError(f"queue root {root}: folder {folder} is not writable; {hint}")
    probe = folder / f".probe-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise QueueRootError(
            f"queue root {root}: folder {folder} is not writable ({exc.strerror}); {hint}"
        ) from None


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
    def open(cls, path: Path, *, create: bool) -> QueueRoot:
        """Check the queue root at ``path`` and return it.

        With ``create`` the root and any missing subfolder are made. Raises
        :class:`QueueRootError`, naming the path and what to do, when the root is
        missing (without ``create``), or the root or a subfolder is not a
        directory or not writable (tested by creating and removing a probe file).
        """
        root = Path(path)
        if not root.exists():
            if not create:
                raise QueueRootError(
                    f"queue root {root} does not exist; create it, or open it with create=True"
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
            _check_writable(root, folder)
        return qr

    def _bundles(self, folder: Path) -> list[tuple[float, str, Path]]:
        out: list[tuple[float, str, Path]] = []
        try:
            it = os.scandir(folder)
        except FileNotFoundError:
            return out
        with it:
            for entry in it:
                if not _is_bundle_name(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # claimed or removed meanwhile
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((st.st_mtime, entry.name, Path(entry.path)))
        return out

    def pending(self) -> list[Path]:
        """Whole bundles in ``inbox/``, oldest first (by mtime, then name).

        Temporary names (``.x``, ``x.tmp``, ``x.part``), directories, symlinks
        and files not ending in ``.zip`` are left out."""
        return [path for _mtime, _name, path in sorted(self._bundles(self.inbox))]

    def claim(self, path: Path) -> Path:
        """Move the bundle ``path`` from ``inbox/`` to ``processing/`` by one
        atomic rename; return its new path.

        Raises :class:`BundleError` when a bundle of that name already sits in
        ``processing/`` (a duplicate bundle name: the caller rejects it), and
        FileNotFoundError when the bundle is gone (another broker claimed it)."""
        name = _plain_name(Path(path).name)
        src = self.inbox / name
        dst = self.processing / name
        if dst.exists() or dst.is_symlink():
            raise BundleError(
                f"bundle {name}: duplicate bundle name, a bundle of that name is already "
                f"being processed ({dst}); give each bundle a unique name"
            )
        src.rename(dst)
        return dst

    def depth(self) -> dict[str, int]:
        """How many bundles (``*.zip``, temporary names left out) each subfolder holds.
        The inputs kept beside refusals in ``failed/`` (``*.input.zip``) are not counted."""
        return {
            sub: sum(
                1 for _, name, _ in self._bundles(self.path / sub) if not name.endswith(KEPT_INPUT)
            )
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
        """Move ``path`` (a file in one of this root's folders) to ``failed/``,
        as ``name`` or under its own name; return the new path. A file of that
        name already in ``failed/`` is replaced."""
        src = self._own(path)
        dst = self.failed / _plain_name(name or src.name)
        src.replace(dst)
        return dst

    def remove_from_processing(self, name: str) -> None:
        """Delete ``processing/<name>``; nothing happens when it is already gone."""
        (self.processing / _plain_name(name)).unlink(missing_ok=True)

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
