"""Which job types may run on a node, and how: the launch rules.

Pure: the rules are values from the configuration, the answers are strings a
person can act on. The same rules are applied at submission (a refusal is a clear
error, nothing is stored) and again when the broker starts an attempt (the
configuration may have changed since the job was accepted).

- ``container_runtime = "local"`` (no sandbox): host types run. Container and
  serve types are refused unless ``allow_unsandboxed_containers``, and then run
  as plain host processes. A ``vram`` type must be a container or serve type:
  model code on a GPU is what the sandbox is for.
- a real runtime (podman, docker, bubblewrap): container and serve types run
  sandboxed; host types are refused unless ``allow_host_jobs``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpuwarden.core.model import JobType, Lane, LaunchMode

__all__ = ["LaunchRules", "Runtime", "image_is_pinned", "widening_refusal"]


class Runtime(StrEnum):
    LOCAL = "local"  # no runtime: plain host processes
    PODMAN = "podman"
    DOCKER = "docker"
    BUBBLEWRAP = "bubblewrap"

    @property
    def needs_image(self) -> bool:
        return self in (Runtime.PODMAN, Runtime.DOCKER)


#: ``name@sha256:<64 hex>`` (a digest), or a local image id: ``sha256:<hex>`` or
#: 12 to 64 hex digits
_DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
_IMAGE_ID = re.compile(r"^(sha256:)?[0-9a-f]{12,64}$")


def image_is_pinned(image: str) -> bool:
    """True for an image named by digest or by local image id: both name exactly
    one image, where a tag can be moved to another."""
    return bool(_DIGEST.fullmatch(image) or _IMAGE_ID.fullmatch(image))


@dataclass(frozen=True, slots=True)
class LaunchRules:
    runtime: Runtime = Runtime.LOCAL
    allow_unsandboxed_containers: bool = False
    allow_host_jobs: bool = False

    @classmethod
    def unchecked(cls) -> LaunchRules:
        """Rules that refuse nothing: for a client that submits to a queue another
        node reads (that node applies its own rules)."""
        return cls(runtime=Runtime.BUBBLEWRAP, allow_host_jobs=True)

    def sandboxed(self, jobtype: JobType) -> bool:
        """True when attempts of ``jobtype`` run inside the runtime's sandbox."""
        return self.runtime is not Runtime.LOCAL and jobtype.launch is not LaunchMode.HOST

    def to_json(self) -> dict[str, Any]:
        """What an agent reports of its rules (the coordinator judges by them)."""
        return {
            "runtime": self.runtime.value,
            "allow_unsandboxed_containers": self.allow_unsandboxed_containers,
            "allow_host_jobs": self.allow_host_jobs,
        }

    @classmethod
    def from_json(cls, raw: object) -> LaunchRules | None:
        """The rules a node reported, or None when ``raw`` is not such a report (an
        older agent, or garbage): then nothing is judged by them."""
        if not isinstance(raw, Mapping):
            return None
        try:
            runtime = Runtime(str(raw.get("runtime")))
        except ValueError:
            return None
        flags = (raw.get("allow_unsandboxed_containers"), raw.get("allow_host_jobs"))
        if not all(isinstance(f, bool) for f in flags):
            return None
        return cls(
            runtime=runtime,
            allow_unsandboxed_containers=bool(flags[0]),
            allow_host_jobs=bool(flags[1]),
        )

    def _refused(self, launch: LaunchMode, lane: Lane) -> str | None:
        """Which rule refuses a type of this launch mode and lane: ``vram_host``
        (model code on a GPU unsandboxed), ``unsandboxed`` (a container or serve type
        with no sandbox), ``host`` (a host type beside a sandbox); None: it runs."""
        if self.runtime is Runtime.LOCAL:
            if launch is LaunchMode.HOST and lane is Lane.VRAM:
                return "vram_host"
            if launch is not LaunchMode.HOST and not self.allow_unsandboxed_containers:
                return "unsandboxed"
            return None
        if launch is LaunchMode.HOST and not self.allow_host_jobs:
            return "host"
        return None

    def refusal(self, jobtype: JobType) -> str | None:
        """Why ``jobtype`` may not run on this node (what to change), or None."""
        name, launch = jobtype.name, jobtype.launch
        rule = self._refused(launch, jobtype.lane)
        if rule == "vram_host":
            return (
                f"{name} runs on a GPU as a plain host process, but vram types must be "
                f'container types (launch = "container" or "serve" in its '
                f"module.toml) so that model code runs sandboxed"
            )
        if rule == "unsandboxed":
            return (
                f'{name} is a {launch.value} type and container_runtime is "local" '
                f"(no sandbox here): set container_runtime to podman, docker or "
                f"bubblewrap, or set allow_unsandboxed_containers = true to run it "
                f"as a plain host process"
            )
        if rule == "host":
            return (
                f"{name} is a host type (no sandbox) and this node runs jobs in "
                f"{self.runtime.value}: run a container type instead, or set "
                f"allow_host_jobs = true"
            )
        return None

    def node_refusal(self, launch: LaunchMode, lane: Lane) -> str | None:
        """As a node's reason, short, for placement and ``explain``: ``refuses
        container types (its runtime is local)``; None when such a type runs."""
        rule = self._refused(launch, lane)
        if rule == "vram_host":
            return "refuses host types on the vram lane (model code on a GPU runs sandboxed)"
        if rule == "unsandboxed":
            return f"refuses {launch.value} types (its runtime is local)"
        if rule == "host":
            return f"refuses host types (its runtime is {self.runtime.value})"
        return None

    def unsandboxed_warning(self, jobtype: JobType) -> str | None:
        """The line logged when attempts of ``jobtype`` run without a sandbox while
        the configuration could give one or has one: a container or serve type
        under ``allow_unsandboxed_containers``, and a host type beside a real
        runtime under ``allow_host_jobs``. None for a host type on a node without
        a sandbox (``local``): nothing there is sandboxed, nothing is hidden."""
        if self.runtime is Runtime.LOCAL and jobtype.launch is not LaunchMode.HOST:
            return (
                f"UNSANDBOXED: {jobtype.name} is a {jobtype.launch.value} type running as "
                f"a plain host process (allow_unsandboxed_containers = true)"
            )
        if self.runtime is not Runtime.LOCAL and jobtype.launch is LaunchMode.HOST:
            return (
                f"UNSANDBOXED: {jobtype.name} is a host type running as a plain host "
                f"process beside the {self.runtime.value} sandbox (allow_host_jobs = true)"
            )
        return None


#: keys a job spec might use to change its own sandbox; none is accepted
_WIDENING_KEYS = {
    "env": "environment variables",
    "environment": "environment variables",
    "mounts": "extra mounts",
    "volumes": "extra mounts",
    "binds": "extra mounts",
    "devices": "devices",
    "gpus": "devices",
    "capabilities": "capabilities",
    "cap_add": "capabilities",
    "privileged": "privileges",
    "security_opt": "security options",
    "network": "network access",
    "user": "the sandbox's user",
    "image": "the sandbox image",
    "runtime": "the container runtime",
}
#: environment variables that would change what the sandbox loads or which GPU
#: it reaches; named in the refusal when a job spec tries to set one
_DANGEROUS_ENV = ("LD_", "NVIDIA_", "CUDA_", "PYTHON", "GPUWARDEN_", "PATH")


def widening_refusal(key: str, value: object) -> str | None:
    """Why the job spec key ``key`` (with ``value``) is refused, or None when the
    key is not one that could change a sandbox. A job never chooses its own
    sandbox: the job type and the node's configuration do."""
    what = _WIDENING_KEYS.get(key.lower())
    if what is None:
        return None
    detail = ""
    if what == "environment variables" and isinstance(value, dict):
        named = sorted(k for k in value if str(k).upper().startswith(_DANGEROUS_ENV))
        if named:
            detail = f" ({', '.join(map(str, named))} would change what the sandbox loads)"
    return (
        f"key {key!r}: a job cannot set {what}{detail}; the sandbox is fixed by the job "
        f"type and the node's configuration. Pass values as the type's parameters instead"
    )
