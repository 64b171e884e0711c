"""A warm server for tests: loads (holds its type's VRAM on the simulated GPU)
once, then serves jobs; a job's `behave` makes it fail, crash or hang."""

import json
import os
import time

from gpuwarden.gpu import simclient
from gpuwarden.server.worker import serve

FOOTPRINT_GIB = {
    "testmods.warm": 6,
    "testmods.warm_big": 16,
    "testmods.pinned": 6,
    "testmods.halfway": 6,
    "testmods.slowload": 2,
    "testmods.warm_counted": 4,
}
#: seconds each type's load takes
LOAD_S = {"testmods.slowload": 5.0}
#: the share of its model a server says sits in device memory
ON_DEVICE = {"testmods.halfway": 0.6}


def load(ctx):
    if os.environ["GPUWARDEN_JOB_TYPE"] == "testmods.warm_counted":
        # each load, one line in the module's model folder: outside the broker's reach
        with open(os.path.join(os.environ["GPUWARDEN_MODEL_DIR"], "loads"), "a") as f:
            f.write(f"load {os.getpid()}\n")
    gpu = simclient.attach()
    gib = FOOTPRINT_GIB[os.environ["GPUWARDEN_JOB_TYPE"]]
    time.sleep(LOAD_S.get(os.environ["GPUWARDEN_JOB_TYPE"], 0.3))
    gpu.allocate(int(gib * 1024**3))
    return {"gpu": gpu, "gib": gib, "pid": os.getpid(), "jobs": 0}


def handle(model, job):
    behave = job.params.get("behave", "ok")
    if behave == "crash":
        os._exit(3)
    if behave == "hang":
        time.sleep(3600)
    if behave == "fail":
        raise ValueError("this job fails by request")
    time.sleep(float(job.params.get("sleep_s", 0)))
    model["jobs"] += 1
    (job.output_dir / "served.json").write_text(
        json.dumps({"pid": model["pid"], "jobs_before": model["jobs"] - 1})
    )
    return f"served by PID {model['pid']} (job {model['jobs']} of this server)"


def device_bytes(model):
    share = ON_DEVICE.get(os.environ["GPUWARDEN_JOB_TYPE"], 1.0)
    return int(model["gib"] * share * 1024**3)


serve(load, handle, device_bytes=device_bytes)
