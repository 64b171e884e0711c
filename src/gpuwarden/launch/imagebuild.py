"""Images built from a job's source commit (SPEC.md, "Jobs from a pinned commit").

The image of a commit is built once, by the node's podman or docker, from the
``Containerfile`` at the top of the commit's exported tree, with no network and
nothing pulled (``FROM`` an image the node has), and tagged
``gpuwarden-src:<commit>``: a later job of the same commit finds the tag and
reuses the image. The build's output is the attempt's ``build.log``.

The ``RUN`` steps of a commit's ``Containerfile`` are code from the repository,
run by the node's runtime as the image's user (root unless it says ``USER``): a
podman build drops every capability but :data:`BUILD_CAPS`; ``docker build`` has
no such option and runs them with docker's defaults (SPEC.md section 20, "Build
and cache").
"""

from __future__ import annotations

import subprocess
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gpuwarden.launch.base import ImageBuild

#: the build's output, in the attempt's folder beside stdout.log
BUILD_LOG = "build.log"
#: the lines of a failed build's log that its launch error quotes
_TAIL_LINES = 12
#: the only capabilities the RUN steps of a podman build keep: to own, chown and
#: chmod files and to change user (chown, useradd, ``USER``); not to chroot, kill
#: outside their own uid, set file capabilities or change capability sets
BUILD_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID")
_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


class ImageBuildError(Exception):
    """An image could not be built; the message quotes the end of its log."""


def image_tag(commit: str) -> str:
    """The tag of a commit's image."""
    return f"localhost/gpuwarden-src:{commit}"


def image_for(
    executable: str,
    build: ImageBuild,
    log_path: Path,
    env: dict[str, str],
    wrap: Callable[[list[str]], list[str]] = list,
) -> tuple[str, bool]:
    """The id of the image of ``build``'s commit, and whether it was there
    already; built now (its output written to ``log_path``) unless it was;
    ``wrap`` wraps the build's command line as the launcher wraps its runs (podman
    in a private mount namespace on a host of mixed cgroups). Raise
    :class:`ImageBuildError` saying why not."""
    with _lock(build.tag):
        found = _image_id(executable, build.tag, env)
        if found is not None:
            log_path.write_text(f"image {build.tag} ({found}) was built before: reused\n")
            return found, True
        argv = [executable, "build", "--network", "none"]
        if Path(executable).name != "docker":  # docker build pulls only when asked
            argv.append("--pull=never")
            # docker build has no --cap-drop: its RUN steps keep docker's defaults
            argv += ["--cap-drop=all", f"--cap-add={','.join(BUILD_CAPS)}"]
        argv += ["--file", str(Path(build.context) / "Containerfile"), "--tag", build.tag]
        argv += ["--label", f"gpuwarden.source.commit={build.tag.rpartition(':')[2]}"]
        argv.append(build.context)
        try:
            with log_path.open("xb") as log:
                done = subprocess.run(
                    wrap(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=build.timeout_s,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            raise ImageBuildError(
                f"building the image took longer than {build.timeout_s:g} s "
                "([sources] build_timeout_s)"
            ) from None
        if done.returncode != 0:
            raise ImageBuildError(
                f"building the image failed (exit {done.returncode}); the end of "
                f"{BUILD_LOG}:\n{_tail(log_path)}"
            )
        built = _image_id(executable, build.tag, env)
        if built is None:
            raise ImageBuildError(f"the build ended but {build.tag} is not there")
        return built, False


def _image_id(executable: str, tag: str, env: dict[str, str]) -> str | None:
    try:
        done = subprocess.run(
            [executable, "image", "inspect", "--format", "{{.Id}}", tag],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    image = done.stdout.strip()
    return image if done.returncode == 0 and image else None


def _lock(tag: str) -> threading.Lock:
    """One build of a tag at a time in this process: a second job waits, then reuses."""
    with _locks_lock:
        return _locks.setdefault(tag, threading.Lock())


def _tail(path: Path) -> str:
    with path.open(errors="replace") as f:
        return "\n".join(line.rstrip("\n") for line in deque(f, maxlen=_TAIL_LINES))
