"""Wiring: build a node (store, probe, registry, launchers, queue roots) from a config.

This is where the configuration meets the broker: the broker's own modules
(``node/``) take plain values (:func:`node_settings`) and collaborators, never
the configuration itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuwarden import safefs
from gpuwarden.config import DATABASE_URL_PREFIXES, Config, RuntimeCall, RuntimeSettings
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import GIB, MIB, LaunchMode
from gpuwarden.errors import ConfigError, GpuwardenError, UserError
from gpuwarden.eventlog import EventLog
from gpuwarden.gpu.base import GpuProbe
from gpuwarden.gpu.select import open_probe
from gpuwarden.gpu.sim import SimGpuConfig
from gpuwarden.intake.manifest import BundleLimits
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import QueueIntake
from gpuwarden.intake.sources import SourceCache
from gpuwarden.launch.base import Launcher
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.memcaps import MemoryCgroups, find_memory_cgroups
from gpuwarden.launch.sandbox import SandboxLauncher, SandboxLimits
from gpuwarden.node.loop import Broker, IntakeFactory
from gpuwarden.node.settings import NodeSettings, RuntimeCallSpec, RuntimeSpec, VramSettings
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
    # psycopg only when it is used: every other command starts without it
    from gpuwarden.store.postgres import PostgresStore  # noqa: PLC0415

    return PostgresStore(config.database)


def make_probe(config: Config, *, mock_gpu: bool) -> GpuProbe:
    kind = "sim" if mock_gpu else config.gpu
    return open_probe(kind, state_dir=config.state_dir, sim=sim_config(config))


def sandbox_launcher(
    config: Config, memory_cgroups: MemoryCgroups | Literal["auto"] | None = "auto"
) -> SandboxLauncher | None:
    """The launcher for sandboxed attempts, or None with ``container_runtime = "local"``
    (``memory_cgroups``: where bubblewrap caps a job's RAM, "auto": found now)."""
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
    return SandboxLauncher(
        config.container_runtime,
        limits,
        image=config.sandbox_image,
        memory_cgroups=memory_cgroups,
    )


def launchers_for(config: Config) -> dict[LaunchMode, Launcher]:
    """One launcher per launch mode that attempts are started with (serve types
    are driven by the broker's warm pool with the container launcher's runtime)."""
    memory = find_memory_cgroups()  # once: where a job's RAM cap is enforced
    host = HostLauncher(memory)
    sandbox = sandbox_launcher(config, memory)
    launchers: dict[LaunchMode, Launcher] = {LaunchMode.HOST: host}
    if sandbox is not None:
        launchers[LaunchMode.CONTAINER] = sandbox
    elif config.allow_unsandboxed_containers:
        launchers[LaunchMode.CONTAINER] = host
    return launchers


def node_settings(config: Config) -> NodeSettings:
    """What the broker of a node is set to, read from the configuration."""
    b, v, w, s = config.broker, config.vram, config.warm, config.sandbox
    return NodeSettings(
        name=config.node_name,
        state_dir=config.state_dir,
        rules=config.launch_rules,
        vram=VramSettings(
            reserve_bytes=int(v.reserve_gib * GIB),
            reclaim_timeout_s=v.reclaim_timeout_s,
            tolerance_bytes=int(v.tolerance_mib * MIB),
            step_bytes=int(v.measure_granularity_mib * MIB),
        ),
        poll_interval_s=b.poll_interval_s,
        cpu_slots=b.cpu_slots,
        shutdown_grace_s=b.shutdown_grace_s,
        on_stop=b.on_stop,
        kill_grace_s=b.kill_grace_s,
        status_interval_s=b.status_interval_s,
        clip_chars=b.clip_chars,
        max_interruptions=b.max_interruptions,
        idle_grace_s=w.idle_grace_s,
        stop_grace_s=w.stop_grace_s,
        weights_dir=s.weights_dir,
        scratch_bytes=int(s.scratch_mib * MIB),
        runtimes=tuple(runtime_spec(r) for r in config.runtimes),
        source_build_timeout_s=config.sources.build_timeout_s,
        fair_share_half_life_s=b.fair_share_half_life_s,
        ram_floor_bytes=math.ceil(b.ram_floor_gib * GIB),
        gpu_lock=config.gpu_lock,
        gpu_lock_group=config.gpu_lock_group,
        service_address=config.cluster.service_address,
        model_dirs={
            name: m.model_dir for name, m in config.modules.items() if m.model_dir is not None
        },
    )


#: the most a runtime's credential file may hold
_TOKEN_MAX = 4096

#: what a bearer token may hold: visible ASCII, no space (RFC 6750's b64token
#: and the usual API keys); anything else is refused without being quoted
_TOKEN_CHARS = re.compile(rb"[\x21-\x7e]+")


def read_credential(path: Path, limit: int = _TOKEN_MAX) -> bytes:
    """The bytes of a credential file (at most ``limit``), opened following no link
    in any component of ``path`` (an absolute path, as the config leaves it): each
    folder from ``/`` down is opened with ``O_NOFOLLOW`` below the one before it,
    so whoever may write a folder on the way cannot point it elsewhere, now or
    between a check and the read. The file must be a regular file with one link
    (a hard link to another file, such as ``/etc/shadow``, is refused).

    Raises :class:`safefs.UnsafePathError` (a link, not a file, a hard link, too
    large) or ``OSError`` (missing, not readable); neither quotes the content."""
    text = os.fspath(path)
    if not text.startswith("/"):
        raise safefs.UnsafePathError(text, "is not an absolute path")
    fd = safefs.open_file(text.lstrip("/"), under="/")
    try:
        st = os.fstat(fd)
        if st.st_nlink != 1:
            raise safefs.UnsafePathError(
                text, f"has {st.st_nlink} hard links; a credential file must have one"
            )
        chunks: list[bytes] = []
        got = 0
        while chunk := os.read(fd, limit + 1 - got):
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise safefs.TooLargeError(text, f"is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def runtime_token(runtime: RuntimeSettings) -> str | None:
    """The bearer token in a runtime's ``credential_file`` (None without one). A
    file that cannot be read safely (missing, a link anywhere on its path, a hard
    link, too large) or that holds what no bearer token holds is a UserError
    naming it, never quoting a byte of it."""
    if runtime.credential_file is None:
        return None
    where = f"runtime {runtime.name}: its credential_file {runtime.credential_file}"
    try:
        raw = read_credential(runtime.credential_file)
    except (OSError, GpuwardenError) as exc:
        why = _why_unreadable(exc)
        raise UserError(f"{where} cannot be read ({why}): fix the path or remove the key") from None
    token = raw.strip()
    if not token:
        return None
    if not _TOKEN_CHARS.fullmatch(token):
        raise UserError(
            f"{where} is not one bearer token (it holds {len(raw)} bytes with spaces, line "
            "breaks, control or non-ASCII characters; its content is not shown): put the "
            "token alone in the file"
        )
    return token.decode("ascii")


def _why_unreadable(exc: BaseException) -> str:
    """Why a credential file could not be read, in words that quote none of it: the
    component refused and why, or the system's words for the error."""
    if isinstance(exc, safefs.UnsafePathError):
        shown = "/" + exc.path.lstrip("/")  # opened below "/": shown as "//..."
        return f"{shown} {exc.why}"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


def runtime_spec(runtime: RuntimeSettings) -> RuntimeSpec:
    """A ``[[runtimes]]`` table as the node takes it."""

    def call(c: RuntimeCall | None) -> RuntimeCallSpec | None:
        return None if c is None else RuntimeCallSpec(c.method, c.path, c.busy_key, c.body)

    return RuntimeSpec(
        name=runtime.name,
        kind=runtime.kind,
        url=runtime.url,
        token=runtime_token(runtime),
        gpus=tuple(runtime.gpus),
        idle_grace_s=runtime.idle_grace_s,
        release_timeout_s=runtime.release_timeout_s,
        busy=call(runtime.busy),
        release=call(runtime.release),
    )


def bundle_limits(config: Config) -> BundleLimits:
    """The config's ``[limits]`` for a bundle, in bytes, as intake checks them."""
    zip_bytes, entries, unpacked, jobs = config.bundle_limits_bytes()
    return BundleLimits(
        max_zip_bytes=zip_bytes, max_entries=entries, max_unpacked_bytes=unpacked, max_jobs=jobs
    )


def queue_intake(
    config: Config, store: Store, registry: Registry, roots: list[QueueRoot]
) -> IntakeFactory:
    """How a broker builds its queue intake: over the config's state directory and
    bundle limits, reporting through the broker."""

    def build(broker: Broker) -> QueueIntake:
        return QueueIntake(
            store=store,
            registry=registry,
            staging_dir=config.state_dir / "staging",
            limits=bundle_limits(config),
            roots=roots,
            emit=broker.emit,
            on_error=broker.record_error,
            check=broker.check_fits,
            clock=broker.clock,
            wake=broker.wake,  # a finished extraction is taken at once, not next tick
            commands=config.commands.bundles,
        )

    return build


@dataclass
class Node:
    broker: Broker
    store: Store
    probe: GpuProbe
    lock: StateLock
    #: the configuration it was built from (its node name as the broker has it)
    config: Config

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
    name: Callable[[GpuProbe, Registry], str] | None = None,
) -> Iterator[Node]:
    """Take the state directory's lock and build a ready broker (recovery not run).

    ``name``, when given, names the node once its probe and modules are ready and
    before its broker is built (an agent enrols there, and its coordinator says
    the name): the broker is built with that name, and ``Node.config`` has it."""
    lock = StateLock(config.state_dir)
    lock.acquire()
    try:
        config.check_sandbox()
        config.check_modules()
        registry = Registry.load(config.module_paths, config.launch_rules)
        _warn_unknown_modules(config, registry)
        registry.sources = source_cache(config)
        # first: a damaged store stops the start before any queue root is touched
        store = open_store(config, check=True)
        try:
            roots = _queue_roots(config, extra_roots or [])
            probe = make_probe(config, mock_gpu=mock_gpu)
            try:
                if name is not None:
                    config = config.model_copy(update={"node_name": name(probe, registry)})
            except BaseException:
                probe.close()
                raise
        except BaseException:
            store.close()
            raise
    except BaseException:
        lock.release()
        raise
    broker = Broker(
        settings=node_settings(config),
        store=store,
        probe=probe,
        registry=registry,
        launchers=launchers_for(config),
        intake=queue_intake(config, store, registry, roots),
        roots=roots,
        events=events,
    )
    node = Node(broker=broker, store=store, probe=probe, lock=lock, config=config)
    try:
        yield node
    finally:
        node.close()


def _warn_unknown_modules(config: Config, registry: Registry) -> None:
    """A ``[modules.<name>]`` table of a module this node did not load is kept (the
    module may be installed later) and logged: a misspelt name is seen at start."""
    for name in sorted(set(config.modules) - set(registry.modules)):
        log.warning(
            "[modules.%s] names no module this node loaded (loaded: %s): its settings reach no job",
            name,
            ", ".join(sorted(registry.modules)) or "none",
        )


def source_cache(config: Config) -> SourceCache:
    """Where the node fetches jobs' source commits (``<state>/sources``), under its
    ``[sources]`` settings and runtime."""
    return SourceCache(
        config.state_dir / "sources",
        tuple(config.sources.allow),
        refusal=config.source_refusal,
        timeout_s=config.sources.fetch_timeout_s,
    )


def coordinator_source_cache(config: Config) -> SourceCache:
    """Where a coordinator fetches the commits jobs name (``<state>/sources``), under
    its own ``[sources] allow``: it reads their ``module.toml`` (each type's lane,
    launch mode, footprint and parameters) and builds nothing, so its own
    ``container_runtime`` does not count (SPEC.md, "Jobs from a pinned commit",
    "Across hosts")."""
    return SourceCache(
        config.state_dir / "sources",
        tuple(config.sources.allow),
        timeout_s=config.sources.fetch_timeout_s,
        who="coordinator",
    )


def _queue_roots(config: Config, extra: list[Path]) -> list[QueueRoot]:
    """The config's queue roots and ``extra`` ones, opened (made, if the config says so)."""
    roots = [
        QueueRoot.open(p, create=config.create_queue_roots) for p in [*config.queue_roots, *extra]
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
    return roots
