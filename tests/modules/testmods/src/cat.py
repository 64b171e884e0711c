import json
import os
import shutil
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
shutil.copy(params["file"], Path(os.environ["GPUWARDEN_OUTPUT_DIR"], "copy"))
try:
    Path(params["file"]).write_text("changed")
    print("input was writable")
except OSError:
    print("input is read-only")
