"""Jobs from a pinned commit (SPEC.md, "Jobs from a pinned commit"): the rules a
job's ``source = {repo = URL, commit = SHA}`` is checked by before anything is
fetched. Pure: no git, no network, no files."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

#: a full commit id: 40 lower-case hex digits (SHA-1 object names)
COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: the URL schemes a source may use; file:// is for repositories on the node itself
SCHEMES = ("https", "ssh", "file")
#: the longest repository URL accepted
MAX_URL = 1024
#: what joins a type's name to the commit it comes from in a job's stored type
TYPE_SEP = "@"
#: the most globs of ``[sources] allow`` a node's report may list (more: it runs none)
MAX_ALLOW = 64
#: the host part of an https or ssh URL: ``[user@]host[:port]``, nothing encoded
_NETLOC = re.compile(
    r"^(?:[A-Za-z0-9._~-]+@)?(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*)|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$"
)
#: a percent-escape, or a ``%`` that starts none
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})?")


def allow_hint(who: str = "node") -> str:
    """What to do about a URL that ``who``'s ``[sources] allow`` does not match."""
    return (
        f"add a glob that matches it to the {who}'s [sources] allow, for example allow = "
        '["https://git.example.org/team/*"] (a * stands for one part of the path, ** for '
        "any number of parts)"
    )


@dataclass(frozen=True, slots=True)
class JobSource:
    """Where a job's module comes from: a repository and one commit of it."""

    repo: str
    commit: str

    def to_json(self) -> dict[str, str]:
        return {"repo": self.repo, "commit": self.commit}


def check_commit(commit: object) -> str:
    """A full commit id, or :class:`ValueError` saying why not (a branch, a tag
    and a short id are refused: they can move or be ambiguous)."""
    if not isinstance(commit, str):
        raise ValueError(f"source commit must be a string, got {type(commit).__name__}")
    if COMMIT.fullmatch(commit):
        return commit
    if re.fullmatch(r"[0-9a-fA-F]{40}", commit):
        raise ValueError(f"source commit {commit!r} must be written in lower-case hex")
    if re.fullmatch(r"[0-9a-fA-F]{4,39}", commit):
        raise ValueError(
            f"source commit {commit!r} is a short commit id; give the full 40-hex-digit "
            "commit (git rev-parse HEAD)"
        )
    raise ValueError(
        f"source commit {commit!r} is not a commit id: branches and tags are refused (they "
        "can move); give the full 40-hex-digit commit (git rev-parse <branch>)"
    )


def check_repo(repo: object, allow: Sequence[str] | None, *, who: str = "node") -> str:
    """A repository URL this node may fetch from, or :class:`ValueError` saying
    why not: https, ssh or file, no credentials, matched by a glob of ``allow``
    (None: the URL's form only, where no ``allow`` is at hand: a bundle's manifest,
    a client, a claim's payload). ``who``: whose ``allow`` it is, as the refusal
    names it (``node``, ``coordinator``)."""
    if not isinstance(repo, str):
        raise ValueError(f"source repo must be a string, got {type(repo).__name__}")
    if not repo or len(repo) > MAX_URL or any(c.isspace() or ord(c) < 32 for c in repo):
        raise ValueError(
            f"source repo {repo[:80]!r} must be a URL of 1 to {MAX_URL} characters without "
            "spaces or control characters"
        )
    parts = urlsplit(repo)
    if parts.scheme not in SCHEMES or not repo.startswith(f"{parts.scheme}://"):
        raise ValueError(
            f"source repo {repo!r}: the URL must start with https://, ssh:// or file:// "
            "(scp-like host:path and other schemes are refused)"
        )
    if parts.password is not None or (parts.username is not None and parts.scheme != "ssh"):
        raise ValueError(
            f"source repo {_shown(repo)!r} holds credentials; give the URL without them (the "
            "node fetches with its own keys)"
        )
    if parts.scheme != "file" and not parts.hostname:
        raise ValueError(f"source repo {repo!r} names no host")
    if parts.query or parts.fragment:
        raise ValueError(f"source repo {repo!r} must not have a query or a fragment")
    _segments(repo, parts)
    if allow is None:
        return repo
    if not allow:
        raise ValueError(
            f"source repo {repo!r}: this {who} accepts no jobs from repositories ([sources] "
            f"allow is empty); {allow_hint(who)}"
        )
    if not allows(allow, repo):
        raise ValueError(
            f"source repo {repo!r} is not allowed on this {who} (allowed: "
            f"{', '.join(allow)}); {allow_hint(who)}"
        )
    return repo


def check_source(raw: object, allow: Sequence[str] | None) -> JobSource:
    """A job's ``source`` table: exactly ``repo`` and ``commit``, each checked
    (``allow`` as :func:`check_repo`)."""
    if not isinstance(raw, Mapping):
        raise ValueError("source must be a table {repo = URL, commit = SHA}")
    extra = sorted(set(raw) - {"repo", "commit"})
    if extra:
        raise ValueError(f"source: unknown key {extra[0]!r} (only repo and commit)")
    missing = [k for k in ("repo", "commit") if k not in raw]
    if missing:
        raise ValueError(f"source: key {missing[0]!r} is missing")
    commit = check_commit(raw["commit"])
    return JobSource(repo=check_repo(raw["repo"], allow), commit=commit)


def source_type(type_name: str, commit: str) -> str:
    """The stored type of a job from a commit: ``mymod.train@<commit>``."""
    return f"{type_name}{TYPE_SEP}{commit}"


def split_type(stored: str) -> tuple[str, str | None]:
    """``mymod.train@<commit>`` -> ``("mymod.train", commit)``; a plain type -> its
    name and None."""
    name, sep, commit = stored.partition(TYPE_SEP)
    return (name, commit) if sep and COMMIT.fullmatch(commit) else (stored, None)


def check_allow(globs: Sequence[str]) -> tuple[str, ...]:
    """``[sources] allow``: globs that each name a scheme this node fetches with,
    written plainly (no ``.`` or ``..`` part, no backslash, no host in a
    ``file://`` glob): a glob is matched part by part (:func:`allows`)."""
    for g in globs:
        if not any(g.startswith(f"{s}://") for s in SCHEMES):
            raise ValueError(f"[sources] allow: {g!r} must start with https://, ssh:// or file://")
        scheme, netloc, segments = _glob_parts(g)
        if "\\" in g:
            raise ValueError(f"[sources] allow: {g!r} holds a backslash; write paths with /")
        if any(seg in (".", "..") for seg in segments):
            raise ValueError(
                f"[sources] allow: {g!r} holds a '.' or '..' part; name the folder plainly "
                "(a repository URL with one is refused, so the glob would match none)"
            )
        if scheme == "file" and netloc:
            raise ValueError(
                f"[sources] allow: {g!r} names a host; a file:// glob names a folder of "
                "this host: file:///path/*"
            )
    return tuple(globs)


def allows(allow: Sequence[str], repo: str) -> bool:
    """Whether a glob of ``allow`` matches ``repo``, part by part: the scheme
    exactly, the host part (``[user@]host[:port]``) by :func:`fnmatch.fnmatchcase`,
    then the path one ``/``-separated part at a time: ``*``, ``?`` and ``[...]``
    within one part (they never match a ``/``), a part ``**`` for any number of
    parts. A URL that breaks the rules of :func:`check_repo` (a ``..`` part, an
    encoded ``/``) matches nothing."""
    try:
        parts = urlsplit(repo)
        segments = _segments(repo, parts)
    except ValueError:
        return False
    if not repo.startswith(f"{parts.scheme}://"):
        return False
    for glob in allow:
        scheme, netloc, globbed = _glob_parts(glob)
        if scheme != parts.scheme or not fnmatch.fnmatchcase(parts.netloc, netloc):
            continue
        if _match_parts(globbed, segments):
            return True
    return False


def _segments(repo: str, parts: SplitResult) -> list[str]:
    """The parts of ``repo``'s path, one trailing ``/`` left out, or
    :class:`ValueError` saying why the URL cannot be matched part by part: a
    ``.`` or ``..`` part, an empty one (``//``), a backslash, a percent-escape of
    ``.``, ``/``, ``\\``, ``%`` or a control character (git decodes them: each
    would hide a part from the allow list), a host part with more than a user,
    host and port, a ``file://`` URL that names a host."""
    if "\\" in repo:
        raise ValueError(f"source repo {repo!r} holds a backslash; write the path with /")
    if parts.scheme == "file":
        if parts.netloc:
            raise ValueError(
                f"source repo {repo!r}: a file:// URL names a folder of this host, no other "
                "host: file:///path/to/repo"
            )
    elif not _NETLOC.fullmatch(parts.netloc):
        raise ValueError(
            f"source repo {_shown(repo)!r}: its host part must be [user@]host[:port], with "
            "nothing encoded"
        )
    for escape in _ESCAPE.finditer(parts.path):
        code = escape.group(1)
        if code is None:
            raise ValueError(f"source repo {repo!r}: a % must start an escape of 2 hex digits")
        char = chr(int(code, 16))
        if char in "./\\%" or ord(char) < 32 or ord(char) == 127:
            raise ValueError(
                f"source repo {repo!r} holds {escape.group(0)!r} (an encoded {char!r}); give "
                "the repository's path plainly: an encoded '.', '/' or '\\' is refused, so "
                "that no '..' can lead out of the folders [sources] allow names"
            )
    if not parts.path.startswith("/") or parts.path == "/":
        raise ValueError(f"source repo {repo!r} names no repository (its path is empty)")
    segments = parts.path[1:].split("/")
    if segments[-1] == "":
        segments.pop()  # one trailing /
    if any(seg in (".", "..") for seg in segments):
        raise ValueError(
            f"source repo {repo!r} holds a '.' or '..' part; give the repository's path "
            "plainly (a '..' could lead out of the folders [sources] allow names)"
        )
    if "" in segments:
        raise ValueError(f"source repo {repo!r} holds an empty part (//); give its path plainly")
    return segments


def _glob_parts(glob: str) -> tuple[str, str, list[str]]:
    """A glob's scheme, host part and path parts (one trailing ``/`` left out)."""
    scheme, _, rest = glob.partition("://")
    netloc, slash, path = rest.partition("/")
    segments = path.split("/") if slash else []
    if segments and segments[-1] == "":
        segments.pop()
    return scheme, netloc, segments


def _match_parts(globbed: Sequence[str], segments: Sequence[str]) -> bool:
    """Whether the path parts ``segments`` match the glob's parts ``globbed``
    (``**``: any number of parts, none too; anything else: one part, by
    :func:`fnmatch.fnmatchcase`)."""
    reached = {0}  # how many of ``segments`` the glob's parts so far can have matched
    for g in globbed:
        if g == "**":
            reached = set(range(min(reached), len(segments) + 1))
        else:
            reached = {
                i + 1 for i in reached if i < len(segments) and fnmatch.fnmatchcase(segments[i], g)
            }
        if not reached:
            return False
    return len(segments) in reached


@dataclass(frozen=True, slots=True)
class SourceAbility:
    """Whether a node runs jobs from commits, as its report says (``sources``): its
    runtime builds images (podman or docker) and which repositories its
    ``[sources] allow`` lets it fetch from."""

    runs: bool
    allow: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"runs": self.runs, "allow": list(self.allow)}

    def refusal(self, repo: str) -> str | None:
        """Why the node does not run a job from a commit of ``repo``, as a phrase
        about the node, or None when it does."""
        if not self.runs:
            return "runs no jobs from commits (its container_runtime is not podman or docker)"
        if not self.allow:
            return "runs no jobs from commits of any repository (its [sources] allow is empty)"
        if not allows(self.allow, repo):
            return (
                f"does not run jobs from commits of {repo} (its [sources] allow: "
                f"{', '.join(self.allow)})"
            )
        return None


def reported_ability(raw: object) -> SourceAbility | None:
    """A node's reported ``sources`` (``{"runs": bool, "allow": [glob, ...]}``),
    taken as hostile: anything not of that shape (a wrong type, more than
    :data:`MAX_ALLOW` globs, a glob that is not text of at most :data:`MAX_URL`
    characters without control characters naming a scheme of :data:`SCHEMES`) is
    None: the node runs no job from a commit."""
    if not isinstance(raw, Mapping):
        return None
    runs, allow = raw.get("runs"), raw.get("allow")
    if not isinstance(runs, bool) or not isinstance(allow, list) or len(allow) > MAX_ALLOW:
        return None
    globs: list[str] = []
    for g in allow:
        if not isinstance(g, str) or not 0 < len(g) <= MAX_URL:
            return None
        if any(ord(c) < 32 or ord(c) == 127 for c in g):
            return None
        if not any(g.startswith(f"{s}://") for s in SCHEMES):
            return None
        globs.append(g)
    return SourceAbility(runs=runs, allow=tuple(globs))


def _shown(repo: str) -> str:
    """The URL with its user information masked (never echo a password)."""
    parts = urlsplit(repo)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"***@{host}").geturl()
