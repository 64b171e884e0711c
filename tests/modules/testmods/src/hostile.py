"""A host job that attacks the broker through the files it leaves (tests only):
its message file made a FIFO, a link or a huge file; outputs 1,100 folders deep,
or links, FIFOs and devices among them."""

import json
import os
import stat
import sys
import time
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
out = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
result = Path(os.environ["GPUWARDEN_RESULT"])
attack, target = params["attack"], params["target"]
time.sleep(float(params["seconds"]))
(out / "ok.txt").write_text("a regular output")
if attack == "fifo_message":
    os.mkfifo(result)
elif attack == "link_message":
    result.symlink_to(target)
elif attack == "big_message":
    result.write_text(json.dumps({"message": "x" * (2 << 20)}))
else:
    result.write_text(json.dumps({"message": f"attack {attack} in place"}))
if attack == "deep_outputs":
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(int(params["depth"])):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
elif attack == "odd_outputs":
    (out / "link").symlink_to(target)
    os.mkfifo(out / "pipe")
    os.mknod(out / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
print(f"attack {attack} in place")
sys.exit(0)
