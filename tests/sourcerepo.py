"""A local git repository holding one module, made by a test (jobs from a pinned
commit: SPEC.md, "Jobs from a pinned commit")."""

from __future__ import annotations

import subprocess
from pathlib import Path

MODULE_TOML = """\
[module]
name = "mymod"

[types.train]
lane = "cpu"
launch = "container"
command = ["python3", "src/train.py"]
timeout_s = 60
"""

#: a module with something to keep: a repository outside an allow list holds it
SECRET_TOML = MODULE_TOML.replace("[module]\n", '[module]\ndescription = "TOP SECRET"\n')

TRAIN = """\
import os, pathlib
out = pathlib.Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
(out / "said.txt").write_text(pathlib.Path("/opt/said").read_text())
print("trained")
"""


def git(repo: Path, *args: str, check: bool = True) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.org",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.org",
        "HOME": str(repo),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=check
    )
    return done.stdout.strip()


def make_repo(path: Path, *, base: str = "scratch", files: dict[str, str] | None = None) -> str:
    """A repository at ``path`` with the module ``mymod`` and a Containerfile
    ``FROM base``; returns the commit's full id."""
    path.mkdir(parents=True)
    content = {
        "module.toml": MODULE_TOML,
        "src/train.py": TRAIN,
        "Containerfile": f"FROM {base}\nRUN echo built-into-image > /opt/said\n",
        **(files or {}),
    }
    for name, text in content.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "init", "--quiet", "--initial-branch", "main")
    git(path, "add", ".")
    git(path, "commit", "--quiet", "-m", "module")
    return git(path, "rev-parse", "HEAD")
