"""A service job's state for ``jobs``, ``show`` and the API's job JSON, read
from what the brokers published last (SPEC.md, "Service jobs").

The state lives in the broker (:mod:`gpuwarden.node.services`); each node
status carries it (``services``, the running ones and those that ended in the
last ``STOPPED_KEEP_S``). Here the fresh statuses (as ``explain`` trusts them:
:data:`gpuwarden.node.explain.FRESH_S`) are read once and each service job is
given its :class:`~gpuwarden.core.service.ServiceView` (the rule is
:func:`gpuwarden.core.service.view_of`). Which jobs are service jobs: those of
a ``launch = "service"`` type, and any with a ``service`` name or a ``share``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuwarden.core.model import Job, LaunchMode
from gpuwarden.core.service import ServiceView, view_of
from gpuwarden.node.explain import FRESH_S
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store


def published(store: Store, now: float) -> dict[str, dict[str, Any]] | None:
    """The services of every broker that published lately, by job id (the
    freshest status wins); None when none did."""
    fresh = sorted(
        (
            s
            for s in store.node_statuses()
            if not s.payload.get("stopped") and now - s.updated_at <= FRESH_S
        ),
        key=lambda s: s.updated_at,
    )
    if not fresh:
        return None
    out: dict[str, dict[str, Any]] = {}
    for status in fresh:
        for entry in status.payload.get("services") or ():
            if isinstance(entry, dict) and isinstance(entry.get("job"), str):
                out[entry["job"]] = entry | {"node": status.node}
    return out


def is_service(job: Job, registry: Registry | None) -> bool:
    """Whether ``job`` is a service job (its type's launch mode, else its keys)."""
    if job.service is not None or job.share:
        return True
    jobtype = registry.types.get(job.type) if registry is not None else None
    return jobtype is not None and jobtype.launch is LaunchMode.SERVICE


def views(
    jobs: Iterable[Job], store: Store, registry: Registry | None, now: float
) -> dict[str, ServiceView]:
    """Each service job's view, by job id (the other jobs are left out)."""
    wanted = [j for j in jobs if is_service(j, registry)]
    if not wanted:
        return {}
    services = published(store, now)
    live = services is not None
    return {j.id: view_of(j, (services or {}).get(j.id), live=live) for j in wanted}
