"""testmods.vramhold: allocate simulated VRAM, say which process holds it (the pid
and PID namespace it sees, in ``out/held.json``), then hold it until the test
writes the file ``wait_for`` into the output folder (sandboxes see that folder;
nothing else of the host). Never by the clock: ``limit_s`` only keeps a
forgotten job from living on. Out of memory: the CUDA message and exit 1.

``clobber``: an attack on the broker through the simulated GPU's state file,
which every job may write: its own allocation's pid becomes a path."""

import fcntl
import json
import os
import sys
import time
from pathlib import Path

from gpuwarden.errors import SimOutOfMemoryError
from gpuwarden.gpu import simclient

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
gpu = simclient.attach()
try:
    gpu.allocate(int(params["gib"] * 1024**3))
except SimOutOfMemoryError as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.exit(1)
if params["clobber"]:
    state_file = Path(os.environ[simclient.SIM_ENV])
    with open(state_file.with_name(state_file.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the device does: the broker reads after
        state = json.loads(state_file.read_text())
        for a in state["allocations"]:
            if a["pid"] == os.getpid():
                a["pid"] = "../1"
        staged = state_file.with_name(f"clobber-{os.getpid()}.tmp")
        staged.write_text(json.dumps(state))
        staged.rename(state_file)
held = {"pid": os.getpid(), "pidns": os.stat("/proc/self/ns/pid").st_ino, "gpu": gpu.gpu_uuid}
(out / "held.json.tmp").write_text(json.dumps(held))
(out / "held.json.tmp").rename(out / "held.json")
if params["wait_for"]:
    release = out / params["wait_for"]
    deadline = time.monotonic() + params["limit_s"]
    while not release.exists():
        if time.monotonic() > deadline:
            print(f"{release} never appeared", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.02)
