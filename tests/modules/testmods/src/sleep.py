import json
import os
import signal
import sys
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
if params.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"pid {os.getpid()}", flush=True)
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "pid").write_text(str(os.getpid()))
hog = bytearray(params.get("ram_mib", 0) << 20)
hog[::4096] = b"\1" * len(range(0, len(hog), 4096))  # touch every page: resident
time.sleep(params["seconds"])
print("slept")
sys.exit(0)
