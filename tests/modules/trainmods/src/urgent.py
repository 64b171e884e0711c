"""trainmods.urgent: holds 12 GiB of simulated VRAM for half a second."""

import os
import time
from pathlib import Path

from gpuwarden.gpu import simclient

gpu = simclient.attach()
gpu.allocate(12 * 1024**3)
time.sleep(0.5)
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "urgent.txt").write_text("ok")
