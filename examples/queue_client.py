"""A client that talks to gpuwarden only through a queue root: it writes a zip
into inbox/ and reads the result from outbox/ (or failed/). It imports nothing
from gpuwarden, to show the bundle format is all a client needs.

    python examples/queue_client.py queues/demo "hello from a client"
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import zipfile
from pathlib import Path


def submit(root: Path, text: str) -> str:
    job_id = f"client-{secrets.token_hex(4)}"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"{job_id}-{stamp}-{secrets.token_hex(3)}.zip"
    manifest = {
        "version": 1,
        "jobs": [{"id": job_id, "type": "echo.echo", "params": {"text": text}}],
    }
    tmp = root / "inbox" / f".{name}.tmp"  # a temporary name is never picked up
    with zipfile.ZipFile(tmp, "w") as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
    os.replace(tmp, root / "inbox" / name)  # appears whole, or not at all
    return name


def wait(root: Path, name: str, timeout_s: float = 60) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for folder in ("outbox", "failed"):
            if (root / folder / name).exists():
                return root / folder / name
        time.sleep(0.1)
    raise SystemExit(f"no result for {name} after {timeout_s} s: is `gpuwarden serve` running?")


def main() -> int:
    root, text = Path(sys.argv[1]), sys.argv[2]
    name = submit(root, text)
    print(f"dropped {name} into {root / 'inbox'}; waiting for the result")
    result = wait(root, name)
    with zipfile.ZipFile(result) as zf:
        for entry in zf.namelist():
            if entry.endswith("/result.json"):
                data = json.loads(zf.read(entry))
                print(f"{data['id']}: {data['status']} - {data.get('message') or data['reason']}")
            elif "/outputs/" in entry:
                print(f"  {entry}: {zf.read(entry).decode(errors='replace')}")
    return 0 if result.parent.name == "outbox" else 1


if __name__ == "__main__":
    sys.exit(main())
