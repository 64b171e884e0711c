"""The ``gpuwarden`` command line: one small function per sub-command, one module
per group of them (:mod:`.node`, :mod:`.submit`, :mod:`.status`, :mod:`.top`, :mod:`.jobs`,
:mod:`.jobctl`, :mod:`.logs`, :mod:`.tokens`, :mod:`.cluster`, :mod:`.tools`), and what they share
in :mod:`.common`: the global options, the config, the consoles, the choice
between the local store and the HTTP API, and errors as exit statuses.

Every global flag can also come from the environment (shown in ``--help``).
``main(argv)`` is callable from tests; a user's mistake prints one clear line,
never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gpuwarden.cli import (
    cluster,
    events,
    jobctl,
    jobs,
    lease,
    logs,
    node,
    run,
    runtimes,
    share,
    status,
    submit,
    tokens,
    tools,
    top,
)
from gpuwarden.cli.common import (
    Parser,
    add_global_options,
    command_parser,
    run_command,
    unknown_option,
)

__all__ = ["build_parser", "main"]

#: the commands in the order ``--help`` lists them (and argparse's "choose from")
COMMANDS = (
    "run",
    "run-once",
    "serve",
    "submit",
    "lease",
    "status",
    "top",
    "jobs",
    "show",
    "logs",
    "events",
    "cancel",
    "stop",
    "hold",
    "release",
    "requeue",
    "priority",
    "explain",
    "share",
    "preview",
    "gpu",
    "token",
    "audit",
    "coordinator",
    "agent",
    "node",
    "types",
    "runtimes",
    "demo",
    "doctor",
)

#: each command with what adds its parser, from the module of its group
_PARSERS = {
    **node.PARSERS,
    **run.PARSERS,
    **submit.PARSERS,
    **lease.PARSERS,
    **status.PARSERS,
    **top.PARSERS,
    **jobs.PARSERS,
    **jobctl.PARSERS,
    **logs.PARSERS,
    **events.PARSERS,
    **tokens.PARSERS,
    **cluster.PARSERS,
    **tools.PARSERS,
    **runtimes.PARSERS,
    **share.PARSERS,
}
assert sorted(_PARSERS) == sorted(COMMANDS), "COMMANDS lists each command once"

#: the commands whose unknown ``--NAME`` words are the job's parameters
_TAKE_PARAMS = ("run-once", "submit")


def build_parser() -> Parser:
    p = Parser(
        prog="gpuwarden",
        description="A GPU job broker: a durable queue, VRAM admission, sandboxed launches.",
        allow_abbrev=False,
    )
    add_global_options(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _PARSERS[name](sub)
    return p


#: the commands that take a command line after ``--`` (SPEC.md, "Command jobs")
_TAKE_COMMAND = ("run", "submit")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    args, extra = _parse(parser, words)
    args.extra = extra
    command = command_parser(parser, args)
    args.options = command.option_names
    if extra and args.command not in _TAKE_PARAMS:
        word = next((w for w in extra if w.startswith("-")), None)
        if word is None:
            command.error(f"unexpected argument {extra[0]!r}")
        command.error(unknown_option(word.partition("=")[0], command.option_names))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_command(args)


def _parse(parser: Parser, words: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and for ``run`` and ``submit`` the command after the first
    ``--`` (``args.command_argv``: the words after it are the command's own)."""
    if "--" in words:
        cut = words.index("--")
        args, extra = parser.parse_known_args(words[:cut])
        if args.command in _TAKE_COMMAND:
            args.command_argv = words[cut + 1 :]
            return args, extra
    args, extra = parser.parse_known_args(words)
    args.command_argv = None
    return args, extra
