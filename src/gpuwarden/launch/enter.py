"""The root half of a bubblewrap start: run as a script, never imported by the broker.

    python -I -S enter.py [--stage SRC]... [--cgroup DIR]... [--rlimit NAME=N]...
                          [--seccomp FILE] [--user UID:GID] -- bwrap ARGS...
    python -I -S enter.py [--cgroup DIR]... --user UID:GID [--groups G,...]
                          --chdir DIR -- JOB ARGS...   (a user's command job)
    python -I -S enter.py --cgroup DIR... -- JOB ARGS...     (a host job with a RAM cap)

A broker that runs as root must not start bubblewrap as root: the sandbox's
user would be root on the host (bubblewrap maps the inside uid to the uid that
started it), and no process limit binds root. So the launcher runs this script
(as root, in a process of its own) and it:

1. opens every ``--stage`` source with ``O_PATH | O_NOFOLLOW`` (a symlink is
   refused), the ``--seccomp`` file, and the cgroup's ``cgroup.procs``: all
   while it is root and before anything below changes what paths mean;
2. with ``--stage``: enters a private mount namespace, mounts a small tmpfs on
   ``/tmp`` there (the broker's own ``/tmp`` is untouched) and bind-mounts the
   N-th source, by its descriptor, at ``/tmp/N``. bubblewrap runs as the
   sandbox's user: it could not reach a source under a folder only root may
   search (a 0700 state directory, an interpreter under ``/root``), and its
   ``--bind-fd`` resolves the descriptor back to that path. The launcher names
   ``/tmp/N`` as the source in bubblewrap's arguments;
3. joins each ``--cgroup`` (the sandbox's pids cgroup; the attempt's memory
   cgroup, :mod:`gpuwarden.launch.memcaps`: cgroup v1 has one hierarchy per
   controller), sets the rlimits;
4. with ``--user``: sets the supplementary groups (``--groups``, none
   without), then the gid, then the uid (real, effective, saved), and checks
   that none of root is left; with ``--chdir``, enters that folder as the user
   (a host command job's working directory, checked at its start);
5. executes the command (bubblewrap, with ``--seccomp FD`` added when a filter
   is given; or a host job's own command) with this process's environment:
   its pid stays the attempt's main pid, and everything it starts is in the
   cgroups.

Any failure ends it with exit status 1 and one line on stderr that starts with
``gpuwarden-sandbox:`` (the launcher reports it as a launch error). Standard
library only, and ``-I -S``: nothing from the environment or site-packages is
loaded into a root process.
"""

from __future__ import annotations

import ctypes
import os
import resource
import stat
import sys
from pathlib import Path

PREFIX = "gpuwarden-sandbox:"
#: where the staged sources appear, in this process's own mount namespace
STAGE_DIR = "/tmp"

_CLONE_NEWNS = 0x00020000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18


class Failure(Exception):
    pass


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise Failure(f"{what}: {os.strerror(err)}")


def _encoded(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None,
           flags: int) -> None:  # fmt: skip
    data = _encoded("size=1m,mode=755") if fstype == "tmpfs" else None
    result = libc.mount(
        _encoded(source), _encoded(target), _encoded(fstype), ctypes.c_ulong(flags), data
    )
    _check(result, f"mount {source or fstype} on {target}")


def parse(argv: list[str]) -> dict[str, object]:
    """The options before ``--`` and the command after it."""
    opts: dict[str, object] = {
        "stage": [],
        "cgroups": [],
        "rlimits": [],
        "seccomp": None,
        "user": None,
        "groups": [],
        "chdir": None,
        "command": [],
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            opts["command"] = argv[i + 1 :]
            break
        if i + 1 >= len(argv):
            raise Failure(f"option {arg} needs a value")
        value = argv[i + 1]
        if arg == "--stage":
            stage = opts["stage"]
            assert isinstance(stage, list)
            stage.append(value)
        elif arg == "--cgroup":
            cgroups = opts["cgroups"]
            assert isinstance(cgroups, list)
            cgroups.append(value)
        elif arg == "--rlimit":
            name, _, number = value.partition("=")
            rlimits = opts["rlimits"]
            assert isinstance(rlimits, list)
            rlimits.append((name, int(number)))
        elif arg == "--seccomp":
            opts["seccomp"] = value
        elif arg == "--user":
            uid, _, gid = value.partition(":")
            opts["user"] = (int(uid), int(gid))
        elif arg == "--groups":
            opts["groups"] = [int(g) for g in value.split(",") if g]
        elif arg == "--chdir":
            opts["chdir"] = value
        else:
            raise Failure(f"unknown option {arg}")
        i += 2
    if not opts["command"]:
        raise Failure("no command after --")
    return opts


def _open_sources(sources: list[str]) -> list[tuple[int, bool]]:
    """(descriptor, is a folder) of each source; a symlink is refused."""
    opened: list[tuple[int, bool]] = []
    for src in sources:
        try:
            fd = os.open(src, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Failure(f"cannot open {src}: {exc.strerror}") from None
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode):
            raise Failure(f"{src} is a symlink; a sandbox's mount source may not be one")
        opened.append((fd, stat.S_ISDIR(mode)))
    return opened


def _stage(sources: list[str]) -> None:
    libc = _libc()
    _check(libc.unshare(ctypes.c_int(_CLONE_NEWNS)), "unshare a mount namespace")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    # opened in the new namespace (a bind mount's source must be in the caller's),
    # before the tmpfs below hides what was at /tmp
    opened = _open_sources(sources)
    _mount(libc, "gpuwarden-stage", STAGE_DIR, "tmpfs", _MS_NOSUID | _MS_NODEV)
    for i, (fd, is_dir) in enumerate(opened):
        target = f"{STAGE_DIR}/{i}"
        if is_dir:
            os.mkdir(target, 0o755)  # noqa: PTH102 - a path of this namespace's tmpfs
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        # the descriptor's own file: the path it was opened by is never looked up again
        _mount(libc, f"/proc/self/fd/{fd}", target, None, _MS_BIND | _MS_REC)
        os.close(fd)


def _drop(uid: int, gid: int, groups: list[int]) -> None:
    if uid == 0:
        raise Failure("--user 0: the starter drops root, it never runs a command as root")
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise Failure(f"could not become {uid}:{gid}")
    if sorted(set(os.getgroups()) - {gid}) != sorted(set(groups) - {gid}):
        raise Failure(f"supplementary groups {os.getgroups()} are not the ones asked: {groups}")
    try:
        os.setresuid(0, 0, 0)
    except PermissionError:
        return
    raise Failure("root could be regained after dropping to the sandbox's user")


def run(argv: list[str]) -> None:
    opts = parse(argv)
    stage = opts["stage"]
    rlimits = opts["rlimits"]
    command = opts["command"]
    cgroups = opts["cgroups"]
    seccomp = opts["seccomp"]
    user = opts["user"]
    assert isinstance(stage, list) and isinstance(rlimits, list) and isinstance(command, list)
    assert isinstance(cgroups, list)
    procs = []
    for cgroup in cgroups:
        try:
            fd = os.open(f"{cgroup}/cgroup.procs", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Failure(f"cannot open the cgroup {cgroup}: {exc.strerror}") from None
        procs.append((cgroup, fd))
    filter_fd = None
    if seccomp is not None:
        try:
            filter_fd = os.open(str(seccomp), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise Failure(f"cannot open the seccomp filter {seccomp}: {exc.strerror}") from None
        os.set_inheritable(filter_fd, True)  # bubblewrap reads it
    if stage:
        _stage([str(s) for s in stage])
    for cgroup, fd in procs:
        try:
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:
            raise Failure(f"cannot join the cgroup {cgroup}: {exc.strerror}") from None
        os.close(fd)
    for name, value in rlimits:
        limit = getattr(resource, f"RLIMIT_{name}", None)
        if limit is None:
            raise Failure(f"unknown rlimit {name}")
        resource.setrlimit(limit, (value, value))
    args = [str(a) for a in command]
    if filter_fd is not None:
        args[1:1] = ["--seccomp", str(filter_fd)]
    program = _which(args[0])
    if user is not None:
        groups = opts["groups"]
        assert isinstance(user, tuple) and isinstance(groups, list)
        uid, gid = user
        _drop(uid, gid, groups)
    chdir = opts["chdir"]
    if chdir is not None:
        # as the user: the check at start that the folder is there and theirs to enter
        try:
            os.chdir(str(chdir))
        except OSError as exc:
            raise Failure(f"cannot enter the working directory {chdir}: {exc.strerror}") from None
    # nothing may be imported from here on: the interpreter's files may be
    # under a folder the sandbox's user cannot search (/root)
    try:
        os.execve(program, args, os.environ)  # noqa: S606 - bubblewrap or the job, by its path
    except OSError as exc:
        raise Failure(f"cannot run {program}: {exc.strerror}") from None


def _which(name: str) -> str:
    """``name`` looked up on PATH now, as root (os.execvp would import later)."""
    if "/" in name:
        return name
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = Path(folder or ".") / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise Failure(f"{name} is not on PATH")


def main() -> None:
    try:
        run(sys.argv[1:])
    except Exception as exc:  # one line, never a traceback (it would import)
        sys.stderr.write(f"{PREFIX} {exc}\n")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
