"""What every check of ``gpuwarden doctor`` shares: the verdict of a check
(:class:`Check`: OK, WARN or FAIL, what it found, what to do), the host and what
earlier checks found (:class:`Host`), and running a command that may hang."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from gpuwarden.config import Config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.gpu.base import GpuProbe, GpuReading
from gpuwarden.registry import Registry

#: seconds a runtime or toolkit command may take
COMMAND_TIMEOUT_S = 30.0
#: probe kinds that read a real GPU
REAL_PROBES = ("nvml", "nvidia-smi")


class Status(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str
    #: what to do (WARN and FAIL)
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
        }


class Skip(Exception):
    """Raised inside a check that cannot run: it becomes a WARN saying why."""


@dataclass
class Host:
    """What the checks share: the inputs, and what earlier checks found."""

    config_path: Path | None
    state_dir: Path | None = None
    mock_gpu: bool = False
    config: Config | None = None
    #: the config could not be read at all (not just its sandbox settings)
    config_unreadable: bool = False
    #: check_sandbox() passed
    config_ok: bool = False
    runtime_ok: bool = False
    probe: GpuProbe | None = None
    readings: list[GpuReading] | None = None
    _registry: Registry | Exception | None = field(default=None, repr=False)

    def need_config(self) -> Config:
        if self.config is None:
            raise Skip("not checked: the config did not load")
        return self.config

    def registry(self) -> Registry:
        """The module registry under the config's launch rules (loaded once)."""
        if self._registry is None:
            config = self.need_config()
            try:
                self._registry = Registry.load(config.module_paths, config.launch_rules)
            except Exception as exc:
                self._registry = exc
        if isinstance(self._registry, Exception):
            raise self._registry
        return self._registry

    @property
    def real_gpus(self) -> list[GpuReading]:
        """The GPUs a real probe (NVML, nvidia-smi) read; [] for none or simulated."""
        if self.probe is None or self.probe.kind not in REAL_PROBES:
            return []
        return list(self.readings or [])

    def close(self) -> None:
        if self.probe is not None:
            with contextlib.suppress(Exception):
                self.probe.close()
            self.probe = None


def executable(runtime: Runtime) -> str:
    return "bwrap" if runtime is Runtime.BUBBLEWRAP else runtime.value


def run_command(
    argv: list[str], timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run a command; a command that cannot start or hangs answers 127 or 124."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer after {timeout:g} s")
    except OSError as exc:
        return subprocess.CompletedProcess(argv, 127, "", str(exc))


def tail(text: str, lines: int = 1) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[:600]


def write_error(folder: Path) -> str | None:
    """None when a file can be created in ``folder``, else why not."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "no write permission"
    probe = folder / f".gpuwarden-doctor-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        return exc.strerror or str(exc)
    return None


@contextlib.contextmanager
def captured(logger_name: str) -> Iterator[list[str]]:
    """Collect what ``logger_name`` logs (instead of printing it) while open."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, propagate = Collect(logging.INFO), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
