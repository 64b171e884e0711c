"""The node endpoints of a coordinator, as an agent calls them, and its credential.

:class:`Coordinator` speaks HTTP with one node token: heartbeat, claim, start and
finish reports, output uploads and input fetches (streamed, by descriptor).
:func:`enroll` exchanges an enrolment token for the node's :class:`Credential`,
which the agent keeps in its state directory (mode 600).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from gpuwarden import __version__, safefs
from gpuwarden.core.sources import SourceAbility
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.registry import Registry

#: a file made fresh: never through a link, never one that is there already
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CoordinatorError(GpuwardenError):
    """The coordinator did not answer, or answered with a server error."""


class Refused(GpuwardenError):
    """The coordinator refused a request (4xx other than 401)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class CredentialRefused(GpuwardenError):
    """401: the node's credential is refused (revoked, or enrolled again elsewhere)."""


class Coordinator:
    """The node endpoints of a coordinator, with one node token."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def set_timeout(self, seconds: float) -> None:
        self._http.timeout = httpx.Timeout(seconds)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise CoordinatorError(f"cannot reach the coordinator at {self.url}: {exc}") from None
        return _answer(response)

    def heartbeat(self, report: dict[str, Any], jobs: list[str]) -> dict[str, Any]:
        return self.post("/v1/node/heartbeat", {"report": report, "jobs": jobs})

    def claim(self, report: dict[str, Any], want: int, jobs: list[str]) -> dict[str, Any]:
        return self.post("/v1/node/claim", {"report": report, "want": want, "jobs": jobs})

    def start(self, job_id: str, lease_id: str, gpu: str | None) -> dict[str, Any]:
        return self.post(f"/v1/node/jobs/{job_id}/start", {"lease_id": lease_id, "gpu": gpu})

    def finish(self, job_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.post(f"/v1/node/jobs/{job_id}/finish", body)

    def reports(self, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several start and finish reports in one request (``POST /v1/node/reports``,
        each ``{"kind", "job", ...}``): one answer each, in order, with its
        ``status``. :class:`Refused` with status 404 from a coordinator without
        the route."""
        answer = self.post("/v1/node/reports", {"reports": reports})
        results = answer.get("results")
        if not isinstance(results, list) or len(results) != len(reports):
            raise CoordinatorError("the coordinator's answer to a batch of reports is not one")
        return [r if isinstance(r, dict) else {} for r in results]

    def upload(self, job_id: str, lease_id: str, rel: str, root: Path) -> dict[str, Any]:
        """Send the output file ``root/rel`` (streamed) to the coordinator. The file
        is a job's: it is opened by descriptor below ``root``, never through a link,
        never a FIFO or a device (:class:`gpuwarden.safefs.UnsafePathError`), and at
        most the size it had when it was opened is sent."""
        fd = safefs.open_file(rel, under=root)
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size

            def body() -> Iterator[bytes]:
                left = size
                while left > 0:
                    chunk = f.read(min(1 << 20, left))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk

            try:
                response = self._http.put(
                    f"/v1/node/jobs/{job_id}/outputs/{quote(rel)}",
                    params={"lease_id": lease_id},
                    content=body(),
                    headers={
                        "content-type": "application/octet-stream",
                        "content-length": str(size),
                    },
                )
            except httpx.HTTPError as exc:
                raise CoordinatorError(
                    f"cannot reach the coordinator at {self.url}: {exc}"
                ) from None
        return _answer(response)

    def send_log(self, job_id: str, lease_id: str, stream: str, offset: int, data: bytes) -> int:
        """Send bytes of a running attempt's stream from ``offset``: the offset the
        coordinator's copy has now (also when it refused a gap: send from there)."""
        try:
            response = self._http.post(
                f"/v1/node/jobs/{job_id}/logs/{stream}",
                params={"lease_id": lease_id, "offset": offset},
                content=data,
                headers={"content-type": "application/octet-stream"},
            )
        except httpx.HTTPError as exc:
            raise CoordinatorError(f"cannot reach the coordinator at {self.url}: {exc}") from None
        if response.status_code == 416 and response.headers.get("x-gpuwarden-offset", "").isdigit():
            return int(response.headers["x-gpuwarden-offset"])
        return int(_answer(response).get("offset", offset))

    def fetch(self, job_id: str, lease_id: str, name: str, *, parts: Path, into: int) -> None:
        """Fetch input ``name`` of a leased job (streamed to a fresh file in the
        folder ``parts``, then renamed into the open folder ``into`` under the last
        part of ``name``)."""
        path = f"/v1/node/jobs/{job_id}/inputs/{quote(name)}"
        tmp = f"{secrets.token_hex(8)}.part"
        with safefs.opened_dir(parts) as parts_fd:
            try:
                with self._http.stream("GET", path, params={"lease_id": lease_id}) as response:
                    if response.status_code >= 400:
                        response.read()
                        _answer(response)
                    out = os.open(tmp, O_NEW, 0o600, dir_fd=parts_fd)
                    # readable by a sandbox's user, as a bundle's input files are on
                    # the host that took it (its folder is this node's own)
                    os.fchmod(out, 0o644)
                    try:
                        for chunk in response.iter_bytes():
                            view = memoryview(chunk)
                            while view:
                                view = view[os.write(out, view) :]
                    finally:
                        os.close(out)
                os.rename(tmp, name.rpartition("/")[2], src_dir_fd=parts_fd, dst_dir_fd=into)
            except httpx.HTTPError as exc:
                raise CoordinatorError(
                    f"cannot reach the coordinator at {self.url}: {exc}"
                ) from None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parts_fd)


def _answer(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {"value": data}
    if response.status_code < 400:
        return data
    message = str(data.get("error") or response.text[:500] or response.reason_phrase)
    if response.status_code == 401:
        raise CredentialRefused(message)
    if response.status_code == 429 or response.status_code >= 500:
        raise CoordinatorError(f"the coordinator answered {response.status_code}: {message}")
    raise Refused(message, response.status_code)


def enroll(
    url: str,
    enroll_token: str,
    capabilities: dict[str, Any],
    *,
    transport: httpx.BaseTransport | None = None,
) -> dict[str, Any]:
    """Exchange an enrolment token for the node's credential."""
    client = Coordinator(url, enroll_token, timeout=30.0, transport=transport)
    try:
        return client.post("/v1/nodes/enroll", {"capabilities": capabilities})
    except CredentialRefused as exc:
        raise UserError(
            f"the coordinator refused the enrolment token: {exc.message} (ask its owner for "
            "a new one: `gpuwarden node invite NAME`)"
        ) from None
    except (Refused, CoordinatorError) as exc:
        raise UserError(f"enrolment failed: {exc.message}") from None
    finally:
        client.close()


@dataclass(frozen=True, slots=True)
class Credential:
    coordinator: str
    node: str
    token: str
    token_id: str = ""
    lease_s: float = 90.0
    #: the id of the enrolment token this credential was got with: that token is
    #: used up, so an agent started again with it keeps this credential
    enrolled_with: str = ""

    def save(self, path: Path) -> None:
        """Write it, readable by its owner only (mode 600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a crash; made fresh below, never through a link
        fd = os.open(tmp, O_NEW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Credential:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UserError(
                f"no node credential at {path}: enrol first with `gpuwarden agent "
                "--coordinator URL --enroll-file FILE` (`gpuwarden node invite NAME` makes the "
                "token to put in FILE; or --enroll - to read it from standard input)"
            ) from None
        if mode & 0o077:
            raise UserError(
                f"node credential {path} can be read by others (mode {mode & 0o777:o}): "
                f"run `chmod 600 {path}`"
            )
        try:
            data = json.loads(path.read_text())
            return cls(
                coordinator=str(data["coordinator"]),
                node=str(data["node"]),
                token=str(data["token"]),
                token_id=str(data.get("token_id", "")),
                lease_s=float(data.get("lease_s", 90.0)),
                enrolled_with=str(data.get("enrolled_with", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"node credential {path} cannot be read: {exc}") from None


def source_ability(registry: Registry) -> SourceAbility:
    """Whether this node runs jobs from commits (its runtime builds images: podman
    or docker) and its ``[sources] allow``, as its enrolment and reports say."""
    reader = registry.sources
    if reader is None:
        return SourceAbility(runs=False)
    return SourceAbility(runs=reader.refusal is None, allow=tuple(reader.allow))


def capabilities(
    probe: GpuProbe, registry: Registry, *, container_runtime: str, labels: dict[str, str]
) -> dict[str, Any]:
    """What the host has, sent once at enrolment (the heartbeat sends live room):
    its GPUs as ``probe`` reads them, the job types of its modules (``registry``)
    and its launch rules (``registry.rules``)."""
    try:
        readings = probe.read()
    except GpuwardenError:
        readings = []
    return {
        "host": socket.gethostname(),
        "gpuwarden": __version__,
        "probe": probe.kind,
        "gpus": [
            {
                "uuid": r.uuid,
                "name": r.name,
                "total_bytes": r.total_bytes,
                "driver": r.driver,
                "cuda": r.extra.get("cuda", ""),
            }
            for r in readings
        ],
        "driver": next((r.driver for r in readings if r.driver), ""),
        "cuda": next((r.extra.get("cuda", "") for r in readings if r.extra.get("cuda")), ""),
        "container_runtime": container_runtime,
        "launch_rules": registry.rules.to_json(),
        "sources": source_ability(registry).to_json(),
        "labels": labels,
        "types": sorted(registry.types),
    }
