"""A runtime job: ask the model the broker made resident, through the runtime's API."""

import json
import os
import time
import urllib.request
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
time.sleep(float(params.get("wait_s", 0)))
url = os.environ["GPUWARDEN_RUNTIME_URL"]
model = os.environ["GPUWARDEN_RUNTIME_MODEL"]
body = json.dumps({"model": model, "prompt": "hello", "stream": False}).encode()
request = urllib.request.Request(
    f"{url}/api/generate", data=body, headers={"Content-Type": "application/json"}
)
with urllib.request.urlopen(request, timeout=30) as answer:
    said = json.load(answer)
seen = {
    "runtime": os.environ["GPUWARDEN_RUNTIME"],
    "kind": os.environ["GPUWARDEN_RUNTIME_KIND"],
    "model": model,
    "done": said.get("done"),
    "gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES"),
}
Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "answer.json").write_text(json.dumps(seen))
