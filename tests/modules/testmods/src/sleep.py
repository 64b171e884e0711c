import json
import os
import signal
import sys
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
if params["ignore_term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"pid {os.getpid()}", flush=True)
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "pid").write_text(str(os.getpid()))
time.sleep(params["seconds"])
print("slept")
sys.exit(0)
