"""A job on several GPUs: holds ``gib`` on each simulated GPU it was given, and
writes what it sees (``CUDA_VISIBLE_DEVICES``, and the GPUs it attached to)."""

import json
import os
import time
from pathlib import Path

from gpuwarden.gpu import simclient

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
gpus = simclient.attach_all()
for gpu in gpus:
    gpu.allocate(int(params["gib"] * 1024**3))
(out / "visible.txt").write_text(os.environ["CUDA_VISIBLE_DEVICES"])
(out / "gpus.txt").write_text(",".join(g.gpu_uuid for g in gpus))
time.sleep(params["seconds"])
