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
- ``container_runtime = "auto"``: the configuration found out which of
  bubblewrap and ``local`` this host has (``auto`` holds what it found) and the
  rules above apply to that one; every message then says that ``auto`` chose.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpuwarden.core.command import is_command_type
from gpuwarden.core.lease import is_lease
from gpuwarden.core.model import JobType, Lane, LaunchMode

__all__ = ["LaunchRules", "Runtime", "image_is_pinned", "process_lane", "widening_refusal"]


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


def process_lane(jobtype: JobType) -> Lane:
    """The lane of what the type's own process does: a runtime type's process is
    the runtime's client and runs no model code on a GPU (the runtime does), so
    the rules judge it as they judge a cpu type."""
    return Lane.CPU if jobtype.runtime is not None else jobtype.lane


@dataclass(frozen=True, slots=True)
class LaunchRules:
    runtime: Runtime = Runtime.LOCAL
    allow_unsandboxed_containers: bool = False
    allow_host_jobs: bool = False
    #: with ``container_runtime = "auto"``: what it found on this host, in words
    #: ("bubblewrap 0.8.0 works (/usr/bin/bwrap)", "bwrap is not on PATH; ...");
    #: "" when the configuration names the runtime
    auto: str = ""

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
        if is_command_type(name) and launch is LaunchMode.HOST:
            # a host command runs as the user who submitted it, not as root: who may
            # is ``[commands]``'s to say (SPEC.md, "Command jobs"), not these rules'
            return None
        if is_command_type(name):
            return self.command_refusal()
        if is_lease(name):
            return None  # a VRAM lease's holder runs no code on its GPU (core/lease.py)
        rule = self._refused(launch, process_lane(jobtype))
        if rule == "vram_host":
            return (
                f"{name} runs on a GPU as a plain host process, but vram types must be "
                f'container types (launch = "container" or "serve" in its '
                f"module.toml) so that model code runs sandboxed"
            )
        if rule == "unsandboxed":
            if self.auto:
                return (
                    f'{name} is a {launch.value} type and container_runtime = "auto" '
                    f"found no sandbox here: {self.auto}. Or set "
                    f"allow_unsandboxed_containers = true to run it as a plain host "
                    f"process"
                )
            return (
                f'{name} is a {launch.value} type and container_runtime is "local" '
                f"(no sandbox here): set container_runtime to podman, docker or "
                f"bubblewrap, or set allow_unsandboxed_containers = true to run it "
                f"as a plain host process"
            )
        if rule == "host":
            return (
                f"{name} is a host type (no sandbox) and this node runs jobs in "
                f"{self._runtime_shown()}: run a container type instead, or set "
                f"allow_host_jobs = true"
            )
        return None

    def command_refusal(self) -> str | None:
        """Why a sandboxed command job (one from HTTP, a bundle or a coordinator)
        may not run here, or None. It runs only in a sandbox: on a node without one
        ``allow_unsandboxed_containers`` does not make it a host process."""
        if self.runtime is not Runtime.LOCAL:
            return None
        found = f' (container_runtime = "auto" found none: {self.auto})' if self.auto else ""
        return (
            "a command job from HTTP, a bundle or a coordinator runs only in a sandbox "
            f"(bubblewrap or podman), and this node has none{found}: set container_runtime "
            'to "bubblewrap" or "podman" in its config (allow_unsandboxed_containers does '
            "not apply to command jobs); a host command comes only through the node's local "
            "socket (`gpuwarden run -- CMD` on the host)"
        )

    def _runtime_shown(self) -> str:
        if self.auto:
            return f'{self.runtime.value} (chosen by container_runtime = "auto")'
        return self.runtime.value

    def unsandboxed_reason(self, jobtype: JobType) -> str | None:
        """Why attempts of ``jobtype`` run without a sandbox here although it or
        the node has one (see :meth:`unsandboxed_warning`), in a few words; None
        when it runs sandboxed, is refused, or nothing on the node is sandboxed."""
        if self.refusal(jobtype) is not None:
            return None
        if is_lease(jobtype.name) or is_command_type(jobtype.name):
            return None  # a lease's holder runs no job code; a host command runs as its user
        if self.runtime is Runtime.LOCAL and jobtype.launch is not LaunchMode.HOST:
            if self.auto:
                return (
                    f'container and serve types; container_runtime = "auto" found no '
                    f"sandbox here ({self.auto}), and allow_unsandboxed_containers = true"
                )
            return (
                'container and serve types; container_runtime = "local" (no sandbox), '
                "and allow_unsandboxed_containers = true"
            )
        if self.runtime is not Runtime.LOCAL and jobtype.launch is LaunchMode.HOST:
            return f"host types beside the {self.runtime.value} sandbox; allow_host_jobs = true"
        return None

    def where(self, jobtype: JobType) -> str:
        """How attempts of ``jobtype`` run here, in a few words (``types``, ``preview``)."""
        if self.refusal(jobtype) is not None:
            return "refused"
        if self.sandboxed(jobtype):
            return f"sandboxed: {self.runtime.value}"
        if self.unsandboxed_reason(jobtype) is not None:
            return "UNSANDBOXED"
        return "host process"  # a host type on a node without a sandbox

    def unsandboxed_summary(self, jobtypes: Iterable[JobType]) -> str | None:
        """One line naming every type of ``jobtypes`` that runs unsandboxed here and
        why (a broker says it once, when it starts); None when there is none."""
        groups: dict[str, list[str]] = {}
        for t in sorted(jobtypes, key=lambda t: t.name):
            if (why := self.unsandboxed_reason(t)) is not None:
                groups.setdefault(why, []).append(t.name)
        if not groups:
            return None
        parts = [f"{', '.join(names)} ({why})" for why, names in groups.items()]
        if self.runtime is not Runtime.LOCAL:
            rest = f"Every other type that runs here is sandboxed in {self._runtime_shown()}."
        else:
            rest = "Host types run as host processes too: nothing is sandboxed on this node."
        return (
            f"UNSANDBOXED on this node, as plain host processes with the broker's user: "
            f"{'; '.join(parts)}. {rest} Each unsandboxed attempt is marked 'unsandboxed' "
            f"in the event log."
        )

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
            why = (
                f'container_runtime = "auto" found no sandbox here ({self.auto}); '
                if self.auto
                else ""
            )
            return (
                f"UNSANDBOXED: {jobtype.name} is a {jobtype.launch.value} type running as "
                f"a plain host process ({why}allow_unsandboxed_containers = true)"
            )
        if self.runtime is not Runtime.LOCAL and jobtype.launch is LaunchMode.HOST:
            return (
                f"UNSANDBOXED: {jobtype.name} is a host type running as a plain host "
                f"process beside the {self._runtime_shown()} sandbox (allow_host_jobs = true)"
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
    if key == "gpus" and isinstance(value, int | float) and not isinstance(value, bool):
        return None  # a count of GPUs for the broker to choose (SPEC.md section 4): no device
    # (a list or a string under ``gpus`` names devices: refused as one)
    detail = ""
    if what == "environment variables" and isinstance(value, dict):
        named = sorted(k for k in value if str(k).upper().startswith(_DANGEROUS_ENV))
        if named:
            detail = f" ({', '.join(map(str, named))} would change what the sandbox loads)"
    return (
        f"key {key!r}: a job cannot set {what}{detail}; the sandbox is fixed by the job "
        f"type and the node's configuration. Pass values as the type's parameters instead"
    )
