"""Fetching a job's source from a local repository (no container runtime needed)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from gpuwarden.core.sources import JobSource
from gpuwarden.errors import ValidationError
from gpuwarden.intake import sources as sources_mod
from gpuwarden.intake.sources import SourceCache
from gpuwarden.registry import Registry
from tests.sourcerepo import SECRET_TOML, git, make_repo


@pytest.fixture
def repo(tmp_path: Path) -> tuple[str, str]:
    commit = make_repo(tmp_path / "repo")
    return f"file://{tmp_path / 'repo'}", commit


def cache(tmp_path: Path, allow: tuple[str, ...] = ("file:///**",)) -> SourceCache:
    return SourceCache(tmp_path / "state" / "sources", allow)


def test_a_commit_is_fetched_exported_and_read_as_a_module(
    tmp_path: Path, repo: tuple[str, str]
) -> None:
    url, commit = repo
    registry = Registry([])
    registry.sources = cache(tmp_path)
    jobtype = registry.from_source(JobSource(url, commit), "mymod.train")
    assert jobtype.name == f"mymod.train@{commit}"
    tree = tmp_path / "state" / "sources" / "trees" / commit
    assert Path(jobtype.module_dir) == tree
    assert (tree / "src" / "train.py").read_text().startswith("import os")
    assert not (tree / ".git").exists()
    module = registry.module_of(jobtype)
    assert str(module.source) == f"commit {commit} of {url}"
    # a second job of the commit reads the cache, and the repository may be gone
    git(tmp_path / "repo", "commit", "--quiet", "--allow-empty", "-m", "later")
    again = Registry([])
    again.sources = cache(tmp_path)
    (tmp_path / "repo").rename(tmp_path / "gone")
    assert again.from_source(JobSource(url, commit), "mymod.train").name == jobtype.name


def test_only_the_commit_asked_for_is_exported(tmp_path: Path, repo: tuple[str, str]) -> None:
    url, first = repo
    (tmp_path / "repo" / "module.toml").write_text(
        (tmp_path / "repo" / "module.toml").read_text().replace("train", "fit")
    )
    git(tmp_path / "repo", "commit", "--quiet", "-am", "rename")
    registry = Registry([])
    registry.sources = cache(tmp_path)
    assert registry.from_source(JobSource(url, first), "mymod.train")
    with pytest.raises(ValidationError, match=r"has no job type 'mymod.fit'; .* mymod.train"):
        registry.from_source(JobSource(url, first), "mymod.fit")


def test_a_commit_the_repository_lacks_is_refused(tmp_path: Path, repo: tuple[str, str]) -> None:
    url, _ = repo
    registry = Registry([])
    registry.sources = cache(tmp_path)
    with pytest.raises(ValidationError, match=f"fetching commit {'1' * 40} of {url} failed"):
        registry.from_source(JobSource(url, "1" * 40), "mymod.train")


def test_a_url_outside_the_allow_list_is_refused_before_any_fetch(
    tmp_path: Path, repo: tuple[str, str]
) -> None:
    url, commit = repo
    registry = Registry([])
    registry.sources = cache(tmp_path, ("https://git.example.org/team/*",))
    with pytest.raises(ValidationError, match="is not allowed on this node"):
        registry.from_source(JobSource(url, commit), "mymod.train")
    assert not (tmp_path / "state" / "sources").exists()


def test_a_registry_without_sources_refuses_them(repo: tuple[str, str]) -> None:
    with pytest.raises(ValidationError, match=r"takes no jobs from a repository .*\[sources\]"):
        Registry([]).from_source(JobSource(*repo), "mymod.train")


def test_a_link_out_of_the_tree_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil"
    commit_files = {"module.toml": "x"}  # replaced by a link below
    make_repo(path, files=commit_files)
    (path / "module.toml").unlink()
    os.symlink("/etc/passwd", path / "module.toml")
    (path / "escape").symlink_to("/etc")
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "links")
    commit = git(path, "rev-parse", "HEAD")
    registry = Registry([])
    registry.sources = cache(tmp_path)
    with pytest.raises(ValidationError, match="its tree was refused"):
        registry.from_source(JobSource(f"file://{path}", commit), "mymod.train")
    assert not (tmp_path / "state" / "sources" / "trees" / commit).exists()


def test_a_module_toml_that_is_a_link_inside_the_tree_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "linked"
    make_repo(path)
    (path / "real.toml").write_text((path / "module.toml").read_text())
    (path / "module.toml").unlink()
    (path / "module.toml").symlink_to("real.toml")
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "link")
    commit = git(path, "rev-parse", "HEAD")
    registry = Registry([])
    registry.sources = cache(tmp_path)
    with pytest.raises(ValidationError, match=r"not a regular file: module\.toml"):
        registry.from_source(JobSource(f"file://{path}", commit), "mymod.train")


def test_no_sources_runtime_refuses_with_the_reason(tmp_path: Path, repo: tuple[str, str]) -> None:
    registry = Registry([])
    registry.sources = SourceCache(
        tmp_path / "s", ("file:///**",), refusal="jobs from a repository need podman or docker"
    )
    with pytest.raises(ValidationError, match="need podman or docker"):
        registry.from_source(JobSource(*repo), "mymod.train")


# ---- issue 30, item 1: the allow list cannot be left with `..`, a link or a gitfile ----


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, str, str]:
    """An allowed folder with a repository, and a private one beside it that the
    allow list does not name: ``(allowed folder, allowed commit, private commit)``."""
    good = make_repo(tmp_path / "allowed" / "mod")
    secret = make_repo(tmp_path / "private" / "secret", files={"module.toml": SECRET_TOML})
    return tmp_path / "allowed", good, secret


def _nothing_fetched(tmp_path: Path, commit: str) -> None:
    assert not (tmp_path / "state" / "sources" / "trees" / commit).exists()
    repos = tmp_path / "state" / "sources" / "repos"
    for bare in repos.iterdir() if repos.exists() else ():
        assert not git(bare, "cat-file", "-t", commit, check=False), bare


@pytest.mark.parametrize(
    "tail",
    [
        "../private/secret",
        "%2e%2e/private/secret",
        "%2E%2E/private/secret",
        ".%2e/private/secret",
        "mod/../../private/secret",
        "mod%2f..%2f..%2fprivate%2fsecret",
    ],
)
def test_dot_parts_cannot_leave_the_allowed_folder(
    tmp_path: Path, planted: tuple[Path, str, str], tail: str
) -> None:
    """`file:///…/allowed/../private/secret` matched `file:///…/allowed/*` as text,
    and the private repository was fetched and exported: now refused before git
    runs, and again by the fetch itself (called without the intake's check)."""
    allowed, good, secret = planted
    registry = Registry([])
    registry.sources = cache(tmp_path, (f"file://{allowed}/*",))
    url = f"file://{allowed}/{tail}"
    with pytest.raises(ValidationError, match=r"'\.' or '\.\.' part|an encoded"):
        registry.from_source(JobSource(url, secret), "mymod.train")
    with pytest.raises(ValidationError, match=r"'\.' or '\.\.' part|an encoded"):
        registry.sources.tree(JobSource(url, secret))  # the fetch path checks it too
    _nothing_fetched(tmp_path, secret)
    assert registry.modules.get(f"mymod@{secret}") is None
    # the next legitimate source is fetched as before
    jobtype = registry.from_source(JobSource(f"file://{allowed}/mod", good), "mymod.train")
    assert jobtype.name == f"mymod.train@{good}"


def test_a_link_out_of_the_allowed_folder_is_not_followed(
    tmp_path: Path, planted: tuple[Path, str, str]
) -> None:
    """A link in the allowed folder to a repository outside it: git would open the
    repository it leads to; the fetch resolves it and refuses."""
    allowed, good, secret = planted
    (allowed / "link").symlink_to(tmp_path / "private" / "secret")
    (allowed / "inner").symlink_to("mod")  # a link that stays inside is fine
    registry = Registry([])
    registry.sources = cache(tmp_path, (f"file://{allowed}/*",))
    with pytest.raises(ValidationError, match=r"leads to .*/private/secret.* \(through a link\)"):
        registry.from_source(JobSource(f"file://{allowed}/link", secret), "mymod.train")
    _nothing_fetched(tmp_path, secret)
    jobtype = registry.from_source(JobSource(f"file://{allowed}/inner", good), "mymod.train")
    assert jobtype.name == f"mymod.train@{good}"


def test_a_gitfile_in_the_allowed_folder_is_refused(
    tmp_path: Path, planted: tuple[Path, str, str]
) -> None:
    """A `.git` file (``gitdir: PATH``) sends git to another repository."""
    allowed, _, secret = planted
    (allowed / "redirect").mkdir()
    (allowed / "redirect" / ".git").write_text(
        f"gitdir: {tmp_path / 'private' / 'secret' / '.git'}\n"
    )
    (allowed / "plain").write_text(f"gitdir: {tmp_path / 'private' / 'secret' / '.git'}\n")
    registry = Registry([])
    registry.sources = cache(tmp_path, (f"file://{allowed}/*",))
    for name in ("redirect", "plain"):
        with pytest.raises(ValidationError, match="is a file or a link, not a folder"):
            registry.from_source(JobSource(f"file://{allowed}/{name}", secret), "mymod.train")
    _nothing_fetched(tmp_path, secret)


# ---- issue 30, item 12: a tree past a limit is refused as too large, early ----


def _big_repo(tmp_path: Path, size: int) -> tuple[str, str]:
    path = tmp_path / "big"
    commit_files = {"weights.bin": ""}
    make_repo(path, files=commit_files)
    (path / "weights.bin").write_bytes(os.urandom(size))
    git(path, "commit", "--quiet", "-am", "weights")
    return f"file://{path}", git(path, "rev-parse", "HEAD")


def test_a_tree_past_the_size_limit_is_refused_as_too_large(
    tmp_path: Path, repo: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources_mod, "MAX_TREE_BYTES", 1024**2)
    url, commit = _big_repo(tmp_path, 3 * 1024**2)
    registry = Registry([])
    registry.sources = cache(tmp_path)
    with pytest.raises(ValidationError) as info:
        registry.from_source(JobSource(url, commit), "mymod.train")
    why = str(info.value)
    assert f"commit {commit} of {url} is too large: its files pass 1 MiB together" in why
    assert "keep large files (model weights, data sets) out of the repository" in why
    assert "git archive failed" not in why
    trees = tmp_path / "state" / "sources" / "trees"
    assert list(trees.iterdir()) == []  # nothing left: no tree, no tar, no half-written folder
    # a tree within the limit is taken as before
    assert registry.from_source(JobSource(*repo), "mymod.train")


def test_too_many_entries_and_too_long_an_archive_are_refused_as_too_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "many"
    make_repo(path, files={f"data/{i:03}.txt": "x" * 2000 for i in range(60)})
    url, commit = f"file://{path}", git(path, "rev-parse", "HEAD")
    registry = Registry([])
    registry.sources = cache(tmp_path)
    monkeypatch.setattr(sources_mod, "MAX_TREE_ENTRIES", 20)
    with pytest.raises(ValidationError, match=r"is too large: more than 20 entries"):
        registry.from_source(JobSource(url, commit), "mymod.train")
    monkeypatch.undo()
    monkeypatch.setattr(sources_mod, "MAX_ARCHIVE_BYTES", 64 * 1024)
    with pytest.raises(ValidationError, match=r"is too large: its archive .* passes 0\.0625 MiB"):
        registry.from_source(JobSource(url, commit), "mymod.train")
    assert list((tmp_path / "state" / "sources" / "trees").iterdir()) == []


def _fake_git(tmp_path: Path, archive: str) -> str:
    """A git that runs the real one but for ``archive``, which runs ``archive``
    (a shell command) instead; its pid goes to ``tmp_path/archive.pid``."""
    real = shutil.which("git")
    script = tmp_path / "fake-git"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do\n'
        '  if [ "$a" = archive ]; then\n'
        f"    echo $$ > {tmp_path / 'archive.pid'}\n"
        f"    {archive}\n"
        "  fi\n"
        "done\n"
        f'exec {real} "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def test_an_endless_archive_is_stopped_at_the_first_file_past_the_limit(
    tmp_path: Path, repo: tuple[str, str]
) -> None:
    """An archive that says its first file holds 10 GiB, then never ends: refused
    from that file's header (nothing of it written), the archive process stopped
    at once, well within the fetch's time limit."""
    header = (
        'python3 -c \'import sys, tarfile; t = tarfile.TarInfo("huge.bin"); '
        "t.size = 10 * 2**30; sys.stdout.buffer.write(t.tobuf(tarfile.PAX_FORMAT))'; "
        "exec cat /dev/zero"
    )
    sources = SourceCache(tmp_path / "s", ("file:///**",), git=_fake_git(tmp_path, header))
    started = time.monotonic()
    with pytest.raises(ValidationError, match=r"is too large: its files pass 256 MiB together"):
        sources.tree(JobSource(*repo))
    assert time.monotonic() - started < 30
    pid = int((tmp_path / "archive.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
    assert list((tmp_path / "s" / "trees").iterdir()) == []


def test_a_failing_or_slow_archive_says_so(tmp_path: Path, repo: tuple[str, str]) -> None:
    fails = _fake_git(tmp_path, "echo 'fatal: the disk is on fire' >&2; exit 128")
    sources = SourceCache(tmp_path / "s", ("file:///**",), git=fails)
    with pytest.raises(ValidationError, match=r"git archive failed: fatal: the disk is on fire"):
        sources.tree(JobSource(*repo))
    slow = _fake_git(tmp_path, "exec sleep 60")
    sources = SourceCache(tmp_path / "s", ("file:///**",), git=slow, timeout_s=2)
    started = time.monotonic()
    with pytest.raises(ValidationError, match=r"git archive took longer than 2 s"):
        sources.tree(JobSource(*repo))
    assert time.monotonic() - started < 30
