"""A job that counts its own work where the broker cannot: one line per event in
the file named by its `ledger` parameter (appended with O_APPEND, one write a
line; "": `ledger` in its output folder, for a sandboxed job). A relative
`until` is in its output folder. 'start JOB ATTEMPT', then after `seconds` (or once the file `until`
exists) 'done JOB ATTEMPT' and exit
`exit_code`. On SIGUSR1 (its checkpoint signal) 'checkpoint JOB ATTEMPT', exit 6."""

import json
import os
import signal
import sys
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
# in a sandbox only the output folder is the job's to write: there by default
ledger = params["ledger"] or str(out / "ledger")
job = os.environ.get("GPUWARDEN_JOB_ID", "?")
attempt = os.environ.get("GPUWARDEN_ATTEMPT_NUMBER", "?")


def note(what: str) -> None:
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{what} {job} {attempt} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def checkpoint(_signum: int, _frame: object) -> None:
    note("checkpoint")
    os._exit(6)


signal.signal(signal.SIGUSR1, checkpoint)
note("start")
deadline = time.monotonic() + float(params["seconds"])
until = out / params["until"] if params["until"] else None  # relative: in out/
while time.monotonic() < deadline and not (until is not None and until.exists()):
    time.sleep(0.05)
note("done")
sys.exit(int(params["exit_code"]))
