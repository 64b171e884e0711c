"""testmods.hold: runs until the test says so (a file appears), never by the clock.
Tests that must see a job running while something else happens hold it this way
instead of racing a sleep; ``limit_s`` only keeps a forgotten job from living on.
With ``tick_s``, it prints ``tick N`` every ``tick_s`` seconds while it holds."""

import json
import os
import sys
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
release = Path(params["until"])
print(f"pid {os.getpid()}: holding until {release} exists", flush=True)
deadline = time.monotonic() + params["limit_s"]
tick_s = float(params.get("tick_s", 0))
ticks = 0
next_tick = time.monotonic() + tick_s
while not release.exists():
    if tick_s > 0 and time.monotonic() >= next_tick:
        ticks += 1
        print(f"tick {ticks}", flush=True)
        next_tick += tick_s
    if time.monotonic() > deadline:
        print(f"{release} never appeared", file=sys.stderr)
        sys.exit(3)
    time.sleep(0.02)
print("released")
