"""``gpuwarden submit``: into the store, into a queue root, or through the HTTP API;
and what ``submit`` and ``run-once`` share: a job from the command's words
(``--NAME VALUE`` parameters, ``--constraint``, ``--input``) and its result shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpuwarden import safefs
from gpuwarden.app import coordinator_source_cache, source_cache
from gpuwarden.cli.common import (
    Commands,
    Progress,
    add_remote_options,
    config_of,
    did_you_mean,
    err,
    existing_store,
    local_or_http,
    out,
    progress_text,
    unknown_option,
    wait_here,
    wait_note,
)
from gpuwarden.cli.run import add_command_options, submit_command
from gpuwarden.client import Client
from gpuwarden.cluster import coordinator
from gpuwarden.config import load_config
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import GIB, JobSpec, JobType, Lane, gpu_count
from gpuwarden.core.params import coerce_text
from gpuwarden.core.policy import never_fits
from gpuwarden.core.ramadmit import RAM_KEYS, RamNeed, check_ram_gib
from gpuwarden.core.sources import JobSource, check_source
from gpuwarden.core.states import JobState
from gpuwarden.core.units import parse_bytes, parse_duration
from gpuwarden.errors import GpuwardenError, UserError, ValidationError
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake.bundlewrite import write_bundle
from gpuwarden.intake.jobs import new_job_id, prepare
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import result_json
from gpuwarden.node import explain
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission
from gpuwarden.store.cluster import ClusterStore, NodeState


def add_service_options(sp: argparse.ArgumentParser) -> None:
    """``--service`` and ``--share`` (SPEC.md, "Service jobs")."""
    sp.add_argument(
        "--service",
        metavar="NAME",
        help='a service type\'s job (launch = "service"): its name in URLs (default: its id)',
    )
    sp.add_argument(
        "--share",
        action="append",
        default=[],
        metavar="WHO",
        help="a service type's job: a token id or role name that may reach it besides its "
        "owner (repeatable)",
    )


def add_source_options(sp: argparse.ArgumentParser) -> None:
    """``--source-repo`` and ``--source-commit`` (SPEC.md, "Jobs from a pinned commit")."""
    sp.add_argument(
        "--source-repo",
        metavar="URL",
        help="run TYPE from the module.toml of a commit of this repository (with "
        "--source-commit; the node's [sources] allow must match the URL)",
    )
    sp.add_argument(
        "--source-commit",
        metavar="SHA",
        help="the full 40-hex-digit commit of --source-repo (no branch, tag or short id)",
    )


def job_source(args: argparse.Namespace) -> JobSource | None:
    """The job's source from ``--source-repo`` and ``--source-commit`` (both or
    neither), checked by the rules of its form; the node checks its allow list."""
    repo, commit = getattr(args, "source_repo", None), getattr(args, "source_commit", None)
    if repo is None and commit is None:
        return None
    if repo is None or commit is None:
        raise ValidationError(
            "--source-repo and --source-commit go together: give the repository's URL and "
            "the full commit"
        )
    try:
        return check_source({"repo": repo, "commit": commit}, None)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def add_job_options(sp: argparse.ArgumentParser, *, or_command: bool = False) -> None:
    """The job of ``submit`` and ``run-once``: its type, parameters and needs
    (``or_command``: or a command after ``--`` instead of a type)."""
    _add_type(sp, or_command=or_command)
    sp.add_argument("--id", dest="job_id", help="job id (default: generated)")
    sp.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    sp.add_argument("--vram-gib", type=float, help="VRAM footprint for this job (vram lane)")
    sp.add_argument(
        "--est-s",
        type=float,
        metavar="SECONDS",
        help="how long the job is expected to run: lets it start on a GPU held back for "
        "another job while its type has no measured run time",
    )
    sp.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="how many GPUs of one node the job holds at once, its footprint on each "
        "(default: its type's gpus, usually 1)",
    )
    add_service_options(sp)
    add_source_options(sp)
    sp.add_argument(
        "--ram-gib",
        type=float,
        metavar="GIB",
        help="the job's RAM cap, enforced by the kernel (a memory cgroup with swap off, or "
        "the container runtime's limit); past it the job is killed for memory",
    )
    sp.add_argument(
        "--ram-floor-gib",
        type=float,
        metavar="GIB",
        help="host RAM that must stay available beside the job while it runs",
    )
    sp.add_argument(
        "--ram-start-min-gib",
        type=float,
        metavar="GIB",
        help="MemAvailable the job needs right before it starts",
    )
    sp.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="an input file for the job (repeatable); named by its file name",
    )
    sp.add_argument(
        "--constraint",
        dest="constraints",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="what the node that runs it must have (repeatable): min_gpu_vram_gib=N, "
        "gpu_model=TEXT, node=NAME, label.KEY=VALUE",
    )
    sp.add_argument(
        "--want",
        dest="outputs",
        action="append",
        default=[],
        metavar="PATH",
        help="an output the job must write (repeatable); it fails without it",
    )
    sp.add_argument(
        "-p",
        "--param",
        dest="kv",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a job parameter; parameters can also be given as --NAME VALUE",
    )


def _add_type(sp: argparse.ArgumentParser, *, or_command: bool) -> None:
    if not or_command:
        sp.add_argument("type", help="job type, module.type (see `gpuwarden types`)")
        return
    sp.add_argument(
        "type",
        nargs="?",
        help="job type, module.type (see `gpuwarden types`); or none, and a command after "
        "--: gpuwarden submit --vram 10G -- python3 train.py",
    )


def _add_submit(sub: Commands) -> None:
    sp = sub.add_parser(
        "submit",
        help="submit a job (into a queue root, or straight into the store)",
        description="Submit a job. With --queue, write a bundle into the queue root's "
        "inbox/ (the broker picks it up); without, insert it into the store.",
        allow_abbrev=False,
    )
    add_job_options(sp, or_command=True)
    add_command_options(sp, with_job_options=False)
    sp.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="KIND:ID",
        help="a job this one waits for (repeatable; all must hold): afterok:ID (ID ended "
        "done), afternotok:ID (ID ended any other way), afterany:ID (ID ended)",
    )
    sp.add_argument("--queue", type=Path, help="queue root to drop the bundle into")
    sp.add_argument("--wait", action="store_true", help="wait for the result and show it")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds (default 3600)")
    sp.add_argument("--results-dir", type=Path, help="with --wait: copy the outputs here")
    add_remote_options(sp)
    sp.set_defaults(func=cmd_submit)


#: the commands of this module, each with what adds its parser
PARSERS = {"submit": _add_submit}


# -- a job from the command's words ------------------------------------------------


def job_params(jobtype: JobType, args: argparse.Namespace) -> dict[str, Any]:
    """Parameters from ``--NAME VALUE`` words and ``-p NAME=VALUE`` options."""
    pairs: list[tuple[str, str | None]] = []
    words = list(args.extra)
    while words:
        word = words.pop(0)
        if not word.startswith("--") or len(word) < 3:
            raise ValidationError(
                f"unexpected argument {word!r}; job parameters are given as --NAME VALUE"
            )
        name, eq, value = word[2:].partition("=")
        spec = jobtype.param(name.replace("-", "_"))
        if spec is None:
            raise ValidationError(_not_a_parameter(jobtype, f"--{name}", args))
        if not eq:
            boolean = spec.type.value == "boolean"
            nxt = words[0] if words else None
            if boolean and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None:
                raise ValidationError(f"--{name} needs a value")
            else:
                value = words.pop(0)
        pairs.append((name, value))
    for item in args.kv:
        name, eq, value = item.partition("=")
        if not eq:
            raise ValidationError(f"-p {item!r}: write it as NAME=VALUE")
        pairs.append((name, value))
    params: dict[str, Any] = {}
    for name, value in pairs:
        key = name.replace("-", "_")
        spec = jobtype.param(key)
        if spec is None:
            close = did_you_mean(key, [p.name for p in jobtype.params])
            known = ", ".join(p.name for p in jobtype.params) or "none"
            raise ValidationError(
                f"-p {name}: {jobtype.name} has no parameter {name!r}{close}; "
                f"its parameters: {known}"
            )
        params[key] = coerce_text(spec, value or "")
    for path in args.inputs:
        if not path.is_file():
            raise ValidationError(f"input file {path} does not exist")
    return params


def loose_params(args: argparse.Namespace) -> dict[str, Any]:
    """Parameters of a type this side does not know (one of a commit's module the
    broker reads): ``-p NAME=VALUE`` and ``--NAME VALUE``, each value read as JSON
    where it is (``3``, ``true``, ``[1, 2]``), as text where not."""
    words, items = list(args.extra), list(args.kv)
    while words:
        word = words.pop(0)
        if not word.startswith("--") or len(word) < 3:
            raise ValidationError(
                f"unexpected argument {word!r}; job parameters are given as --NAME VALUE"
            )
        name, eq, value = word[2:].partition("=")
        if not eq:
            if not words:
                raise ValidationError(f"--{name} needs a value")
            value = words.pop(0)
        items.append(f"{name}={value}")
    params: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise ValidationError(f"-p {item!r}: write it as NAME=VALUE")
        try:
            params[name.replace("-", "_")] = json.loads(value)
        except ValueError:
            params[name.replace("-", "_")] = value
    return params


def _not_a_parameter(jobtype: JobType, word: str, args: argparse.Namespace) -> str:
    """An unknown ``--NAME`` after ``run-once TYPE`` or ``submit TYPE``: neither an
    option of the command nor a parameter of the type."""
    # the way the user writes names: --exit-code or --exit_code (both are read)
    dash = "-" in word[2:]
    params = [f"--{p.name.replace('_', '-') if dash else p.name}" for p in jobtype.params]
    said = unknown_option(word, getattr(args, "options", ()), params)
    if "did you mean" in said or "global option" in said:
        return said
    name = word[2:].replace("-", "_")
    return (
        f"{said}: not an option of `{args.command}`, and {jobtype.name} has no parameter "
        f"{name!r}; its parameters: {', '.join(params) or 'none'} "
        f"(`gpuwarden {args.command} --help` lists the options)"
    )


def parse_constraints(items: Sequence[str]) -> dict[str, Any]:
    """``--constraint KEY=VALUE`` options as a job's ``constraints`` object (checked
    later, with the job): ``min_gpu_vram_gib`` is a number, ``label.KEY=VALUE`` a label."""
    found: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValidationError(
                f"--constraint {item!r}: write it as KEY=VALUE (min_gpu_vram_gib=40, "
                "gpu_model=H100, node=NAME, label.KEY=VALUE)"
            )
        if key.startswith("label."):
            name = key.removeprefix("label.")
            if not name:
                raise ValidationError(f"--constraint {item!r}: name the label, label.KEY=VALUE")
            labels[name] = value
        elif key == "labels":
            raise ValidationError(f"--constraint {item!r}: give each label as label.KEY=VALUE")
        elif key == "min_gpu_vram_gib":
            try:
                number = float(value)
            except ValueError:
                raise ValidationError(
                    f"--constraint {item!r}: min_gpu_vram_gib must be a number of GiB"
                ) from None
            found[key] = int(number) if number.is_integer() else number
        else:
            found[key] = value  # an unknown key is refused with the job's other checks
    if labels:
        found["labels"] = labels
    return found


def job_spec(registry: Registry, args: argparse.Namespace) -> JobSpec:
    """The job the command's words describe, checked against its type (of a
    module the node has, or of the module at ``--source-commit``)."""
    source = job_source(args)
    jobtype = registry.get(args.type) if source is None else registry.from_source(source, args.type)
    params = job_params(jobtype, args)
    spec = JobSpec(
        id=args.job_id or new_job_id(jobtype.name),
        type=jobtype.name if source is None else args.type,
        params=params,
        inputs=tuple(p.name for p in args.inputs),
        outputs=tuple(args.outputs),
        priority=args.priority,
        vram_bytes=_sized(
            args, "vram", int(args.vram_gib * GIB) if args.vram_gib is not None else None
        ),
        constraints=parse_constraints(args.constraints),
        after=tuple(getattr(args, "after", ())),
        est_s=_timed(args, "est", args.est_s),
        gpus=args.gpus,
        ram=ram_need(args),
        service=getattr(args, "service", None),
        share=tuple(getattr(args, "share", ())),
        source=source,
    )
    return prepare(registry, spec)


def _sized(args: argparse.Namespace, key: str, old: int | None) -> int | None:
    """``--vram 10G`` (``--ram``): human units, over the older ``--vram-gib``."""
    text = getattr(args, key, None)
    if text is None:
        return old
    try:
        return parse_bytes(text, option=f"--{key}")
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def _timed(args: argparse.Namespace, key: str, old: float | None) -> float | None:
    """``--est 10m``: human units, over the older ``--est-s``."""
    text = getattr(args, key, None)
    if text is None:
        return old
    try:
        return parse_duration(text, option=f"--{key}")
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def ram_need(args: argparse.Namespace) -> RamNeed:
    """``--ram-gib`` (or ``--ram 4G``), ``--ram-floor-gib`` and ``--ram-start-min-gib``
    in bytes."""
    if getattr(args, "ram", None) is not None and getattr(args, "ram_gib", None) is None:
        cap = _sized(args, "ram", None) or 0
        floor_min = ram_need_gib(args)
        return RamNeed(cap, floor_min.floor_bytes, floor_min.start_min_bytes)
    return ram_need_gib(args)


def ram_need_gib(args: argparse.Namespace) -> RamNeed:
    """``--ram-gib``, ``--ram-floor-gib`` and ``--ram-start-min-gib`` in bytes."""
    values = []
    for key in RAM_KEYS:
        value = getattr(args, key, None)
        try:
            values.append(
                0 if value is None else check_ram_gib(value, "--" + key.replace("_", "-"))
            )
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
    return RamNeed(*values)


def copy_inputs(inputs: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in inputs:
        shutil.copy2(path, dest / path.name)


# -- a job's result --------------------------------------------------------------


def print_result(
    result: dict[str, Any], outputs_dir: Path | None, *, kept: bool, where: str | None = None
) -> None:
    """Status, message and each output with a preview of its content. ``where``
    names the outputs' place when ``outputs_dir`` is only a temporary copy."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", min_width=9)
    grid.add_column()
    colour = "green" if result["status"] == "done" else "red"
    grid.add_row("job", result["id"])
    grid.add_row("status", f"[{colour}]{result['status']}[/]")
    grid.add_row("message", escape(result.get("message") or result.get("reason") or ""))
    if result.get("status") != "done" and result.get("reason"):
        grid.add_row("reason", escape(result["reason"]))
    grid.add_row("attempts", str(result.get("attempts")))
    for entry in result.get("refused") or []:
        grid.add_row("refused", escape(f"{entry['path']} ({entry['kind']}): {entry['why']}"))
    if result.get("message_file"):
        grid.add_row("note", escape(str(result["message_file"])))
    out.print(grid)
    if outputs_dir is None:
        return
    for rel in result.get("outputs", []):
        path = outputs_dir / rel
        if where is not None:
            out.print(f"[bold]output[/]    {where}/{rel}")
        else:
            note = "" if kept else "  (removed on exit; --keep keeps it)"
            out.print(f"[bold]output[/]    {path}{note}")
        out.print(f"[bold]content[/]   {_preview(outputs_dir, rel)}")
    if result.get("status") != "done" and result.get("stderr"):
        out.print("[bold]stderr[/]")
        out.print(result["stderr"], markup=False)


def _preview(outputs_dir: Path, rel: str, limit: int = 2000) -> str:
    """The start of an output file, read like every file a job wrote: without
    following a link, never blocking, at most ``limit`` bytes."""
    try:
        fd = safefs.open_file(rel, under=outputs_dir)
    except (OSError, safefs.UnsafePathError) as exc:
        return f"(cannot read: {exc})"
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, limit)
    finally:
        os.close(fd)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return f"({size} bytes of binary data)"
    return text + ("..." if size > limit else "")


def copy_outputs(src: Path, dest: Path) -> None:
    """Copy a job's output folder to ``dest`` the safe way (regular files and
    folders only, never through a link; a name already in ``dest`` is kept), and
    say what was not copied."""
    if dest.exists() or dest.is_symlink():
        with safefs.opened_dir(dest) as fd:  # a link at dest is refused, not followed
            listing = safefs.copy_into(src, fd)
    else:
        listing = safefs.copy_tree(src, dest)
    for entry in listing.refused:
        err.print(f"[yellow]not copied:[/] {escape(entry.path)}: {escape(entry.why)}")


# -- submit ------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    if getattr(args, "command_argv", None) is not None:
        if args.extra:  # --NAME VALUE before --: VALUE was read as the type
            raise ValidationError(
                f"unexpected {args.extra[0]!r} before --: `gpuwarden submit --help` lists a "
                "command job's options; the command's own go after --"
            )
        if args.type is not None:
            raise ValidationError(f"give a job type ({args.type}) or a command after --, not both")
        return submit_command(args)
    if args.type is None:
        raise ValidationError(
            "give a job type (gpuwarden types lists them) or a command after --, e.g. "
            "gpuwarden submit --vram 10G -- python3 train.py"
        )
    _refuse_command_only(args)
    return local_or_http(args, _submit_here, _submit_http)


#: the options only a command job takes (a type's job has them from its module.toml)
COMMAND_ONLY = ("name", "env", "export_env", "share_gpu", "preemptible", "array", "timeout")


def _refuse_command_only(args: argparse.Namespace) -> None:
    for key in COMMAND_ONLY:
        value = getattr(args, key, None)
        if value not in (None, False, []):
            option = "--" + key.replace("_", "-")
            raise ValidationError(
                f"{option} is for a command job (gpuwarden submit {option} ... -- CMD); a "
                f"job of type {args.type} takes its {option.lstrip('-')} from its module.toml"
            )


def _submit_here(args: argparse.Namespace) -> int:
    if args.queue is not None:
        return _submit_to_queue(args)
    config = config_of(args)
    store = existing_store(args, config)
    try:
        # on a coordinator's store (PostgreSQL, or one with enrolled nodes) the
        # nodes' own launch rules decide (checked below), not this host's config
        coordinated = bool(config.database) or _has_nodes(store)
        rules = LaunchRules.unchecked() if coordinated else config.launch_rules
        registry = Registry.load(config.module_paths, rules)
        # a coordinator reads a commit's module.toml under its own [sources] allow
        # and builds nothing: its agents build and run it (SPEC.md section 20)
        registry.sources = coordinator_source_cache(config) if coordinated else source_cache(config)
        spec = job_spec(registry, args)
        _refuse_if_it_never_fits(spec, registry, store, config.broker.cpu_slots)
        _refuse_if_no_node_ever_could(spec, registry, store)
        input_dir = config.state_dir / "inputs" / spec.id
        if args.inputs:
            copy_inputs(args.inputs, input_dir)
        store.submit(
            [spec],
            now=time.time(),
            origin=Submission(input_dir=str(input_dir) if args.inputs else None),
        )
        out.print(f"submitted {spec.id} ({spec.type}) to {config.state_dir}")
        if not args.wait:
            return 0
        job = wait_here(store, registry, config, spec.id, args.wait_timeout)
        if not job.state.terminal:
            err.print(f"gave up waiting after {args.wait_timeout:g} s; job is {job.state.value}")
            return 1
        result = result_json(job, store.attempts(job.id))
        outputs = Path(job.result["output_dir"]) if "output_dir" in job.result else None
        if outputs is not None and args.results_dir:
            copy_outputs(outputs, Path(args.results_dir))
            outputs = Path(args.results_dir)
        print_result(result, outputs, kept=True)
        return 0 if job.state is JobState.DONE else 1
    finally:
        store.close()


def _refuse_if_it_never_fits(
    spec: JobSpec, registry: Registry, store: Store, cpu_slots: int
) -> None:
    """Against the GPUs and RAM the running broker last reported (when one runs)."""
    jobtype = registry.get(spec.type)
    status = explain.latest_status(store, time.time())
    if status is None:
        return
    view = explain.view_from_status(status, cpu_slots)
    if (why := explain.never_admitted(view.ram, jobtype, spec.ram)) is not None:
        raise ValidationError(f"job {spec.id} ({spec.type}) {why}")
    if jobtype.lane is not Lane.VRAM:
        return
    need = explain.effective_footprint(jobtype, spec.vram_bytes, store)
    if (why := never_fits(need, view.gpus, gpu_count(jobtype, spec.gpus))) is not None:
        raise ValidationError(f"job {spec.id} ({spec.type}) {why}")


def _has_nodes(store: Store) -> bool:
    """True for a coordinator's store: one with an enrolled node that is not revoked."""
    return isinstance(store, ClusterStore) and any(
        n.state is not NodeState.REVOKED for n in store.list_nodes()
    )


def _refuse_if_no_node_ever_could(spec: JobSpec, registry: Registry, store: Store) -> None:
    """Against the enrolled nodes of a coordinator's store (none: no check)."""
    if not isinstance(store, ClusterStore):
        return
    why = coordinator.submission_refusal(store, registry, spec, time.time())
    if why is not None:
        raise ValidationError(f"job {spec.id} ({spec.type}): {why}")


def _submit_to_queue(args: argparse.Namespace) -> int:
    root = QueueRoot.open(
        args.queue,
        create=False,
        how_to_create=f"`gpuwarden serve --queue {args.queue}` makes it when the broker starts "
        "(unless its config says create_queue_roots = false)",
    )
    try:
        config = config_of(args)
    except GpuwardenError:
        # no usable config here: the broker that reads the queue applies its rules
        config = load_config(None)
        rules = LaunchRules.unchecked()
    else:
        rules = config.launch_rules
    registry = Registry.load(config.module_paths, rules)
    registry.sources = source_cache(config)
    spec = job_spec(registry, args)
    files = {p.name: p for p in args.inputs}
    path = write_bundle(root.inbox, [spec], files, now=time.time())
    out.print(f"submitted {spec.id} ({spec.type}) as {path}")
    if not args.wait:
        return 0
    with Progress(f"waiting for the result of {path.name} in {root.outbox} or {root.failed}"):
        result_path = root.wait_for_result(path.name, args.wait_timeout)
    if result_path is None:
        err.print(f"no result after {args.wait_timeout:g} s; is a broker watching {root.path}?")
        return 1
    results = bundles.read_result_bundle(result_path)
    result = results.get(spec.id) or next(iter(results.values()))
    if args.results_dir:
        bundles.extract_outputs(result_path, spec.id, args.results_dir)
        print_result(result, args.results_dir, kept=True)
    else:
        with tempfile.TemporaryDirectory(prefix="gpuwarden-") as tmp:
            bundles.extract_outputs(result_path, spec.id, Path(tmp))
            print_result(
                result, Path(tmp), kept=False, where=f"{result_path.name}:{spec.id}/outputs"
            )
    out.print(f"[bold]result[/]    {result_path}")
    return 0 if result.get("status") == "done" else 1


def _remote_jobtype(client: Client, name: str) -> JobType:
    """The job type as the API describes it: enough to read --NAME VALUE parameters."""
    types: dict[str, JobType] = {t.name: t for t in client.job_types()}
    t = types.get(name)
    if t is None:
        known = ", ".join(sorted(types)) or "none"
        raise ValidationError(
            f"unknown job type {name!r}{did_you_mean(name, list(types))} at {client.url}; "
            f"known types: {known}"
        )
    return t


#: with ``--wait`` over HTTP, how long the submit request itself waits for the end
#: (then the CLI polls, showing why the job waits)
FIRST_WAIT_S = 2.0


def _wait_http(client: Client, job_id: str, timeout: float, *, total: float) -> bool:
    """Poll until the job has ended, showing its state and why it waits; False
    (said, with the ``total`` time waited) after ``timeout``."""
    with Progress(f"job {job_id}: submitted") as status:

        def progress(j: dict[str, Any]) -> None:
            status.update(progress_text(j["id"], j["state"], wait_note(j.get("explain", []))))

        try:
            client.wait(job_id, timeout=max(0.0, timeout), progress=progress, explain=True)
        except TimeoutError:
            err.print(f"gave up waiting after {total:g} s")
            return False
    return True


def _submit_http(args: argparse.Namespace, client: Client) -> int:
    if args.queue is not None:
        raise UserError("--queue and --url do not go together: choose one way to submit")
    if args.inputs:
        raise UserError(
            "file inputs are not sent over HTTP yet: submit with --queue DIR, "
            "or on the broker's host without --url"
        )
    source = job_source(args)
    if source is None:
        jobtype = _remote_jobtype(client, args.type)
        type_name, params = jobtype.name, job_params(jobtype, args)
    else:  # the broker reads the commit's module.toml and checks them
        type_name, params = args.type, loose_params(args)
    # with --wait, the submit itself waits a little (a long poll): a job that ends
    # within it comes back with its result in that one request
    first_wait = min(args.wait_timeout, FIRST_WAIT_S) if args.wait else None
    # a terminal shows a spinner while the first request waits; a log gets its
    # first line once the job is known ("job ID: submitted", then one per change)
    submitting = (
        Progress(f"submitting a {type_name} job to {client.url}")
        if err.is_terminal
        else contextlib.nullcontext()
    )
    with submitting:
        job = client.submit(
            type_name,
            params,
            id=args.job_id,
            priority=args.priority,
            vram_gib=args.vram_gib,
            outputs=args.outputs,
            constraints=parse_constraints(args.constraints),
            wait=first_wait,
            after=args.after,
            est_s=args.est_s,
            gpus=args.gpus,
            ram_gib=args.ram_gib,
            ram_floor_gib=args.ram_floor_gib,
            ram_start_min_gib=args.ram_start_min_gib,
            service=args.service,
            share=args.share,
            source=None if source is None else source.to_json(),
        )
    out.print(f"submitted {job['id']} ({job['type']}) to {client.url}")
    if not args.wait:
        return 0
    result = job.get("result") if (job.get("wait") or {}).get("ended") else None
    if result is None:
        left = args.wait_timeout - (first_wait or 0.0)
        if not _wait_http(client, job["id"], left, total=args.wait_timeout):
            return 1
        result = client.result(job["id"])
    if args.results_dir:
        for rel in result.get("outputs", []):
            client.download(job["id"], rel, args.results_dir / rel)
        print_result(result, args.results_dir, kept=True)
    else:
        with tempfile.TemporaryDirectory(prefix="gpuwarden-") as tmp:
            for rel in result.get("outputs", []):
                client.download(job["id"], rel, Path(tmp) / rel)
            print_result(
                result, Path(tmp), kept=False, where=f"{client.url}/v1/jobs/{job['id']}/outputs"
            )
    return 0 if result.get("status") == "done" else 1
