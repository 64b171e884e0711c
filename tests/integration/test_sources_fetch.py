"""Fetching a job's source from a local repository (no container runtime needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwarden.core.sources import JobSource
from gpuwarden.errors import ValidationError
from gpuwarden.intake.sources import SourceCache
from gpuwarden.registry import Registry
from tests.sourcerepo import git, make_repo


@pytest.fixture
def repo(tmp_path: Path) -> tuple[str, str]:
    commit = make_repo(tmp_path / "repo")
    return f"file://{tmp_path / 'repo'}", commit


def cache(tmp_path: Path, allow: tuple[str, ...] = ("file:///*",)) -> SourceCache:
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
        tmp_path / "s", ("file:///*",), refusal="jobs from a repository need podman or docker"
    )
    with pytest.raises(ValidationError, match="need podman or docker"):
        registry.from_source(JobSource(*repo), "mymod.train")
