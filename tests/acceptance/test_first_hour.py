"""Acceptance: what a new user gets out of the box, through the real CLI.

``examples/local.toml`` runs every shipped type on the simulated GPU, in
bubblewrap where it works and unsandboxed (said once) where it does not;
``container_runtime = "auto"`` never runs anything unsandboxed the config did not
allow; ``types`` says what this node refuses and why, and where each type came
from; ``preview`` and ``explain`` apply the launch rules; and the README's quick
start runs as written: a VRAM job admitted, one held back, then started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.store.sqlite import SqliteStore
from tests.conftest import need_tool

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LOCAL = EXAMPLES / "local.toml"
SANDBOXED = EXAMPLES / "sandboxed.toml"
GW = [sys.executable, "-m", "gpuwarden"]

#: every shipped type, with parameters that make it quick
SHIPPED: dict[str, list[str]] = {
    "audiogen.stableaudio": ["--prompt", "rain", "--seconds", "1", "--steps", "2"],
    "burn.custom": ["--seconds", "0"],
    "burn.embed": ["--seconds", "0"],
    "burn.llm": ["--seconds", "0"],
    "burn.vision": ["--seconds", "0"],
    "burn.whisper": ["--seconds", "0"],
    "echo.echo": ["--text", "hi"],
    "echo.container": ["--text", "hi"],
    "echo.serve": ["--text", "hi"],
    "embed.minilm": ["--texts", '["a cat sits on the mat"]'],
    "probe.gpu": ["--cuda", "false"],
    "probe.sandbox": [],
    # a recording from Debian's pocketsphinx-testdata (CI installs it)
    "speech.check": [
        "--input",
        "/usr/share/pocketsphinx/test/data/cards/001.wav",
        "--audio",
        "001.wav",
        "--text",
        "ten of clubs",
    ],
    "speech.voxcpm2": ["--text", "hi"],
}
CONTAINER_AND_SERVE = sorted(t for t in SHIPPED if t != "echo.echo")


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def run(
    *args: str | Path, cwd: Path | None = None, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GW, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env(**extra),
    )


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def no_bwrap_path(tmp_path: Path) -> str:
    """A PATH without bwrap (the CLI runs by its absolute interpreter, and jobs'
    ``{python}`` is that interpreter, so nothing else needs PATH)."""
    empty = tmp_path / "no-bwrap-bin"
    empty.mkdir(exist_ok=True)
    assert shutil.which("bwrap", path=str(empty)) is None
    return str(empty)


def fake_bwrap(tmp_path: Path, script: str) -> str:
    """A PATH whose only bwrap is ``script`` (a shell script, world-readable, so
    that the sandbox user the root-side starter drops to could run it)."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    fake = folder / "bwrap"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    assert shutil.which("bwrap", path=str(folder)) == str(fake)
    return str(folder)


def types_json(config: Path, **extra: str) -> dict[str, Any]:
    r = run("--config", config, "types", "--json", **extra)
    assert r.returncode == 0, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def by_type(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["type"]: t for t in doc["types"]}


def made_state(state: Path) -> Path:
    """A state directory as `gpuwarden serve` leaves it: the CLI submits only into
    one that a broker has made (a mistyped --state-dir is refused)."""
    state.mkdir(mode=0o700)
    SqliteStore(state / "gpuwarden.db").close()
    return state


def jobs_in(state: Path) -> list[str]:
    store = SqliteStore(state / "gpuwarden.db")
    try:
        return [j.id for j in store.list_jobs()]
    finally:
        store.close()


def unsandboxed_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "UNSANDBOXED" in ln]


# -- types -----------------------------------------------------------------------------


def test_types_without_a_config_marks_what_it_refuses_and_why() -> None:
    r = run("types")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("container runtime: local\n")
    # one row per shipped type, each with its description and where it came from
    for name in SHIPPED:
        assert re.search(rf"│ {re.escape(name)}\s+│", out), name
    assert "A large language model: 14 GiB, needs the GPU to itself." in out
    assert "Write `text` to the output file `output`; print it on stdout." in out
    assert re.search(r"│ echo\.echo\s+│ cpu, host\s+│ -\s+│ host process\s+│ built-in", out)
    assert re.search(r"│ burn\.llm\s+│ vram, container\s+│ 14\.0 GiB\s+│ REFUSED\s+│ built-in", out)
    [containers] = [ln for ln in out.splitlines() if ln.startswith("REFUSED here: audiogen.")]
    assert containers == (
        "REFUSED here: audiogen.stableaudio, burn.custom, burn.embed, burn.llm, burn.vision, "
        "burn.whisper, echo.container, probe.gpu, probe.sandbox, speech.check: each is a "
        "container type and "
        'container_runtime is "local" (no sandbox here): set container_runtime to podman, '
        "docker or bubblewrap, or set allow_unsandboxed_containers = true to run it as a "
        "plain host process"
    )
    assert "REFUSED here: echo.serve, embed.minilm, speech.voxcpm2: each is a serve type" in out
    assert "UNSANDBOXED" not in out  # nothing runs unsandboxed that could be sandboxed
    assert out.rstrip().endswith("modules from: built-in")

    doc = json.loads(run("types", "--json").stdout)
    assert doc["container_runtime"] == "local" and doc["container_runtime_auto"] is None
    assert doc["unsandboxed"] is None and doc["passed_over"] == []
    types = by_type(doc)
    assert set(SHIPPED) | {"lease"} == set(types)  # lease: the built-in type of VRAM leases
    assert {n for n, t in types.items() if t["runs_here"]} == {"echo.echo", "lease"}
    llm = types["burn.llm"]
    assert llm["refused"].startswith("burn.llm is a container type and container_runtime is")
    assert llm["runs_as"] == "refused" and llm["vram_bytes"] == 14 * 2**30
    assert llm["description"] == "A large language model: 14 GiB, needs the GPU to itself."
    assert llm["source"]["kind"] == "built-in"
    assert Path(llm["source"]["where"]) == REPO / "src" / "gpuwarden" / "modules"
    assert [p["name"] for p in llm["params"]] == ["gib", "seconds", "ramp_s", "leak"]


def test_types_with_local_toml_and_bubblewrap_says_how_each_type_runs() -> None:
    need_tool("bwrap")
    doc = types_json(LOCAL)
    assert doc["container_runtime"] == "bubblewrap"
    assert re.fullmatch(r"bubblewrap \S+ works \(\S+/bwrap\)", doc["container_runtime_auto"])
    types = by_type(doc)
    assert all(t["runs_here"] for t in types.values())  # every shipped type runs
    for name in CONTAINER_AND_SERVE:
        assert types[name]["runs_as"] == "sandboxed: bubblewrap", name
        assert types[name]["sandboxed"] is True and types[name]["unsandboxed"] is None
    echo = types["echo.echo"]
    assert echo["runs_as"] == "UNSANDBOXED" and echo["sandboxed"] is False
    assert echo["unsandboxed"] == "host types beside the bubblewrap sandbox; allow_host_jobs = true"
    assert doc["unsandboxed"] == (
        "UNSANDBOXED on this node, as plain host processes with the broker's user: echo.echo "
        "(host types beside the bubblewrap sandbox; allow_host_jobs = true). Every other type "
        'that runs here is sandboxed in bubblewrap (chosen by container_runtime = "auto"). '
        "Each unsandboxed attempt is marked 'unsandboxed' in the event log."
    )
    table = run("--config", LOCAL, "types").stdout
    assert table.startswith(
        'container runtime: bubblewrap (container_runtime = "auto": bubblewrap '
    )
    assert re.search(
        r"│ burn\.llm\s+│ vram, container\s+│ 14\.0 GiB\s+│ sandboxed: bubblewrap", table
    )
    assert re.search(r"│ echo\.echo\s+│ cpu, host\s+│ -\s+│ UNSANDBOXED", table)
    assert doc["unsandboxed"] in table and "REFUSED" not in table


def test_auto_without_bubblewrap_runs_unsandboxed_only_where_the_config_allows(
    tmp_path: Path,
) -> None:
    path = no_bwrap_path(tmp_path)
    missing = (
        "bwrap is not on PATH; install bubblewrap 0.8.0 or later: sudo apt-get install bubblewrap"
    )

    # local.toml allows it: every type runs, the container and serve ones unsandboxed
    doc = types_json(LOCAL, PATH=path)
    assert doc["container_runtime"] == "local" and doc["container_runtime_auto"] == missing
    types = by_type(doc)
    assert all(t["runs_here"] for t in types.values())
    assert {n for n, t in types.items() if t["runs_as"] == "UNSANDBOXED"} == set(
        CONTAINER_AND_SERVE
    )
    assert types["echo.echo"]["runs_as"] == "host process"
    assert f'container_runtime = "auto" found no sandbox here ({missing})' in doc["unsandboxed"]

    # sandboxed.toml does not: what needs a sandbox is refused, with what auto found
    strict = by_type(types_json(SANDBOXED, PATH=path))
    assert {n for n, t in strict.items() if t["runs_here"]} == {"echo.echo", "lease"}
    assert strict["burn.llm"]["refused"] == (
        'burn.llm is a container type and container_runtime = "auto" found no sandbox '
        f"here: {missing}. Or set allow_unsandboxed_containers = true to run it as a plain "
        "host process"
    )
    state = made_state(tmp_path / "s")
    r = run("--config", SANDBOXED, "--state-dir", state, "submit", "burn.llm", PATH=path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert strict["burn.llm"]["refused"] in " ".join(r.stderr.split())
    assert jobs_in(state) == []  # nothing was stored
    p = run("--mock-gpu", "--config", SANDBOXED, "preview", "burn.llm", PATH=path)
    assert p.returncode == 0
    assert p.stdout.strip() == (
        f"burn.llm would be refused: this node's launch rules: {strict['burn.llm']['refused']}"
    )


@pytest.mark.parametrize(
    ("script", "detail"),
    [
        (  # an old bubblewrap: no --disable-userns
            'case "$1" in --version) echo "bubblewrap 0.4.0";; --help) echo "--seccomp --size";; '
            "*) exit 0;; esac\n",
            r"bubblewrap 0\.4\.0 \(\S+/bwrap\) lacks --disable-userns; install bubblewrap",
        ),
        (  # there and new, but no sandbox starts (user namespaces refused)
            'case "$1" in --version) echo "bubblewrap 0.8.0";; '
            '--help) echo "--disable-userns --seccomp --size";; '
            '*) echo "bwrap: setting up uid map: Permission denied" >&2; exit 1;; esac\n',
            r"bubblewrap 0\.8\.0 \(\S+/bwrap\) cannot start a sandbox here: .+ \(user namespaces",
        ),
    ],
)
def test_auto_takes_a_bubblewrap_only_when_it_works(
    tmp_path: Path, script: str, detail: str
) -> None:
    doc = types_json(LOCAL, PATH=fake_bwrap(tmp_path, script))
    assert doc["container_runtime"] == "local"
    assert re.fullmatch(detail + ".*", doc["container_runtime_auto"]), doc["container_runtime_auto"]
    # local.toml allows running without: said, not hidden
    assert doc["container_runtime_auto"] in doc["unsandboxed"]


# -- preview and explain apply the launch rules -----------------------------------------


def test_preview_refuses_what_submit_refuses_whatever_the_gpu_has(tmp_path: Path) -> None:
    state = made_state(tmp_path / "state")
    sub = run("--state-dir", state, "submit", "burn.llm", "--id", "llm")
    assert sub.returncode == 2, sub.stdout + sub.stderr
    said = " ".join(sub.stderr.split())
    prefix = "error: job llm: refused by this node's launch rules: "
    assert said.startswith(prefix)
    why = said.removeprefix(prefix)
    # the simulated GPU is empty: only the launch rules stand in the way
    p = run("--mock-gpu", "--state-dir", state, "preview", "burn.llm")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"burn.llm would be refused: this node's launch rules: {why}"
    assert "would start" not in p.stdout
    # a type that may run still gets the admission answer, and how it would run
    ok = run("--mock-gpu", "--state-dir", state, "preview", "echo.echo")
    assert ok.stdout.splitlines()[:2] == [
        "would start now on a cpu slot",
        "it would run as a plain host process (no sandbox on this node)",
    ]


def test_explain_says_a_queued_job_the_rules_now_refuse_will_fail(tmp_path: Path) -> None:
    state = made_state(tmp_path / "state")
    # accepted where host types run (no config: container_runtime "local")
    r = run("--state-dir", state, "submit", "echo.echo", "--text", "x", "--id", "e1")
    assert r.returncode == 0, r.stderr
    # then the node's configuration changes to one that refuses host types
    strict = tmp_path / "strict.toml"
    strict.write_text('container_runtime = "bubblewrap"\n')
    e = run("--config", strict, "--state-dir", state, "explain", "e1")
    assert e.returncode == 0, e.stderr
    assert e.stdout.splitlines() == [
        "e1 (echo.echo) is queued",
        "it will fail when it is due to start: this node's launch rules refuse it now (it "
        "was accepted under another configuration): echo.echo is a host type (no sandbox) "
        "and this node runs jobs in bubblewrap: run a container type instead, or set "
        "allow_host_jobs = true",
    ]
    # under the configuration that accepted it, it is only waiting for a broker
    plain = run("--state-dir", state, "explain", "e1")
    assert "no broker is running here" in plain.stdout and "will fail" not in plain.stdout


# -- every shipped type runs with examples/local.toml -----------------------------------


def run_once(type_name: str, *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    extra = {"PATH": path} if path else {}
    return run("--mock-gpu", "--config", LOCAL, "run-once", type_name, *SHIPPED[type_name], **extra)


def assert_ran(type_name: str, r: subprocess.CompletedProcess[str]) -> None:
    assert "refused" not in r.stderr, r.stderr
    if r.returncode == 0:
        assert re.search(r"status\s+done", r.stdout), r.stdout
        return
    # audiogen needs its model staged (model_dir or a weights dir), which local.toml has not
    if type_name == "audiogen.stableaudio":
        assert re.search(r"status\s+failed", r.stdout), r.stdout + r.stderr
        assert re.search(r"no\s+model\s+folder:\s+this\s+node", r.stdout), r.stdout + r.stderr
        return
    if type_name == "speech.voxcpm2":  # its weights are staged by hand: none here
        assert "WeightsError: no model folder" in " ".join(r.stdout.split()), r.stdout + r.stderr
        return
    # the types that need more than Python: the embed extra (a real model) and the
    # speech extra (offline ASR)
    if type_name == "speech.check":
        assert os.environ.get("GPUWARDEN_REQUIRE_SPEECH") != "1", r.stdout + r.stderr
        assert "the speech extra is not installed" in r.stdout, r.stdout + r.stderr
        return
    assert type_name == "embed.minilm", r.stdout + r.stderr
    assert os.environ.get("GPUWARDEN_REQUIRE_EMBED") != "1", r.stdout + r.stderr
    assert "the embed extra is not installed" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_local_toml_runs_every_shipped_type_sandboxed_in_bubblewrap() -> None:
    need_tool("bwrap")
    for type_name in SHIPPED:
        r = run_once(type_name)
        assert_ran(type_name, r)
        # said once per broker, naming the one type that runs unsandboxed here
        [line] = unsandboxed_lines(r.stderr)
        assert "UNSANDBOXED on this node" in line and "echo.echo (host types beside" in line
    report = run_once("probe.sandbox")
    m = re.search(r"message\s+uid (\d+), CapEff 0, NoNewPrivs 1", report.stdout)
    assert m and m.group(1) != "0", report.stdout  # in the sandbox: not root


@pytest.mark.slow
def test_local_toml_without_bubblewrap_runs_them_unsandboxed_and_says_so_once(
    tmp_path: Path,
) -> None:
    path = no_bwrap_path(tmp_path)
    for type_name in ("burn.llm", "echo.serve", "probe.sandbox", "echo.echo"):
        r = run_once(type_name, path=path)
        assert_ran(type_name, r)
        [line] = unsandboxed_lines(r.stderr)
        assert line.split("WARNING gpuwarden.node.loop: ", 1)[1].startswith(
            "UNSANDBOXED on this node, as plain host processes with the broker's user: "
            + ", ".join(CONTAINER_AND_SERVE)
            + ' (container and serve types; container_runtime = "auto" found no sandbox here '
            "(bwrap is not on PATH"
        ), line
    probe = run_once("probe.sandbox", path=path)
    assert re.search(rf"message\s+uid {os.getuid()}, ", probe.stdout), probe.stdout


# -- VRAM admission through the CLI: admitted, held back, started -----------------------


def local_copy(tmp_path: Path) -> Path:
    """examples/local.toml in a folder of its own (its paths are relative)."""
    (tmp_path / "examples").mkdir()
    cfg = tmp_path / "examples" / "local.toml"
    shutil.copy(LOCAL, cfg)
    return cfg


def show(cfg: Path, job: str) -> dict[str, Any]:
    r = run("--config", cfg, "show", job, "--json")
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_a_vram_job_is_held_back_while_another_holds_the_gpu_then_started(
    tmp_path: Path,
) -> None:
    cfg = local_copy(tmp_path)
    log = tmp_path / "examples" / "events.log"
    serve = subprocess.Popen(
        [*GW, "--mock-gpu", "--config", str(cfg), "serve", "--log", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.stderr").open("w"),
        env=env(),
        start_new_session=True,
    )
    try:
        wait_for(lambda: log.exists() and "broker_started" in log.read_text(), "the broker")
        # llm holds 14 of 24 GiB until it is cancelled; it needs the GPU to itself
        r = run("--config", cfg, "submit", "burn.llm", "--id", "llm", "--seconds", "600")
        assert r.returncode == 0, r.stderr
        wait_for(lambda: show(cfg, "llm")["state"] == "running", "llm to run")
        r = run("--config", cfg, "submit", "burn.vision", "--id", "vision")
        assert r.returncode == 0, r.stderr
        # held back: it fits in the memory left, but not beside llm
        wait_for(lambda: "it waits:" in run("--config", cfg, "explain", "vision").stdout, "wait")
        lines = run("--config", cfg, "explain", "vision").stdout.splitlines()
        assert lines[:2] == [
            "vision (burn.vision) is queued",
            "footprint 6.0 GiB; it needs a GPU to itself",
        ]
        assert re.fullmatch(
            r"it waits: needs 6\.0 GiB on one GPU; (GPU-sim-\S+) is not empty \(burn\.llm "
            r"\(llm\), running\) and burn\.vision needs a GPU to itself\. \1 is held back for "
            r"it until it fits",
            lines[2],
        ), lines
        p = run("--config", cfg, "preview", "burn.vision").stdout.splitlines()
        assert p[1].startswith("would wait: ") and "burn.llm (llm), running" in p[1], p
        assert p[2] == "it would run sandboxed (bubblewrap)" or "UNSANDBOXED" in p[2], p
        # llm ends: vision starts on the GPU it was held back for, and finishes
        assert run("--config", cfg, "cancel", "llm").returncode == 0
        wait_for(lambda: show(cfg, "vision")["state"] == "done", "vision to finish")
        llm, vision = show(cfg, "llm"), show(cfg, "vision")
        assert llm["state"] == "cancelled"
        [llm_attempt], [vision_attempt] = llm["attempts_detail"], vision["attempts_detail"]
        assert vision_attempt["gpu"] == llm_attempt["gpu"]
        assert vision_attempt["started_at"] >= llm_attempt["ended_at"]
    finally:
        serve.terminate()
        assert serve.wait(60) == 0, (tmp_path / "serve.stderr").read_text()
    stderr = (tmp_path / "serve.stderr").read_text()
    assert len(unsandboxed_lines(stderr)) == 1, stderr  # said once, as it started


def readme_block(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def run_block(block: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A README block, verbatim, with ``bash -e`` in ``tmp_path`` (which holds the
    examples), where ``.venv/bin/gpuwarden`` is this interpreter's CLI."""
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    cli = venv_bin / "gpuwarden"
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpuwarden "$@"\n')
    cli.chmod(0o755)
    # its own process group: a block that stops early leaves no broker holding the pipes
    proc = subprocess.Popen(
        ["bash", "-e", "-c", block],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"the quick start did not finish in 100 s:\n{stdout}{stderr}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The README's quick-start block, verbatim, in a folder with the examples and
    a ``.venv/bin/gpuwarden`` that is this interpreter's CLI."""
    block = readme_block("## Quick start: VRAM admission")
    assert "submit burn.llm" in block and "explain vision" in block
    cfg = local_copy(tmp_path)
    done = run_block(block, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "waiting up to 60 s for a broker" in done.stderr or "node local" in out
    assert "submitted llm (burn.llm)" in out and "submitted vision (burn.vision)" in out
    assert re.search(r"^vision \(burn\.vision\) is (queued|running|done)$", out, re.MULTILINE)
    assert re.search(r"^job\s+whisper\s*$", out, re.MULTILINE) and re.search(r"status\s+done", out)
    assert "tightened permissions" not in done.stderr and "Traceback" not in done.stderr
    # admitted, held back, started: each needs the GPU to itself or beside sharers only
    jobs = {name: show(cfg, name) for name in ("llm", "vision", "whisper")}
    assert {j["state"] for j in jobs.values()} == {"done"}, jobs
    llm, vision, whisper = (jobs[n]["attempts_detail"][0] for n in ("llm", "vision", "whisper"))
    assert vision["started_at"] >= llm["ended_at"]
    assert whisper["started_at"] >= vision["ended_at"]
    assert len(unsandboxed_lines(done.stderr)) == 1  # the broker said it once


@pytest.mark.slow
def test_the_readme_command_job_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The README's first section: a broker, then ``gpuwarden run`` and an array."""
    block = readme_block("## Quick start: any command is a job")
    assert "gpuwarden run --vram" in block and "--array" in block
    cfg = local_copy(tmp_path)
    done = run_block(block, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^hello from GPU-sim-\S+$", done.stdout, re.MULTILINE), done.stdout
    ids = re.findall(r"^(sh-[0-9a-f]{8}_[0-3])$", done.stdout, re.MULTILINE)
    assert len(ids) == 4, done.stdout
    python = [j for j in json.loads(run("--config", cfg, "jobs", "--json").stdout)
              if j["type"] == "command:python3"]  # fmt: skip
    assert [j["state"] for j in python] == ["done"]
    assert "Traceback" not in done.stderr


def test_a_config_cannot_claim_what_auto_found_and_errors_list_auto(tmp_path: Path) -> None:
    forged = tmp_path / "forged.toml"
    forged.write_text('container_runtime = "local"\ncontainer_runtime_auto = "bubblewrap works"\n')
    r = run("--config", forged, "types")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "error: config key 'container_runtime_auto' is set by gpuwarden, not in a config "
        'file: write container_runtime = "auto"'
    )
    typo = tmp_path / "typo.toml"
    typo.write_text('container_runtime = "bwrap"\n')
    r = run("--config", typo, "types")
    assert r.returncode == 2
    assert (
        "key 'container_runtime': must be one of auto, local, podman, docker, bubblewrap "
        "(got 'bwrap')"
    ) in r.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("container_runtimes = 1\n")
    r = run("--config", unknown, "types")
    assert r.returncode == 2 and "allowed keys here: " in r.stderr
    assert "container_runtime_auto" not in r.stderr  # not a key a file may hold
