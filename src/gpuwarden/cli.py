"""The ``gpuwarden`` command line: one small function per sub-command.

Every global flag can also come from the environment (shown in ``--help``).
``main(argv)`` is callable from tests; a user's mistake prints one clear line,
never a traceback.
"""

from __future__ import annotations

import argparse
import codecs
import difflib
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuwarden import __version__, safefs
from gpuwarden.app import make_probe, open_node, open_store
from gpuwarden.cluster import cli as cluster_cli
from gpuwarden.cluster import coordinator, report
from gpuwarden.config import CONFIG_ENV, STATE_DIR_ENV, Config, load_config
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import (
    GIB,
    Job,
    JobSpec,
    JobType,
    Lane,
    LaunchMode,
    Role,
    format_bytes,
)
from gpuwarden.core.params import coerce_text
from gpuwarden.core.policy import QueuedJob, never_fits
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError, UserError, ValidationError
from gpuwarden.eventlog import CURSOR_FILE, EventLog, NullLog
from gpuwarden.intake import bundle as bundles
from gpuwarden.intake.bundlewrite import write_bundle
from gpuwarden.intake.jobs import new_job_id, prepare
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.node import explain, joblogs
from gpuwarden.node.loop import result_json
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Store, Submission
from gpuwarden.store.cluster import ClusterStore, NodeState

#: a broker whose status is older than this is reported as not running
STALE_AFTER_S = 120.0

URL_ENV = "GPUWARDEN_URL"
TOKEN_ENV = "GPUWARDEN_TOKEN"  # noqa: S105 - the name of a variable
DEFAULT_TOKEN_FILE = Path("~/.config/gpuwarden/token")

#: piped output (scripts, logs) gets wide tables instead of cells cut to 80 columns
_PIPE_WIDTH = 200
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# -- argument parsing ---------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that remembers its option names and its sub-commands,
    so that an unknown option or command can be answered with "did you mean"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: every option string of this parser (``--wait``, ``-p``, ...)
        self.option_names: list[str] = []
        #: the sub-commands action, when this parser has one
        self.commands: Any = None
        super().__init__(*args, **kwargs)  # adds -h through add_argument

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.option_names += action.option_strings
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def error(self, message: str) -> NoReturn:
        # argparse: "argument COMMAND: invalid choice: 'sumbit' (choose from ...)"
        head = message.split(":", 1)[0]
        if self.commands is not None and head == f"argument {self.commands.metavar}":
            word = message.partition("invalid choice: ")[2].split(" (", 1)[0].strip("'\"")
            if word and (hint := did_you_mean(word, list(self.commands.choices))):
                message = f"unknown command {word!r}{hint}"
        super().error(message)


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the candidate closest to ``word``, or ``""``.

    Closest: the fewest edits, where swapping two neighbours is one edit (a typo
    like ``--wiat`` is one from ``--wait``, two from ``--want``), then difflib's
    ratio; a candidate more than 2 edits (or half the word) away is no match."""
    best: tuple[int, float, str] | None = None
    for c in dict.fromkeys(candidates):
        d = edits(word, c)
        if d > 2 or d * 2 >= max(len(word), 1):
            continue
        key = (d, -difflib.SequenceMatcher(None, word, c).ratio(), c)
        best = key if best is None or key < best else best
    return f" (did you mean {best[2]}?)" if best else ""


def edits(a: str, b: str) -> int:
    """The optimal string alignment distance: inserts, deletes, substitutions and
    swaps of two neighbours, each one edit."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i, *([0] * len(b))]
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[len(b)]


def build_parser() -> Parser:
    p = Parser(
        prog="gpuwarden",
        description="A GPU job broker: a durable queue, VRAM admission, sandboxed launches.",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    p.add_argument(
        "--config",
        type=Path,
        default=os.environ.get(CONFIG_ENV),
        help=f"TOML config file (env {CONFIG_ENV}); none needed for run-once",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help=f"state directory, overrides the config (default: the config's, else "
        f"${STATE_DIR_ENV}, else ~/.local/state/gpuwarden)",
    )
    p.add_argument(
        "--mock-gpu",
        action="store_true",
        default=os.environ.get("GPUWARDEN_MOCK_GPU", "").lower() in ("1", "true", "yes", "on"),
        help="use the simulated GPU instead of NVML (env GPUWARDEN_MOCK_GPU=1)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log what the broker does")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def job_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("type", help="job type, module.type (see `gpuwarden types`)")
        sp.add_argument("--id", dest="job_id", help="job id (default: generated)")
        sp.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
        sp.add_argument("--vram-gib", type=float, help="VRAM footprint for this job (vram lane)")
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

    def remote_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--url",
            default=os.environ.get(URL_ENV),
            help=f"talk to the HTTP API there instead of the local store (env {URL_ENV}); "
            f"the token comes from {TOKEN_ENV} or --token-file",
        )
        sp.add_argument(
            "--token-file",
            type=Path,
            default=DEFAULT_TOKEN_FILE,
            help="with --url: file holding the token, mode 600 (default ~/.config/gpuwarden/token)",
        )

    sp = sub.add_parser(
        "run-once",
        help="run one job on this machine and show its result",
        description="Submit one job, run a broker until it ends, and show the result. "
        "Job parameters follow as --NAME VALUE.",
        allow_abbrev=False,
    )
    job_args(sp)
    sp.add_argument("--keep", action="store_true", help="keep the temporary directory")
    sp.set_defaults(func=cmd_run_once)

    sp = sub.add_parser("serve", help="run the broker", allow_abbrev=False)
    sp.add_argument("--log", type=Path, help="append JSON events to this file (default stdout)")
    sp.add_argument(
        "--queue", dest="queues", action="append", default=[], type=Path, help="extra queue root"
    )
    sp.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="also serve the HTTP API there, e.g. 127.0.0.1:8765 (port 0: any free port)",
    )
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser(
        "submit",
        help="submit a job (into a queue root, or straight into the store)",
        description="Submit a job. With --queue, write a bundle into the queue root's "
        "inbox/ (the broker picks it up); without, insert it into the store.",
        allow_abbrev=False,
    )
    job_args(sp)
    sp.add_argument("--queue", type=Path, help="queue root to drop the bundle into")
    sp.add_argument("--wait", action="store_true", help="wait for the result and show it")
    sp.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds (default 3600)")
    sp.add_argument("--results-dir", type=Path, help="with --wait: copy the outputs here")
    remote_args(sp)
    sp.set_defaults(func=cmd_submit)

    sp = sub.add_parser("status", help="the broker's GPUs, ledger, queues and health")
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=60.0,
        metavar="SECONDS",
        help="first wait until a broker reports and is well (default 60 s; for scripts "
        "that start `gpuwarden serve` in the background)",
    )
    remote_args(sp)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("jobs", help="list jobs")
    sp.add_argument("--state", choices=[s.value for s in JobState], action="append")
    sp.add_argument("--limit", type=int, default=50)
    sp.add_argument("--json", action="store_true")
    remote_args(sp)
    sp.set_defaults(func=cmd_jobs)

    sp = sub.add_parser("show", help="one job: its attempts and events")
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true")
    remote_args(sp)
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser(
        "logs",
        help="a job's output streams: what it wrote on stdout (or stderr)",
        description="Print what an attempt of the job wrote on stdout (with --stderr: on "
        "stderr), from its attempt folder, or with --url through the API. Default: the "
        "latest attempt. --follow prints what it writes until the attempt ends (a job "
        "that has not started yet is waited for).",
        allow_abbrev=False,
    )
    sp.add_argument("job")
    sp.add_argument("--attempt", type=int, metavar="N", help="this attempt (default: the latest)")
    sp.add_argument("-f", "--follow", action="store_true", help="go on until the attempt has ended")
    sp.add_argument("--stderr", action="store_true", help="the stderr stream instead of stdout")
    remote_args(sp)
    sp.set_defaults(func=cmd_logs)

    sp = sub.add_parser("cancel", help="cancel a queued or running job")
    sp.add_argument("job")
    remote_args(sp)
    sp.set_defaults(func=cmd_cancel)

    sp = sub.add_parser("explain", help="why a job waits (or where it runs, or how it ended)")
    sp.add_argument("job")
    remote_args(sp)
    sp.set_defaults(func=cmd_explain)

    sp = sub.add_parser(
        "preview",
        help="would a job of this type start now, where, or what would it wait for",
        description="Run the admission policy on what the broker last saw (or on the probe, "
        "if no broker runs) with one more job in the queue. Submits nothing.",
        allow_abbrev=False,
    )
    sp.add_argument("type", help="job type, module.type")
    sp.add_argument("--vram-gib", type=float, help="footprint for this job (default: the type's)")
    sp.add_argument("--priority", type=int, default=0)
    sp.set_defaults(func=cmd_preview)

    sp = sub.add_parser("gpu", help="operator actions on a GPU")
    gpu_sub = sp.add_subparsers(dest="gpu_command", required=True, metavar="ACTION")
    clear = gpu_sub.add_parser(
        "clear",
        help="resume VRAM admission on a GPU after its hardware fault was dealt with",
    )
    clear.add_argument("uuid", help="the GPU's UUID, as `gpuwarden status` shows it")
    remote_args(clear)
    clear.set_defaults(func=cmd_gpu_clear)

    sp = sub.add_parser(
        "token",
        help="API tokens: create, list, revoke (in the store, or with --url through the API)",
        description="Manage the HTTP API's tokens in the store of the state directory, or "
        "with --url through the API (an owner token). Whoever can write that store owns "
        "the machine: the first owner token is made here "
        "(`gpuwarden token create admin --role owner`).",
    )
    token_sub = sp.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    tc = token_sub.add_parser("create", help="make a token; it is printed once", allow_abbrev=False)
    tc.add_argument("name", help="who or what holds it (letters, digits, space, . _ @ -)")
    tc.add_argument("--role", required=True, choices=[r.value for r in Role])
    tc.add_argument("--expires-days", type=float, help="it expires after this many days")
    tc.add_argument("--node", help="the node a node or enroll token is bound to")
    tc.add_argument(
        "--save", type=Path, metavar="FILE", help="also write the token to FILE (mode 600)"
    )
    tc.add_argument("--json", action="store_true", help="print one JSON object")
    remote_args(tc)
    tc.set_defaults(func=cmd_token_create)
    tl = token_sub.add_parser("list", help="every token (never a secret)")
    tl.add_argument("--json", action="store_true")
    remote_args(tl)
    tl.set_defaults(func=cmd_token_list)
    tr = token_sub.add_parser("revoke", help="revoke a token: every request with it is refused")
    tr.add_argument("id", help="the token's id (12 hex digits, `token list` shows it)")
    remote_args(tr)
    tr.set_defaults(func=cmd_token_revoke)

    sp = sub.add_parser("audit", help="the audit log: who did what through the API and the CLI")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--limit", type=int, default=100, help="most rows (default 100)")
    sp.add_argument("--after", type=int, default=0, metavar="ID", help="rows after this id")
    remote_args(sp)
    sp.set_defaults(func=cmd_audit)

    # several hosts: coordinator, agent, node (gpuwarden/cluster/cli.py)
    cluster_cli.add_parsers(sub, remote_args)

    sp = sub.add_parser(
        "types",
        help="list the job types: what each does, whether and how it runs here, its source",
        description="List every job type of the modules found (module_paths, packages "
        "installed with pip, the shipped ones): what it does, its lane and VRAM, whether "
        "this node's launch rules refuse it (and why), whether it runs sandboxed, and "
        "where its module came from.",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    remote_args(sp)
    sp.set_defaults(func=cmd_types)

    sp = sub.add_parser(
        "demo",
        help="run a mixed workload on a simulated GPU, on its own and through gpuwarden",
        description="Run the same mixed workload of burn jobs on a simulated 24 GiB GPU "
        "twice: every job at once, as services on their own do, then through gpuwarden. "
        "Exit 0 when every job finished through gpuwarden and none crashed.",
    )
    sp.add_argument("--jobs", type=int, default=16, help="how many jobs (4-64, default 16)")
    sp.add_argument("--seed", type=int, default=1, help="draws the workload (default 1)")
    sp.add_argument(
        "--json",
        action="store_true",
        help="print the figures as one JSON line on stdout (progress and table go to stderr)",
    )
    sp.add_argument("--keep", action="store_true", help="keep the temporary directory")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser(
        "doctor",
        help="check this host against the config: runtime, GPUs, image, a real sandbox start",
        description="Check this host against the config, one line per check: OK, WARN or "
        "FAIL, what was found and what to do. Exit 0 when no check fails, 1 otherwise "
        "(2: the config cannot be read).",
        allow_abbrev=False,
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    command = _command_parser(parser, args)
    args.options = command.option_names
    if extra and args.command not in ("run-once", "submit"):
        word = next((w for w in extra if w.startswith("-")), None)
        if word is None:
            command.error(f"unexpected argument {extra[0]!r}")
        command.error(unknown_option(word.partition("=")[0], command.option_names))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.func(args)
        return code
    except UserError as exc:
        err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
        return 2
    except GpuwardenError as exc:
        err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
        cause = exc.__cause__
        while cause is not None:
            err.print(f"  caused by: {cause}")
            cause = cause.__cause__
        return 1
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


# -- helpers --------------------------------------------------------------------


#: the options that go before the command (``gpuwarden --state-dir DIR jobs``)
GLOBAL_OPTIONS = ("--config", "--state-dir", "--mock-gpu", "--verbose", "-v")


def _command_parser(parser: Parser, args: argparse.Namespace) -> Parser:
    """The parser of the (sub-)command that ``args`` were parsed for."""
    here = parser
    while here.commands is not None:
        name = getattr(args, here.commands.dest, None)
        nxt = here.commands.choices.get(name) if name else None
        if not isinstance(nxt, Parser):
            break
        here = nxt
    return here


def unknown_option(word: str, options: Sequence[str], params: Sequence[str] = ()) -> str:
    """What to say of ``--word`` that is neither an option of the command nor (for
    ``run-once`` and ``submit``) a parameter of the job type."""
    if word in GLOBAL_OPTIONS and word not in options:
        return (
            f"{word} is a global option: put it before the command, e.g. "
            f"`gpuwarden {word} ... COMMAND`"
        )
    longs = [o for o in options if o.startswith("--")]
    said = f"unknown option {word}"
    return said + did_you_mean(word, [*longs, *params])


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, state_dir=args.state_dir)


def _existing_store(args: argparse.Namespace, config: Config | None = None) -> Store:
    """The store of a state directory a broker has used; never creates one: a
    mistyped ``--state-dir`` is refused, not made into a new, empty store."""
    config = config or _config(args)
    if not config.database and not config.db_path.exists():
        raise UserError(
            f"no gpuwarden state in {config.state_dir}: check --state-dir, --config and "
            f"{STATE_DIR_ENV}; `gpuwarden serve` creates a state directory when it first "
            "starts there"
        )
    return open_store(config)


def _job_params(jobtype: JobType, args: argparse.Namespace) -> dict[str, Any]:
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
    out: dict[str, Any] = {}
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
            out[key] = int(number) if number.is_integer() else number
        else:
            out[key] = value  # an unknown key is refused with the job's other checks
    if labels:
        out["labels"] = labels
    return out


def _spec(registry: Registry, args: argparse.Namespace) -> JobSpec:
    jobtype = registry.get(args.type)
    params = _job_params(jobtype, args)
    spec = JobSpec(
        id=args.job_id or new_job_id(jobtype.name),
        type=jobtype.name,
        params=params,
        inputs=tuple(p.name for p in args.inputs),
        outputs=tuple(args.outputs),
        priority=args.priority,
        vram_bytes=int(args.vram_gib * GIB) if args.vram_gib is not None else None,
        constraints=parse_constraints(args.constraints),
    )
    return prepare(registry, spec)


def _copy_inputs(inputs: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in inputs:
        shutil.copy2(path, dest / path.name)


def _age(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def _print_result(
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
    grid.add_row("message", result.get("message") or result.get("reason") or "")
    if result.get("status") != "done" and result.get("reason"):
        grid.add_row("reason", result["reason"])
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


def _copy_outputs(src: Path, dest: Path) -> None:
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


# -- commands -------------------------------------------------------------------


def cmd_run_once(args: argparse.Namespace) -> int:
    base = load_config(args.config) if args.config else None
    tmp = Path(tempfile.mkdtemp(prefix="gpuwarden-run-"))
    try:
        raw = base.model_dump() if base else {}
        raw.update({"state_dir": tmp / "state", "queue_roots": []})
        config = Config.model_validate(raw)
        if base is None:
            config = config.model_copy(update={"module_paths": load_config(None).module_paths})
        with open_node(
            config,
            mock_gpu=args.mock_gpu,
            events=EventLog(stream=sys.stderr) if args.verbose else NullLog(),
        ) as node:
            spec = _spec(node.broker.registry, args)
            node.broker.check_fits([spec])
            input_dir = tmp / "inputs"
            _copy_inputs(args.inputs, input_dir)
            node.store.submit([spec], now=time.time(), origin=Submission(input_dir=str(input_dir)))
            job = _drive(node.broker, spec.id)
            result = result_json(job, node.store.attempts(job.id))
        outputs: Path | None = None
        if "output_dir" in job.result:
            outputs = tmp / "outputs"
            _copy_outputs(Path(job.result["output_dir"]), outputs)
        _print_result(result, outputs, kept=args.keep)
        if args.keep:
            out.print(f"[bold]kept[/]      {tmp}")
        return 0 if job.state is JobState.DONE else 1
    finally:
        if not args.keep:
            try:  # what the job left there is removed without following a link
                safefs.remove_tree(tmp)
            except (OSError, safefs.UnsafePathError) as exc:
                err.print(f"[yellow]warning:[/] could not remove {tmp}: {escape(str(exc))}")


class Progress:
    """What a command says while it waits for a job: on a terminal, a spinner with
    the job's state and why it waits; without one (piped, in a log), one line on
    stderr, with the time, each time that changes."""

    def __init__(self, first: str) -> None:
        self._spinner = err.status(printable(first), spinner="dots") if err.is_terminal else None
        self._said: str | None = None
        self._first = first

    def __enter__(self) -> Progress:
        if self._spinner is not None:
            self._spinner.start()
        self.update(self._first)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._spinner is not None:
            self._spinner.stop()

    def update(self, text: str) -> None:
        text = printable(text)
        if text == self._said:
            return
        self._said = text
        if self._spinner is not None:
            self._spinner.update(text)
        else:
            err.print(f"{time.strftime('%H:%M:%S')} {text}", markup=False, highlight=False)


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline shown as an escape
    (``\\x1b``): what a job wrote cannot drive the terminal it is shown on."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in "\t\n" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def wait_note(lines: Sequence[str]) -> str:
    """What ``explain`` says about where a job stands, as one line: its lines but
    the first (the state, shown already), the footprint and where the view came
    from (they say nothing new while it waits)."""
    keep = [ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen by"))]
    return "; ".join(keep)


def _progress_text(job_id: str, state: str, note: str) -> str:
    return f"job {job_id}: {state}" + (f": {note}" if note else "")


def _drive(broker: Any, job_id: str) -> Job:
    """Tick the broker until the job ends, saying what it waits for."""
    store = broker.store
    stop = threading.Event()
    try:
        with Progress(f"job {job_id}: starting") as status:
            while True:
                broker.tick()
                job = store.get_job(job_id)
                assert job is not None
                if job.state.terminal:
                    return job  # type: ignore[no-any-return]
                reason = broker.wait_reason(job_id)
                if reason and "this node has no GPU" in reason:
                    raise UserError(
                        f"{job.type} needs a GPU and none was found; "
                        "run with --mock-gpu to use the simulated GPU"
                    )
                status.update(
                    _progress_text(job_id, job.state.value, f"it waits: {reason}" if reason else "")
                )
                stop.wait(0.02)
    finally:
        broker.shutdown(0.0)  # also on Ctrl-C: the job's processes are stopped first


def cmd_serve(args: argparse.Namespace) -> int:
    config = _config(args)
    # a log file keeps a cursor in the state directory: a restart writes the events
    # the last run had not written yet, none twice (SPEC.md section 9, "Event log")
    events = (
        EventLog(args.log, cursor=config.state_dir / CURSOR_FILE)
        if args.log
        else EventLog(stream=sys.stdout)
    )
    stop = threading.Event()
    force = threading.Event()

    node_ref: list[Any] = []

    def on_signal(signum: int, _frame: Any) -> None:
        for n in node_ref:
            n.broker.wake()
        if stop.is_set():
            force.set()
            err.print("second signal: stopping running jobs now")
        else:
            stop.set()
            err.print(
                f"stopping: no new jobs; running jobs get up to "
                f"{config.broker.shutdown_grace_s:g} s (signal again to stop them now)"
            )

    roots = [q.resolve() for q in args.queues]
    address = _parse_address(args.api) if args.api else None
    with open_node(config, mock_gpu=args.mock_gpu, events=events, extra_roots=roots) as node:
        node_ref.append(node)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        b = node.broker
        api = _ApiServer.start(config, b.registry, *address) if address else None
        try:
            err.print(
                f"gpuwarden {__version__} serving on node {config.node_name} "
                f"(PID {os.getpid()})\n"
                f"  state dir   {config.state_dir}\n"
                f"  gpu probe   {node.probe.kind}\n"
                f"  job types   {', '.join(sorted(b.registry.types)) or 'none'}\n"
                f"  queue roots {', '.join(str(r.path) for r in b.roots) or 'none'}\n"
                f"  api         {api.url if api else 'none (serve --api HOST:PORT)'}"
            )
            if api is not None and not api.loopback:
                err.print(
                    "[yellow]warning:[/] the API speaks plain HTTP: tokens cross the network "
                    "in clear text; put it behind a TLS proxy or listen on 127.0.0.1"
                )
            b.recover()
            b.run(stop, force=force)
        finally:
            if api is not None:
                api.stop()
    events.close()
    return 0


def _parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UserError(f"--api {text!r}: give it as HOST:PORT, e.g. 127.0.0.1:8765")
    return host, int(port)


class _ApiServer:
    """The HTTP API on a thread of its own (uvicorn), over its own store connection."""

    def __init__(self, server: Any, thread: threading.Thread, store: Store, url: str) -> None:
        self.server = server
        self.thread = thread
        self.store = store
        self.url = url
        host = url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
        self.loopback = host in ("127.0.0.1", "::1", "localhost")

    @classmethod
    def start(cls, config: Config, registry: Registry, host: str, port: int) -> _ApiServer:
        import uvicorn

        from gpuwarden.api import create_app

        store = open_store(config)
        app = create_app(store, registry, config)
        server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=server.run, name="gpuwarden-api", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                store.close()
                raise UserError(
                    f"the API cannot listen on {host}:{port} (in use, or not an address of "
                    "this host?); see the message above"
                )
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        return cls(server, thread, store, f"http://{shown}:{bound[1]}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.store.close()


def cmd_submit(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            return _submit_http(args, client)
    if args.queue is not None:
        return _submit_to_queue(args)
    config = _config(args)
    store = _existing_store(args, config)
    try:
        # on a coordinator's store (PostgreSQL, or one with enrolled nodes) the
        # nodes' own launch rules decide (checked below), not this host's config
        coordinated = bool(config.database) or _has_nodes(store)
        rules = LaunchRules.unchecked() if coordinated else config.launch_rules
        registry = Registry.load(config.module_paths, rules)
        spec = _spec(registry, args)
        _refuse_if_it_never_fits(spec, registry, store, config)
        _refuse_if_no_node_ever_could(spec, registry, store)
        input_dir = config.state_dir / "inputs" / spec.id
        if args.inputs:
            _copy_inputs(args.inputs, input_dir)
        store.submit(
            [spec],
            now=time.time(),
            origin=Submission(input_dir=str(input_dir) if args.inputs else None),
        )
        out.print(f"submitted {spec.id} ({spec.type}) to {config.state_dir}")
        if not args.wait:
            return 0
        job = _wait_here(store, registry, config, spec.id, args.wait_timeout)
        if not job.state.terminal:
            err.print(f"gave up waiting after {args.wait_timeout:g} s; job is {job.state.value}")
            return 1
        result = result_json(job, store.attempts(job.id))
        outputs = Path(job.result["output_dir"]) if "output_dir" in job.result else None
        if outputs is not None and args.results_dir:
            _copy_outputs(outputs, Path(args.results_dir))
            outputs = Path(args.results_dir)
        _print_result(result, outputs, kept=True)
        return 0 if job.state is JobState.DONE else 1
    finally:
        store.close()


#: how often a waiting command asks again why the job waits (explain's work)
NOTE_EVERY_S = 1.0


def _wait_here(
    store: Store,
    registry: Registry,
    config: Config,
    job_id: str,
    timeout: float,
    *,
    until: Callable[[Job], bool] = lambda job: job.state.terminal,
    first: str = "submitted",
) -> Job:
    """Poll the store until ``until(job)`` (default: the job has ended) or
    ``timeout`` passed; return the job. Says what ``explain`` knows of where it
    stands while it waits (:class:`Progress`)."""
    deadline = time.monotonic() + timeout
    next_note = 0.0
    note = ""
    state: JobState | None = None
    with Progress(f"job {job_id}: {first}") as progress:
        while True:
            job = store.get_job(job_id)
            if job is None:
                raise UserError(f"job {job_id} is no longer in the store of {config.state_dir}")
            if until(job) or time.monotonic() > deadline:
                return job
            if time.monotonic() >= next_note or job.state is not state:
                state = job.state
                status = explain.latest_status(store, time.time())
                view = explain.view_from_status(status, config.broker.cpu_slots) if status else None
                note = wait_note(explain.explain_job(job, store, registry, view))
                next_note = time.monotonic() + NOTE_EVERY_S
            progress.update(_progress_text(job_id, job.state.value, note))
            time.sleep(0.1)


def _refuse_if_it_never_fits(
    spec: JobSpec, registry: Registry, store: Store, config: Config
) -> None:
    """Against the GPUs the running broker last reported (when one runs)."""
    jobtype = registry.get(spec.type)
    status = explain.latest_status(store, time.time())
    if jobtype.lane is not Lane.VRAM or status is None:
        return
    view = explain.view_from_status(status, config.broker.cpu_slots)
    need = explain.effective_footprint(jobtype, spec.vram_bytes, store)
    if (why := never_fits(need, view.gpus)) is not None:
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
        config = _config(args)
        paths, rules = config.module_paths, config.launch_rules
    except GpuwardenError:
        # no usable config here: the broker that reads the queue applies its rules
        paths, rules = load_config(None).module_paths, LaunchRules.unchecked()
    spec = _spec(Registry.load(paths, rules), args)
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
        _print_result(result, args.results_dir, kept=True)
    else:
        with tempfile.TemporaryDirectory(prefix="gpuwarden-") as tmp:
            bundles.extract_outputs(result_path, spec.id, Path(tmp))
            _print_result(
                result, Path(tmp), kept=False, where=f"{result_path.name}:{spec.id}/outputs"
            )
    out.print(f"[bold]result[/]    {result_path}")
    return 0 if result.get("status") == "done" else 1


_Gathered = tuple[list[NodeStatus], dict[JobState, int], str, list[dict[str, Any]] | None]


def cmd_status(args: argparse.Namespace) -> int:
    gathered = _gather_status(args)
    if args.wait is not None:
        deadline = time.monotonic() + args.wait
        where = gathered[2] if gathered else str(_config(args).state_dir)
        if not _broker_up(gathered):
            err.print(f"waiting up to {args.wait:g} s for a broker to report on {where} ...")
        while not _broker_up(gathered) and time.monotonic() < deadline:
            time.sleep(0.2)
            gathered = _gather_status(args)
    if gathered is None:
        err.print(f"no broker has run on state directory {_config(args).state_dir}")
        return 1
    return _report_status(args, *gathered)


def _gather_status(args: argparse.Namespace) -> _Gathered | None:
    """What ``status`` reports, from the API (``--url``) or the state directory;
    None where no broker has made that state directory yet."""
    if (client := _remote(args)) is not None:
        with client:
            data = client.status()
        statuses = [
            NodeStatus(
                node=n["node"],
                pid=n.get("pid"),
                updated_at=n["updated_at"],
                payload={k: v for k, v in n.items() if k not in ("node", "pid", "updated_at")},
            )
            for n in data.get("nodes", [])
        ]
        counts = {JobState(k): int(v) for k, v in data.get("jobs", {}).items()}
        return statuses, counts, client.url, data.get("cluster")
    config = _config(args)
    if not config.database and not config.db_path.exists():
        return None
    store = open_store(config)
    try:
        statuses = store.node_statuses()
        counts = store.count_by_state()
        cluster = None
        if isinstance(store, ClusterStore) and store.list_nodes():
            # a coordinator's store: its agents' reports
            cluster = report.cluster_status(
                store, time.time(), offline_after_s=config.cluster.offline_after_s
            )
    finally:
        store.close()
    return statuses, counts, str(config.state_dir), cluster


def _broker_up(gathered: _Gathered | None) -> bool:
    """Whether ``status --wait`` is done waiting: a broker (or, on a coordinator,
    an enrolled node) reports and reports no problem."""
    if gathered is None:
        return False
    statuses, _, _, cluster = gathered
    if cluster is not None:
        working = [n for n in cluster if n.get("state") != "revoked"]
        return bool(working) and all(not n.get("problem") for n in working)
    return bool(statuses) and not any(_status_problem(s) for s in statuses)


def _status_problem(s: NodeStatus) -> str:
    """What is wrong with one broker's last status, or ``""``."""
    age = time.time() - s.updated_at
    if s.payload.get("stopped"):
        return "the broker has stopped"
    if age > STALE_AFTER_S:
        return f"status is {age:.0f} s old: the broker is not running or is stuck"
    if degraded := s.payload.get("degraded"):
        return f"{len(degraded)} GPU(s) degraded: VRAM admission paused there"
    if s.payload.get("probe_error"):
        return "the GPU probe fails: VRAM admission paused"
    return ""


def _report_status(
    args: argparse.Namespace,
    statuses: list[NodeStatus],
    counts: dict[JobState, int],
    where: str,
    cluster: list[dict[str, Any]] | None = None,
) -> int:
    """Print the status (or ``--json``); 0 when every node is well, else 1. With
    ``cluster`` (a coordinator's enrolled nodes), those nodes are what counts."""
    if args.json:
        data: dict[str, Any] = {
            "nodes": [
                {"node": s.node, "pid": s.pid, "updated_at": s.updated_at, **s.payload}
                for s in statuses
            ],
            "jobs": {k.value: v for k, v in counts.items()},
        }
        if cluster is not None:
            data["cluster"] = cluster
        out.print_json(json.dumps(data))
    healthy = bool(statuses)
    if cluster is not None:
        working = [n for n in cluster if n.get("state") != "revoked"]
        healthy = bool(working) and all(not n.get("problem") for n in working)
        if not working:
            err.print(
                f"no node is enrolled with the coordinator at {where}: "
                "`gpuwarden node invite NAME` makes an enrolment token"
            )
        if not args.json:
            for n in cluster:
                _print_cluster_node(n)
    elif not statuses:
        err.print(f"no broker status in {where}: start `gpuwarden serve`")
    for s in statuses:
        if problem := _status_problem(s):
            healthy = False
        if not args.json:
            _print_status(s.node, s.pid, time.time() - s.updated_at, s.payload, problem)
    if not args.json:
        out.print(
            "jobs: " + (", ".join(f"{k.value} {v}" for k, v in sorted(counts.items())) or "none")
        )
    return 0 if healthy else 1


def _maybe_bytes(value: Any) -> str:
    return "-" if value is None else format_bytes(int(value))


def _print_cluster_node(n: dict[str, Any]) -> None:
    """One enrolled node of a coordinator, as its agent last reported it."""
    name, state, problem = escape(str(n["node"])), str(n["state"]), str(n.get("problem") or "")
    shown = f"[red]{escape(problem)}[/]" if problem else "[green]ok[/]"
    if state == "revoked":
        out.print(f"[bold]node {name}[/]  revoked")
        return
    leased = f", {n['leased']} leased here and waiting" if n.get("leased") else ""
    out.print(
        f"[bold]node {name}[/]  {state}  heartbeat {float(n['heard_s_ago']):.1f} s ago  "
        f"{len(n.get('running', []))} running{leased}  {shown}"
    )
    out.print(
        f"probe: {escape(str(n.get('probe') or '?'))}"
        + (f"  [red]error: {escape(str(n['probe_error']))}[/]" if n.get("probe_error") else "")
    )
    gpus = Table("GPU", "name", "total", "used", "gpuwarden", "free", "state")
    for g in n.get("gpus", []):
        gpus.add_row(
            escape(str(g["uuid"])),
            escape(str(g["name"])),
            format_bytes(int(g["total_bytes"])),
            _maybe_bytes(g.get("used_bytes")),
            _maybe_bytes(g.get("ledger_bytes")),
            _maybe_bytes(g.get("free_bytes")),
            f"[red]degraded: {escape(str(g['degraded']))}[/]" if g.get("degraded") else "ok",
        )
    out.print(gpus if gpus.row_count else "GPUs: none reported")
    warm = Table("warm server", "GPU", "state", "jobs served")
    for w in n.get("warm", []):
        served = w.get("jobs_served")
        warm.add_row(
            escape(str(w["type"])),
            escape(str(w.get("gpu") or "-")),
            escape(str(w.get("state") or "-")),
            "-" if served is None else str(served),
        )
    out.print(warm if warm.row_count else "warm servers: none")
    running = Table("running job", "type", "attempt", "GPU", "for")
    for r in n.get("running", []):
        running.add_row(
            escape(str(r["job"] or "another job")),
            escape(str(r.get("type") or "")),
            str(r.get("attempt") or "-"),
            escape(str(r.get("gpu") or "-")),
            _age(r["started_at"]) if r.get("started_at") else "-",
        )
    out.print(running if running.row_count else "running: none")


def _print_status(node: str, pid: int | None, age: float, p: dict[str, Any], problem: str) -> None:
    state = f"[red]{problem}[/]" if problem else "[green]running[/]"
    out.print(f"[bold]node {node}[/]  PID {pid}  status {age:.1f} s old  {state}")
    out.print(
        f"probe: {p.get('probe')}"
        + (f"  [red]error: {p['probe_error']}[/]" if p.get("probe_error") else "")
    )
    gpus = Table("GPU", "name", "total", "used", "gpuwarden", "others", "reserve", "free", "state")
    holdings = Table("GPU", "job", "type", "VRAM", "shares", "state")
    for g in p.get("gpus", []):
        held = sum(h["bytes"] for h in g.get("holdings", []))
        gpus.add_row(
            g["uuid"],
            g["name"],
            format_bytes(g["total_bytes"]),
            format_bytes(g["used_bytes"]),
            format_bytes(held),
            format_bytes(g.get("foreign_bytes", 0)),
            format_bytes(g.get("reserve_bytes", 0)),
            format_bytes(g.get("free_bytes", 0)),
            f"[red]degraded: {g['degraded']}[/]" if g.get("degraded") else "ok",
        )
        for h in g.get("holdings", []):
            holdings.add_row(
                g["uuid"],
                h.get("job_id") or "-",
                h["type"],
                format_bytes(h["bytes"]),
                "yes" if h["coresident"] else "no",
                h["state"],
            )
    out.print(gpus)
    if holdings.row_count:
        out.print(holdings)
    warm = Table("warm server", "GPU", "state", "VRAM", "jobs served", "load", "idle", "epoch")
    for w in p.get("warm", []):
        warm.add_row(
            w["type"] + (" (kept warm)" if w.get("keep_warm") else ""),
            w["gpu"],
            w["state"],
            format_bytes(w["footprint_bytes"]),
            str(w["jobs_served"]),
            "-" if w["load_s"] is None else f"{w['load_s']:.2f}s",
            "-" if w["idle_s"] is None else f"{w['idle_s']:.0f}s",
            str(w["epoch"]),
        )
    out.print(warm if warm.row_count else "warm servers: none")
    footprints = Table("job type", "declared", "measured", "admitted with")
    for name, f in p.get("footprints", {}).items():
        footprints.add_row(
            name,
            format_bytes(f["declared_bytes"]),
            format_bytes(f["measured_bytes"]) if f["measured_bytes"] else "-",
            format_bytes(f["effective_bytes"]),
        )
    if footprints.row_count:
        out.print(footprints)
    queues = Table("queue root", "inbox", "processing", "outbox", "failed")
    for root, depth in p.get("queues", {}).items():
        queues.add_row(
            root, *(str(depth.get(k, 0)) for k in ("inbox", "processing", "outbox", "failed"))
        )
    if p.get("queues"):
        out.print(queues)
    running = Table("running job", "type", "attempt", "GPU", "for")
    for r in p.get("running", []):
        running.add_row(
            r["job"], r["type"], str(r["attempt"]), r["gpu"] or "-", _age(r["started_at"])
        )
    out.print(running if p.get("running") else "running: none")
    if p.get("waiting"):
        waiting = Table("waiting job", "why")
        for job, why in p["waiting"].items():
            waiting.add_row(job, why)
        out.print(waiting)
    if p.get("last_error"):
        e = p["last_error"]
        out.print(f"[red]last loop error[/] ({_age(e['ts'])} ago, in {e['where']}): {e['message']}")


def cmd_jobs(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            rows = client.list(states=args.state or (), limit=args.limit)
        if args.json:
            out.print_json(json.dumps(rows))
            return 0
        table = Table("job", "state", "type", "attempts", "age", "reason")
        for r in rows:
            table.add_row(
                r["id"], r["state"], r["type"], str(r["attempts"]), _age(r["submitted_at"]),
                r["reason"],
            )  # fmt: skip
        out.print(table if rows else "no jobs")
        return 0
    store = _existing_store(args)
    try:
        states = frozenset(JobState(s) for s in args.state) if args.state else None
        jobs = store.list_jobs(states=states, limit=args.limit)
    finally:
        store.close()
    if args.json:
        out.print_json(json.dumps([_job_json(j) for j in jobs]))
        return 0
    table = Table("job", "state", "type", "attempts", "age", "reason")
    for j in jobs:
        table.add_row(j.id, j.state.value, j.type, str(j.attempts), _age(j.submitted_at), j.reason)
    out.print(table if jobs else "no jobs")
    return 0


def _job_json(j: Job) -> dict[str, Any]:
    return {
        "id": j.id,
        "state": j.state.value,
        "type": j.type,
        "priority": j.priority,
        "attempts": j.attempts,
        "submitted_at": j.submitted_at,
        "updated_at": j.updated_at,
        "reason": j.reason,
        "exit_code": j.exit_code,
        "bundle": j.bundle,
        "params": j.params,
    }


def cmd_show(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            return _show_http(args, client)
    store = _existing_store(args)
    try:
        job = store.get_job(args.job)
        if job is None:
            raise UserError(f"no job with id {args.job!r} (see `gpuwarden jobs`)")
        attempts = store.attempts(job.id)
        events = store.events(job_id=job.id)
    finally:
        store.close()
    if args.json:
        data = _job_json(job)
        data["attempts_detail"] = [
            a.__getstate__() if False else _attempt_json(a) for a in attempts
        ]
        data["events"] = [e.to_json() for e in events]
        out.print_json(json.dumps(data))
        return 0
    out.print(f"[bold]{job.id}[/]  {job.type}  [bold]{job.state.value}[/]  priority {job.priority}")
    if job.reason:
        out.print(f"reason: {job.reason}")
    out.print(f"params: {json.dumps(job.params)}")
    table = Table("attempt", "node", "GPU", "started", "ran", "exit", "outcome", "reason")
    for a in attempts:
        ran = f"{a.ended_at - a.started_at:.2f}s" if a.ended_at else "running"
        table.add_row(
            str(a.number),
            a.node,
            a.gpu_uuid or "-",
            _age(a.started_at) + " ago",
            ran,
            "-" if a.exit_code is None else str(a.exit_code),
            a.outcome or "-",
            a.reason,
        )
    out.print(table)
    _logs_hint(job.id, len(attempts))
    ev = Table("when", "event", "change", "detail")
    for e in events:
        change = f"{e.from_state or ''} -> {e.to_state}" if e.to_state else ""
        ev.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.ts)), e.kind, change, json.dumps(e.detail)
        )
    out.print(ev)
    return 0


def _logs_hint(job_id: str, attempts: int) -> None:
    if attempts:
        more = " --attempt N" if attempts > 1 else ""
        out.print(
            f"output: `gpuwarden logs {job_id}{more}` (stdout; add --stderr for stderr)",
            markup=False,
        )


# -- logs -------------------------------------------------------------------------


class StreamOut:
    """Writes a job's bytes to stdout: as they are when piped; on a terminal as
    text (invalid UTF-8 shown as U+FFFD) with control characters escaped
    (:func:`printable`), so what a job wrote cannot drive the terminal."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> None:
        if self.tty:
            sys.stdout.write(printable(self._decoder.decode(data)))
            sys.stdout.flush()
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        if self.tty:
            sys.stdout.write(printable(self._decoder.decode(b"", final=True)))
        sys.stdout.flush()


def cmd_logs(args: argparse.Namespace) -> int:
    if args.attempt is not None and args.attempt < 1:
        raise UserError(f"--attempt {args.attempt}: attempts are numbered from 1")
    stream = "stderr" if args.stderr else "stdout"
    try:
        if (client := _remote(args)) is not None:
            with client:
                return _logs_http(args, client, stream)
        return _logs_here(args, stream)
    except BrokenPipeError:  # `gpuwarden logs JOB | head`: the reader has had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _not_started(job_id: str, state: str, terminal: bool) -> str:
    """As the API says it (``api.routers.logs.not_started``)."""
    if terminal:
        return f"job {job_id} ended ({state}) without starting: it has no output"
    return (
        f"job {job_id} is {state} and has not started: no output yet "
        f"(`gpuwarden logs --follow {job_id}` waits for it; `gpuwarden explain {job_id}` "
        "says why it waits)"
    )


def _pick(job_id: str, numbers: list[int], wanted: int | None) -> int:
    if wanted is None:
        return numbers[-1]
    if wanted not in numbers:
        have = ", ".join(map(str, numbers))
        raise UserError(f"job {job_id} has no attempt {wanted} (its attempts: {have})")
    return wanted


def _logs_here(args: argparse.Namespace, stream: str) -> int:
    config = _config(args)
    store = _existing_store(args, config)
    try:
        job = store.get_job(args.job)
        if job is None:
            raise UserError(f"no job with id {args.job!r} (see `gpuwarden jobs`)")
        try:
            registry: Registry | None = Registry.load(config.module_paths, config.launch_rules)
        except GpuwardenError:  # the streams are there whatever the modules say now
            registry = None
        if job.attempts == 0 and not job.state.terminal and args.follow and registry is not None:
            job = _wait_here(
                store,
                registry,
                config,
                job.id,
                math.inf,
                until=lambda j: j.attempts > 0 or j.state.terminal,
                first="waiting for it to start",
            )
        attempts = store.attempts(job.id)
        if not attempts:
            raise UserError(_not_started(job.id, job.state.value, job.state.terminal))
        number = _pick(job.id, [a.number for a in attempts], args.attempt)
        attempt = next(a for a in attempts if a.number == number)
        jobs_dir = config.state_dir / "jobs"
        where = joblogs.locate(
            jobs_dir, attempt, stream, node=config.node_name, registry=registry, job_type=job.type
        )
        sink = StreamOut()
        fd = where.fd
        if fd is None and where.later and args.follow:
            fd = _wait_for_file(store, jobs_dir, attempt, stream)
        if fd is None:
            if where.note:
                err.print(where.note, markup=False, highlight=False)
            sink.write(where.copy)
            sink.close()
            return 1 if where.refused else 0
        try:
            if args.follow:
                sink.write_all(
                    joblogs.follow(
                        fd,
                        lambda: _attempt_ended(store, attempt.job_id, attempt.number),
                        sleep=time.sleep,
                        clock=time.monotonic,
                    )
                )
            else:
                sink.write_all(joblogs.read_all(fd))
        finally:
            os.close(fd)
        sink.close()
        if args.follow:
            after = store.get_job(job.id)
            if after is not None:
                _after_follow(after.id, attempt.number, after.attempts, after.state.value,
                              after.state.terminal)  # fmt: skip
    finally:
        store.close()
    return 0


def _attempt_ended(store: Store, job_id: str, number: int) -> bool:
    job = store.get_job(job_id)
    if job is None or job.state.terminal:
        return True
    attempt = next((a for a in store.attempts(job_id) if a.number == number), None)
    return attempt is None or attempt.ended_at is not None


def _wait_for_file(store: Store, jobs_dir: Path, attempt: Any, stream: str) -> int | None:
    """The stream file of a running attempt once the launcher has made it; None if
    the attempt ended first."""
    while True:
        try:
            fd = joblogs.reopen(jobs_dir, attempt, stream)
        except safefs.UnsafePathError as exc:
            raise GpuwardenError(f"{joblogs.file_name(stream)} of attempt {attempt.number} "
                                 f"{exc.why}: it is not read") from None  # fmt: skip
        if fd is not None:
            return fd
        if _attempt_ended(store, attempt.job_id, attempt.number):
            return None
        time.sleep(joblogs.ENDED_EVERY_S)


def _after_follow(job_id: str, number: int, attempts: int, state: str, terminal: bool) -> None:
    """After --follow: say so when the job goes on with another attempt."""
    if not terminal and attempts > number:
        err.print(
            f"attempt {number} ended; job {job_id} runs again as attempt {attempts}: "
            f"`gpuwarden logs --follow {job_id}` follows it",
            markup=False,
        )
    elif not terminal:
        err.print(
            f"attempt {number} ended; job {job_id} is {state} for another attempt: "
            f"`gpuwarden logs --follow {job_id}` follows it",
            markup=False,
        )


def _logs_http(args: argparse.Namespace, client: Any, stream: str) -> int:
    job = client.get(args.job)
    if not job.get("attempts_detail") and args.follow and job["state"] not in TERMINAL_STATES:
        with Progress(f"job {job['id']}: waiting for it to start") as progress:

            def started(j: dict[str, Any]) -> None:
                progress.update(
                    _progress_text(j["id"], j["state"], wait_note(j.get("explain", [])))
                )

            job = client.wait_started(job["id"], progress=started)
    numbers = [int(a["number"]) for a in job.get("attempts_detail", [])]
    if not numbers:
        raise UserError(_not_started(job["id"], job["state"], job["state"] in TERMINAL_STATES))
    number = _pick(job["id"], numbers, args.attempt)
    sink = StreamOut()
    with client.logs(job["id"], stream, attempt=number, follow=args.follow) as got:
        if got.note:
            err.print(got.note, markup=False, highlight=False)
        sink.write_all(got.chunks)
    sink.close()
    if args.follow:
        after = client.get(job["id"])
        _after_follow(after["id"], number, int(after.get("attempts", 0)), after["state"],
                      after["state"] in TERMINAL_STATES)  # fmt: skip
    return 1 if got.refused else 0


#: the states after which a job never changes again
TERMINAL_STATES = frozenset(s.value for s in JobState if s.terminal)


def _attempt_json(a: Any) -> dict[str, Any]:
    return {
        "number": a.number,
        "node": a.node,
        "gpu": a.gpu_uuid,
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "exit_code": a.exit_code,
        "outcome": a.outcome,
        "reason": a.reason,
    }


def cmd_cancel(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            data = client.cancel(args.job)
        if data["state"] == JobState.CANCELLED.value:
            out.print(f"{data['id']} cancelled (it had not started)")
        else:
            out.print(f"{data['id']} is running: the broker will stop it and record it cancelled")
        return 0
    store = _existing_store(args)
    try:
        job = store.request_cancel(args.job, now=time.time())
    finally:
        store.close()
    if job.state is JobState.CANCELLED:
        out.print(f"{job.id} cancelled (it had not started)")
    else:
        out.print(f"{job.id} is running: the broker will stop it and record it cancelled")
    return 0


def cmd_types(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:  # /v1/types: the rows `types --json` gives here, as that host has them
            described = client.types()
        if args.json:
            print(json.dumps({"types": described}, indent=2))
            return 0
        _print_types(described)
        return 0
    config = _config(args)
    registry = Registry.load(config.module_paths, config.launch_rules)
    rules = registry.rules
    described = registry.describe()
    summary = rules.unsandboxed_summary(registry.types.values())
    if args.json:
        doc = {
            "container_runtime": config.container_runtime.value,
            "container_runtime_auto": config.container_runtime_auto or None,
            "types": described,
            "unsandboxed": summary,
            "passed_over": list(registry.passed_over),
        }
        print(json.dumps(doc, indent=2))
        return 0
    out.print(f"container runtime: {config.runtime_shown}", markup=False)
    _print_types(described)
    if summary:
        out.print(summary, markup=False)
    for line in registry.passed_over:
        out.print(f"not used: module {line}", markup=False)
    sources = sorted({str(registry.modules[m].source) for m in registry.modules})
    out.print(f"modules from: {'; '.join(sources) or 'nowhere'}", markup=False)
    return 0


def _print_types(described: list[dict[str, Any]]) -> None:
    """The table of ``types`` and its refusals, from :meth:`Registry.describe` rows
    (the API's ``/v1/types`` rows are the same)."""
    table = Table("type", "lane, launch", "VRAM", "runs here", "from", "what it does; parameters")
    for d in described:
        params = ", ".join(
            f"{p['name']}:{p['type']}{'' if p['required'] else '?'}" for p in d["params"]
        )
        source = d.get("source") or {"kind": "?"}
        shown_from = {"built-in": "built-in", "module_paths": "module_paths"}.get(
            source["kind"], f"pip {source.get('dist', '')}".strip()
        )
        runs = (d.get("runs_as") or "runs") if d["runs_here"] else "[red]REFUSED[/]"
        if d.get("unsandboxed"):
            runs = "[yellow]UNSANDBOXED[/]"
        what = escape(d["description"] or "-") + (f"\n[dim]{escape(params)}[/]" if params else "")
        table.add_row(
            escape(d["type"]),
            f"{d['lane']}, {d['launch']}",
            format_bytes(d["vram_bytes"]) if d["vram_bytes"] else "-",
            runs,
            escape(shown_from),
            what,
        )
    out.print(table)
    refused: dict[str, list[str]] = {}  # one line per reason: they differ only in the name
    for d in described:
        if d.get("refused"):
            refused.setdefault(d["refused"].replace(d["type"], "\0"), []).append(d["type"])
    for why, names in refused.items():
        shown = why.replace("\0", "each" if names[1:] else names[0])
        out.print(f"REFUSED here: {', '.join(names)}: {shown}", markup=False)


def cmd_explain(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            for line in client.explain(args.job):
                out.print(line, markup=False)
        return 0
    config = _config(args)
    store = _existing_store(args)
    try:
        job = store.get_job(args.job)
        if job is None:
            raise UserError(f"no job with id {args.job!r} (see `gpuwarden jobs`)")
        registry = Registry.load(config.module_paths, config.launch_rules)
        status = explain.latest_status(store, time.time())
        view = explain.view_from_status(status, config.broker.cpu_slots) if status else None
        for line in explain.explain_job(job, store, registry, view):
            out.print(line, markup=False)
    finally:
        store.close()
    return 0


def cmd_preview(args: argparse.Namespace) -> int:
    config = _config(args)
    registry = Registry.load(config.module_paths, config.launch_rules)
    jobtype = registry.get(args.type)
    override = int(args.vram_gib * GIB) if args.vram_gib is not None else None
    if override is not None and jobtype.lane is not Lane.VRAM:
        raise ValidationError(f"{jobtype.name} runs on the cpu lane; --vram-gib does not apply")
    if (refused := explain.refused_line(registry, jobtype)) is not None:
        # what `submit` would answer, before any GPU's room matters
        out.print(f"{jobtype.name} {refused}", markup=False)
        return 0
    store = open_store(config) if config.database or config.db_path.exists() else None
    try:
        status = explain.latest_status(store, time.time()) if store else None
        if status is not None:
            view = explain.view_from_status(status, config.broker.cpu_slots)
            warm_types = frozenset(w.type for w in view.warm)
            queued = explain.queued_entries(store, registry, warm_types) if store else []
        else:
            probe = make_probe(config, mock_gpu=args.mock_gpu)
            try:
                reserve = int(config.vram.reserve_gib * GIB)
                view = explain.view_from_probe(probe, reserve, config.broker.cpu_slots)
            finally:
                probe.close()
            queued = explain.queued_entries(store, registry) if store else []
        need = 0
        if jobtype.lane is Lane.VRAM:
            measured = store.footprints().get(jobtype.name) if store else None
            need = max(override or jobtype.vram_bytes, measured.bytes if measured else 0)
        me = QueuedJob(
            id=explain.PREVIEW_ID,
            type=jobtype.name,
            lane=jobtype.lane,
            vram_bytes=need,
            priority=args.priority,
            seq=max((q.seq for q in queued), default=0) + 1,
            coresident=jobtype.coresident,
            serve=jobtype.launch is LaunchMode.SERVE,
            warm=any(w.type == jobtype.name for w in view.warm),
        )
        decision = explain.decide(view, [*queued, me], me.id)
    finally:
        if store is not None:
            store.close()
    if jobtype.lane is Lane.VRAM:
        out.print(f"{jobtype.name}: footprint {format_bytes(need)}", markup=False)
    out.print(f"{explain.describe(decision)}", markup=False)
    out.print(explain.sandbox_line(registry, jobtype), markup=False)
    out.print(f"(as seen by the {view.source}; {len(queued)} job(s) queued ahead or around it)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gpuwarden.tools.demo import run_demo

    return run_demo(
        err if args.json else out,
        seed=args.seed,
        jobs=args.jobs,
        json_out=sys.stdout if args.json else None,
        keep=args.keep,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    from gpuwarden.tools.doctor import run_doctor

    return run_doctor(
        args.config,
        state_dir=args.state_dir,
        mock_gpu=args.mock_gpu,
        console=out,
        json_out=args.json,
    )


def cmd_gpu_clear(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            client.clear_gpu(args.uuid)
        out.print(
            f"asked the broker at {client.url} to clear the fault on {args.uuid}; "
            "`gpuwarden status` shows it",
            markup=False,
        )
        return 0
    store = _existing_store(args)
    try:
        status = explain.latest_status(store, time.time())
        known = {g["uuid"] for g in status.payload.get("gpus", [])} if status else set()
        if status is not None and args.uuid not in known:
            raise UserError(
                f"no GPU {args.uuid} on the running broker; its GPUs: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        store.request_gpu_clear(args.uuid, now=time.time())
    finally:
        store.close()
    out.print(f"asked the broker to clear the fault on {args.uuid}; `gpuwarden status` shows it")
    return 0


# -- the HTTP API: tokens, audit, and the commands that talk to a remote broker ---------


def _remote(args: argparse.Namespace) -> Any:
    """A :class:`gpuwarden.client.Client` when ``--url`` (or GPUWARDEN_URL) is given."""
    if not getattr(args, "url", None):
        return None
    if not str(args.url).startswith(("http://", "https://")):
        raise UserError(f"--url {args.url!r}: give the API's address, e.g. http://HOST:8765")
    from gpuwarden.client import Client

    return Client(args.url, _read_token(args.token_file))


def _read_token(path: Path) -> str:
    """The token from GPUWARDEN_TOKEN, else from ``path``, which only its owner may read."""
    if token := os.environ.get(TOKEN_ENV, "").strip():
        return token
    path = path.expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise UserError(
            f"no token: set {TOKEN_ENV}, or write the token to {path} (chmod 600); "
            "the broker's owner makes one with `gpuwarden token create NAME --role ROLE`"
        ) from None
    except OSError as exc:
        raise UserError(f"token file {path} cannot be read: {exc.strerror}") from None
    if mode & 0o077:
        raise UserError(
            f"token file {path} can be read by others (mode {mode & 0o777:o}): "
            f"run `chmod 600 {path}` and try again"
        )
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"token file {path} cannot be read: {exc}") from None
    if not token:
        raise UserError(f"token file {path} is empty")
    return token


def _remote_jobtype(client: Any, name: str) -> JobType:
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


def _submit_http(args: argparse.Namespace, client: Any) -> int:
    if args.queue is not None:
        raise UserError("--queue and --url do not go together: choose one way to submit")
    if args.inputs:
        raise UserError(
            "file inputs are not sent over HTTP yet: submit with --queue DIR, "
            "or on the broker's host without --url"
        )
    jobtype = _remote_jobtype(client, args.type)
    params = _job_params(jobtype, args)
    job = client.submit(
        jobtype.name,
        params,
        id=args.job_id,
        priority=args.priority,
        vram_gib=args.vram_gib,
        outputs=args.outputs,
        constraints=parse_constraints(args.constraints),
    )
    out.print(f"submitted {job['id']} ({job['type']}) to {client.url}")
    if not args.wait:
        return 0
    with Progress(f"job {job['id']}: submitted") as status:

        def progress(j: dict[str, Any]) -> None:
            status.update(_progress_text(j["id"], j["state"], wait_note(j.get("explain", []))))

        try:
            client.wait(job["id"], timeout=args.wait_timeout, progress=progress, explain=True)
        except TimeoutError:
            err.print(f"gave up waiting after {args.wait_timeout:g} s")
            return 1
    result = client.result(job["id"])
    if args.results_dir:
        for rel in result.get("outputs", []):
            client.download(job["id"], rel, args.results_dir / rel)
        _print_result(result, args.results_dir, kept=True)
    else:
        with tempfile.TemporaryDirectory(prefix="gpuwarden-") as tmp:
            for rel in result.get("outputs", []):
                client.download(job["id"], rel, Path(tmp) / rel)
            _print_result(
                result, Path(tmp), kept=False, where=f"{client.url}/v1/jobs/{job['id']}/outputs"
            )
    return 0 if result.get("status") == "done" else 1


def _show_http(args: argparse.Namespace, client: Any) -> int:
    data = client.get(args.job)
    if args.json:
        out.print_json(json.dumps(data))
        return 0
    out.print(
        f"[bold]{escape(data['id'])}[/]  {escape(data['type'])}  [bold]{data['state']}[/]  "
        f"priority {data['priority']}"
    )
    if data.get("reason"):
        out.print(f"reason: {data['reason']}", markup=False)
    out.print(f"params: {json.dumps(data['params'])}", markup=False)
    table = Table("attempt", "node", "GPU", "started", "ran", "exit", "outcome", "reason")
    for a in data.get("attempts_detail", []):
        ran = f"{a['ended_at'] - a['started_at']:.2f}s" if a.get("ended_at") else "running"
        table.add_row(
            str(a["number"]),
            a["node"],
            a.get("gpu") or "-",
            _age(a["started_at"]) + " ago",
            ran,
            "-" if a.get("exit_code") is None else str(a["exit_code"]),
            a.get("outcome") or "-",
            a.get("reason", ""),
        )
    out.print(table)
    _logs_hint(data["id"], len(data.get("attempts_detail", [])))
    ev = Table("when", "event", "change", "detail")
    for e in data.get("events", []):
        rest = {k: v for k, v in e.items() if k not in ("ts", "event", "job", "from", "to")}
        change = f"{e.get('from') or ''} -> {e['to']}" if e.get("to") else ""
        ev.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["ts"])), e["event"], change, json.dumps(rest)
        )
    out.print(ev)
    return 0


def _local_actor() -> Any:
    import getpass

    from gpuwarden.api.auth import local_principal

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return local_principal(user)


def cmd_token_create(args: argparse.Namespace) -> int:
    from gpuwarden.api.auth import TOKEN_NAME, issue_token

    if not TOKEN_NAME.fullmatch(args.name):
        raise UserError(
            f"token name {args.name!r}: use 1-64 letters, digits, spaces, '.', '_', '@' or "
            "'-', starting with a letter or digit"
        )
    if args.expires_days is not None and not 0 < args.expires_days <= 3660:
        raise UserError("--expires-days must be more than 0 and at most 3660")
    new_store = ""
    try:
        client = _remote(args)
    except UserError as exc:  # the first token cannot come through the API
        raise UserError(
            f"{exc.message}; the first token is made in the store, without --url "
            f"(unset {URL_ENV}): `gpuwarden token create NAME --role owner`"
        ) from None
    if client is not None:
        with client:
            made = client.create_token(
                args.name,
                args.role,
                expires_in_s=args.expires_days * 86400 if args.expires_days is not None else None,
                node=args.node,
            )
        token_id, name, role, token = made["id"], made["name"], made["role"], made["token"]
    else:
        now = time.time()
        expires_at = now + args.expires_days * 86400 if args.expires_days is not None else None
        config = _config(args)
        if not config.database and not config.db_path.exists():
            new_store = (
                f"; it is in a new store in {config.state_dir}: start `gpuwarden serve` "
                "with this state directory for the API to know it"
            )
        store = open_store(config)  # the first token may come before the first `serve`
        try:
            record, token = issue_token(
                store,
                name=args.name,
                role=Role(args.role),
                by=_local_actor(),
                now=now,
                expires_at=expires_at,
                node=args.node,
            )
        finally:
            store.close()
        token_id, name, role = record.id, record.name, record.role.value
    if args.save is not None:
        _save_token(args.save.expanduser(), token)
    if args.json:
        print(json.dumps({"id": token_id, "name": name, "role": role, "token": token}))
        return 0
    err.print(
        f"token {token_id} for {name} (role {role}); it is shown once, keep it secret"
        + (f"; saved to {args.save}" if args.save else "")
        + new_store,
        markup=False,
    )
    print(token)
    return 0


def _save_token(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def _token_json(t: Any, now: float) -> dict[str, Any]:
    """A token record as the API shows it (``GET /v1/tokens``)."""
    return {
        "id": t.id,
        "name": t.name,
        "role": t.role.value,
        "created_at": t.created_at,
        "created_by": t.created_by,
        "expires_at": t.expires_at,
        "revoked_at": t.revoked_at,
        "node": t.node,
        "active": t.active(now),
    }


def cmd_token_list(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            rows = client.tokens()
    else:
        store = _existing_store(args)
        try:
            tokens = store.list_tokens()
        finally:
            store.close()
        now = time.time()
        rows = [_token_json(t, now) for t in tokens]
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table("id", "name", "role", "created", "by", "expires", "state")
    for t in rows:
        if t.get("revoked_at") is not None:
            state = f"revoked {_age(t['revoked_at'])} ago"
        elif not t.get("active"):
            state = "expired"
        else:
            state = "active"
        expires = t.get("expires_at")
        table.add_row(
            escape(str(t["id"])),
            escape(printable(str(t["name"]))),
            escape(str(t["role"])),
            _age(t["created_at"]) + " ago",
            escape(printable(str(t["created_by"]))),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(expires)) if expires else "-",
            state,
        )
    out.print(table if rows else "no tokens (make one: gpuwarden token create NAME --role ROLE)")
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            revoked = client.revoke_token(args.id)
        out.print(
            f"revoked token {revoked['id']} ({revoked['name']}); requests with it are refused now",
            markup=False,
        )
        return 0
    store = _existing_store(args)
    try:
        record = store.get_token(args.id)
        actor = _local_actor()
        now = time.time()
        if record is None:
            raise UserError(f"no token with id {args.id!r} (see `gpuwarden token list`)")
        if not store.revoke_token(record.id, now=now):
            raise UserError(f"token {record.id} ({record.name}) was revoked already")
        store.add_audit(
            actor.audit(
                "token.revoke",
                now=now,
                target=record.id,
                detail={"name": record.name, "role": record.role.value},
            )
        )
    finally:
        store.close()
    out.print(
        f"revoked token {record.id} ({record.name}); requests with it are refused now",
        markup=False,
    )
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    if (client := _remote(args)) is not None:
        with client:
            rows = client.audit(after_id=args.after, limit=args.limit)
    else:
        store = _existing_store(args)
        try:
            found = store.audit_rows(after_id=args.after, limit=args.limit)
        finally:
            store.close()
        rows = [
            {
                "id": r.id,
                "ts": r.ts,
                "actor": r.actor,
                "actor_name": r.actor_name,
                "role": r.role,
                "action": r.action,
                "target": r.target,
                "outcome": r.outcome,
                "detail": r.detail,
            }
            for r in found
        ]
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table("id", "when", "actor", "role", "action", "target", "outcome")
    for r in rows:
        name = str(r["actor_name"])
        actor = name if r["actor"] in ("-", "local") else f"{name} ({r['actor']})"
        table.add_row(
            str(r["id"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])),
            escape(printable(actor)),
            escape(str(r["role"])),
            escape(str(r["action"])),
            escape(printable(str(r["target"]))),
            escape(printable(str(r["outcome"]))),
        )
    out.print(table if rows else "no audit rows")
    return 0
