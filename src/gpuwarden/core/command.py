"""Command jobs (SPEC.md, "Command jobs"): any command line is a job.

A command job has no module. Its type is written ``command:NAME`` (NAME: its
``--name``, by default the program's name), with the per-job choices that the
planner and the launcher read from a type in brackets after it:
``command:train[share,preempt=SIGUSR1,timeout=7200]``. The options are part of
the type so that everything that reads a job's type (the queue's classes, the
plan, the launcher, recovery) reads them without a second lookup; what was
measured is kept under ``command:NAME`` whatever the options
(:func:`profile_key`), so the next run of the same name is sized by it.

Its command itself (:class:`CommandSpec`: argv, working directory, environment,
the user it runs as) is stored with the job. Pure: no files, no processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: a command job's timeout unless it gives one (``--timeout``): a week
DEFAULT_TIMEOUT_S = 7 * 86400.0
#: what every command job's type starts with
PREFIX = "command:"
#: a command job's name: what its measurements are kept under
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
#: an environment variable's name
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: the signals a preemptible command may be asked to checkpoint with
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")
#: the most arguments, the longest argument, the most environment entries, the
#: longest value: a command line is small
MAX_ARGS = 4096
MAX_ARG = 65536
MAX_ENV = 512
MAX_TOTAL = 1 << 20
#: what a command job may not set in its environment: the broker's contract with
#: every job, and the GPU the plan gave it
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
RESERVED_ENV_PREFIX = "GPUWARDEN_"
#: what a sandboxed command may not set either: names that change what the
#: sandbox's runtime or its starter loads (the GPU devices a runtime hook
#: exposes, the dynamic loader, Python's paths), as a module job's bundle may not
SANDBOX_RESERVED_PREFIXES = ("LD_", "NVIDIA_", "CUDA_", "PYTHON", "PATH")


@dataclass(frozen=True, slots=True)
class CommandOptions:
    """The per-job choices of a command job that the planner and launcher read
    from its type: shares its GPU with co-resident jobs, checkpoint signal
    (preemptible), timeout, sandboxed (podman or bubblewrap)."""

    share: bool = False
    preempt: str | None = None
    timeout_s: float | None = None
    sandbox: bool = False


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """The command of a command job, as stored with it.

    ``uid``/``gid``/``groups``: the user it runs as on the host, learned from the
    kernel when it was submitted (None: a sandboxed command, which runs as the
    sandbox's user). ``cwd``: where it runs on the host (a sandboxed command runs
    in its output folder: ``""``)."""

    argv: tuple[str, ...]
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()
    #: its index in an array (``--array``): ``GPUWARDEN_ARRAY_INDEX``
    array_index: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"argv": list(self.argv), "cwd": self.cwd, "env": dict(self.env)}
        if self.uid is not None:
            body |= {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)}
        if self.array_index is not None:
            body["array_index"] = self.array_index
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CommandSpec:
        uid = body.get("uid")
        return cls(
            argv=tuple(body["argv"]),
            cwd=str(body.get("cwd", "")),
            env=dict(body.get("env", {})),
            uid=None if uid is None else int(uid),
            gid=None if uid is None else int(body["gid"]),
            groups=tuple(int(g) for g in body.get("groups", ())),
            array_index=body.get("array_index"),
        )


def is_command_type(type_name: str) -> bool:
    return type_name.startswith(PREFIX)


def check_name(name: str) -> str:
    """A command job's ``--name``, or :class:`ValueError` saying what is allowed."""
    if not NAME.fullmatch(name):
        raise ValueError(
            f"command name {name!r} is not valid: use 1-64 letters, digits, '.', '_', '+' "
            "or '-', starting with a letter or digit (--name NAME)"
        )
    return name


def default_name(argv: tuple[str, ...] | list[str]) -> str:
    """The program's name (``python3`` of ``/usr/bin/python3 train.py``), made a
    valid name; ``command`` when nothing of it is."""
    base = argv[0].rsplit("/", 1)[-1] if argv else ""
    cleaned = re.sub(r"[^A-Za-z0-9_.+-]", "-", base).lstrip("._+-")[:64]
    return cleaned or "command"


def type_name(name: str, options: CommandOptions = CommandOptions()) -> str:
    """``command:NAME``, with its options in brackets in one order."""
    words = []
    if options.share:
        words.append("share")
    if options.preempt is not None:
        words.append(f"preempt={options.preempt}")
    if options.timeout_s is not None:
        words.append(f"timeout={_number(options.timeout_s)}")
    if options.sandbox:
        words.append("sandbox")
    return f"{PREFIX}{check_name(name)}" + (f"[{','.join(words)}]" if words else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse_type(text: str) -> tuple[str, CommandOptions]:
    """The name and options of a command job's type; :class:`ValueError` when it
    is not one (an unknown option, a bad value)."""
    if not is_command_type(text):
        raise ValueError(f"{text!r} is not a command job's type (command:NAME)")
    rest = text.removeprefix(PREFIX)
    name, bracket, opts = rest.partition("[")
    check_name(name)
    if bracket and not opts.endswith("]"):
        raise ValueError(f"{text!r}: the options end with ']'")
    share, preempt, timeout, sandbox = False, None, None, False
    for word in filter(None, opts.removesuffix("]").split(",")):
        key, _, value = word.partition("=")
        if word == "share":
            share = True
        elif word == "sandbox":
            sandbox = True
        elif key == "preempt" and value in SIGNALS:
            preempt = value
        elif key == "timeout":
            timeout = _positive(value, text)
        else:
            raise ValueError(f"{text!r}: unknown option {word!r}")
    options = CommandOptions(share, preempt, timeout, sandbox)
    if type_name(name, options) != text:
        raise ValueError(
            f"{text!r}: write its options in the order share, preempt, timeout, sandbox"
        )
    return name, options


def _positive(value: str, where: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where!r}: timeout={value!r} is not a number of seconds") from None
    if not (number > 0 and number < 1e9):
        raise ValueError(f"{where!r}: timeout must be a positive number of seconds")
    return number


def profile_key(type_name: str) -> str:
    """What a type's measurements (footprint, run time, RAM peak) are kept under:
    a command job's ``command:NAME`` whatever its options; any other type's name."""
    if is_command_type(type_name):
        return type_name.partition("[")[0]
    return type_name


def check_command(
    argv: object, env: object, cwd: object, *, sandboxed: bool
) -> tuple[tuple[str, ...], dict[str, str], str]:
    """A command's argv, environment and working directory from a client, or
    :class:`ValueError` saying what is wrong and what to do."""
    if not isinstance(argv, (list, tuple)) or not argv:
        raise ValueError("the command is empty: give it after --, e.g. -- python3 train.py")
    if len(argv) > MAX_ARGS:
        raise ValueError(f"the command has {len(argv)} arguments; at most {MAX_ARGS}")
    total = 0
    for arg in argv:
        if not isinstance(arg, str) or "\0" in arg or len(arg) > MAX_ARG:
            raise ValueError(
                f"command argument {str(arg)[:40]!r} is not valid: each is text without NUL, "
                f"at most {MAX_ARG} characters"
            )
        total += len(arg)
    if not argv[0]:
        raise ValueError("the command's program is empty")
    env_ok = _check_env(env)
    if sandboxed and (
        named := sorted(k for k in env_ok if k.startswith(SANDBOX_RESERVED_PREFIXES))
    ):
        raise ValueError(
            f"env {', '.join(named)}: a sandboxed command may not set variables that begin "
            f"with {', '.join(SANDBOX_RESERVED_PREFIXES)} (they would change what the sandbox "
            "loads); set them inside the command (sh -c 'export ...; ...')"
        )
    total += sum(len(k) + len(v) for k, v in env_ok.items())
    if total > MAX_TOTAL:
        raise ValueError(f"the command and its environment are over {MAX_TOTAL} characters")
    if sandboxed:
        if cwd not in (None, ""):
            raise ValueError(
                "a sandboxed command runs in its output folder: it takes no working directory"
            )
        return tuple(argv), env_ok, ""
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise ValueError(f"working directory {cwd!r} must be an absolute path")
    return tuple(argv), env_ok, cwd


def _check_env(env: object) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError("the command's environment must be an object of NAME: VALUE")
    if len(env) > MAX_ENV:
        raise ValueError(f"the command's environment has {len(env)} entries; at most {MAX_ENV}")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            raise ValueError(
                f"environment name {str(key)[:40]!r} is not valid: letters, digits and '_', "
                "not starting with a digit"
            )
        if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"--env {key}: set by gpuwarden for every job (the GPU it was given, the "
                "GPUWARDEN_* contract); a command may not set it"
            )
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_ARG:
            raise ValueError(f"--env {key}: the value must be text without NUL")
        out[key] = value
    return out


#: the environment every host command starts from (plus what its submitter passes)
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def base_env(home: str, user: str) -> dict[str, str]:
    """A clean environment for a command run as ``user``: what a login would set,
    nothing of the broker's own."""
    return {
        "PATH": BASE_PATH,
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "LANG": "C.UTF-8",
    }


@dataclass(frozen=True, slots=True)
class LocalUser:
    """A local user as the kernel told the broker (``SO_PEERCRED``), with the
    names the host's user database gives its uid and groups."""

    uid: int
    gid: int
    name: str
    groups: tuple[int, ...] = ()
    group_names: tuple[str, ...] = ()


def user_refusal(
    user: LocalUser, *, users: tuple[str, ...], groups: tuple[str, ...], state_owner: int
) -> str | None:
    """Why ``user`` may not run host commands on this node (the rule that refused
    and how to change it), or None. ``users``/``groups``: ``[commands] users`` and
    ``groups`` (names or numbers); with neither, root and ``state_owner`` (the
    owner of the state directory) may."""
    if user.uid == 0:
        return None
    if not users and not groups:
        if user.uid == state_owner:
            return None
        return (
            f"user {user.name} (uid {user.uid}) may not run commands on this node: with "
            "[commands] users and groups unset only root and the owner of the state "
            f"directory (uid {state_owner}) may; add {user.name!r} to [commands] users, or a "
            "group of theirs to [commands] groups, in the node's config"
        )
    if user.name in users or str(user.uid) in users:
        return None
    mine = set(user.group_names) | {str(g) for g in (user.gid, *user.groups)}
    if mine & set(groups):
        return None
    return (
        f"user {user.name} (uid {user.uid}) may not run commands on this node: [commands] "
        f"users = {list(users)} does not name them and groups = {list(groups)} holds no "
        f"group of theirs; add {user.name!r} to [commands] users in the node's config"
    )
