"""A leased job's files between an agent and its coordinator.

Its input files are fetched before it is queued here, into a fresh folder of the
node's own (``<state_dir>/inputs/<local id>/``, sub-folders made by descriptor,
no link followed). Before the finish of a ``done`` or ``failed`` attempt is
reported, its output files go up (``PUT /v1/node/jobs/{id}/outputs/{path}``);
the coordinator keeps them (SPEC.md, section 16). A job's files are hostile: an
output is opened by descriptor below its folder, never through a link, never a
FIFO or a device.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.cluster.coordinator_client import Coordinator, CoordinatorError, Refused
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import safe_relpath

log = logging.getLogger("gpuwarden.agent")

#: where fetched inputs are written before they are renamed into place, beside the
#: jobs' input folders
PARTS = ".parts"


@dataclass
class _Fd:
    """An open descriptor, for ``contextlib.closing``."""

    fd: int

    def close(self) -> None:
        os.close(self.fd)


#: a fetched input folder's mode (its files are 0644)
INPUT_DIR_MODE = 0o755


def fetch_inputs(
    coordinator: Coordinator,
    state_dir: Path,
    *,
    job_id: str,
    lease_id: str,
    local_id: str,
    inputs: tuple[str, ...],
) -> Path | None:
    """Fetch a leased job's input files from the coordinator into a fresh folder
    of this node's own (``<state_dir>/inputs/LOCAL_ID``, its sub-folders made by
    descriptor, no link followed); None when that fails."""
    top = state_dir / "inputs"
    folder = top / local_id
    parts = top / PARTS  # beside the job folders: a local id never starts with '.'
    try:
        top.mkdir(parents=True, exist_ok=True)
        parts.mkdir(mode=0o700, exist_ok=True)
        safefs.remove_tree(folder)  # a leftover of an earlier run: not this job's
        # readable by a sandbox's user (its input mount is read-only), as a bundle's
        # input folder is on the host that took it
        safefs.make_dir(folder, mode=INPUT_DIR_MODE)
        for name in inputs:
            rel = safe_relpath(name, "input")
            rel.encode("utf-8")  # UnicodeEncodeError: a name that is not UTF-8
            with contextlib.closing(
                _Fd(safefs.make_dirs(rel.rpartition("/")[0], under=folder, mode=INPUT_DIR_MODE))
            ) as into:
                coordinator.fetch(job_id, lease_id, rel, parts=parts, into=into.fd)
    except (CoordinatorError, Refused, UserError, OSError, UnicodeError) as exc:
        message = getattr(exc, "message", str(exc))
        log.error("leased job %s: its input files could not be fetched: %s", job_id, message)
        try:
            safefs.remove_tree(folder)
        except OSError as gone:
            log.error("leased job %s: %s could not be removed: %s", job_id, folder, gone)
        return None
    return folder


@dataclass
class Outputs:
    """The outputs of one finish report, as they go up (a finish is retried after
    the outputs it sent already)."""

    job_id: str
    lease_id: str
    #: outputs sent to the coordinator already
    uploaded: set[str]
    #: outputs not sent, and why: ``[{"path", "why"}]``, in the finish's result
    not_uploaded: list[dict[str, str]]


def upload_outputs(coordinator: Coordinator, outputs: Outputs, body: dict[str, Any]) -> None:
    """Before a job's end (done or failed) is reported in ``body``, send its
    attempt's output files up; ``body``'s result then says what did not go up.
    Raises :class:`Refused` (409: the lease is gone, and so is the report) and
    :class:`CoordinatorError` (no answer: the report is tried again)."""
    if body.get("state") not in (JobState.DONE.value, JobState.FAILED.value):
        return
    result = body.get("result") or {}
    out_dir = result.get("output_dir")
    if not out_dir:
        return
    root = Path(str(out_dir))
    listed = [str(x) for x in result.get("outputs") or ()]
    for rel in listed:
        if rel in outputs.uploaded:
            continue
        why = _upload_one(coordinator, outputs, rel, root)
        if why is not None:
            shown = rel.encode("utf-8", "backslashreplace").decode("utf-8")
            log.warning("job %s: output %s not uploaded: %s", outputs.job_id, shown, why)
            outputs.not_uploaded.append({"path": shown, "why": why})
        outputs.uploaded.add(rel)
    if outputs.not_uploaded:
        # the result says what did not go up; a name that is not UTF-8 cannot be
        # in it (the coordinator takes only valid text)
        kept = [rel for rel in listed if _is_utf8(rel)]
        body["result"] = {
            **result,
            "outputs": kept,
            "outputs_not_uploaded": list(outputs.not_uploaded),
        }


def _upload_one(coordinator: Coordinator, outputs: Outputs, rel: str, root: Path) -> str | None:
    """Send one output; why it was not sent, or None."""
    if not _is_utf8(rel):
        return "its name is not valid UTF-8"
    try:
        coordinator.upload(outputs.job_id, outputs.lease_id, rel, root)
    except Refused as exc:
        if exc.status == 409:
            raise
        # too large, or a path the coordinator refuses: the rest still goes
        return f"the coordinator refused it ({exc.status}): {exc.message}"
    except safefs.UnsafePathError as exc:
        # a link, a FIFO, a device the job put there: never read
        return f"it {exc.why}"
    except FileNotFoundError:
        return "it is gone"
    except OSError as exc:
        return f"it cannot be read: {exc.strerror or exc}"
    return None


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
