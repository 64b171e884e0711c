"""The ``gpuwarden`` command line: one small function per sub-command, one module
per group of them (:mod:`.node`, :mod:`.submit`, :mod:`.status`, :mod:`.top`, :mod:`.jobs`,
:mod:`.logs`, :mod:`.tokens`, :mod:`.cluster`, :mod:`.tools`), and what they share
in :mod:`.common`: the global options, the config, the consoles, the choice
between the local store and the HTTP API, and errors as exit statuses.

Every global flag can also come from the environment (shown in ``--help``).
``main(argv)`` is callable from tests; a user's mistake prints one clear line,
never a traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from gpuwarden.cli import (
    cluster,
    events,
    jobs,
    lease,
    logs,
    node,
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
    **submit.PARSERS,
    **lease.PARSERS,
    **status.PARSERS,
    **top.PARSERS,
    **jobs.PARSERS,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
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
