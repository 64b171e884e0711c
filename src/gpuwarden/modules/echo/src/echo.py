"""echo.echo: write a text to an output file. Follows docs/MODULE_GUIDE.md."""

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
    out_dir = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
    target = (out_dir / params["output"]).resolve()
    if not target.is_relative_to(out_dir.resolve()):
        print(f"output {params['output']!r} must stay inside the output directory", file=sys.stderr)
        return 2
    if params.get("sleep_s"):
        time.sleep(float(params["sleep_s"]))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(params["text"])
    print(params["text"])
    message = f"wrote {len(params['text'])} characters to {params['output']}"
    Path(os.environ["GPUWARDEN_RESULT"]).write_text(json.dumps({"message": message}))
    return int(params.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
