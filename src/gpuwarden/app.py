"""Wiring: build a node (store, probe, registry, launchers, queue roots) from a config."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.config import DATABASE_URL_PREFIXES, Config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import GIB, MIB, LaunchMode
from gpuwarden.errors import ConfigError
from gpuwarden.eventlog import EventLog
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.gpu.select import open_probe
from gpuwarden.gpu.sim import SimGpuConfig
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.launch.base import Launcher
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.sandbox import SandboxLauncher, SandboxLimits
from gpuwarden.node.loop import Broker
from gpuwarden.registry import Registry
from gpuwarden.statelock import StateLock
from gpuwarden.store.base import Store
from gpuwarden.store.sqlite import SqliteStore

log = logging.getLogger("gpuwarden.app")


def sim_config(config: Config) -> SimGpuConfig:
    s = config.sim_gpu
    return SimGpuConfig(
        count=s.count,
        vram_bytes=config.sim_vram_bytes,
        name=s.name,
        release_delay_s=s.release_delay_s,
    )


def open_store(config: Config, *, check: bool = False) -> Store:
    """The store named by the config's ``database``: SQLite in the state directory
    when it is empty, else the PostgreSQL database at that URL. With ``check`` (a
    broker's start) a SQLite file is checked whole first (``PRAGMA quick_check``);
    a damaged one raises ``DamagedDatabaseError`` (a UserError: one line, exit 2)."""
    if not config.database:
        return SqliteStore(config.db_path, check=check)
    if not config.database.startswith(DATABASE_URL_PREFIXES):
        raise ConfigError(
            "config key 'database' must be \"\" (SQLite in the state directory) or a "
            "PostgreSQL URL postgresql://USER@HOST:PORT/DBNAME"
        )
    from gpuwarden.store.postgres import PostgresStore  # psycopg only when it is used

    return PostgresStore(config.database)


def make_probe(config: Config, *, mock_gpu: bool) -> GpuProbe:
    kind = "sim" if mock_gpu else config.gpu
    return open_probe(kind, state_dir=config.state_dir, sim=sim_config(config))


def sandbox_launcher(config: Config) -> SandboxLauncher | None:
    """The launcher for sandboxed attempts, or None with ``container_runtime = "local"``."""
    if config.container_runtime is Runtime.LOCAL:
        return None
    s = config.sandbox
    limits = SandboxLimits(
        uid=s.uid,
        gid=s.gid,
        pids=s.pids,
        nofile=s.nofile,
        cpus=s.cpus,
        memory_bytes=int(s.memory_gib * GIB),
        cgroups=s.cgroups,
        python=s.python,
        tmp_bytes=int(s.tmp_mib * MIB),
        output_bytes=int(s.output_mib * MIB),
    )
    return SandboxLauncher(config.container_runtime, limits, image=config.sandbox_image)


def launchers_for(config: Config) -> dict[LaunchMode, Launcher]:
    """One launcher per launch mode that attempts are started with (serve types
    are driven by the broker's warm pool with the container launcher's runtime)."""
    host = HostLauncher()
    sandbox = sandbox_launcher(config)
    launchers: dict[LaunchMode, Launcher] = {LaunchMode.HOST: host}
    if sandbox is not None:
        launchers[LaunchMode.CONTAINER] = sandbox
    elif config.allow_unsandboxed_containers:
        launchers[LaunchMode.CONTAINER] = host
    return launchers


@dataclass
class Node:
    broker: Broker
    store: Store
    probe: GpuProbe
    lock: StateLock

    def close(self) -> None:
        self.broker.queues.close()  # the extraction threads
        self.probe.close()
        self.store.close()
        self.lock.release()


@contextlib.contextmanager
def open_node(
    config: Config,
    *,
    mock_gpu: bool,
    events: EventLog | None = None,
    extra_roots: list[Path] | None = None,
) -> Iterator[Node]:
    """Take the state directory's lock and build a ready broker (recovery not run)."""
    lock = StateLock(config.state_dir)
    lock.acquire()
    try:
        config.check_sandbox()
        registry = Registry.load(config.module_paths, config.launch_rules)
        # first: a damaged store stops the start before any queue root is touched
        store = open_store(config, check=True)
        try:
            roots = [
                QueueRoot.open(p, create=config.create_queue_roots)
                for p in [*config.queue_roots, *(extra_roots or [])]
            ]
            for root in roots:  # its permissions are its clients' business: left alone
                if config.state_dir.resolve() in root.path.resolve().parents:
                    log.warning(
                        "queue root %s is inside the state directory %s, which only its "
                        "owner can enter (mode 0700): clients of other users cannot reach "
                        "it; put the queue root elsewhere",
                        root.path,
                        config.state_dir,
                    )
            probe = make_probe(config, mock_gpu=mock_gpu)
        except BaseException:
            store.close()
            raise
    except BaseException:
        lock.release()
        raise
    broker = Broker(
        config=config,
        store=store,
        probe=probe,
        registry=registry,
        launchers=launchers_for(config),
        roots=roots,
        events=events,
    )
    node = Node(broker=broker, store=store, probe=probe, lock=lock)
    try:
        yield node
    finally:
        node.close()
