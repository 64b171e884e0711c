"""``gpuwarden demo`` and ``gpuwarden doctor``: the commands of
:mod:`gpuwarden.tools`, which show what gpuwarden does and check a host for it."""

from __future__ import annotations

import argparse
import sys

from gpuwarden.cli.common import Commands, err, out
from gpuwarden.tools.demo import run_demo
from gpuwarden.tools.doctor import run_doctor


def _add_demo(sub: Commands) -> None:
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


def _add_doctor(sub: Commands) -> None:
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


#: the commands of this module, each with what adds its parser
PARSERS = {"demo": _add_demo, "doctor": _add_doctor}


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(
        err if args.json else out,
        seed=args.seed,
        jobs=args.jobs,
        json_out=sys.stdout if args.json else None,
        keep=args.keep,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    return run_doctor(
        args.config,
        state_dir=args.state_dir,
        mock_gpu=args.mock_gpu,
        console=out,
        json_out=args.json,
    )
