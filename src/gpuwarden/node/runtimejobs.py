"""A runtime type's attempt: its model made resident in the managed runtime first.

A runtime type (``runtime`` and ``model`` in its ``module.toml``) is a client of a
model server the broker owns (``[[runtimes]]``): its job's process asks the
runtime for work, and the runtime holds the model on a GPU. Before that process
starts, :class:`RuntimeLaunch` (on the attempt's worker thread: a load can take
long, and the loop never waits on an HTTP call) asks the runtime to make the
model resident (``prepare``: Ollama's preload, llama-server's router load) and
checks where it went. Where the runtime says that less than :data:`MIN_IN_VRAM`
of the model sits in GPU memory (Ollama's ``size_vram / size``: the rest went to
the CPU, and the job would run many times slower than the queue expects), the
attempt ends as a launch error (infrastructure: retried) saying so. Then the
wrapped launcher runs the job's process, told where the runtime answers.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from gpuwarden.launch.base import Launcher, LaunchRequest, LaunchResult, MemoryCapSupport
from gpuwarden.node.settings import RuntimeSpec
from gpuwarden.runtimes.base import Prepared, RuntimeApiError, RuntimeClient

#: the least share of the model that must be in GPU memory for the job to run
MIN_IN_VRAM = 0.99
#: the longest a model's load may take before the attempt fails (infrastructure)
LOAD_TIMEOUT_S = 600.0

#: the job's environment: which runtime to call, and with which model
RUNTIME_ENV = "GPUWARDEN_RUNTIME"
RUNTIME_KIND_ENV = "GPUWARDEN_RUNTIME_KIND"
RUNTIME_URL_ENV = "GPUWARDEN_RUNTIME_URL"
RUNTIME_MODEL_ENV = "GPUWARDEN_RUNTIME_MODEL"


class RuntimeLaunch:
    """A :class:`gpuwarden.launch.base.Launcher` that prepares the runtime's model,
    then runs the attempt through ``inner``."""

    def __init__(
        self,
        inner: Launcher,
        spec: RuntimeSpec,
        model: str,
        *,
        client: Callable[[RuntimeSpec], RuntimeClient],
        clock: Callable[[], float],
    ) -> None:
        self.inner = inner
        self.spec = spec
        self.model = model
        self.client = client
        self.clock = clock

    def run(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None = None,
    ) -> LaunchResult:
        started = self.clock()
        trouble = self.prepare(min(req.timeout_s, LOAD_TIMEOUT_S))
        if trouble is None and stop.is_set():
            return LaunchResult(req.job_id, req.attempt, None, started, self.clock(), stopped=True)
        if trouble is not None:
            return LaunchResult(
                req.job_id, req.attempt, None, started, self.clock(), launch_error=trouble
            )
        env = {
            **req.env,
            RUNTIME_ENV: self.spec.name,
            RUNTIME_KIND_ENV: self.spec.kind.value,
            RUNTIME_URL_ENV: self.spec.url,
            RUNTIME_MODEL_ENV: self.model,
        }
        return self.inner.run(dataclasses.replace(req, env=env), stop, on_start)

    def memory_caps(self) -> MemoryCapSupport:
        """The wrapped launcher's: it runs the job's process."""
        return self.inner.memory_caps()

    def prepare(self, timeout_s: float) -> str | None:
        """Make the model resident and check where it went; None when the job may
        start, else the launch error, in a person's words."""
        name, model = self.spec.name, self.model
        try:
            client = self.client(self.spec)
            try:
                prepared = client.prepare(
                    model, keep_alive_s=self.spec.idle_grace_s, timeout_s=timeout_s
                )
            finally:
                client.close()
        except RuntimeApiError as exc:
            return f"the runtime {name} could not make the model {model} resident: {exc}"
        return placement_trouble(name, prepared)


def placement_trouble(name: str, prepared: Prepared) -> str | None:
    """Why the model's placement keeps the job from starting (too little of it on
    the GPU), or None. A runtime that cannot say passes."""
    share = prepared.in_vram
    if share is None or share >= MIN_IN_VRAM:
        return None
    detail = f" ({prepared.detail})" if prepared.detail else ""
    return (
        f"the runtime {name} placed only {share * 100:.1f} % of the model {prepared.model} in "
        f"GPU memory, the rest on the CPU{detail}; at least {MIN_IN_VRAM * 100:.0f} % must be on "
        "the GPU (it had too little room there, or was told to use the CPU)"
    )
