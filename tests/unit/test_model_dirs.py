"""``[modules.<name>] model_dir``: the folder reaches the jobs and warm servers of
that module's types, and no other's (their environment, and in a sandbox a
read-only mount at /gpuwarden/model in the runtime's own command line)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import node_settings
from gpuwarden.config import Config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import Attempt, Job, JobType
from gpuwarden.core.states import JobState
from gpuwarden.launch.base import LaunchRequest
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.sandbox import SandboxLauncher, sandbox_env
from gpuwarden.node.attempts import Launching
from gpuwarden.node.running import RunningAttempt
from gpuwarden.registry import Registry

IMAGE = "sha256:" + "a" * 64
MODEL = "/gpuwarden/model"


class NoGpu:
    """A probe that makes no GPU visible (the jobs here are given none)."""

    def job_env(self, gpu: str | None) -> dict[str, str]:
        return {}


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    made = {"audiogen": tmp_path / "sao", "speech": tmp_path / "voxcpm2"}
    for folder in made.values():
        folder.mkdir()
    return made


def launching(tmp_path: Path, runtime: Runtime, models: dict[str, Path]) -> Launching:
    (tmp_path / "state").mkdir(mode=0o700)
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "n",
            "container_runtime": runtime.value,
            "sandbox_image": IMAGE if runtime.needs_image else "",
            "modules": {name: {"model_dir": str(path)} for name, path in models.items()},
        }
    )
    config.check_modules()
    settings = node_settings(config)
    registry = Registry.load([], settings.rules, installed=False)
    if runtime is Runtime.BUBBLEWRAP:
        sandbox = SandboxLauncher(runtime, pids_cgroups=None, as_root=False, memory_cgroups=None)
    else:
        sandbox = SandboxLauncher(runtime, image=IMAGE, mixed_cgroups=False, as_root=False)
    return Launching(
        settings=settings,
        probe=NoGpu(),  # type: ignore[arg-type]
        registry=registry,
        sandbox=sandbox,
        instance="n-test",
        emit=lambda *a, **k: None,
    )


def job_request(launch: Launching, type_name: str) -> LaunchRequest:
    jobtype = launch.registry.types[type_name]
    job = Job(
        id=f"j-{type_name.replace('.', '-')}",
        type=type_name,
        state=JobState.RUNNING,
        priority=0,
        params={},
        inputs=(),
        outputs=(),
        vram_bytes=None,
        submitted_at=0.0,
        updated_at=0.0,
    )
    attempt = Attempt(job_id=job.id, number=1, node="n", gpu_uuid=None, started_at=0.0)
    run = RunningAttempt(
        job=job, attempt=attempt, jobtype=jobtype, attempt_dir=launch.attempt_dir(job.id, 1)
    )
    return launch.request(run, None, 0.0)


def model_binds(runtime: Runtime, argv: list[str]) -> list[Any]:
    """The runtime's flags that mount something at /gpuwarden/model."""
    if runtime is Runtime.BUBBLEWRAP:
        return [
            (a, b, c)
            for a, b, c in zip(argv, argv[1:], argv[2:], strict=False)
            if c == MODEL and a != "--setenv"
        ]
    return [(a, b) for a, b in itertools.pairwise(argv) if f"target={MODEL}" in b]


def expected_bind(runtime: Runtime, folder: Path) -> list[Any]:
    if runtime is Runtime.BUBBLEWRAP:
        return [("--ro-bind", str(folder), MODEL)]
    return [("--mount", f"type=bind,source={folder},target={MODEL},readonly")]


@pytest.mark.parametrize("runtime", [Runtime.BUBBLEWRAP, Runtime.PODMAN, Runtime.DOCKER])
def test_a_job_of_the_module_gets_its_folder_read_only_and_others_do_not(
    tmp_path: Path, models: dict[str, Path], runtime: Runtime
) -> None:
    launch = launching(tmp_path, runtime, models)
    assert launch.sandbox is not None
    for type_name, folder in (
        ("audiogen.stableaudio", models["audiogen"]),
        ("speech.check", models["speech"]),
    ):
        req = job_request(launch, type_name)
        assert req.env["GPUWARDEN_MODEL_DIR"] == str(folder)  # the host path
        assert sandbox_env(req)["GPUWARDEN_MODEL_DIR"] == MODEL  # as the job sees it
        argv = launch.sandbox.argv(req)
        assert model_binds(runtime, argv) == expected_bind(runtime, folder)
    for other in ("echo.container", "probe.sandbox"):
        req = job_request(launch, other)
        assert "GPUWARDEN_MODEL_DIR" not in req.env
        assert "GPUWARDEN_MODEL_DIR" not in sandbox_env(req)
        argv = launch.sandbox.argv(req)
        assert model_binds(runtime, argv) == []
        assert not any(MODEL in a for a in argv)
        assert not any(str(f) in a for a in argv for f in models.values())


@pytest.mark.parametrize("runtime", [Runtime.BUBBLEWRAP, Runtime.PODMAN])
def test_a_warm_server_of_the_module_gets_its_folder_and_others_do_not(
    tmp_path: Path, models: dict[str, Path], runtime: Runtime
) -> None:
    launch = launching(tmp_path, runtime, models)
    types = launch.registry.types
    for jobtype, folder in (
        (types["speech.voxcpm2"], models["speech"]),
        (types["echo.serve"], None),
    ):
        log_dir = tmp_path / "warm" / jobtype.name
        (log_dir / "exchange").mkdir(parents=True)
        # a sandboxed server is given no GPU device here: a CPU-only server
        launcher, req = launch.server_request(jobtype, "", 1, log_dir, log_dir / "serve.sock")
        req = dataclasses.replace(req, gpu_uuid=None)
        argv = launcher.argv(req)
        if folder is None:
            assert "GPUWARDEN_MODEL_DIR" not in req.env
            assert model_binds(runtime, argv) == []
        else:
            assert req.env["GPUWARDEN_MODEL_DIR"] == str(folder)
            assert sandbox_env(req)["GPUWARDEN_MODEL_DIR"] == MODEL
            assert model_binds(runtime, argv) == expected_bind(runtime, folder)


def test_unsandboxed_jobs_get_the_host_path_and_a_commits_module_gets_none(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    (tmp_path / "state").mkdir(mode=0o700)
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "allow_unsandboxed_containers": True,
            "modules": {"audiogen": {"model_dir": str(models["audiogen"])}},
        }
    )
    settings = node_settings(config)
    launch = Launching(
        settings=settings,
        probe=NoGpu(),  # type: ignore[arg-type]
        registry=Registry.load([], settings.rules, installed=False),
        sandbox=None,
        instance="n-test",
        emit=lambda *a, **k: None,
    )
    req = job_request(launch, "audiogen.stableaudio")
    assert req.mounts == () and req.env["GPUWARDEN_MODEL_DIR"] == str(models["audiogen"])
    assert "GPUWARDEN_MODEL_DIR" not in job_request(launch, "echo.container").env
    # a type from a commit is of a module of its own, whatever its module.toml says
    stableaudio: JobType = launch.registry.types["audiogen.stableaudio"]
    from_commit = dataclasses.replace(stableaudio, module="audiogen@" + "b" * 40)
    assert launch.model_dir(stableaudio) == models["audiogen"]
    assert launch.model_dir(from_commit) is None
    # an unsandboxed warm server's load scratch is made for it, as a sandboxed
    # one's is (issue 31: speech.voxcpm2 never loaded without a sandbox)
    log_dir = tmp_path / "warm" / "speech.voxcpm2"
    (log_dir / "exchange").mkdir(parents=True)
    voxcpm = launch.registry.types["speech.voxcpm2"]
    launcher, _ = launch.server_request(voxcpm, "", 1, log_dir, log_dir / "serve.sock")
    assert isinstance(launcher, HostLauncher) and (log_dir / "scratch").is_dir()


def test_a_node_does_not_start_while_a_model_dir_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """open_node (serve, agent, run-once) checks every model_dir before anything
    runs; a table of a module it did not load is only logged."""
    from gpuwarden.app import open_node
    from gpuwarden.errors import ConfigError

    def config(modules: dict[str, Any]) -> Config:
        return Config.model_validate(
            {"state_dir": tmp_path / "state", "gpu": "sim", "modules": modules}
        )

    missing = {"audiogen": {"model_dir": str(tmp_path / "nowhere")}}
    refused = r"^\[modules\.audiogen\] model_dir .*nowhere does not"
    with pytest.raises(ConfigError, match=refused), open_node(config(missing), mock_gpu=True):
        pass
    (tmp_path / "sao").mkdir()
    fine = {"audiogen": {"model_dir": str(tmp_path / "sao")}, "audiogne": {}}
    with open_node(config(fine), mock_gpu=True) as node:
        assert node.broker.settings.model_dirs == {"audiogen": tmp_path / "sao"}
    assert "[modules.audiogne] names no module this node loaded" in caplog.text
