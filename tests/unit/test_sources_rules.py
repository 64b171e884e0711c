"""The rules of a job's source (gpuwarden.core.sources): commit, URL, allow-list."""

from __future__ import annotations

import pytest

from gpuwarden.core.sources import (
    JobSource,
    SourceAbility,
    allows,
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
        "file:///srv/git/mod/",
        "https://git.example.org/team/m%C3%B6d",
        "https://git.example.org/team/.hidden",
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


# ---- the allow list is matched part by part (issue 30, item 1) ----

ESCAPES = [
    # `..` in every spelling git or a server would decode
    ("file:///srv/git/mod/../../private/secret", "'.' or '..' part"),
    ("file:///srv/git/../private/secret", "'.' or '..' part"),
    ("file:///srv/git/%2e%2e/private/secret", "an encoded '.'"),
    ("file:///srv/git/%2E%2E/private/secret", "an encoded '.'"),
    ("file:///srv/git/.%2e/private/secret", "an encoded '.'"),
    ("file:///srv/git/./mod", "'.' or '..' part"),
    ("https://git.example.org/team/../other/mod", "'.' or '..' part"),
    ("https://git.example.org/team/%2e%2e/other/mod", "an encoded '.'"),
    # an encoded / or \, a double escape, a bare %
    ("https://git.example.org/team/x%2f..%2fother", "an encoded '/'"),
    ("https://git.example.org/team/x%2F..%2Fother", "an encoded '/'"),
    ("https://git.example.org/team/x%5c..%5cother", "'%5c' \\(an encoded"),
    ("file:///srv/git/mod\\..\\..\\private", "backslash"),
    ("https://git.example.org/team/%252e%252e", "an encoded '%'"),
    ("https://git.example.org/team/%zz", "a % must start an escape"),
    ("https://git.example.org/team/%00", "an encoded"),
    # an empty part, a host in a file:// URL, an encoded host
    ("file:///srv/git//mod", "empty part"),
    ("file://localhost/srv/git/mod", "names a folder of this host"),
    ("file://evil.org/srv/git/mod", "names a folder of this host"),
    ("https://git.example.org%2fteam/x", "host part"),
    ("ssh://git@git.example.org:22.x/team/m", "host part"),
    ("FILE:///srv/git/mod", "must start with https://"),
    ("https://git.example.org", "names no repository"),
    ("https://git.example.org/", "names no repository"),
]


@pytest.mark.parametrize(("url", "says"), ESCAPES)
def test_dot_parts_and_their_encodings_are_refused_whatever_the_allow_list(
    url: str, says: str
) -> None:
    """The attack of issue 30: a URL that a glob matched as text but that leads out
    of the folder the glob names. It is refused by its form (a client, a manifest,
    the API refuse it before any allow list), and no glob matches it: not even a
    `**` over the whole host."""
    with pytest.raises(ValueError, match=says):
        check_repo(url, None)
    with pytest.raises(ValueError, match=says):
        check_repo(url, ALLOW)
    assert not allows(("file:///**", "https://git.example.org/**", "ssh://**"), url)
    assert SourceAbility(True, ("file:///**",)).refusal(url) is not None


@pytest.mark.parametrize(
    ("glob", "url", "matches"),
    [
        # a * is one part of the path: it never crosses a /
        ("https://git.example.org/team/*", "https://git.example.org/team/mod", True),
        ("https://git.example.org/team/*", "https://git.example.org/team/a/b", False),
        ("https://git.example.org/team/*", "https://git.example.org/other/mod", False),
        ("https://git.example.org/team/*", "https://git.example.org/team", False),
        ("https://git.example.org/team*", "https://git.example.org/team/mod", False),
        ("https://git.example.org/*/mod", "https://git.example.org/team/mod", True),
        ("https://git.example.org/*/mod", "https://git.example.org/a/b/mod", False),
        ("https://git.example.org/team/m?d", "https://git.example.org/team/mod", True),
        ("https://git.example.org/team/[mn]od", "https://git.example.org/team/nod", True),
        ("https://git.example.org/team/*.git", "https://git.example.org/team/m.git", True),
        # ** is any number of parts
        ("https://git.example.org/team/**", "https://git.example.org/team/a/b", True),
        ("https://git.example.org/team/**", "https://git.example.org/team/mod", True),
        ("https://git.example.org/team/**", "https://git.example.org/other/mod", False),
        ("https://git.example.org/**/mod", "https://git.example.org/a/b/mod", True),
        ("https://git.example.org/**/mod", "https://git.example.org/mod", True),
        ("https://git.example.org/**/mod", "https://git.example.org/a/b/other", False),
        ("file:///**", "file:///srv/git/mod", True),
        # the host part: exactly, or by its own glob, never across a /
        ("https://git.example.org/team/*", "https://git.example.org.evil/team/mod", False),
        ("https://git.example.org/team/*", "https://git.example.org:8443/team/mod", False),
        ("https://*.example.org/team/*", "https://git.example.org/team/mod", True),
        ("https://*/team/*", "https://evil.org/team/mod", True),
        ("https://git.example.org*", "https://git.example.org/team/mod", False),
        ("ssh://git@git.example.org/team/*", "ssh://git@git.example.org/team/m", True),
        ("ssh://git@git.example.org/team/*", "ssh://root@git.example.org/team/m", False),
        ("https://git.example.org/team/*", "ssh://git.example.org/team/mod", False),
        # a trailing / is the same repository
        ("file:///srv/git/*", "file:///srv/git/mod/", True),
        ("file:///srv/git/mod/", "file:///srv/git/mod", True),
    ],
)
def test_globs_match_part_by_part(glob: str, url: str, matches: bool) -> None:
    assert allows((glob,), url) is matches


def test_a_glob_that_would_match_every_url_as_text_matches_no_escape() -> None:
    """`fnmatch("file:///srv/git/allowed/../private/secret", "file:///srv/git/allowed/*")`
    was True: the old matcher's `*` crossed `/`."""
    glob = ("file:///srv/git/allowed/*",)
    assert allows(glob, "file:///srv/git/allowed/mod")
    for url in (
        "file:///srv/git/allowed/../private/secret",
        "file:///srv/git/allowed/%2e%2e/private/secret",
        "file:///srv/git/allowed/mod/../../private/secret",
    ):
        assert not allows(glob, url)
        with pytest.raises(ValueError):
            check_repo(url, glob)


@pytest.mark.parametrize(
    ("glob", "says"),
    [
        ("file:///srv/git/../*", "'.' or '..' part"),
        ("https://h.org/./team/*", "'.' or '..' part"),
        ("file:///srv\\git/*", "backslash"),
        ("file://host/srv/*", "names a host"),
    ],
)
def test_an_allow_glob_is_written_plainly(glob: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_allow([glob])


def test_the_refusal_says_how_globs_match() -> None:
    with pytest.raises(ValueError, match=r"a \* stands for one part of the path, \*\* for any"):
        check_repo("https://git.example.org/team/a/b", ALLOW)
