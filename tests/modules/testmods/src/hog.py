"""testmods.hog: says which cgroups it is in (``out/cgroup``), waits until the test
creates the file ``go`` (so the test can read its limits while it runs), then
takes ``mib`` MiB of RAM, touching every page, and exits 0 if it was allowed to."""

import json
import os
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
(out / "cgroup").write_text(Path("/proc/self/cgroup").read_text())
go = Path(params["go"])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
hog = bytearray(params["mib"] << 20)
hog[::4096] = b"\1" * len(range(0, len(hog), 4096))  # resident, every page
print(f"took {params['mib']} MiB", flush=True)
