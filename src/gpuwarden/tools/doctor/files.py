"""What the config points at: the modules, the weights and model folders, the queue roots,
the GPU lock file's folder (``gpu_lock``) and the sandbox image."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuwarden.config import Config
from gpuwarden.core.launchrules import Runtime, image_is_pinned
from gpuwarden.errors import GpuwardenError
from gpuwarden.gpu.lockfile import GpuLockError, LockTemplate, folder_problem
from gpuwarden.intake.queueroot import SUBFOLDERS
from gpuwarden.tools.doctor.base import (
    Check,
    Host,
    Status,
    executable,
    run_command,
    tail,
    write_error,
)


def check_modules(host: Host) -> Check:
    config = host.need_config()
    paths = ", ".join(map(str, config.module_paths)) or "none"
    try:
        registry = host.registry()
    except GpuwardenError as exc:
        return Check(
            "modules",
            Status.FAIL,
            exc.message,
            "fix the module.toml it names (docs/MODULE_GUIDE.md), or take that folder off "
            "module_paths",
        )
    if not registry.types:
        return Check(
            "modules",
            Status.WARN,
            f"no job types found on module_paths ({paths})",
            "set module_paths to the folders that hold your modules (each a folder with "
            "a module.toml)",
        )
    sources = "; ".join(sorted({str(m.source) for m in registry.modules.values()}))
    found = f"{len(registry.modules)} module(s), {len(registry.types)} type(s) from {sources}"
    # one line per kind of refusal: the reasons differ only in the type's name
    refused: dict[str, list[str]] = {}
    for t in sorted(registry.types.values(), key=lambda t: t.name):
        if (why := registry.rules.refusal(t)) is not None:
            refused.setdefault(why.replace(t.name, "\0"), []).append(t.name)
    if refused:
        count = sum(map(len, refused.values()))
        return Check(
            "modules",
            Status.WARN,
            f"{found}; {count} refused on this node: "
            + "; ".join(
                f"{', '.join(names)} ({why.replace(chr(0), 'each' if names[1:] else names[0])})"
                for why, names in refused.items()
            ),
            "jobs of these types are refused at submission; change container_runtime or "
            "the allow_* settings if they should run here",
        )
    return Check("modules", Status.OK, f"{found}; every type may run on this node")


def check_weights(host: Host) -> Check:
    """The weights folder (``[sandbox] weights_dir``) and every module's model
    folder (``[modules.<name>] model_dir``): there, folders, readable."""
    config = host.need_config()
    folders = [("weights_dir", "[sandbox] weights_dir", config.sandbox.weights_dir)]
    folders += [
        (f"[modules.{name}] model_dir", f"[modules.{name}] model_dir", m.model_dir)
        for name, m in sorted(config.modules.items())
    ]
    checks = [_folder_check(config, what, key, path) for what, key, path in folders if path]
    if not checks:
        return Check("weights", Status.OK, "none ([sandbox] weights_dir is not set)")
    worst = next(
        (c for status in (Status.FAIL, Status.WARN) for c in checks if c.status is status),
        checks[0],
    )
    detail = "; ".join(c.detail for c in checks)
    return Check("weights", worst.status, detail, worst.fix)


def _folder_check(config: Config, what: str, key: str, folder: Path) -> Check:
    """One model folder, mounted read-only in the sandboxes that get it."""
    fix = f"create {folder} and put the model weights there, or fix {key}"
    if not folder.exists():
        return Check("weights", Status.FAIL, f"{what} {folder} does not exist", fix)
    if not folder.is_dir():
        return Check("weights", Status.FAIL, f"{what} {folder} is not a directory", fix)
    try:
        entries = sum(1 for _ in folder.iterdir())
        st = folder.stat()
    except OSError as exc:
        return Check(
            "weights",
            Status.FAIL,
            f"{what} {folder} cannot be read: {exc.strerror}",
            f"make it readable by the broker's user (uid {os.geteuid()})",
        )
    if not os.access(folder, os.R_OK | os.X_OK):
        return Check(
            "weights",
            Status.FAIL,
            f"{what} {folder} is not readable by this user (uid {os.geteuid()})",
            f"chmod a+rx {folder}, or run the broker as a user that can read it",
        )
    found = f"{what} {folder}: readable, {entries} entries, mounted read-only"
    s = config.sandbox
    mode = st.st_mode
    sandbox_reads = (
        (st.st_uid == s.uid and mode & 0o500 == 0o500)
        or (st.st_gid == s.gid and mode & 0o050 == 0o050)
        or mode & 0o005 == 0o005
    )
    if config.container_runtime is not Runtime.LOCAL and not sandbox_reads:
        return Check(
            "weights",
            Status.WARN,
            f"{found}, but its mode {oct(mode & 0o777)} may keep the sandbox's user "
            f"({s.uid}:{s.gid}) out",
            f"chmod -R o+rX {folder}",
        )
    return Check("weights", Status.OK, found)


def check_queue_roots(host: Host) -> Check:
    config = host.need_config()
    if not config.queue_roots:
        return Check(
            "queue-roots", Status.OK, "none configured (jobs come in through `gpuwarden submit`)"
        )
    problems: list[str] = []
    found: list[str] = []
    for root in config.queue_roots:
        problem = _queue_root_problem(root, create=config.create_queue_roots)
        if problem:
            problems.append(problem)
        elif not root.exists():
            found.append(f"{root} (created at start)")
        else:
            found.append(str(root))
    if problems:
        return Check(
            "queue-roots",
            Status.FAIL,
            "; ".join(problems),
            "make each queue root a directory gpuwarden can write (with inbox/, processing/, "
            "outbox/, failed/ in it, or create_queue_roots = true), or fix queue_roots",
        )
    return Check("queue-roots", Status.OK, f"writable: {', '.join(found)}")


def _queue_root_problem(root: Path, *, create: bool) -> str | None:
    if not root.exists():
        if root.is_symlink():
            return f"{root} is a link to nothing"
        if not create:
            return f"{root} does not exist (and create_queue_roots = false)"
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            return f"{root} does not exist and cannot be created: {parent} is not a directory"
        if why := write_error(parent):
            return f"{root} does not exist and cannot be created in {parent} ({why})"
        return None
    if not root.is_dir():
        return f"{root} is not a directory"
    for sub in SUBFOLDERS:
        folder = root / sub
        if not folder.exists() and not folder.is_symlink():
            if not create:
                return f"{folder} is missing (and create_queue_roots = false)"
            if why := write_error(root):
                return f"{folder} is missing and {root} is not writable ({why})"
        elif not folder.is_dir():
            return f"{folder} is not a directory"
        elif why := write_error(folder):
            return f"{folder} is not writable ({why})"
    return None


def check_image(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if not runtime.needs_image:
        how = "uses the host's /usr and Python" if runtime is Runtime.BUBBLEWRAP else "no sandbox"
        return Check("image", Status.OK, f"not needed: {runtime.value} ({how})")
    image = config.sandbox_image
    fix = (
        f"`images/build.sh --runtime {runtime.value} --pin`, then put the sandbox_image line "
        f"it prints into the config"
    )
    if not image:
        return Check("image", Status.FAIL, "sandbox_image is not set", fix)
    problems: list[str] = []
    warnings: list[str] = []
    if image_is_pinned(image):
        found = f"sandbox_image {image} is pinned"
    elif config.allow_unpinned_images:
        found = f"sandbox_image {image}"
        warnings.append("it is not pinned (allowed by allow_unpinned_images = true)")
    else:
        found = f"sandbox_image {image}"
        problems.append("it is not pinned: a tag can be moved to another image")
    if not host.runtime_ok:
        warnings.append(f"not checked whether it is present: {runtime.value} is not usable")
    else:
        exe = executable(runtime)
        argv = [exe, "image", "exists", image] if runtime is Runtime.PODMAN else [
            exe, "image", "inspect", image,
        ]  # fmt: skip
        done = run_command(argv)
        if done.returncode == 0:
            found += ", present locally"
        else:
            said = tail(done.stderr)
            problems.append(f"it is not present locally{f' ({said})' if said else ''}")
    if problems:
        return Check("image", Status.FAIL, f"{found}; " + "; ".join(problems + warnings), fix)
    if warnings:
        return Check(
            "image",
            Status.WARN,
            f"{found}; " + "; ".join(warnings),
            f"pin it: {fix}" if not image_is_pinned(image) else "fix the runtime check first",
        )
    return Check("image", Status.OK, found)


def check_gpu_lock(host: Host) -> Check:
    """``gpu_lock``: whether it is set, that its folder is usable (a folder, not a
    link, that no one else may write, sticky or not), as the broker and ``gpu
    lock`` need it, and that ``gpu_lock_group`` is a group here."""
    config = host.need_config()
    template = config.gpu_lock
    if not template:
        return Check("gpu-lock", Status.OK, "off (gpu_lock is not set)")
    lock = LockTemplate(template, config.gpu_lock_group)
    folder = lock.folder
    mode_wanted = "0750, of gpu_lock_group" if lock.group else "0700"
    fix = (
        f"make {folder} a folder of the broker's user, mode {mode_wanted} "
        "(or remove it: made at start)"
    )
    try:
        gid = lock.gid()
    except GpuLockError as exc:
        return Check("gpu-lock", Status.FAIL, str(exc), "create the group, or fix gpu_lock_group")
    who = (
        f"the broker's user and group {lock.group} (gid {gid})"
        if lock.group
        else f"the broker's user and its group (gid {os.getegid()}); set gpu_lock_group"
    )
    try:
        st = folder.lstat()
    except FileNotFoundError:
        return Check(
            "gpu-lock",
            Status.OK,
            f"gpu_lock = {template}; {folder} is made at start (mode {mode_wanted}); "
            f"who may lock: {who}",
        )
    problem = folder_problem(st)
    if problem:
        return Check("gpu-lock", Status.FAIL, f"{folder} {problem}", fix)
    if st.st_uid != os.geteuid():
        owner = f"{folder} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
        return Check("gpu-lock", Status.WARN, owner, fix)
    mode = f"{stat.S_IMODE(st.st_mode):04o}"
    if gid is not None and (st.st_gid != gid or not st.st_mode & 0o010):
        return Check(
            "gpu-lock",
            Status.WARN,
            f"{folder} ({mode}, gid {st.st_gid}) cannot be searched by group {lock.group}: "
            "its members cannot reach the lock files",
            fix,
        )
    return Check(
        "gpu-lock",
        Status.OK,
        f"gpu_lock = {template}; {folder} is usable ({mode}); who may lock: {who}",
    )
