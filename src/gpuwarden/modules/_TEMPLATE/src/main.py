"""A template job: read parameters, write outputs, report a message, exit 0.

The contract (docs/MODULE_GUIDE.md): parameters in $GPUWARDEN_PARAMS (JSON),
inputs under $GPUWARDEN_INPUT_DIR (treat them as read-only), outputs into
$GPUWARDEN_OUTPUT_DIR, scratch space in $GPUWARDEN_SCRATCH_DIR, an optional
{"message": ...} in $GPUWARDEN_RESULT; exit 0 for success. The GPU you were
given is the only one in CUDA_VISIBLE_DEVICES.
"""

import json
import os
import sys
from pathlib import Path


def main() -> int:
    params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
    out_dir = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
    # Load your model here onto the one visible GPU, run it, and write results.
    (out_dir / "result.txt").write_text(f"{params['prompt']} x {params['steps']}\n")
    Path(os.environ["GPUWARDEN_RESULT"]).write_text(json.dumps({"message": "template ran"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
