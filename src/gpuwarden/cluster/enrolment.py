"""How an agent is given its enrolment token, and its labels.

A token on the command line can be read by every user of the host for as long
as the agent runs: ``--enroll`` takes only ``-`` (standard input); the token
comes from a file only its owner can read, from standard input, or from the
environment (:data:`ENROLL_ENV`, removed from this process's environment at once).
"""

from __future__ import annotations

import getpass
import os
import re
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import TextIO

from gpuwarden import safefs
from gpuwarden.errors import UserError

#: the environment variable an agent may take its enrolment token from
ENROLL_ENV = "GPUWARDEN_ENROLL_TOKEN"
#: the most a token file or standard input is read for a token
_SECRET_MAX = 4096
_TOKEN_ID = re.compile(r"^gw_([0-9a-f]{12})_")


def token_on_argv(value: str) -> str:
    """Why ``--enroll VALUE`` (anything but ``-``) is refused, and what to do."""
    m = _TOKEN_ID.match(value)
    seen = (
        f"; it was on a command line for a moment, so treat it as seen: revoke it "
        f"(`gpuwarden token revoke {m.group(1)}`) and make a new one "
        "(`gpuwarden node invite NAME`)"
        if m
        else ""
    )
    return (
        "--enroll takes '-' (read the token from standard input), not the token itself: "
        "a token on the command line can be read by every user of this host (ps, "
        "/proc/PID/cmdline) for as long as the agent runs. Give it one of three ways: "
        "--enroll-file FILE (a file only its owner can read: chmod 600 FILE), "
        "--enroll - (standard input: `gpuwarden agent ... --enroll - < FILE`), or the "
        f"environment variable {ENROLL_ENV}{seen}"
    )


def read_secret_file(path: Path, what: str) -> str:
    """A token from ``path``: a regular file that only its owner may read (no bits for
    group or others, as `chmod 600` leaves it), at most 4 KiB, one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(
                f"{what} {path} is a {safefs.kind_of(st.st_mode)}, not a file: write the "
                "token to a file (chmod 600)"
            )
        if st.st_mode & 0o077:
            raise UserError(
                f"{what} {path} can be read by others (mode {st.st_mode & 0o777:o}): run "
                f"`chmod 600 {path}` and try again"
            )
        data = os.read(fd, _SECRET_MAX + 1)
    finally:
        os.close(fd)
    return _one_token(data, f"{what} {path}")


def _one_token(data: bytes, where: str) -> str:
    if len(data) > _SECRET_MAX:
        raise UserError(f"{where} holds more than {_SECRET_MAX} bytes: it should hold one token")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise UserError(f"{where} is not a token (it is not ASCII text)") from None
    if not text:
        raise UserError(f"{where} is empty: it should hold the token `gpuwarden node invite` made")
    if any(c.isspace() for c in text):
        raise UserError(f"{where} holds more than one word: it should hold one token")
    return text


def enrolment_token(
    *,
    enroll: str | None,
    enroll_file: Path | None,
    environ: MutableMapping[str, str],
    stdin: TextIO,
) -> str | None:
    """The enrolment token from one of ``--enroll -`` (``stdin``), ``--enroll-file``
    or the environment (:data:`ENROLL_ENV`), or None when none is given. The
    variable is removed from ``environ`` first, whatever happens next, so nothing
    this process starts inherits it. A token given as ``--enroll TOKEN`` is refused
    (:func:`token_on_argv`)."""
    from_env = environ.pop(ENROLL_ENV, None)
    if enroll is not None and enroll != "-":
        raise UserError(token_on_argv(enroll))
    ways = [
        name
        for name, given in (
            ("--enroll -", enroll is not None),
            ("--enroll-file", enroll_file is not None),
            (ENROLL_ENV, bool(from_env)),
        )
        if given
    ]
    if len(ways) > 1:
        raise UserError(
            f"the enrolment token was given {len(ways)} ways ({', '.join(ways)}): give it one way"
        )
    if enroll_file is not None:
        return read_secret_file(enroll_file, "enrolment token file")
    if enroll is not None:
        if stdin.isatty():
            return _one_token(
                getpass.getpass("enrolment token (from `gpuwarden node invite`): ").encode(),
                "the token typed",
            )
        return _one_token(stdin.read(_SECRET_MAX + 1).encode(), "standard input")
    if from_env:
        return _one_token(from_env.encode(), ENROLL_ENV)
    return None


def parse_labels(text: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` -> dict."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--labels {text!r}: write them as key=value,key2=value2")
        out[key.strip()] = value.strip()
    return out


def token_id(token: str) -> str:
    """The id of a token of gpuwarden's form (``gw_<id>_...``), or ""."""
    m = _TOKEN_ID.match(token)
    return m.group(1) if m else ""
