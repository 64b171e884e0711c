"""Job control people reach for (SPEC.md section 1, "Job control"): ``hold``,
``release``, ``requeue`` and ``priority``, on the store or, with ``--url``,
through the API (``POST /v1/jobs/{id}/hold`` …). The rules are
:mod:`gpuwarden.core.jobcontrol`'s, checked by the store under the job's lock.
"""

from __future__ import annotations

import argparse
import getpass
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.cli.common import (
    Commands,
    add_remote_options,
    audited,
    existing_store,
    local_or_http,
    out,
)
from gpuwarden.core import jobcontrol
from gpuwarden.core.model import Job
from gpuwarden.store.base import Store


def _add(
    sub: Commands, name: str, help_text: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    sp.add_argument("job")
    add_remote_options(sp)
    sp.set_defaults(func=func)
    return sp


def _add_hold(sub: Commands) -> None:
    _add(sub, "hold", "keep a queued job from starting until it is released", cmd_hold)


def _add_release(sub: Commands) -> None:
    _add(sub, "release", "let a held job start again", cmd_release)


def _add_requeue(sub: Commands) -> None:
    _add(sub, "requeue", "queue an ended job again (same id and spec)", cmd_requeue)


def _add_priority(sub: Commands) -> None:
    sp = _add(sub, "priority", "set a queued job's priority", cmd_priority)
    sp.add_argument("priority", help="an integer; higher starts first")


#: the commands of this module, each with what adds its parser
PARSERS = {
    "hold": _add_hold,
    "release": _add_release,
    "requeue": _add_requeue,
    "priority": _add_priority,
}


def _who() -> str:
    """Who acts through the CLI on the host, as the job and its events name them."""
    return f"{getpass.getuser()} (on the host)"


#: a change on the local store: (store, the command's arguments, the audit row's
#: detail to fill in) -> the job as it is after it
Change = Callable[[Store, argparse.Namespace, dict[str, Any]], Job]


def _here(action: str, change: Change) -> Callable[[argparse.Namespace], dict[str, Any]]:
    """The command on the local store, audited as ``action`` like the API's route
    (refusals too), answering as the API does."""

    def run(args: argparse.Namespace) -> dict[str, Any]:
        store = existing_store(args)
        try:
            with audited(store, action, args.job) as detail:
                job = change(store, args, detail)
        finally:
            store.close()
        return {"id": job.id, "state": job.state.value, "priority": job.priority,
                "hold_by": job.hold_by, "held": job.held}  # fmt: skip

    return run


def _hold(store: Store, args: argparse.Namespace, detail: dict[str, Any]) -> Job:
    job = store.hold(args.job, by=_who(), now=time.time())
    detail["hold_by"] = job.hold_by
    return job


def _release(store: Store, args: argparse.Namespace, detail: dict[str, Any]) -> Job:
    before = store.get_job(args.job)
    detail["held_by"] = None if before is None else before.hold_by
    return store.release(args.job, by=_who(), now=time.time())


def _requeue(store: Store, args: argparse.Namespace, detail: dict[str, Any]) -> Job:
    before = store.get_job(args.job)
    if before is not None:
        detail["from"] = before.state.value
    job = store.requeue(args.job, by=_who(), now=time.time())
    detail["attempts"] = job.attempts
    return job


def _set_priority(store: Store, args: argparse.Namespace, detail: dict[str, Any]) -> Job:
    priority = jobcontrol.parse_priority(args.priority)
    before = store.get_job(args.job)
    if before is not None:
        detail["from"] = before.priority
    detail["to"] = priority
    return store.set_priority(args.job, priority, by=_who(), now=time.time())


def cmd_hold(args: argparse.Namespace) -> int:
    job = local_or_http(args, _here("job.hold", _hold), lambda a, client: client.hold(a.job))
    out.print(f"{job['id']} is held by {job['hold_by']}: `gpuwarden release {job['id']}` lets "
              "it start", markup=False)  # fmt: skip
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    job = local_or_http(
        args, _here("job.release", _release), lambda a, client: client.release(a.job)
    )
    waits = " (it still waits for its dependencies)" if job.get("held") else ""
    out.print(f"{job['id']} is released: it is queued{waits}", markup=False)
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    job = local_or_http(
        args, _here("job.requeue", _requeue), lambda a, client: client.requeue(a.job)
    )
    waits = " (it waits for its dependencies)" if job.get("held") else ""
    out.print(f"{job['id']} is queued again{waits}; its earlier attempts stay in "
              f"`gpuwarden show {job['id']}`", markup=False)  # fmt: skip
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    job = local_or_http(
        args,
        _here("job.priority", _set_priority),
        lambda a, client: client.set_priority(a.job, jobcontrol.parse_priority(a.priority)),
    )
    out.print(f"{job['id']} has priority {job['priority']}", markup=False)
    return 0
