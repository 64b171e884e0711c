"""What every command of the ``gpuwarden`` command line shares: the parser that
answers a typo with "did you mean", the global options and ``--url``, the config
and the store of a state directory, the choice between the local store and the
HTTP API (made once here, in :func:`local_or_http`), the consoles, what is shown
while a command waits for a job, and the mapping of errors to exit statuses.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import getpass
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rich.console import Console
from rich.markup import escape

from gpuwarden import __version__
from gpuwarden.api.auth import Principal, local_principal
from gpuwarden.app import open_store
from gpuwarden.client import Client
from gpuwarden.cluster import report
from gpuwarden.config import CONFIG_ENV, STATE_DIR_ENV, Config, load_config
from gpuwarden.core.model import Job
from gpuwarden.core.states import JobState
from gpuwarden.errors import GpuwardenError, UserError
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.sqlite import DamagedDatabaseError

URL_ENV = "GPUWARDEN_URL"
TOKEN_ENV = "GPUWARDEN_TOKEN"  # noqa: S105 - the name of a variable
DEFAULT_TOKEN_FILE = Path("~/.config/gpuwarden/token")

#: piped output (scripts, logs) gets wide tables instead of cells cut to 80 columns
_PIPE_WIDTH = 200
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True)

#: argparse's sub-commands action, which a group module adds its commands to (its
#: class is private to argparse)
Commands = Any

#: the states after which a job never changes again
TERMINAL_STATES = frozenset(s.value for s in JobState if s.terminal)

T = TypeVar("T")


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


#: words people bring from other tools, and the command that does what they mean
#: here: a near spelling would mislead (``undrain`` is one edit from ``drain``)
SYNONYMS = {
    "undrain": "resume",
    "uncordon": "resume",
    "cordon": "drain",
    "unhold": "release",
    "delete": "cancel",
    "kill": "cancel",
    "ps": "jobs",
    "queue": "jobs",
}


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the candidate closest to ``word``, or ``""``.

    A word of another tool's (:data:`SYNONYMS`) names the command that means it
    (nothing, where there is none: never its near spelling).
    Closest: the fewest edits, where swapping two neighbours is one edit (a typo
    like ``--wiat`` is one from ``--wait``, two from ``--want``), then difflib's
    ratio; a candidate more than 2 edits (or half the word) away is no match."""
    if (meant := SYNONYMS.get(word)) is not None:
        return f" (did you mean {meant}?)" if meant in candidates else ""
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


#: the options that go before the command (``gpuwarden --state-dir DIR jobs``)
GLOBAL_OPTIONS = ("--config", "--state-dir", "--mock-gpu", "--verbose", "-v")


def add_global_options(p: argparse.ArgumentParser) -> None:
    """The options before the command; each also comes from the environment."""
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


def add_remote_options(sp: argparse.ArgumentParser) -> None:
    """``--url`` and ``--token-file``: the commands that can talk to the HTTP API."""
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


def command_parser(parser: Parser, args: argparse.Namespace) -> Parser:
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


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; a user's mistake (exit 2) or a failure (exit 1) is
    printed as one line (with its causes), never as a traceback."""
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


# -- the state directory, or the HTTP API ---------------------------------------


def config_of(args: argparse.Namespace) -> Config:
    """The config of ``--config`` with ``--state-dir`` over it."""
    return load_config(args.config, state_dir=args.state_dir)


def existing_store(
    args: argparse.Namespace, config: Config | None = None, *, writes: bool = True
) -> Store:
    """The store of a state directory a broker has used; never creates one: a
    mistyped ``--state-dir`` is refused, not made into a new, empty store. A
    damaged one is refused to a command that ``writes``, said to one that reads
    (:func:`checked_store`)."""
    config = config or config_of(args)
    if not config.database and not config.db_path.exists():
        raise UserError(
            f"no gpuwarden state in {config.state_dir}: check --state-dir, --config and "
            f"{STATE_DIR_ENV}; `gpuwarden serve` creates a state directory when it first "
            "starts there"
        )
    return checked_store(config, writes=writes)


def checked_store(config: Config, *, writes: bool) -> Store:
    """The config's store, its SQLite file checked whole first (``PRAGMA
    quick_check``, as ``serve`` does): a damaged one is refused to every command
    that ``writes``, with the line ``serve`` says (DamagedDatabaseError, exit 2);
    a reader is told on stderr that it is damaged and reads what it can (a
    damaged page it meets is that same line)."""
    if config.database:
        return open_store(config)  # PostgreSQL checks its own pages
    try:
        return open_store(config, check=True)
    except DamagedDatabaseError as exc:
        if writes:
            raise
        err.print(f"[bold yellow]warning:[/] {escape(exc.message)}", markup=True)
        return open_store(config)


def local_actor() -> Principal:
    """Who acts through the local store, for the audit log: this host's user."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return local_principal(user)


@contextlib.contextmanager
def audited(store: Store, action: str, target: str) -> Iterator[dict[str, Any]]:
    """Write the audit row of a change made on the local store, as the API writes a
    request's (SPEC.md section 15, "Audit log"): the actor is this host's user
    (:func:`local_actor`, role ``local``). The block fills in the detail it yields;
    the row says ``ok``, or ``refused: WHY`` when the block raises a
    :class:`GpuwardenError` (raised on). A refusal's row that cannot be written (the
    store is down) is left out: the refusal is what the user is told."""
    detail: dict[str, Any] = {}
    actor = local_actor()
    try:
        yield detail
    except GpuwardenError as exc:
        row = actor.audit(
            action, now=time.time(), target=target, outcome=f"refused: {exc}", detail=detail
        )
        with contextlib.suppress(GpuwardenError):
            store.add_audit(row)
        raise
    store.add_audit(actor.audit(action, now=time.time(), target=target, detail=detail))


def remote(args: argparse.Namespace) -> Client | None:
    """A :class:`gpuwarden.client.Client` when ``--url`` (or GPUWARDEN_URL) is given."""
    if not getattr(args, "url", None):
        return None
    if not str(args.url).startswith(("http://", "https://")):
        raise UserError(f"--url {args.url!r}: give the API's address, e.g. http://HOST:8765")
    return Client(args.url, read_token(args.token_file), on_wait=say_waiting)


def say_waiting(text: str) -> None:
    """What a client waits for (a server whose store is unreachable), on stderr."""
    err.print(f"{time.strftime('%H:%M:%S')} {printable(text)}", markup=False, highlight=False)


def local_or_http(
    args: argparse.Namespace,
    here: Callable[[argparse.Namespace], T],
    there: Callable[[argparse.Namespace, Client], T],
    *,
    hint: str = "",
) -> T:
    """The one choice between the local store and the HTTP API: with ``--url``,
    ``there(args, client)`` with a client of that API (closed after), else
    ``here(args)``. ``hint`` is added to the message when no client can be made
    (a bad ``--url``, no token)."""
    try:
        client = remote(args)
    except UserError as exc:
        if not hint:
            raise
        raise UserError(f"{exc.message}; {hint}") from None
    if client is None:
        return here(args)
    with client:
        return there(args, client)


def read_token(path: Path) -> str:
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


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UserError(f"--api {text!r}: give it as HOST:PORT, e.g. 127.0.0.1:8765")
    return host, int(port)


class StopSignals:
    """SIGTERM and SIGINT for a command that runs jobs (``serve``, ``agent``): the
    first stops taking new jobs and, with ``leave``, leaves the running ones to
    their supervisors (the next start takes them back), else gives them the
    config's grace; a second stops them now. Each broker given to :meth:`add` is
    woken at once."""

    def __init__(self, grace_s: float, *, leave: bool = False) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()
        self._grace_s = grace_s
        self._leave = leave
        self._brokers: list[Any] = []

    def add(self, broker: Any) -> None:
        self._brokers.append(broker)

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        for b in self._brokers:
            b.wake()
        # written straight to the descriptor, not through rich: the handler runs
        # between two bytecodes of the main thread, which may be inside rich's
        # own print (its lazy import of the emoji table then failed: the agent
        # exited 1 on a SIGTERM that came during its first line)
        if self.stop.is_set():
            self.force.set()
            _say_now("second signal: stopping running jobs now")
        elif self._leave:
            self.stop.set()
            _say_now(
                "stopping: no new jobs; running jobs go on under their supervisors and the "
                "next start takes them back (signal again to stop them now)"
            )
        else:
            self.stop.set()
            _say_now(
                f"stopping: no new jobs; running jobs get up to "
                f"{self._grace_s:g} s (signal again to stop them now)"
            )


def stop_signals(config: Config) -> StopSignals:
    """The :class:`StopSignals` of a broker run with ``config``."""
    b = config.broker
    return StopSignals(b.shutdown_grace_s, leave=b.on_stop == "leave")


def with_stop_jobs(config: Config, stop_jobs: bool) -> Config:
    """``config`` with ``[broker] on_stop = "stop-jobs"`` when ``stop_jobs`` (the
    ``--stop-jobs`` option of ``serve`` and ``agent``)."""
    if not stop_jobs:
        return config
    broker = config.broker.model_copy(update={"on_stop": "stop-jobs"})
    return config.model_copy(update={"broker": broker})


def _say_now(line: str) -> None:
    """One line to stderr, safe from a signal handler."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


# -- what a command shows ---------------------------------------------------------


def age(ts: float | None) -> str:
    """How long ago ``ts`` was, in one unit: ``42s``, ``5m``, ``3h``, ``2d``."""
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


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline shown as an escape
    (``\\x1b``): what a job wrote cannot drive the terminal it is shown on."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in "\t\n" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


#: a time in a progress line (``heard from 3 s ago``, ``for 12.5 s``): it changes
#: every second, so a log gets a new line only when something else changes
_TIMES = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s|min|h)\b")


class Progress:
    """What a command says while it waits for a job: on a terminal, a spinner with
    the job's state and why it waits; without one (piped, in a log), one line on
    stderr, with the time, each time that changes (a time in it alone is no change)."""

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
        if self._spinner is not None:
            if text != self._said:
                self._said = text
                self._spinner.update(text)
            return
        gist = _TIMES.sub("…", text)
        if gist != self._said:
            self._said = gist
            err.print(f"{time.strftime('%H:%M:%S')} {text}", markup=False, highlight=False)


def wait_note(lines: Sequence[str]) -> str:
    """What ``explain`` says about where a job stands, as one line: its lines but
    the first (the state, shown already), the footprint and where the view came
    from (they say nothing new while it waits)."""
    keep = [ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen by"))]
    return "; ".join(keep)


def progress_text(job_id: str, state: str, note: str) -> str:
    """One line of :class:`Progress`: the job, its state and why it waits."""
    return f"job {job_id}: {state}" + (f": {note}" if note else "")


#: how often a waiting command asks again why the job waits (explain's work)
NOTE_EVERY_S = 1.0


def wait_here(
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
                lines = report.explain(job, store, registry, config.broker.cpu_slots, time.time())
                note = wait_note(lines)
                next_note = time.monotonic() + NOTE_EVERY_S
            progress.update(progress_text(job_id, job.state.value, note))
            time.sleep(0.1)
