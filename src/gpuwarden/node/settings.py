"""What the broker of one node is set to: plain values, not the configuration.

The configuration file is an edge (``gpuwarden.config``): the wiring
(``gpuwarden.app.node_settings``) reads it and builds these, so nothing in
``node/`` reads a file or knows the config's layout, and a test can build a
broker from values alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.core.fairshare import DEFAULT_HALF_LIFE_S
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.runtime import RuntimeKind


@dataclass(frozen=True, slots=True)
class VramSettings:
    """Admission against each GPU's memory (``[vram]``), in bytes."""

    #: kept free on every GPU (driver, CUDA context growth, fragmentation)
    reserve_bytes: int
    #: how long an ended job's memory may take to show free before its GPU is degraded
    reclaim_timeout_s: float
    #: memory differences below this are noise, not a leak
    tolerance_bytes: int
    #: a measured peak is rounded up to a multiple of this before it is stored
    step_bytes: int


@dataclass(frozen=True, slots=True)
class RuntimeCallSpec:
    """A ``generic`` runtime's call: method, path, the JSON key busy reads, a body."""

    method: str
    path: str
    busy_key: str = ""
    body: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    """One ``[[runtimes]]`` table, as plain values (the token read from its file)."""

    name: str
    kind: RuntimeKind
    url: str
    #: the bearer token (never in a repr: a logged setting shows no secret)
    token: str | None = field(default=None, repr=False)
    gpus: tuple[str, ...] = ()
    idle_grace_s: float = 300.0
    release_timeout_s: float = 15.0
    busy: RuntimeCallSpec | None = None
    release: RuntimeCallSpec | None = None


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """Everything the broker loop, its warm servers and its attempts are set to."""

    #: the node's name (attempts record it; the instance marker starts with it)
    name: str
    #: the state directory: ``jobs/`` (attempt folders), ``warm/`` (server folders)
    state_dir: Path
    #: the launch rules, applied at submission and again at each start
    rules: LaunchRules
    vram: VramSettings
    # -- the loop (``[broker]``)
    poll_interval_s: float
    cpu_slots: int
    shutdown_grace_s: float
    kill_grace_s: float
    status_interval_s: float
    clip_chars: int
    #: times a job may be interrupted by the broker's own end before it is quarantined
    max_interruptions: int
    # -- warm servers (``[warm]``)
    idle_grace_s: float
    stop_grace_s: float
    # -- what a sandboxed attempt is given (``[sandbox]``)
    weights_dir: Path | None
    scratch_bytes: int
    #: the managed runtimes (``[[runtimes]]``)
    runtimes: tuple[RuntimeSpec, ...] = ()
    #: seconds one image build of a job's source commit may take (``[sources]``)
    source_build_timeout_s: float = 1800.0
    #: fair share (``[broker] fair_share_half_life_s``): the half-life of an owner's use; 0: off
    fair_share_half_life_s: float = DEFAULT_HALF_LIFE_S
    #: host RAM that must stay available beside every job (``[broker] ram_floor_gib``)
    ram_floor_bytes: int = 0
    #: the GPU lock file's path template (``gpu_lock``), "": off
    gpu_lock: str = ""
    #: the group that may take the GPU locks (``gpu_lock_group``), "": the broker's
    gpu_lock_group: str = ""
    #: where the service forwarders listen (``[cluster] service_address``)
    service_address: str = "127.0.0.1"
    #: what a routine stop does with running attempts (``[broker] on_stop``):
    #: "leave" them to their supervisors, or "stop-jobs" (the default here, for a
    #: broker made in code; the config's default is "leave")
    on_stop: str = "stop-jobs"
    #: module name -> its model folder (``[modules.<name>] model_dir``): given to the
    #: jobs and warm servers of that module's types only
    model_dirs: Mapping[str, Path] = field(default_factory=dict)
