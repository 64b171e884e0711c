"""trainmods.train / trainmods.stubborn: a training stand-in.

Holds 16 GiB of simulated VRAM and counts ``steps`` steps of ``step_s`` seconds.
On SIGUSR1 (the type's checkpoint signal) it writes its step to ``step.txt`` in
its output folder and exits 6; with ``GPUWARDEN_RESUME=1`` it starts from that
step. Every attempt appends a line to ``log.txt``. With ``--ignore`` it ignores
the signal (and is stopped after its grace)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

from gpuwarden.gpu import simclient

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
ckpt = out / "step.txt"
resume = os.environ.get("GPUWARDEN_RESUME") == "1"
step = int(ckpt.read_text()) if resume and ckpt.exists() else 0
attempt = os.environ["GPUWARDEN_ATTEMPT_NUMBER"]


def note(line: str) -> None:
    with (out / "log.txt").open("a") as f:
        f.write(f"attempt {attempt}: {line}\n")


note(f"start at step {step} resume={int(resume)}")
gpu = simclient.attach()
gpu.allocate(16 * 1024**3)
asked: list[int] = []


def on_signal(signum: int, frame: object) -> None:
    asked.append(signum)


signal.signal(signal.SIGUSR1, signal.SIG_IGN if "--ignore" in sys.argv else on_signal)
while step < params["steps"]:
    time.sleep(params["step_s"])
    step += 1
    if asked:  # a safe point: between two steps
        ckpt.write_text(str(step))
        note(f"checkpointed at step {step}")
        sys.exit(6)
note(f"finished at step {step}")
(out / "done.txt").write_text(str(step))
