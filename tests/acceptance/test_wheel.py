"""Acceptance: gpuwarden installed as a package (a wheel in a fresh virtual
environment, not an editable checkout) has every shipped job type, finds a pip
package's module by its entry point, and runs the README's first command's
``run-once`` and ``demo`` from an empty folder."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TOY_TOML = """\
[module]
name = "toy"
description = "A module from a pip package."
version = "1"

[types.run]
description = "Write toy.txt."
lane = "cpu"
command = ["{python}", "src/run.py"]
timeout_s = 60
"""
TOY_RUN = """\
import json, os, pathlib
out = pathlib.Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
(out / "toy.txt").write_text("toy ran")
pathlib.Path(os.environ["GPUWARDEN_RESULT"]).write_text(json.dumps({"message": "toy ran"}))
"""


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    e.pop("PYTHONPATH", None)  # nothing of the checkout
    e["PYTHONUNBUFFERED"] = "1"
    return e


def sh(argv: list[str | Path], *, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env(),
        check=False,
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def toy_wheel(folder: Path, marker: Path) -> Path:
    """A third party's wheel, as a build backend writes one: the package
    ``toy_models`` with the module folder ``gpuwarden_toy`` inside it, and the
    entry point ``toy = toy_models.gpuwarden_toy``. Importing the package would
    write ``marker``."""
    files = {
        "toy_models/__init__.py": f"open({str(marker)!r}, 'w').write('imported')\n",
        "toy_models/gpuwarden_toy/module.toml": TOY_TOML,
        "toy_models/gpuwarden_toy/src/run.py": TOY_RUN,
        "toy_models-1.0.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: toy-models\nVersion: 1.0\n"
        ),
        "toy_models-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        "toy_models-1.0.dist-info/entry_points.txt": (
            "[gpuwarden.modules]\ntoy = toy_models.gpuwarden_toy\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{name},sha256={b64},{len(text.encode())}")
    record.append("toy_models-1.0.dist-info/RECORD,,")
    files["toy_models-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir()
    wheel = folder / "toy_models-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def readme_first_command() -> list[str]:
    """The README's first command, split at ``&&``: set up, then run."""
    text = (REPO / "README.md").read_text()
    first = text.split("```sh\n", 1)[1].split("```", 1)[0].strip()
    assert "\n" not in first, first  # one line a user pastes
    return [part.strip() for part in first.split(" && ")]


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_runs_run_once_and_demo_from_an_empty_folder(
    tmp_path: Path,
) -> None:
    steps = readme_first_command()
    assert steps[:2] == ["python3 -m venv .venv", ".venv/bin/pip install -q -e ."], steps
    runs = steps[2:]
    assert runs and all(s.startswith(".venv/bin/gpuwarden ") for s in runs), runs

    dist = tmp_path / "dist"
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, REPO], cwd=tmp_path)
    [wheel] = dist.glob("gpuwarden-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("audiogen", "burn", "echo", "embed", "probe", "speech"):
        assert f"gpuwarden/modules/{module}/module.toml" in names, module
    assert "gpuwarden/modules/echo/src/echo.py" in names
    for page in ("index.html", "app.js", "app.css"):  # the dashboard, served offline
        assert f"gpuwarden/api/dashboard/{page}" in names, page

    venv = tmp_path / "venv"
    sh([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    marker = tmp_path / "toy-imported"
    toy = toy_wheel(tmp_path / "toy", marker)
    sh([venv / "bin" / "pip", "install", "-q", wheel, toy], cwd=tmp_path)

    empty = tmp_path / "empty"
    empty.mkdir()
    gw = venv / "bin" / "gpuwarden"
    where = sh(
        [venv / "bin" / "python", "-c", "import gpuwarden; print(gpuwarden.__file__)"], cwd=empty
    )
    site = Path(where.strip()).parent.parent
    assert site.is_relative_to(venv) and not site.is_relative_to(REPO)  # the installed copy

    doc = json.loads(sh([gw, "types", "--json"], cwd=empty))
    types = {t["type"]: t for t in doc["types"]}
    assert {"burn.llm", "echo.echo", "echo.serve", "embed.minilm", "probe.gpu"} <= set(types)
    assert types["echo.echo"]["source"] == {
        "kind": "built-in",
        "where": str(site / "gpuwarden" / "modules"),
    }
    assert types["toy.run"]["source"] == {
        "kind": "entry point",
        "where": "toy_models.gpuwarden_toy",
        "dist": "toy-models 1.0",
    }
    assert types["toy.run"]["description"] == "Write toy.txt." and types["toy.run"]["runs_here"]
    table = sh([gw, "types"], cwd=empty)
    assert re.search(
        r"│ toy\.run\s+│ cpu, host\s+│ -\s+│ host process\s+│ pip toy-models 1\.0", table
    )
    assert not marker.exists()  # found by its entry point, never imported

    toy_run = sh([gw, "run-once", "toy.run"], cwd=empty)
    assert re.search(r"status\s+done", toy_run) and re.search(r"content\s+toy ran", toy_run)

    # the README's first command, after its set-up, with this venv's gpuwarden
    for step in runs:
        out = sh(["bash", "-c", step.replace(".venv/bin/", f"{venv}/bin/", 1)], cwd=empty)
        if " run-once echo.echo" in step:
            assert re.search(r"status\s+done", out) and re.search(r"content\s+hello", out)
        if step.endswith(" demo"):
            assert "through gpuwarden" in out and re.search(r"jobs done\s+│.*│\s+16 of 16", out)
    assert list(empty.iterdir()) == []  # run-once and demo leave nothing behind here
