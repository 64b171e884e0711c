import json
import os
import time
from pathlib import Path

from gpuwarden.gpu import simclient

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
gpu = simclient.attach()
gpu.allocate(int(params["gib"] * 1024**3), leak=params["leak"])
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "gpu.txt").write_text(gpu.gpu_uuid)
time.sleep(params["seconds"])
