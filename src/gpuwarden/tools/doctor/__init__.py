"""``gpuwarden doctor``: check this host against the configuration.

Each check is a small function that looks at one thing (the config, the
container runtime, the GPUs, CDI, the NVIDIA container toolkit, the modules,
the weights folder, the queue roots, the GPU lock file's folder, the sandbox
image, a real sandboxed start)
and returns a :class:`Check`: ``OK``, ``WARN`` or ``FAIL``, what it found and,
for WARN and FAIL, what to do. A check never crashes the doctor: an exception
becomes a FAIL with its text. Checks that need what an earlier check could not
provide (a config, a runtime) say they were not run.

The sandbox checks run the ``probe`` module's ``probe.sandbox`` (and, with a
real GPU, ``probe.gpu``) through the same :class:`SandboxLauncher` and the same
kind of launch request the broker builds, and judge the report the probe writes
from inside: not root, no capabilities, no network, a read-only root, writable
output and scratch, read-only inputs, no sight of a host file placed next to
the attempt's folders, no user namespace, no mount, a seccomp filter that
refuses keyctl, and a /tmp no larger than ``[sandbox] tmp_mib``. How the
process limit is enforced (a pids cgroup per sandbox, or RLIMIT_NPROC shared
by all) is said too: the shared fallback is a WARN. ``memory-caps`` says whether a
job's RAM cap (``ram_gib``) is enforced here, by making a memory cgroup with a
small limit, reading it back and removing it. The doctor opens no store.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from gpuwarden.tools.doctor.base import Check, Host, Skip, Status
from gpuwarden.tools.doctor.files import (
    check_gpu_lock,
    check_image,
    check_modules,
    check_queue_roots,
    check_weights,
)
from gpuwarden.tools.doctor.host import (
    check_cdi,
    check_config,
    check_gpu,
    check_memory_caps,
    check_runtime,
    check_toolkit,
)
from gpuwarden.tools.doctor.sandbox import check_sandbox, check_sandbox_gpu, judge

__all__ = [
    "CHECKS",
    "Check",
    "Host",
    "Status",
    "check_cdi",
    "check_sandbox",
    "check_toolkit",
    "judge",
    "render",
    "run_checks",
    "run_doctor",
]


#: every check, in the order they run and are shown
CHECKS: tuple[tuple[str, Callable[[Host], Check]], ...] = (
    ("config", check_config),
    ("runtime", check_runtime),
    ("memory-caps", check_memory_caps),
    ("gpu", check_gpu),
    ("cdi", check_cdi),
    ("toolkit", check_toolkit),
    ("modules", check_modules),
    ("weights", check_weights),
    ("queue-roots", check_queue_roots),
    ("gpu-lock", check_gpu_lock),
    ("image", check_image),
    ("sandbox", check_sandbox),
    ("sandbox-gpu", check_sandbox_gpu),
)


def run_checks(host: Host) -> list[Check]:
    """Every check in order; none raises."""
    checks: list[Check] = []
    try:
        for name, fn in CHECKS:
            try:
                checks.append(fn(host))
            except Skip as skip:
                checks.append(Check(name, Status.WARN, str(skip), "fix the checks above first"))
            except Exception as exc:
                checks.append(
                    Check(
                        name,
                        Status.FAIL,
                        f"the check itself failed: {type(exc).__name__}: {exc}",
                        "report this as a bug in gpuwarden doctor, with the line above",
                    )
                )
    finally:
        host.close()
    return checks


_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def render(console: Console, checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        console.print(
            f"[{_STYLE[c.status]}]{c.status.value:<4}[/] {c.name:<{width}}  {escape(c.detail)}"
        )
        if c.fix and c.status is not Status.OK:
            console.print(f"{'':<{width + 6}}[bold]fix:[/] {escape(c.fix)}")
    counts = {s: sum(1 for c in checks if c.status is s) for s in Status}
    console.print(f"{counts[Status.OK]} OK, {counts[Status.WARN]} WARN, {counts[Status.FAIL]} FAIL")


def run_doctor(
    config_path: Path | None,
    *,
    state_dir: Path | None,
    mock_gpu: bool,
    console: Console,
    json_out: bool,
) -> int:
    """Run every check and print the report. Exit status: 0 when none FAILs, 1
    otherwise, 2 when the config cannot be read at all."""
    host = Host(config_path=config_path, state_dir=state_dir, mock_gpu=mock_gpu)
    checks = run_checks(host)
    ok = not any(c.status is Status.FAIL for c in checks)
    if json_out:
        console.print_json(json.dumps({"checks": [c.to_json() for c in checks], "ok": ok}))
    else:
        render(console, checks)
    if host.config_unreadable:
        return 2
    return 0 if ok else 1
