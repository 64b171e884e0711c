"""A Python client of the HTTP API (SPEC.md, section 15).

    from gpuwarden.client import Client
    with Client("http://127.0.0.1:8765", token) as c:
        job = c.submit("echo.echo", {"text": "hi"}, idempotency_key="run-42")
        done = c.wait(job["id"], timeout=600)
        c.download(job["id"], "echo.txt", Path("echo.txt"))

Every refusal raises an :class:`ApiError` subclass carrying the server's own
``error`` text and the status; 4xx ones are also :class:`UserError`s (the
request was at fault), so the CLI prints them as one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

import httpx

from gpuwarden.core.lease import ENDED_BY_HOLDER
from gpuwarden.core.model import JobType, Lane, LaunchMode, ParamSpec, ParamType
from gpuwarden.errors import GpuwardenError, UserError

#: a JSON array of objects (named here: the client has a method called ``list``)
Rows = list[dict[str, Any]]
Lines = list[str]
JobTypes = list[JobType]

#: the event stream: how long a silent connection is trusted (the server sends a
#: heartbeat every 15 s), and how soon a dropped one is opened again (doubling)
EVENTS_READ_TIMEOUT_S = 45.0
FIRST_RECONNECT_S = 0.25
MAX_RECONNECT_S = 5.0

#: how long a request answered 503 (the server's store unreachable) is tried again,
#: each time after the server's ``Retry-After`` (at most :data:`MAX_RETRY_AFTER_S`)
RETRY_UNAVAILABLE_S = 120.0
MAX_RETRY_AFTER_S = 30.0

#: the states after which a job never changes again
TERMINAL = frozenset({"done", "failed", "cancelled", "quarantined"})


class ApiError(GpuwardenError):
    """The API refused or failed a request; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class RequestRefused(ApiError, UserError):
    """A 4xx answer: the request was at fault."""


class Unauthorized(RequestRefused):
    """401: no token, or one that is unknown, wrong, revoked or expired."""


class Forbidden(RequestRefused):
    """403: the token's role may not do that."""


class NotFound(RequestRefused):
    """404: no such job (or not one of yours), token, output or endpoint."""


class Conflict(RequestRefused):
    """409: a job id used already, a job that has ended, a result not there yet."""


class TooLarge(RequestRefused):
    """413: the request body is over the API's limit."""


class Invalid(RequestRefused):
    """422: the request is not valid (the message says which field and why)."""


class RateLimited(RequestRefused):
    """429: too many requests; ``retry_after`` says how long to wait (seconds)."""

    def __init__(self, message: str, status: int = 429, retry_after: float = 1.0) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class ServerError(ApiError):
    """5xx: the server failed."""


class Unavailable(ServerError):
    """503: the server cannot serve the request now (its store is unreachable);
    ``retry_after`` says how long to wait (seconds)."""

    def __init__(self, message: str, status: int = 503, retry_after: float = 1.0) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after


class Unreachable(ApiError):
    """No answer: the server cannot be reached, or it did not answer in time."""


_BY_STATUS: dict[int, type[RequestRefused]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: Invalid,
}


class Client:
    """One API endpoint and one token. Usable as a context manager."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
        retry_unavailable_s: float = RETRY_UNAVAILABLE_S,
        on_wait: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``http``: an httpx client to send with instead of a new one (a test's
        ``fastapi.testclient.TestClient``); the token header is set on it.
        ``retry_unavailable_s``: how long a request answered 503 is sent again,
        each time after the answer's ``Retry-After`` (0: never; then
        :class:`Unavailable` is raised at once); ``on_wait`` is told each wait
        (the CLI prints it)."""
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retry_unavailable_s = retry_unavailable_s
        self.on_wait = on_wait
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if http is not None:
            http.headers.update(headers)
            self._http = http
        else:
            self._http = httpx.Client(
                base_url=self.url, headers=headers, timeout=timeout, transport=transport
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing -----------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """Send one request; one answered 503 (the server's store is unreachable:
        nothing was done) is sent again after its ``Retry-After``, for up to
        :attr:`retry_unavailable_s` seconds."""
        deadline = time.monotonic() + self.retry_unavailable_s
        while True:
            try:
                return self._request_once(method, path, **kw)
            except Unavailable as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                wait = min(max(0.1, exc.retry_after), MAX_RETRY_AFTER_S, left)
                if self.on_wait is not None:
                    self.on_wait(
                        f"{self.url} answered 503: {exc.message}; trying again in "
                        f"{wait:.0f} s (for up to {left:.0f} s more)"
                    )
                self._sleep(wait)

    def _request_once(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{self.url} did not answer in time ({exc})") from None
        except httpx.TransportError as exc:
            raise Unreachable(
                f"cannot reach the gpuwarden API at {self.url}: {exc} "
                "(is `gpuwarden serve --api` running there?)"
            ) from None
        if response.status_code >= 400:
            raise _error(response)
        return response

    def request_json(self, method: str, path: str, **kw: Any) -> Any:
        """Send one request and return its JSON answer (an endpoint with no method of
        its own here, such as ``/v1/nodes``); a refusal raises as every call does."""
        return self._request(method, path, **kw).json()

    # -- jobs ---------------------------------------------------------------

    def submit(
        self,
        type: str,
        params: dict[str, Any] | None = None,
        *,
        id: str | None = None,
        priority: int = 0,
        vram_gib: float | None = None,
        outputs: Iterable[str] = (),
        idempotency_key: str | None = None,
        constraints: Mapping[str, Any] | None = None,
        wait: float | None = None,
        after: Iterable[str] = (),
        est_s: float | None = None,
        gpus: int | None = None,
        ram_gib: float | None = None,
        ram_floor_gib: float | None = None,
        ram_start_min_gib: float | None = None,
        service: str | None = None,
        share: Iterable[str] = (),
        source: Mapping[str, str] | None = None,
        source_repo: str | None = None,
        source_commit: str | None = None,
    ) -> dict[str, Any]:
        """Submit a job; returns it (``queued``). With ``idempotency_key``, a retry of
        the same request returns the same job instead of a second one. ``constraints``:
        what the node that runs it must have (``min_gpu_vram_gib``, ``gpu_model``,
        ``labels``, ``node``; SPEC.md section 4). ``after``: the jobs it waits for,
        each ``afterok:ID``, ``afterany:ID`` or ``afternotok:ID`` (all must hold).
        ``est_s``: how long it is expected to run (seconds), used for backfill until
        its type has a measured run time. ``gpus``: how many GPUs of one node it
        holds at once, its footprint on each (default: its type's). ``ram_gib``: its
        RAM cap, enforced by the kernel; ``ram_floor_gib``: host RAM that must stay
        available beside it; ``ram_start_min_gib``: MemAvailable it needs to start
        (SPEC.md section 11, "Host RAM"). ``source`` (``{"repo": URL, "commit":
        SHA}``), or ``source_repo`` and ``source_commit``: the commit whose
        module.toml declares ``type`` (SPEC.md, "Jobs from a pinned commit").

        With ``wait`` (seconds, 0 to 60), the one request waits for the job to end
        (a long poll): the job comes back ended, with its result.json in ``result``
        and ``wait["ended"]`` true, or as it is after ``wait`` seconds (queued or
        running) with ``wait["ended"]`` false."""
        body: dict[str, Any] = {"type": type, "params": dict(params or {}), "priority": priority}
        if id is not None:
            body["id"] = id
        if vram_gib is not None:
            body["vram_gib"] = vram_gib
        if outputs:
            body["outputs"] = list(outputs)
        if constraints:
            body["constraints"] = dict(constraints)
        if after:
            body["after"] = list(after)
        if est_s is not None:
            body["est_s"] = est_s
        if gpus is not None:
            body["gpus"] = gpus
        ram = {"ram_gib": ram_gib, "ram_floor_gib": ram_floor_gib}
        ram["ram_start_min_gib"] = ram_start_min_gib
        body.update((k, v) for k, v in ram.items() if v is not None)
        if service is not None:
            body["service"] = service
        if share:
            body["share"] = list(share)
        pinned = {"repo": source_repo, "commit": source_commit}
        if source is not None or any(pinned.values()):
            body["source"] = {**(source or {}), **{k: v for k, v in pinned.items() if v}}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job: dict[str, Any] = self.request_json(
            "POST", "/v1/jobs", json=body, headers=headers, **self._waiting(wait)
        )
        return job

    def submit_command(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        share_gpu: bool = False,
        preempt: str | None = None,
        timeout_s: float | None = None,
        wait: float | None = None,
        idempotency_key: str | None = None,
        **job: Any,
    ) -> dict[str, Any]:
        """Submit a command job (SPEC.md, "Command jobs over HTTP, bundles and
        agents"): ``argv`` runs sandboxed on the node, in its output folder (its
        ``outputs`` are fetched as any job's), where the node's ``[commands] roles``
        names this token's role. ``name``: what its measurements are kept under
        (default: the program's name); ``env``: its environment variables;
        ``share_gpu``: it may share a GPU with co-resident jobs; ``preempt``: the
        signal it checkpoints on (it is then preemptible); ``timeout_s``. ``job``:
        the keys every job has (``id``, ``priority``, ``vram_gib``, ``outputs``,
        ``after``, ``est_s``, ``gpus``, ``ram_gib``, ``constraints``...), as the
        JSON body has them."""
        body: dict[str, Any] = {"command": list(argv), **job}
        if name is not None:
            body["name"] = name
        if env:
            body["env"] = dict(env)
        if share_gpu:
            body["share_gpu"] = True
        if preempt is not None:
            body["preempt"] = preempt
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        answer: dict[str, Any] = self.request_json(
            "POST", "/v1/jobs", json=body, headers=headers, **self._waiting(wait)
        )
        return answer

    def _waiting(self, wait: float | None) -> dict[str, Any]:
        """The query parameter and the longer read timeout of a request that waits."""
        if wait is None:
            return {}
        return {"params": {"wait": f"{wait:g}"}, "timeout": self.timeout + wait}

    def get(self, job_id: str) -> dict[str, Any]:
        """The job, with ``attempts_detail`` and ``events``."""
        job: dict[str, Any] = self.request_json("GET", f"/v1/jobs/{_seg(job_id)}")
        return job

    def list(self, *, states: Iterable[str] = (), limit: int = 50) -> Rows:
        """Jobs, newest first (a submitter's own only)."""
        params: list[tuple[str, str | int]] = [("state", s) for s in states]
        params.append(("limit", limit))
        jobs: Rows = self.request_json("GET", "/v1/jobs", params=params)
        return jobs

    def cancel(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self.request_json("POST", f"/v1/jobs/{_seg(job_id)}/cancel")
        return job

    def stop(self, job_id: str) -> dict[str, Any]:
        """Stop a running service job (it ends ``done``, "stopped by" this token)."""
        job: dict[str, Any] = self.request_json("POST", f"/v1/jobs/{_seg(job_id)}/stop")
        return job

    def hold(self, job_id: str) -> dict[str, Any]:
        """Hold a queued job (SPEC.md section 1, "Job control")."""
        job: dict[str, Any] = self.request_json("POST", f"/v1/jobs/{_seg(job_id)}/hold")
        return job

    def release(self, job_id: str) -> dict[str, Any]:
        """Release a job a person holds."""
        job: dict[str, Any] = self.request_json("POST", f"/v1/jobs/{_seg(job_id)}/release")
        return job

    def requeue(self, job_id: str) -> dict[str, Any]:
        """Queue an ended job again, same id and spec."""
        job: dict[str, Any] = self.request_json("POST", f"/v1/jobs/{_seg(job_id)}/requeue")
        return job

    def set_priority(self, job_id: str, priority: int) -> dict[str, Any]:
        """Set a queued job's priority (a submitter may only lower its own)."""
        job: dict[str, Any] = self.request_json(
            "POST", f"/v1/jobs/{_seg(job_id)}/priority", json={"priority": priority}
        )
        return job

    # -- VRAM leases (SPEC.md section 11, "VRAM leases") ------------------------------

    def lease(
        self,
        vram_bytes: int,
        *,
        gpu: str | None = None,
        ttl_s: float = 60.0,
        priority: int = 0,
        holder: str | None = None,
        wait: float | None = None,
    ) -> dict[str, Any]:
        """Ask for a lease; with ``wait`` (at most 60), the answer comes once it is
        granted (``granted``, ``gpu``, ``until``), has ended, or after ``wait`` s."""
        body: dict[str, Any] = {"vram_bytes": vram_bytes, "ttl_s": ttl_s, "priority": priority}
        if gpu is not None:
            body["gpu"] = gpu
        if holder is not None:
            body["holder"] = holder
        lease: dict[str, Any] = self.request_json(
            "POST", "/v1/leases", json=body, **self._waiting(wait)
        )
        return lease

    def get_lease(self, lease_id: str) -> dict[str, Any]:
        lease: dict[str, Any] = self.request_json("GET", f"/v1/leases/{_seg(lease_id)}")
        return lease

    def lease_wait(self, lease_id: str, wait: float) -> dict[str, Any]:
        """The lease once granted or ended, or as it is after ``wait`` s (at most 60)."""
        lease: dict[str, Any] = self.request_json(
            "GET", f"/v1/leases/{_seg(lease_id)}", **self._waiting(wait)
        )
        return lease

    def leases(self) -> Rows:
        """The queued and granted leases this token may see."""
        rows: Rows = self.request_json("GET", "/v1/leases")
        return rows

    def renew_lease(self, lease_id: str, ttl_s: float | None = None) -> dict[str, Any]:
        """Move a granted lease's deadline to now + its ttl (409 before its grant, or
        after its end)."""
        body = None if ttl_s is None else {"ttl_s": ttl_s}
        lease: dict[str, Any] = self.request_json(
            "POST", f"/v1/leases/{_seg(lease_id)}/renew", json=body
        )
        return lease

    def end_lease(self, lease_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """End a lease (a queued one is cancelled); ``reason`` follows "ended by its
        holder" in its end's reason."""
        said = (reason or "").removeprefix(ENDED_BY_HOLDER).lstrip(": ")[:300]
        params = {"reason": said} if said else {}
        lease: dict[str, Any] = self.request_json(
            "DELETE", f"/v1/leases/{_seg(lease_id)}", params=params
        )
        return lease

    def lease_pids(self, lease_id: str, pids: Iterable[int]) -> dict[str, Any]:
        """Name processes of the node's host whose device memory is the lease's."""
        lease: dict[str, Any] = self.request_json(
            "POST", f"/v1/leases/{_seg(lease_id)}/pids", json={"pids": list(pids)}
        )
        return lease

    def preview(self, type_name: str, *, vram_gib: float | None = None, priority: int = 0) -> Lines:
        """What the broker (or a coordinator's nodes) would do with one more job of
        ``type_name`` now: ``GET /v1/preview``. Submits nothing."""
        params: dict[str, Any] = {"type": type_name, "priority": priority}
        if vram_gib is not None:
            params["vram_gib"] = vram_gib
        lines: Lines = self.request_json("GET", "/v1/preview", params=params)["lines"]
        return lines

    def explain(self, job_id: str) -> Lines:
        lines: Lines = self.request_json("GET", f"/v1/jobs/{_seg(job_id)}/explain")["lines"]
        return lines

    def result(self, job_id: str, *, wait: float | None = None) -> dict[str, Any]:
        """The ended job's result.json (409 :class:`Conflict` while it has not ended).
        With ``wait`` (seconds, 0 to 60), a job that has not ended is waited for that
        long first, in the one request."""
        result: dict[str, Any] = self.request_json(
            "GET", f"/v1/jobs/{_seg(job_id)}/result", **self._waiting(wait)
        )
        return result

    def download(self, job_id: str, path: str, dest: Path) -> Path:
        """Write output ``path`` of a done job to ``dest`` (a file, or a folder to put it
        in under its relative path); return where it went. Streamed, never whole in memory,
        into a temporary file beside the target that is renamed into place when whole.
        A ``path`` that could lead out of a ``dest`` folder (absolute, ``..``) is refused
        before anything is sent or made; nothing is made before the server answers."""
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise Invalid(
                f"output path {path!r} must be relative, without '.', '..' or empty parts "
                "(the paths in the job's result outputs are)",
                422,
            )
        if dest.is_dir():
            dest = dest.joinpath(*parts)
        url = f"/v1/jobs/{_seg(job_id)}/outputs/{'/'.join(_seg(p) for p in parts)}"
        part = dest.with_name(f".{secrets.token_hex(6)}.part")  # short: never past NAME_MAX
        try:
            with self._http.stream("GET", url) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with part.open("xb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
        except httpx.TransportError as exc:
            part.unlink(missing_ok=True)
            raise Unreachable(f"download of {path} from {self.url} failed: {exc}") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        part.replace(dest)
        return dest

    def wait(
        self,
        job_id: str,
        *,
        timeout: float = 3600.0,
        progress: Callable[[dict[str, Any]], None] | None = None,
        explain: bool = False,
    ) -> dict[str, Any]:
        """Poll until the job has ended; return it. Polls fast at first, then every
        2 s at most; waits out a 429. ``progress`` is called with the job whenever its
        state or reason changes. With ``explain``, each poll of a job that has not
        ended also asks why it waits (``GET …/explain``): the job then carries its
        lines as ``explain``, and a change in them calls ``progress`` too. Raises
        ``TimeoutError`` after ``timeout`` seconds."""
        return self._poll(
            job_id,
            lambda job: job.get("state") in TERMINAL,
            timeout=timeout,
            progress=progress,
            explain=explain,
        )

    def wait_started(
        self,
        job_id: str,
        *,
        timeout: float = math.inf,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll, as :meth:`wait` with ``explain``, until the job has an attempt (or
        has ended without one); return it."""
        return self._poll(
            job_id,
            lambda job: bool(job.get("attempts_detail")) or job.get("state") in TERMINAL,
            timeout=timeout,
            progress=progress,
            explain=True,
        )

    def _poll(
        self,
        job_id: str,
        done: Callable[[dict[str, Any]], bool],
        *,
        timeout: float,
        progress: Callable[[dict[str, Any]], None] | None,
        explain: bool,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        delay = 0.1
        seen: tuple[str, str, tuple[str, ...]] | None = None
        while True:
            try:
                job = self.get(job_id)
                if explain and not done(job):
                    job["explain"] = self.explain(job_id)
            except RateLimited as exc:
                time.sleep(min(exc.retry_after, max(0.0, deadline - time.monotonic())))
            else:
                lines = tuple(job.get("explain", ()))
                now_seen = (str(job.get("state")), str(job.get("reason")), lines)
                if progress is not None and now_seen != seen:
                    progress(job)
                seen = now_seen
                if done(job):
                    return job
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job_id} has not ended after {timeout:g} s")
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 2.0)

    # -- the rest -------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.request_json("GET", "/v1/status")
        return status

    def share(self) -> Rows:
        """Each owner's fair share (a submitter: its own row)."""
        rows: Rows = self.request_json("GET", "/v1/share")
        return rows

    def types(self) -> Rows:
        types: Rows = self.request_json("GET", "/v1/types")
        return types

    def health(self) -> dict[str, Any]:
        health: dict[str, Any] = self.request_json("GET", "/v1/health")
        return health

    def create_token(
        self, name: str, role: str, *, expires_in_s: float | None = None, node: str | None = None
    ) -> dict[str, Any]:
        """Make a token (an owner's call); the answer holds it, once, as ``token``."""
        body: dict[str, Any] = {"name": name, "role": role}
        if expires_in_s is not None:
            body["expires_in_s"] = expires_in_s
        if node is not None:
            body["node"] = node
        token: dict[str, Any] = self.request_json("POST", "/v1/tokens", json=body)
        return token

    def tokens(self) -> Rows:
        tokens: Rows = self.request_json("GET", "/v1/tokens")
        return tokens

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        token: dict[str, Any] = self.request_json("DELETE", f"/v1/tokens/{_seg(token_id)}")
        return token

    def audit(self, *, after_id: int = 0, limit: int = 100) -> Rows:
        rows: Rows = self.request_json(
            "GET", "/v1/audit", params={"after_id": after_id, "limit": limit}
        )
        return rows

    def clear_gpu(self, gpu_uuid: str, *, reason: str) -> dict[str, Any]:
        """Ask the broker that owns the GPU to clear its fault (an owner's call),
        saying what was done about it (``reason``, recorded with the token)."""
        done: dict[str, Any] = self.request_json(
            "POST", f"/v1/gpus/{_seg(gpu_uuid)}/clear", json={"reason": reason}
        )
        return done

    def job_types(self) -> JobTypes:
        """:meth:`types` as :class:`~gpuwarden.core.model.JobType` values, as the
        registry has them on the broker's host (as far as the API tells: no command,
        no module folder), so that one table shows both."""
        return [_jobtype(t) for t in self.types()]

    @contextlib.contextmanager
    def logs(
        self,
        job_id: str,
        stream: str = "stdout",
        *,
        attempt: int | None = None,
        follow: bool = False,
    ) -> Iterator[LogStream]:
        """An attempt's ``stdout`` or ``stderr`` (``GET /v1/jobs/{id}/logs/{stream}``),
        read as it arrives: ``with c.logs(id) as s: for chunk in s.chunks: ...``.
        With ``follow`` the answer goes on until the attempt has ended (no read
        timeout: the job may be silent for long)."""
        params: dict[str, Any] = {"follow": "true" if follow else "false"}
        if attempt is not None:
            params["attempt"] = attempt
        url = f"/v1/jobs/{_seg(job_id)}/logs/{_seg(stream)}"
        timeout = httpx.Timeout(30.0, read=None) if follow else httpx.USE_CLIENT_DEFAULT
        try:
            with self._http.stream("GET", url, params=params, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                yield LogStream(
                    attempt=int(response.headers.get("X-Gpuwarden-Attempt", "0") or 0),
                    note=response.headers.get("X-Gpuwarden-Note", ""),
                    refused=response.headers.get("X-Gpuwarden-Refused") == "true",
                    chunks=self._chunks(response, job_id),
                )
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{self.url} did not answer in time ({exc})") from None
        except httpx.TransportError as exc:
            raise Unreachable(
                f"reading the logs of {job_id} from {self.url} failed: {exc}"
            ) from None

    def _chunks(self, response: httpx.Response, job_id: str) -> Iterator[bytes]:
        try:
            yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise Unreachable(
                f"reading the logs of {job_id} from {self.url} failed: {exc}"
            ) from None

    # -- the event stream ------------------------------------------------------

    def events(
        self,
        *,
        after: int | None = None,
        job: str | None = None,
        type_name: str | None = None,
        follow: bool = True,
        on_drop: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Iterator[dict[str, Any]]:
        """The event log (``GET /v1/events``): one dict per event, in order. Starts
        after event ``after`` (None: from now on; 0: the whole history). Without
        ``follow``, ends once the events there are have come. A connection that
        drops (or a stream the server ends while following) is opened again with
        ``Last-Event-ID``, so no event is lost or repeated; ``on_drop`` is told why
        each time. A first connection that fails raises, as every call does."""
        cursor = after
        connected = False
        delay = FIRST_RECONNECT_S
        while True:
            why = "the server ended the stream"
            try:
                for kind, value in self._event_blocks(cursor, job, type_name, follow=follow):
                    connected = True
                    delay = FIRST_RECONNECT_S
                    if kind == "id":
                        cursor = int(value)
                    else:
                        yield value
                if not follow:
                    return
            except RateLimited as exc:
                if not connected:
                    raise
                why, delay = exc.message, max(delay, exc.retry_after)
            except (Unreachable, ServerError) as exc:
                if not connected:
                    raise
                why = exc.message
            if on_drop is not None:
                at = "the start" if cursor is None else f"event {cursor}"
                on_drop(f"{why}; reconnecting in {delay:g} s (resuming after {at})")
            sleep(delay)
            delay = min(delay * 2, MAX_RECONNECT_S)

    def _event_blocks(
        self, cursor: int | None, job: str | None, type_name: str | None, *, follow: bool
    ) -> Iterator[tuple[str, Any]]:
        """One connection to the stream: ``("id", N)`` when the cursor moves and
        ``("event", dict)`` for each event (its ``id`` comes first)."""
        params: dict[str, Any] = {"follow": "true" if follow else "false"}
        if job is not None:
            params["job"] = job
        if type_name is not None:
            params["type"] = type_name
        headers = {"Last-Event-ID": str(cursor)} if cursor is not None else {}
        timeout = httpx.Timeout(30.0, read=EVENTS_READ_TIMEOUT_S)
        try:
            with self._http.stream(
                "GET", "/v1/events", params=params, headers=headers, timeout=timeout
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                for event_id, data in sse_events(response.iter_lines()):
                    if data:
                        yield "event", json.loads(data)
                    if event_id is not None and event_id.isdigit():
                        yield "id", int(event_id)
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{self.url} sent nothing for too long ({exc})") from None
        except httpx.TransportError as exc:
            raise Unreachable(f"the event stream of {self.url} broke off: {exc}") from None


@dataclass
class LogStream:
    """An answer of :meth:`Client.logs`: the attempt it is of, why the file itself
    is not sent (``note``; ``refused`` when it was not a regular file reached
    through no link), and the bytes."""

    attempt: int
    note: str
    refused: bool
    chunks: Iterator[bytes]


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str | None, str]]:
    """Server-sent events from a stream's lines, as ``(last event id, data)`` per
    event (data ``""``: a block that only moves the id). A block the stream did not
    end with a blank line is not an event (it was cut off)."""
    event_id: str | None = None
    data: list[str] = []
    moved = False
    for line in lines:
        if not line:
            if data or moved:
                yield event_id, "\n".join(data)
            data, moved = [], False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            event_id, moved = value, True


def _jobtype(t: dict[str, Any]) -> JobType:
    """A ``GET /v1/types`` row as a JobType (enough to read ``--NAME VALUE``
    parameters and to list it)."""
    return JobType(
        name=t["type"],
        module=t["type"].split(".", 1)[0],
        module_dir="",
        lane=Lane(t["lane"]),
        launch=LaunchMode(t["launch"]),
        command=(),
        vram_bytes=int(t["vram_bytes"]),
        description=str(t.get("description", "")),
        coresident=bool(t.get("coresident", False)),
        timeout_s=float(t.get("timeout_s", 3600.0)),
        max_retries=int(t.get("max_retries", 2)),
        params=tuple(
            ParamSpec(
                name=p["name"],
                type=ParamType(p["type"]),
                required=bool(p["required"]),
                default=p.get("default"),
                description=p.get("description", ""),
                choices=tuple(p.get("choices", [])),
            )
            for p in t["params"]
        ),
    )


def _seg(text: str) -> str:
    """One URL path segment, escaped."""
    return quote(text, safe="")


def _error(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
        message = str(body["error"]) if isinstance(body, dict) and "error" in body else ""
    except ValueError:
        message = ""
    status = response.status_code
    if not message:
        message = f"HTTP {status} {response.reason_phrase}: {response.text[:200]}"
    if status in (429, 503):
        try:
            wait = float(response.headers.get("Retry-After", "1"))
        except ValueError:
            wait = 1.0
        if status == 503:
            return Unavailable(f"the server cannot serve it now (503): {message}", status, wait)
        return RateLimited(message, status, retry_after=wait)
    if status in _BY_STATUS:
        return _BY_STATUS[status](message, status)
    if 400 <= status < 500:
        return RequestRefused(message, status)
    return ServerError(f"the server failed ({status}): {message}", status)
