"""The rules of a job's source (gpuwarden.core.sources): commit, URL, allow-list."""

from __future__ import annotations

import pytest

from gpuwarden.core.sources import (
    JobSource,
    check_allow,
    check_commit,
    check_repo,
    check_source,
    source_type,
    split_type,
)

SHA = "0123456789abcdef0123456789abcdef01234567"
ALLOW = ("https://git.example.org/team/*", "file:///srv/git/*")


def test_a_full_commit_is_kept() -> None:
    assert check_commit(SHA) == SHA


@pytest.mark.parametrize(
    ("commit", "says"),
    [
        ("main", "branches and tags are refused"),
        ("v1.0", "branches and tags are refused"),
        ("0123456", "is a short commit id"),
        (SHA.upper(), "lower-case hex"),
        (SHA + "0", "branches and tags are refused"),
        ("", "branches and tags are refused"),
    ],
)
def test_a_commit_that_is_not_a_full_sha_is_refused(commit: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_commit(commit)


def test_a_commit_that_is_no_string_is_refused() -> None:
    with pytest.raises(ValueError, match="must be a string"):
        check_commit(12)


@pytest.mark.parametrize(
    "url",
    [
        "https://git.example.org/team/mod.git",
        "file:///srv/git/mod",
        "https://git.example.org/team/a/b",
    ],
)
def test_an_allowed_url_is_kept(url: str) -> None:
    assert check_repo(url, ALLOW) == url


def test_ssh_with_a_user_name_is_allowed() -> None:
    assert check_repo("ssh://git@git.example.org/team/m", ("ssh://git@git.example.org/team/*",))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://git.example.org/other/mod", "is not allowed on this node"),
        ("git@git.example.org:team/mod", "must start with https://, ssh:// or file://"),
        ("http://git.example.org/team/mod", "must start with https://, ssh:// or file://"),
        ("ext::sh -c evil", "without spaces"),
        ("https://user:pw@git.example.org/team/mod", "holds credentials"),
        ("https://token@git.example.org/team/mod", "holds credentials"),
        ("https://git.example.org/team/mod?x=1", "query or a fragment"),
        ("https:///team/mod", "names no host"),
    ],
)
def test_a_url_outside_the_rules_is_refused(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_repo(url, ALLOW)


def test_credentials_are_never_echoed() -> None:
    with pytest.raises(ValueError) as info:
        check_repo("https://me:secret@git.example.org/team/mod", ALLOW)
    assert "secret" not in str(info.value)


def test_an_empty_allow_list_refuses_every_source_and_says_how_to_allow() -> None:
    with pytest.raises(ValueError, match=r"allow is empty\); add a glob .*\[sources\] allow"):
        check_repo("https://git.example.org/team/mod", ())


def test_a_source_table_is_checked_key_by_key() -> None:
    raw = {"repo": "file:///srv/git/mod", "commit": SHA}
    assert check_source(raw, ALLOW) == JobSource("file:///srv/git/mod", SHA)
    with pytest.raises(ValueError, match="unknown key 'branch'"):
        check_source({**raw, "branch": "main"}, ALLOW)
    with pytest.raises(ValueError, match="key 'commit' is missing"):
        check_source({"repo": raw["repo"]}, ALLOW)
    with pytest.raises(ValueError, match="must be a table"):
        check_source("file:///srv/git/mod", ALLOW)


def test_a_stored_type_names_its_commit() -> None:
    stored = source_type("mymod.train", SHA)
    assert stored == f"mymod.train@{SHA}"
    assert split_type(stored) == ("mymod.train", SHA)
    assert split_type("echo.host") == ("echo.host", None)


def test_allow_globs_name_a_scheme() -> None:
    assert check_allow(["https://a/*"]) == ("https://a/*",)
    with pytest.raises(ValueError, match="must start with https://"):
        check_allow(["git.example.org/*"])
