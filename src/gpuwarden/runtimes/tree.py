"""What a managed runtime holds on each GPU: its whole process tree's usage.

A runtime's own account of its memory (Ollama's ``size_vram``, ComfyUI's
``/system_stats``) is a hint; the truth is the device's per-process usage
(NVML, or the simulated GPU's) of every process of the runtime: the server and
its children (Ollama's runners, a llama-server router's model processes, vLLM's
engine core). The server is found as the process listening on the port of the
runtime's URL on this host.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import psutil

__all__ = ["holdings", "is_local", "listener_pid", "process_tree"]


def is_local(url: str) -> bool:
    """True when the URL's host is this machine (a loopback address or its name)."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listener_pid(url: str) -> int | None:
    """The process listening on the URL's port here, or None (not local, nothing
    listens, or the socket's owner cannot be seen)."""
    if not is_local(url):
        return None
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def process_tree(root: int) -> set[int]:
    """``root`` and every live descendant of it (empty when ``root`` is gone)."""
    try:
        proc = psutil.Process(root)
        kids = proc.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {root, *(k.pid for k in kids)}


class _Usage(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...


class _Gpu(Protocol):
    """A GPU reading with its processes: the probe's, or a broker's published one."""

    @property
    def uuid(self) -> str: ...
    @property
    def processes(self) -> Sequence[_Usage]: ...


def holdings(pids: Iterable[int], readings: Iterable[_Gpu]) -> dict[str, int]:
    """Per GPU UUID, the bytes the device shows held by these processes (GPUs
    where they hold nothing are left out)."""
    mine = set(pids)
    out: dict[str, int] = {}
    for gpu in readings:
        held = sum(p.used_bytes for p in gpu.processes if p.pid in mine)
        if held:
            out[gpu.uuid] = held
    return out
