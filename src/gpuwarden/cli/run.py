"""``gpuwarden run -- CMD`` and ``gpuwarden submit -- CMD``: any command is a job
(SPEC.md, "Command jobs").

``run`` queues the command, says why it waits while it waits, streams its
stdout and stderr as it runs, and exits with its exit status; Ctrl-C cancels
it. ``submit`` queues it and prints its id. Both reach the broker through its
local socket (:mod:`gpuwarden.api.localsock`), where the kernel tells the
broker who submits; with no broker listening, a user who may write the store
(root, the state directory's owner) queues it there directly and it runs when
a broker starts.
"""

from __future__ import annotations

import argparse
import base64
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuwarden.api import localsock
from gpuwarden.cli.common import (
    Commands,
    Progress,
    add_remote_options,
    config_of,
    err,
    existing_store,
    out,
    progress_text,
    remote,
)
from gpuwarden.client import Client
from gpuwarden.config import Config
from gpuwarden.core import command
from gpuwarden.core.states import JobState
from gpuwarden.core.units import parse_bytes, parse_duration
from gpuwarden.errors import UserError, ValidationError
from gpuwarden.registry import Registry

#: the exit status of a ``run`` whose job was cancelled by Ctrl-C (as a shell's)
CANCELLED_STATUS = 130
#: what a job that failed without an exit status of its own exits ``run`` with
FAILED_STATUS = 1

OnMessage = Callable[[dict[str, Any]], None]


def add_command_options(sp: argparse.ArgumentParser, *, with_job_options: bool) -> None:
    """The options of a command job, in human units. ``with_job_options``: also
    those ``submit`` already has for every job (``--id``, ``--priority``, ...)."""
    if with_job_options:
        sp.add_argument("--id", dest="job_id", help="job id (default: NAME-<random>)")
        sp.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
        sp.add_argument("--gpus", type=int, metavar="N", help="GPUs of one node it holds at once")
        sp.add_argument(
            "--after", action="append", default=[], metavar="KIND:ID",
            help="a job this one waits for: afterok:ID, afternotok:ID, afterany:ID (repeatable)",
        )  # fmt: skip
    sp.add_argument("--vram", metavar="SIZE", help="its VRAM footprint on each GPU: 10G, 512M")
    sp.add_argument("--ram", metavar="SIZE", help="its RAM cap, enforced by the kernel: 4G")
    sp.add_argument("--est", metavar="TIME", help="how long it is expected to run: 10m, 2h")
    sp.add_argument("--timeout", metavar="TIME", help="stop it after this long: 30m, 2h")
    sp.add_argument(
        "--name", help="what its measured peaks are kept under (default: the program's name)"
    )
    sp.add_argument(
        "--env", action="append", default=[], metavar="K=V",
        help="set an environment variable for the command (repeatable); it starts clean",
    )  # fmt: skip
    sp.add_argument(
        "--export-env", nargs="?", const="ALL", metavar="NAMES",
        help="pass this shell's environment: all of it, or the comma-separated NAMES",
    )  # fmt: skip
    sp.add_argument(
        "--share-gpu", action="store_true",
        help="it may share its GPU with other co-resident jobs (default: a GPU to itself)",
    )  # fmt: skip
    sp.add_argument(
        "--preemptible", nargs="?", const="SIGUSR1", metavar="SIGNAL",
        help="it may be asked to checkpoint (SIGNAL, default SIGUSR1; exit 6) and yield",
    )  # fmt: skip
    sp.add_argument(
        "--array", metavar="SPEC",
        help="one job per index (GPUWARDEN_ARRAY_INDEX): 0-99, 1,3,5; %%4: at most 4 at once",
    )  # fmt: skip


def _add_run(sub: Commands) -> None:
    sp = sub.add_parser(
        "run",
        help="run a command as a job and stream its output (like srun)",
        description="Queue CMD as a job, say why it waits, stream its output as it runs, "
        "and exit with its exit status. Ctrl-C cancels it. Example: "
        "gpuwarden run --vram 10G -- python3 train.py",
        allow_abbrev=False,
    )
    add_command_options(sp, with_job_options=True)
    add_remote_options(sp)
    sp.set_defaults(func=cmd_run)


#: the commands of this module, each with what adds its parser
PARSERS = {"run": _add_run}


# -- the request -----------------------------------------------------------------


def command_request(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The local socket's submit request for ``argv`` and the options."""
    try:
        body: dict[str, Any] = {
            "op": "submit",
            "argv": argv,
            "cwd": str(Path.cwd()),
            "env": _env(args),
            "name": args.name,
            "id": args.job_id,
            "priority": args.priority,
            "gpus": args.gpus,
            "after": list(args.after),
            "vram_bytes": _size(args.vram, "--vram"),
            "ram_bytes": _size(args.ram, "--ram"),
            "est_s": None if args.est is None else parse_duration(args.est, option="--est"),
            "timeout_s": None
            if args.timeout is None
            else parse_duration(args.timeout, option="--timeout", example="2h"),
            "share": args.share_gpu,
            "preempt": _signal(args.preemptible),
            "array": None if args.array is None else parse_array(args.array),
        }
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    try:  # said here, before the broker is asked (it checks again)
        command.check_command(argv, body["env"], body["cwd"], sandboxed=False)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    if body["vram_bytes"] is None and getattr(args, "vram_gib", None) is not None:
        body["vram_bytes"] = int(args.vram_gib * (1 << 30))
    if body["est_s"] is None and getattr(args, "est_s", None) is not None:
        body["est_s"] = args.est_s
    return body


def _size(text: str | None, option: str) -> int | None:
    return None if text is None else parse_bytes(text, option=option)


def _env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    if args.export_env is not None:
        names = None if args.export_env == "ALL" else set(args.export_env.split(","))
        env.update(
            (k, v)
            for k, v in os.environ.items()
            if (names is None or k in names)
            and k not in command.RESERVED_ENV
            and not k.startswith(command.RESERVED_ENV_PREFIX)
        )
    for item in args.env:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValidationError(f"--env {item!r}: write it as NAME=VALUE")
        env[key] = value
    return env


def _signal(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
    if name not in command.SIGNALS:
        raise ValueError(f"--preemptible={value}: one of {', '.join(command.SIGNALS)}")
    return name


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_array(spec: str) -> dict[str, Any]:
    """``0-99``, ``1,3,5``, ``0-9,20`` with an optional ``%N`` (at most N at once)."""
    text, pct, limit_text = spec.partition("%")
    indices: list[int] = []
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"--array {spec}: write it as 0-99, 1,3,5 or 0-99%4")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low or high - low >= localsock.MAX_ARRAY:
            raise ValueError(f"--array {spec}: {part} is not a range from low to high")
        indices.extend(range(low, high + 1))
    limit = 0
    if pct:
        if not limit_text.isdigit() or int(limit_text) < 1:
            raise ValueError(f"--array {spec}: after % give how many may run at once, e.g. %4")
        limit = int(limit_text)
    if len(set(indices)) != len(indices) or len(indices) > localsock.MAX_ARRAY:
        raise ValueError(f"--array {spec}: at most {localsock.MAX_ARRAY} distinct indices")
    return {"indices": indices, "limit": limit}


# -- the way to the broker ----------------------------------------------------------


class Link:
    """The broker's local socket, or (no broker listening) the store itself."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config: Config = config_of(args)
        self.path = localsock.socket_path(self.config)
        self.session: localsock.LocalSession | None = None
        self.user = localsock.local_user(os.getuid(), os.getgid())
        if not localsock.listening(self.path):
            self.session = self._here()

    def _here(self) -> localsock.LocalSession:
        try:
            store = existing_store(self.args, self.config)
        except UserError as exc:
            raise UserError(
                f"no broker listens on {self.path} and the store cannot be used here "
                f"({exc.message}): start one with `gpuwarden serve`, or ask its operator"
            ) from None
        registry = Registry.load(self.config.module_paths, self.config.launch_rules)
        err.print(
            f"[yellow]note:[/] no broker listens on {self.path}: the job is queued in the "
            f"store of {self.config.state_dir} and runs when one starts (`gpuwarden serve`)"
        )
        return localsock.LocalSession(store, registry, self.config)

    def close(self) -> None:
        if self.session is not None:
            self.session.store.close()

    def request(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The answers to ``body``, one message at a time; an error message raises."""
        if self.session is not None:
            yield from self._in_process(body)
            return
        yield from localsock.ask(self.path, body)

    def _in_process(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        session = self.session
        assert session is not None
        if body["op"] == "submit":
            yield {"ids": session.submit(body, self.user)}
        elif body["op"] == "cancel":
            yield {"state": session.cancel(body["id"], self.user).state.value}
        else:  # follow: the session's messages as it sends them, from a thread
            messages: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()

            def follow() -> None:
                try:
                    session.follow(body["id"], self.user, messages.put)
                except BaseException as exc:  # handed to the reader, raised there
                    messages.put(exc)

            threading.Thread(target=follow, name="follow", daemon=True).start()
            while True:
                message = messages.get()
                if isinstance(message, BaseException):
                    raise message
                yield message
                if "end" in message:
                    return


class HttpLink:
    """The HTTP API (``--url``): the same requests as :class:`Link`'s, answered by
    the API. The command runs sandboxed there (SPEC.md, "Command jobs over HTTP,
    bundles and agents"): no working directory, no local user; its ``--want``
    files are fetched as any job's."""

    def __init__(self, args: argparse.Namespace, client: Client) -> None:
        self.args = args
        self.client = client
        self.path = client.url

    def close(self) -> None:
        self.client.close()

    def request(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if body["op"] == "submit":
            yield {"ids": [self._submit(body)]}
        elif body["op"] == "cancel":
            yield {"state": self.client.cancel(body["id"])["state"]}
        else:
            yield from _HttpFollower(self.client, str(body["id"])).messages()

    def _submit(self, body: dict[str, Any]) -> str:
        if body.get("array") is not None:
            raise UserError(
                "--array is not sent over HTTP yet: submit each index, or run on the host"
            )
        gib = 1 << 30
        job: dict[str, Any] = {
            k: body[k] for k in ("id", "est_s", "gpus") if body.get(k) is not None
        }
        if body.get("vram_bytes") is not None:
            job["vram_gib"] = body["vram_bytes"] / gib
        if body.get("ram_bytes"):
            job["ram_gib"] = body["ram_bytes"] / gib
        made = self.client.submit_command(
            body["argv"],
            name=body.get("name"),
            env=body.get("env") or {},
            share_gpu=bool(body.get("share")),
            preempt=body.get("preempt"),
            timeout_s=body.get("timeout_s"),
            priority=body.get("priority", 0),
            after=list(body.get("after") or ()),
            outputs=list(getattr(self.args, "outputs", None) or ()),
            **job,
        )
        return str(made["id"])


class _HttpFollower:
    """``follow`` over HTTP: why the job waits (``explain``) while it is queued,
    each attempt's stdout and stderr as the logs API sends them (``follow``), then
    its end."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.note = ""
        self.shown = 0  # the last attempt whose streams were read

    def messages(self) -> Iterator[dict[str, Any]]:
        while True:
            job = self.client.get(self.job_id)
            attempts = [a["number"] for a in job.get("attempts_detail") or []]
            if attempts and attempts[-1] > self.shown:
                self.shown = attempts[-1]
                yield from self._streams(self.shown)
                continue
            if job["state"] in TERMINAL:
                yield {"end": {k: job.get(k) for k in ("state", "exit_code", "reason")}}
                return
            if job["state"] == "queued":
                lines = self.client.explain(self.job_id)
                keep = [ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen"))]
                if (note := "; ".join(keep)) != self.note:
                    self.note = note
                    yield {"waiting": note}
            time.sleep(HTTP_POLL_S)

    def _streams(self, attempt: int) -> Iterator[dict[str, Any]]:
        """Attempt ``attempt``'s two streams at once, until it has ended."""
        got: queue.Queue[dict[str, Any] | BaseException | None] = queue.Queue()

        def read(name: str) -> None:
            try:
                with self.client.logs(self.job_id, name, attempt=attempt, follow=True) as s:
                    for chunk in s.chunks:
                        got.put({name: base64.b64encode(chunk).decode()})
            except BaseException as exc:  # handed to the reader, raised there
                got.put(exc)
            got.put(None)

        for name in ("stdout", "stderr"):
            threading.Thread(target=read, args=(name,), name=f"logs-{name}", daemon=True).start()
        done = 0
        while done < 2:
            message = got.get()
            if message is None:
                done += 1
            elif isinstance(message, BaseException):
                raise message
            else:
                yield message


#: the states a job ends in, and how often ``run --url`` asks about a job
TERMINAL = frozenset(s.value for s in JobState if s.terminal)
HTTP_POLL_S = 0.5


def _link(args: argparse.Namespace) -> Link | HttpLink:
    """The broker's local socket (or its store), or with ``--url`` its HTTP API."""
    client = remote(args)
    return Link(args) if client is None else HttpLink(args, client)


# -- run and submit ----------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    argv = _argv(args)
    body = command_request(args, argv)
    link = _link(args)
    try:
        if isinstance(link, Link) and link.session is not None:
            raise UserError(
                f"no broker listens on {link.path}: `gpuwarden run` needs one to run the "
                "command now (start `gpuwarden serve`), or queue it with `gpuwarden submit -- CMD`"
            )
        ids = next(link.request(body))["ids"]
        status = 0
        for job_id in ids:
            status = _worst(status, _run_one(link, job_id))
        return status
    finally:
        link.close()


def submit_command(args: argparse.Namespace) -> int:
    """``gpuwarden submit [options] -- CMD``: queue it, print the ids."""
    body = command_request(args, _argv(args))
    _refuse_typed_only(args, remote=bool(getattr(args, "url", None)))
    link = _link(args)
    try:
        ids = next(link.request(body))["ids"]
        for job_id in ids:
            out.print(job_id, highlight=False)
        if not getattr(args, "wait", False):
            return 0
        status = 0
        for job_id in ids:
            status = _worst(status, _run_one(link, job_id))
            if isinstance(link, HttpLink) and getattr(args, "results_dir", None):
                _fetch_outputs(link.client, job_id, args.results_dir)
        return status
    finally:
        link.close()


#: ``submit``'s options a command job does not take: (option, attribute, over HTTP too)
TYPED_ONLY = (
    ("--queue", "queue", True),
    ("--input", "inputs", True),
    ("-p / --NAME VALUE", "kv", True),
    ("--constraint", "constraints", True),
    ("--service", "service", True),
    ("--source-repo", "source_repo", True),
    ("--want", "outputs", False),
    ("--results-dir", "results_dir", False),
)


def _refuse_typed_only(args: argparse.Namespace, *, remote: bool) -> None:
    """A typed job's option given with a command: said, not silently dropped (a
    host command has no output folder: its files land where it writes them)."""
    if getattr(args, "extra", None):
        raise ValidationError(
            f"unexpected {args.extra[0]!r} before --: `gpuwarden submit --help` lists a "
            "command job's options; the command's own go after --"
        )
    for option, key, everywhere in TYPED_ONLY:
        if getattr(args, key, None) and (everywhere or not remote):
            where = "" if everywhere else " on the host (its files land where it writes them)"
            raise ValidationError(
                f"{option} is not taken by a command job{where}; give it to a typed job "
                "(gpuwarden submit TYPE ...), or leave it out"
            )


def _fetch_outputs(client: Client, job_id: str, dest: Path) -> None:
    """A job's outputs from the API into ``dest`` (``--results-dir``)."""
    result = client.result(job_id)
    for rel in result.get("outputs", []):
        client.download(job_id, rel, dest / rel)
        err.print(f"job {job_id}: {dest / rel}", highlight=False)


def _argv(args: argparse.Namespace) -> list[str]:
    argv = list(getattr(args, "command_argv", None) or [])
    if not argv:
        raise ValidationError(
            "give the command after --, e.g. gpuwarden run --vram 10G -- python3 train.py"
        )
    return argv


def _worst(a: int, b: int) -> int:
    return a if a != 0 else b


def _run_one(link: Link | HttpLink, job_id: str) -> int:
    """Follow one job to its end, its output to ours; Ctrl-C cancels it."""
    shown = _Shown(job_id)
    try:
        for message in link.request({"op": "follow", "id": job_id}):
            if "end" in message:
                shown.close()
                return _status(job_id, message["end"])
            shown.show(message)
    except KeyboardInterrupt:
        shown.close()
        err.print(f"cancelling job {job_id} (Ctrl-C)")
        state = next(link.request({"op": "cancel", "id": job_id}))["state"]
        err.print(f"job {job_id}: {state}" + (", stopping" if state == "running" else ""))
        return CANCELLED_STATUS
    finally:
        shown.close()
    raise UserError(f"the broker stopped answering about job {job_id}; see gpuwarden show {job_id}")


class _Shown:
    """What ``run`` shows: why the job waits (a spinner or a line on stderr), then
    the command's own output, byte for byte."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.progress: Progress | None = Progress(f"job {job_id}: queued").__enter__()

    def show(self, message: dict[str, Any]) -> None:
        if "waiting" in message and self.progress is not None:
            self.progress.update(progress_text(self.job_id, "queued", message["waiting"]))
            return
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            if name in message:
                self.close()
                stream.buffer.write(base64.b64decode(message[name]))
                stream.buffer.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)
            self.progress = None


def _status(job_id: str, end: dict[str, Any]) -> int:
    """The job's exit status as ``run``'s: 0 done, its own exit code, else 1."""
    if end["state"] == "done":
        return 0
    code = end.get("exit_code")
    err.print(f"job {job_id} {end['state']}: {end.get('reason') or ''}", highlight=False)
    if isinstance(code, int) and 0 < code < 256:
        return code
    return CANCELLED_STATUS if end["state"] == "cancelled" else FAILED_STATUS
