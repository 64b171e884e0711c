"""Fetching a job's source (SPEC.md, "Jobs from a pinned commit").

A repository is hostile input: the node fetches exactly one commit of it with
git, hooks off, no prompt, only the URL's own protocol allowed, bounded in time,
after checking the URL against ``[sources] allow`` once more (a ``file://`` one
with its links resolved); checks that the commit it got is the one asked for; and
exports its tree with ``git archive``, streamed straight into a fresh folder the
broker owns, refusing links that leave the tree, special files and trees past a
size (the archive is stopped at the first entry past it). The module is then read
from that folder like any other (``registry.parse_source_module``). Everything lives under
``<state>/sources/``: ``repos/<sha256 of the URL>.git`` (bare repositories) and
``trees/<commit>/`` (one exported tree per commit, never changed once there).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import tarfile
import tempfile
import threading
import uuid
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlsplit

from gpuwarden import safefs
from gpuwarden.core.sources import JobSource, allows, check_commit, check_repo
from gpuwarden.errors import ModuleError, ValidationError
from gpuwarden.registry import Module, parse_source_module

#: what a source's tree may hold at most, all files together, and how many entries
MAX_TREE_BYTES = 256 * 1024**2
MAX_TREE_ENTRIES = 20_000
#: the most of ``git archive``'s output read: the files and their names and headers
MAX_ARCHIVE_BYTES = MAX_TREE_BYTES + 64 * 1024**2
#: module.toml and Containerfile are read whole: at most this many bytes
MAX_META_BYTES = 64 * 1024
#: the file a source's image is built from
CONTAINERFILE = "Containerfile"
_CHUNK = 1 << 20


class SourceCache:
    """Fetches and exports commits under ``root`` (``<state>/sources``) and reads
    their modules; ``allow`` is the host's ``[sources] allow``; ``refusal``, where
    set, is why this node runs no source at all (no podman or docker here);
    ``who``: what the host is, as refusals name it (a coordinator fetches a
    commit's ``module.toml`` to learn its types and builds nothing)."""

    def __init__(
        self,
        root: Path,
        allow: tuple[str, ...],
        *,
        refusal: str | None = None,
        timeout_s: float = 120.0,
        git: str = "git",
        who: str = "node",
    ) -> None:
        self.root = root
        self.who = who
        self.allow = allow
        self.refusal = refusal
        self.timeout_s = timeout_s
        self.git = git
        self._lock = threading.Lock()

    def module(self, source: JobSource) -> Module:
        """The module at ``source``'s commit (fetched once, then read from the
        cache); :class:`ValidationError` saying why not."""
        try:
            check_commit(source.commit)
            check_repo(source.repo, self.allow, who=self.who)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if self.refusal is not None:
            raise ValidationError(f"source {source.repo}: {self.refusal}")
        with self._lock:
            tree = self.tree(source)
        where = f"commit {source.commit} of {source.repo}"
        for name in ("module.toml", CONTAINERFILE):
            try:
                safefs.read_bytes(name, MAX_META_BYTES, under=tree)
            except FileNotFoundError:
                raise ValidationError(f"{where} has no {name} at its top") from None
            except safefs.UnsafePathError as exc:
                raise ValidationError(f"{where}: {exc.why}: {name}") from None
        try:
            return parse_source_module(tree, source)
        except ModuleError as exc:
            raise ValidationError(f"{where}: {exc}") from None

    def tree_of(self, commit: str) -> Path:
        """Where the tree of ``commit`` is (or would be) exported."""
        return self.root / "trees" / check_commit(commit)

    def tree(self, source: JobSource) -> Path:
        """The exported tree of ``source``'s commit: fetched and exported now
        unless it already is."""
        dest = self.tree_of(source.commit)
        if dest.is_dir():
            return dest
        bare = self._fetch(source)
        (self.root / "trees").mkdir(parents=True, exist_ok=True, mode=0o755)
        tmp = self.root / "trees" / f".new-{uuid.uuid4().hex}"
        safefs.make_dir(tmp, mode=0o755)
        try:
            self._export(bare, source, tmp)
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.is_dir():  # not another process that won the race
                    raise
        finally:
            safefs.remove_tree(tmp)
        return dest

    def _fetch(self, source: JobSource) -> Path:
        """Fetch exactly the commit into the URL's bare repository; check it."""
        url, commit = source.repo, source.commit
        self._check_url(url)  # again, just before git reads it
        key = hashlib.sha256(url.encode()).hexdigest()[:32]
        bare = self.root / "repos" / f"{key}.git"
        if not bare.is_dir():
            bare.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._git(None, "init", "--quiet", "--bare", str(bare), what="git init")
        self._git(
            bare,
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-recurse-submodules",
            "--depth",
            "1",
            url,
            commit,
            what=f"fetching commit {commit} of {url}",
            scheme=urlsplit(url).scheme,
        )
        got = self._git(
            bare, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", what="rev-parse"
        ).strip()
        if got != commit:
            raise ValidationError(f"{url}: fetched {got or 'nothing'}, not commit {commit}")
        return bare

    def _check_url(self, url: str) -> None:
        """The URL under this host's ``[sources] allow`` (the rules of
        :func:`check_repo`), checked just before it is fetched; a ``file://`` one
        also with its links resolved, where git looks (``PATH``, ``PATH.git``): the
        folder a link leads to must be allowed too, and a file there or a ``.git``
        in it that is a file or a link (``gitdir: ...``) is refused: either would
        send git to another repository."""
        try:
            check_repo(url, self.allow, who=self.who)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if urlsplit(url).scheme != "file":
            return
        path = unquote(urlsplit(url).path).rstrip("/") or "/"
        for place in (path, f"{path}.git"):
            if not os.path.lexists(place):
                continue
            real = os.path.realpath(place)
            if real != place and not allows(self.allow, f"file://{real}"):
                raise ValidationError(
                    f"source repo {url}: {place} leads to {real} (through a link), which this "
                    f"{self.who}'s [sources] allow does not match (allowed: "
                    f"{', '.join(self.allow)}); give the URL of the real folder, or allow it"
                )
            inner = Path(place, ".git")
            if not Path(place).is_dir() or (
                os.path.lexists(inner) and (inner.is_symlink() or not inner.is_dir())
            ):
                shown = place if not Path(place).is_dir() else inner
                raise ValidationError(
                    f"source repo {url}: {shown} is a file or a link, not a folder (it could "
                    "send git to another repository); give the URL of the repository's own "
                    "folder"
                )

    def _export(self, bare: Path, source: JobSource, dest: Path) -> None:
        """``git archive`` of the commit, streamed into the fresh ``dest``: a tree
        past a limit stops the archive at once (nothing past the limit is written)
        and is refused saying so; a ``git archive`` that fails or takes longer than
        ``timeout_s`` is refused saying that."""
        where = f"commit {source.commit} of {source.repo}"
        argv = [*self._base(bare), "archive", "--format=tar", source.commit]
        with tempfile.TemporaryFile() as errors:
            try:
                proc = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=errors, env=self._env()
                )
            except OSError as exc:
                raise ValidationError(
                    f"git archive: git cannot be run here ({exc.strerror})"
                ) from None
            assert proc.stdout is not None
            late = threading.Event()

            def too_slow() -> None:
                late.set()
                proc.kill()

            timer = threading.Timer(self.timeout_s, too_slow)
            timer.start()
            refusal: ValidationError | None = None
            try:
                stream = _Capped(proc.stdout, MAX_ARCHIVE_BYTES)
                try:
                    _extract(stream, dest, where)
                    while stream.read(_CHUNK):  # the archive's padding after its end
                        pass
                except _TooLarge:
                    raise _OverLimit(_too_large(where, archive=True)) from None
            except ValidationError as exc:
                refusal = exc
                if not isinstance(exc, _OverLimit):  # a cut-off archive: git may be ending
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=1)
                proc.kill()  # stop the archive now: nothing more of it is read
            except BaseException:
                proc.kill()
                raise
            finally:
                proc.stdout.close()
                proc.wait()  # it ended, or was killed (by the timer at the latest)
                timer.cancel()
            if late.is_set():
                raise ValidationError(
                    f"{where}: git archive took longer than {self.timeout_s:g} s "
                    "([sources] fetch_timeout_s)"
                )
            code = proc.returncode
            if code != 0 and (refusal is None or code != -signal.SIGKILL):
                errors.seek(0)  # git's own failure explains a cut-off archive best
                last = errors.read(64 * 1024).decode(errors="replace").strip().splitlines()
                raise ValidationError(
                    f"{where}: its tree could not be exported (git archive failed: "
                    f"{last[-1] if last else f'exit {code}'})"
                )
            if refusal is not None:
                raise refusal

    def _base(self, bare: Path | None, scheme: str | None = None) -> list[str]:
        """git with hooks off, every protocol refused but ``scheme``."""
        argv = [self.git, "-c", "core.hooksPath=/dev/null", "-c", "protocol.allow=never"]
        if scheme is not None:
            argv += ["-c", f"protocol.{scheme}.allow=always"]
        if bare is not None:
            argv += ["--git-dir", str(bare)]
        return argv

    def _env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_ASKPASS": "/bin/false",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_SSH_COMMAND": "ssh -o BatchMode=yes",
            "LC_ALL": "C",
        }

    def _git(self, bare: Path | None, *args: str, what: str, scheme: str | None = None) -> str:
        try:
            done = subprocess.run(
                [*self._base(bare, scheme), *args],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self.timeout_s,
                env=self._env(),
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ValidationError(f"{what}: took longer than {self.timeout_s:g} s") from None
        except OSError as exc:
            raise ValidationError(f"{what}: git cannot be run here ({exc.strerror})") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ValidationError(f"{what} failed: {last}")
        return done.stdout


class _TooLarge(Exception):
    """More of ``git archive``'s output than :data:`MAX_ARCHIVE_BYTES`."""


class _OverLimit(ValidationError):
    """A tree refused for its size or its entries: the archive is stopped at once."""


class _Capped:
    """A stream read up to ``cap`` bytes: past them, :class:`_TooLarge`."""

    def __init__(self, raw: IO[bytes], cap: int) -> None:
        self.raw = raw
        self.cap = cap
        self.got = 0

    def read(self, size: int = -1, /) -> bytes:
        want = self.cap + 1 - self.got
        chunk = self.raw.read(want if size < 0 else min(size, want))
        self.got += len(chunk)
        if self.got > self.cap:
            raise _TooLarge
        return chunk

    def tell(self) -> int:
        return self.got

    def write(self, b: bytes, /) -> int:
        raise OSError("read only")

    def seek(self, pos: int, /) -> int:
        raise OSError("not seekable")

    def close(self) -> None:
        """The caller closes the stream it gave."""


def _mib(n: int) -> str:
    return f"{n / 1024**2:g} MiB"


def _too_large(where: str, *, archive: bool = False) -> str:
    """Why a tree is refused for its size, and what to do."""
    what = (
        f"its archive (its files with their names) passes {_mib(MAX_ARCHIVE_BYTES)}"
        if archive
        else f"its files pass {_mib(MAX_TREE_BYTES)} together"
    )
    return (
        f"{where} is too large: {what}, the most a job's source may hold (SPEC.md section "
        "20, Fetch); keep large files (model weights, data sets) out of the repository and "
        "give them to the job another way, such as a bundle's inputs"
    )


def _extract(stream: _Capped, dest: Path, where: str) -> None:
    """Extract git's tar, read from ``stream`` as it comes, into ``dest``: the
    "data" filter refuses absolute names, links that leave ``dest`` and special
    files; the entries and the files' sizes are counted from each entry's header,
    before it is written, so the first one past a limit stops it."""
    entries = size = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                entries += 1
                if entries > MAX_TREE_ENTRIES:
                    raise _OverLimit(
                        f"{where} is too large: more than {MAX_TREE_ENTRIES} entries (files "
                        "and folders), the most a job's source may hold (SPEC.md section 20, "
                        "Fetch); keep the repository's tree smaller"
                    )
                if member.isfile():
                    size += member.size
                    if size > MAX_TREE_BYTES:
                        raise _OverLimit(_too_large(where))
                tar.extract(member, dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ValidationError(f"{where}: its tree was refused: {exc}") from None
