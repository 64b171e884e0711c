"""What a submitter is shown of other tokens' jobs: nothing, not even their ids.

A submitter sees only its own jobs (SPEC.md, section 15); an id of another's job
in an answer would tell that the job exists. Answers that describe a node or a
GPU (``GET /v1/status``, the wait reasons of ``GET /v1/jobs/{id}/explain``)
name the jobs there. For a submitter, every job id in them that is not one of its
own is replaced with ``another job`` (in structured fields: ``null``), whether
or not such a job exists: the answer is the same for an id that does not exist.
Queue roots are named by their last path component, not their host path.
"""

from __future__ import annotations

import re
from typing import Any

from gpuwarden.store.base import Store

#: how an anonymous job is named in text
ANOTHER = "another job"

_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
#: where texts name a job: "by/for/of/its job ID", a ledger holder "module.type (ID)",
#: and a holder "ID/ATTEMPT" or "ID/next"
_IN_TEXT = re.compile(
    rf"(?P<lead>\b(?:by|for|of|its)) job (?P<id>{_ID})"
    rf"|(?P<lead2>\b[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+ \()(?P<id2>{_ID})(?=\))"
    rf"|(?<![A-Za-z0-9._/-])(?!\d+/)(?P<held>{_ID})(?P<tail>/(?:\d+|next))(?![A-Za-z0-9._-])"
)
#: structured fields that hold one job id
_JOB_FIELDS = frozenset({"job", "job_id", "backfill_for"})


def _last_part(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] or path


class Redactor:
    """For one submitter token: keep its own jobs' ids, hide every other."""

    def __init__(self, store: Store, token_id: str) -> None:
        self.store = store
        self.token_id = token_id
        self._own: dict[str, bool] = {}

    def own(self, job_id: object) -> bool:
        """Is ``job_id`` one of this token's jobs?"""
        key = str(job_id)
        got = self._own.get(key)
        if got is None:
            job = self.store.get_job(key) if len(key) <= 128 else None
            got = job is not None and job.owner == self.token_id
            self._own[key] = got
        return got

    def text(self, text: str) -> str:
        """``text`` with every job id that is not this token's replaced."""

        def swap(m: re.Match[str]) -> str:
            if m.group("id") is not None:
                job_id, lead, end = m.group("id"), m.group("lead"), ""
                if job_id.endswith(".") and not self.own(job_id):
                    job_id, end = job_id[:-1], "."  # the sentence's full stop
                return m.group(0) if self.own(job_id) else f"{lead} {ANOTHER}{end}"
            if m.group("id2") is not None:
                return m.group(0) if self.own(m.group("id2")) else f"{m.group('lead2')}{ANOTHER}"
            return m.group(0) if self.own(m.group("held")) else f"{ANOTHER}{m.group('tail')}"

        return _IN_TEXT.sub(swap, text)

    def value(self, value: Any) -> Any:
        """A JSON value (a node's status) as this token may see it: job ids that are
        not its own hidden, in fields (``null``) and in text (``another job``)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, v in value.items():
            if key in _JOB_FIELDS and (v is None or isinstance(v, str)):
                out[key] = v if v is None or self.own(v) else None
            elif key == "waiting" and isinstance(v, dict):  # job id -> why it waits
                out[key] = {j: self.value(w) for j, w in v.items() if self.own(j)}
            elif key == "queues" and isinstance(v, dict):  # queue root path -> depths
                # the host's paths are not a submitter's business: the roots' names
                out[key] = {_last_part(str(root)): depth for root, depth in v.items()}
            else:
                out[key] = self.value(v)
        return out
