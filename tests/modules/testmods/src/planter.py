"""A warm server for tests that plants something in its exchange folder, at the
name a later job's slot will have (``<victim>-<victim_attempt>``): a symlink to
``target``, or a folder holding a file nobody can remove (chattr +i, as root).
Every job writes ``served.txt`` and, given an input ``file``, ``copy.txt``."""

import os
import shutil
import subprocess

from gpuwarden.server.worker import serve


def load(ctx):
    return {"pid": os.getpid()}


def handle(model, job):
    plant = job.params.get("plant", "none")
    if plant != "none":
        exchange = job.output_dir.parent.parent  # <exchange>/<job>-<attempt>/out
        spot = exchange / f"{job.params['victim']}-{job.params['victim_attempt']}"
        if plant == "symlink":
            os.symlink(job.params["target"], spot)
        else:
            spot.mkdir()
            (spot / "stuck").write_text("cannot be removed")
            subprocess.run(["chattr", "+i", str(spot / "stuck")], check=True)
    if job.params.get("file"):
        shutil.copyfile(job.params["file"], job.output_dir / "copy.txt")
    (job.output_dir / "served.txt").write_text(f"served {job.job_id} by {model['pid']}")
    return f"planted {plant}"


serve(load, handle)
