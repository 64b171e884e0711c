"""What the broker of one node is set to: plain values, not the configuration.

The configuration file is an edge (``gpuwarden.config``): the wiring
(``gpuwarden.app.node_settings``) reads it and builds these, so nothing in
``node/`` reads a file or knows the config's layout, and a test can build a
broker from values alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuwarden.core.launchrules import LaunchRules


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
