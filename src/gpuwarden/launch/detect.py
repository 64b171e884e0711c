"""``container_runtime = "auto"``: is there a working bubblewrap on this host?

bubblewrap needs no image, so it is the one runtime ``auto`` can take without
the operator's help. It is taken only when it is really there and works:

1. ``bwrap`` is on PATH;
2. ``bwrap --help`` lists the options the sandbox launcher needs
   (:data:`BWRAP_OPTIONS`, bubblewrap 0.8.0 and later);
3. a trial sandbox starts and runs ``true`` with the launcher's namespace
   options (``--unshare-all --unshare-user --disable-userns --cap-drop ALL``),
   as the launcher would start it: as the sandbox's user when the broker is
   root (through the root-side starter, :mod:`gpuwarden.launch.enter`), as the
   broker's own user otherwise. A host whose kernel or AppArmor refuses
   unprivileged user namespaces fails here.

Anything else answers "no sandbox" with the reason; what then runs where is
the launch rules' business (:mod:`gpuwarden.core.launchrules`): nothing that
needs a sandbox runs without one unless the config says so. The answer is
computed once per process (a few tens of milliseconds).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.core.launchrules import Runtime
from gpuwarden.launch import enter

__all__ = ["BWRAP_OPTIONS", "Detected", "detect_runtime"]

#: what the sandbox launcher needs of bubblewrap (0.8.0 and later)
BWRAP_OPTIONS = ("--disable-userns", "--seccomp", "--size")
#: seconds each trial command may take
TRIAL_TIMEOUT_S = 10.0
_INSTALL = "install bubblewrap 0.8.0 or later: sudo apt-get install bubblewrap"


@dataclass(frozen=True, slots=True)
class Detected:
    """What ``auto`` found: the runtime it takes, and why, in words."""

    runtime: Runtime
    #: e.g. "bubblewrap 0.8.0 works (/usr/bin/bwrap)" or "bwrap is not on PATH"
    detail: str


def detect_runtime(uid: int = 65534, gid: int = 65534) -> Detected:
    """bubblewrap where ``bwrap`` is on PATH and a trial sandbox starts; else
    ``local`` with the reason. ``uid``/``gid``: the sandbox's user (``[sandbox]``),
    which a broker running as root drops to before it starts bubblewrap."""
    return _detect(uid, gid, os.geteuid() == 0, os.environ.get("PATH", os.defpath))


@functools.lru_cache(maxsize=8)
def _detect(uid: int, gid: int, as_root: bool, path_env: str) -> Detected:
    exe = shutil.which("bwrap", path=path_env)
    if exe is None:
        return Detected(Runtime.LOCAL, f"bwrap is not on PATH; {_INSTALL}")
    version = _run([exe, "--version"])
    shown = _tail(version.stdout) or _tail(version.stderr) or "bubblewrap"
    if version.returncode != 0:
        return Detected(
            Runtime.LOCAL,
            f"{exe} --version failed (exit {version.returncode}: {shown}); {_INSTALL}",
        )
    usage = _run([exe, "--help"])
    lacking = [o for o in BWRAP_OPTIONS if o not in usage.stdout + usage.stderr]
    if lacking:
        return Detected(Runtime.LOCAL, f"{shown} ({exe}) lacks {', '.join(lacking)}; {_INSTALL}")
    true = shutil.which("true", path=path_env) or "/bin/true"
    trial = [exe, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    trial += ["--new-session", "--cap-drop", "ALL", "--ro-bind", "/", "/"]
    trial += ["--proc", "/proc", "--dev", "/dev", "--", true]
    if as_root:  # as the launcher does: never bubblewrap as root
        starter = [sys.executable, "-I", "-S", str(Path(enter.__file__).resolve())]
        trial = [*starter, "--user", f"{uid}:{gid}", "--", *trial]
    done = _run(trial)
    if done.returncode != 0:
        said = _tail(done.stderr) or _tail(done.stdout) or f"exit {done.returncode}"
        return Detected(
            Runtime.LOCAL,
            f"{shown} ({exe}) cannot start a sandbox here: {said} (user namespaces "
            "may be off: sysctl kernel.unprivileged_userns_clone, or AppArmor's "
            "kernel.apparmor_restrict_unprivileged_userns)",
        )
    return Detected(Runtime.BUBBLEWRAP, f"{shown} works ({exe})")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer after {TRIAL_TIMEOUT_S:g} s")
    except OSError as exc:
        return subprocess.CompletedProcess(argv, 127, "", exc.strerror or str(exc))


def _tail(text: str) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-1:]
    return " | ".join(kept)[:300]
