"""Fetching a job's source (SPEC.md, "Jobs from a pinned commit").

A repository is hostile input: the node fetches exactly one commit of it with
git, hooks off, no prompt, only the URL's own protocol allowed, bounded in time;
checks that the commit it got is the one asked for; and exports its tree with
``git archive`` into a fresh folder the broker owns, refusing links that leave the
tree, special files and trees past a size. The module is then read from that
folder like any other (``registry.parse_source_module``). Everything lives under
``<state>/sources/``: ``repos/<sha256 of the URL>.git`` (bare repositories) and
``trees/<commit>/`` (one exported tree per commit, never changed once there).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from gpuwarden import safefs
from gpuwarden.core.sources import JobSource, check_commit, check_repo
from gpuwarden.errors import ModuleError, ValidationError
from gpuwarden.registry import Module, parse_source_module

#: what a source's tree may hold at most, all files together, and how many entries
MAX_TREE_BYTES = 256 * 1024**2
MAX_TREE_ENTRIES = 20_000
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
        key = hashlib.sha256(source.repo.encode()).hexdigest()[:32]
        bare = self.root / "repos" / f"{key}.git"
        if not bare.is_dir():
            bare.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._git(None, "init", "--quiet", "--bare", str(bare), what="git init")
        url, commit = source.repo, source.commit
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

    def _export(self, bare: Path, source: JobSource, dest: Path) -> None:
        """``git archive`` of the commit, extracted into the fresh ``dest``."""
        archive = dest.parent / f"{dest.name}.tar"
        argv = [*self._base(bare), "archive", "--format=tar", source.commit]
        try:
            with archive.open("xb") as out:
                proc = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self._env()
                )
                assert proc.stdout is not None
                got = 0
                while chunk := proc.stdout.read(_CHUNK):
                    got += len(chunk)
                    if got > 2 * MAX_TREE_BYTES:
                        proc.kill()
                        break
                    out.write(chunk)
                proc.wait(timeout=self.timeout_s)
            if got > 2 * MAX_TREE_BYTES or proc.returncode != 0:
                raise ValidationError(
                    f"commit {source.commit} of {source.repo}: its tree could not be exported "
                    f"(git archive {'passed the size limit' if proc.returncode == 0 else 'failed'})"
                )
            _extract(archive, dest, f"commit {source.commit} of {source.repo}")
        finally:
            archive.unlink(missing_ok=True)

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


def _extract(archive: Path, dest: Path, where: str) -> None:
    """Extract a tar of git's into ``dest``: the "data" filter refuses absolute
    names, links that leave ``dest`` and special files; sizes are counted first."""
    try:
        with tarfile.open(archive, "r:") as tar:
            members = tar.getmembers()
            if len(members) > MAX_TREE_ENTRIES:
                raise ValidationError(f"{where}: more than {MAX_TREE_ENTRIES} entries")
            if sum(m.size for m in members if m.isfile()) > MAX_TREE_BYTES:
                raise ValidationError(f"{where}: larger than {MAX_TREE_BYTES // 1024**2} MiB")
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ValidationError(f"{where}: its tree was refused: {exc}") from None
