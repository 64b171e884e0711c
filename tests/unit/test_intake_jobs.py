"""Intake checks on job specs before anything is stored."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.errors import UserError, ValidationError
from gpuwarden.intake.jobs import JOB_ID, new_job_id, prepare, safe_relpath
from gpuwarden.registry import Registry

MODULES = Path(__file__).parents[2] / "src" / "gpuwarden" / "modules"

ECHO_DEFAULTS = {"output": "echo.txt", "sleep_s": 0, "exit_code": 0}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load([MODULES])


@pytest.fixture
def vram_registry(tmp_path: Path) -> Registry:
    """A vram-lane type with an input parameter, beside the shipped modules."""
    mod = tmp_path / "ocr"
    (mod / "src").mkdir(parents=True)
    (mod / "src" / "main.py").write_text("")
    (mod / "module.toml").write_text(
        """
[module]
name = "ocr"

[types.read]
lane = "vram"
launch = "container"
vram_gib = 4
command = ["{python}", "src/main.py"]

[types.read.params.scan]
type = "input"
required = true
"""
    )
    return Registry.load([tmp_path, MODULES], LaunchRules(allow_unsandboxed_containers=True))


def invalid(registry: Registry, spec: JobSpec) -> str:
    with pytest.raises(ValidationError) as info:
        prepare(registry, spec)
    assert isinstance(info.value, UserError)
    return str(info.value)


def echo(
    job_id: str = "job-1",
    *,
    params: dict[str, Any] | None = None,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
    priority: int = 0,
    vram_bytes: int | None = None,
) -> JobSpec:
    return JobSpec(
        id=job_id,
        type="echo.echo",
        params={"text": "hi"} if params is None else params,
        inputs=inputs,
        outputs=outputs,
        priority=priority,
        vram_bytes=vram_bytes,
    )


# --- success --------------------------------------------------------------------------


def test_prepare_fills_defaults(registry: Registry) -> None:
    spec = echo(priority=3)
    out = prepare(registry, spec)
    assert out.params == {"text": "hi", **ECHO_DEFAULTS}
    assert out.id == "job-1"
    assert out.type == "echo.echo"
    assert out.priority == 3
    assert out.vram_bytes is None
    assert spec.params == {"text": "hi"}  # the given spec is not changed


def test_prepare_keeps_given_params(registry: Registry) -> None:
    params = {"text": "x", "output": "o/out.txt", "sleep_s": 0.5, "exit_code": 3}
    assert prepare(registry, echo(params=params)).params == params


def test_prepare_normalises_inputs_and_outputs(registry: Registry) -> None:
    out = prepare(
        registry,
        echo(inputs=("a.txt", "./b.txt", "dir//c.txt"), outputs=("out/", "x/./y.json")),
    )
    assert out.inputs == ("a.txt", "b.txt", "dir/c.txt")
    assert out.outputs == ("out", "x/y.json")


def test_prepare_reports_param_problems(registry: Registry) -> None:
    assert invalid(registry, echo(params={"txt": "hi"})) == (
        "job type echo.echo: unknown parameter 'txt' (allowed: exit_code, output, sleep_s, "
        "text); missing required parameter 'text' (string)"
    )


# --- job ids --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job_id",
    ["", "-lead", ".lead", "_lead", "a b", "a/b", "a\\b", "x" * 129, "é", "a\nb", "a:b"],
)
def test_bad_job_id(registry: Registry, job_id: str) -> None:
    assert invalid(registry, echo(job_id)) == (
        f"job id {job_id!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


def test_job_id_with_trailing_newline_is_refused(registry: Registry) -> None:
    assert invalid(registry, echo("job\n")).startswith("job id 'job\\n' is not valid")


@pytest.mark.parametrize("job_id", ["a", "9", "A.b_c-1", "x" * 128, "echo-20261129T074212Z-3f9a1c"])
def test_good_job_id(registry: Registry, job_id: str) -> None:
    assert prepare(registry, echo(job_id)).id == job_id


def test_job_id_checked_before_the_type(registry: Registry) -> None:
    spec = JobSpec(id="bad id", type="nope.x")
    assert invalid(registry, spec).startswith("job id 'bad id' is not valid")


# --- type -----------------------------------------------------------------------------


def test_unknown_type(registry: Registry) -> None:
    spec = JobSpec(id="j1", type="nope.x", params={"text": "hi"})
    known = ", ".join(sorted(registry.types))
    assert "echo.echo" in known
    assert invalid(registry, spec) == f"unknown job type 'nope.x'; known types: {known}"


# --- paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a/..", "/"])
def test_unsafe_input_escapes(registry: Registry, path: str) -> None:
    assert invalid(registry, echo(inputs=(path,))) == (
        f"input {path!r} must be a relative path without '..'"
    )


@pytest.mark.parametrize("path", ["a\\b", "..\\x", "", "a\0b"])
def test_unsafe_input_malformed(registry: Registry, path: str) -> None:
    assert invalid(registry, echo(inputs=(path,))) == (
        f"input {path!r} is not a valid relative path"
    )


@pytest.mark.parametrize("path", ["/tmp/out", "../out", "x/../../out"])
def test_unsafe_output_escapes(registry: Registry, path: str) -> None:
    assert invalid(registry, echo(outputs=(path,))) == (
        f"output {path!r} must be a relative path without '..'"
    )


@pytest.mark.parametrize("path", ["out\\file", ""])
def test_unsafe_output_malformed(registry: Registry, path: str) -> None:
    assert invalid(registry, echo(outputs=(path,))) == (
        f"output {path!r} is not a valid relative path"
    )


def test_one_bad_path_among_good_ones(registry: Registry) -> None:
    message = invalid(registry, echo(inputs=("ok.txt", "../bad.txt")))
    assert message == "input '../bad.txt' must be a relative path without '..'"


def test_safe_relpath_directly() -> None:
    assert safe_relpath("a/b/c.txt", "input") == "a/b/c.txt"
    assert safe_relpath("dots..ok", "input") == "dots..ok"  # '..' inside a name is fine
    with pytest.raises(ValidationError) as info:
        safe_relpath("../x", "bundle entry")
    assert str(info.value) == "bundle entry '../x' must be a relative path without '..'"


@pytest.mark.parametrize("path", [".", "./"])
def test_output_naming_the_directory_itself_is_refused(registry: Registry, path: str) -> None:
    with pytest.raises(ValidationError):
        prepare(registry, echo(outputs=(path,)))


# --- vram override --------------------------------------------------------------------


def test_vram_override_on_cpu_lane_refused(registry: Registry) -> None:
    assert invalid(registry, echo("j1", vram_bytes=GIB)) == (
        "job j1: a VRAM footprint was given, but echo.echo runs on the cpu lane and never "
        "takes GPU memory"
    )


def test_vram_override_on_vram_lane(vram_registry: Registry) -> None:
    spec = JobSpec(
        id="j2", type="ocr.read", params={"scan": "p1.png"}, inputs=("p1.png",), vram_bytes=GIB
    )
    out = prepare(vram_registry, spec)
    assert out.vram_bytes == GIB
    assert out.params == {"scan": "p1.png"}


@pytest.mark.parametrize("vram", [0, -GIB])
def test_vram_override_must_be_positive(vram_registry: Registry, vram: int) -> None:
    spec = JobSpec(
        id="j3", type="ocr.read", params={"scan": "p.png"}, inputs=("p.png",), vram_bytes=vram
    )
    assert invalid(vram_registry, spec) == "job j3: the VRAM footprint must be > 0"


def test_input_param_matches_normalised_inputs(vram_registry: Registry) -> None:
    spec = JobSpec(
        id="j4", type="ocr.read", params={"scan": "pages/p.png"}, inputs=("./pages//p.png",)
    )
    out = prepare(vram_registry, spec)
    assert out.inputs == ("pages/p.png",)
    assert out.params == {"scan": "pages/p.png"}


def test_input_param_must_name_an_input(vram_registry: Registry) -> None:
    spec = JobSpec(id="j5", type="ocr.read", params={"scan": "q.png"}, inputs=("p.png",))
    assert invalid(vram_registry, spec) == (
        "job type ocr.read: parameter 'scan' names input 'q.png', which is not among the "
        "job's inputs (p.png)"
    )


# --- new_job_id -----------------------------------------------------------------------


def test_new_job_id_format() -> None:
    job_id = new_job_id("echo.echo")
    assert re.fullmatch(r"echo-[0-9a-f]{8}", job_id), job_id
    assert JOB_ID.fullmatch(job_id)


def test_new_job_id_for_a_bare_name() -> None:
    assert re.fullmatch(r"llm-[0-9a-f]{8}", new_job_id("llm"))


def test_new_job_id_is_unique() -> None:
    ids = {new_job_id("echo.echo") for _ in range(200)}
    assert len(ids) == 200


def test_a_type_the_launch_rules_refuse_is_refused_at_submission(registry: Registry) -> None:
    why = invalid(registry, JobSpec(id="c1", type="echo.container", params={"text": "x"}))
    assert why.startswith("job c1: refused by this node's launch rules: echo.container")
    assert "allow_unsandboxed_containers = true" in why


# --- constraints ------------------------------------------------------------------------


def test_constraints_are_checked_and_kept(vram_registry: Registry) -> None:
    want = {"min_gpu_vram_gib": 40, "gpu_model": "H100", "labels": {"rack": "a"}, "node": "n1"}
    spec = JobSpec(id="c1", type="ocr.read", params={"scan": "s"}, inputs=("s",), constraints=want)
    assert prepare(vram_registry, spec).constraints == want


def test_a_cpu_job_may_ask_for_a_node_and_labels(registry: Registry) -> None:
    spec = replace(echo("c2"), constraints={"node": "n1", "labels": {}})
    assert prepare(registry, spec).constraints == {"node": "n1", "labels": {}}


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ({"gpus": "H100"}, "unknown constraint 'gpus' (allowed: min_gpu_vram_gib, gpu_model,"),
        ({"gpu": "H100"}, "constraint gpu must be a GPU's UUID as `gpuwarden status` lists it"),
        ({"gpu": 3}, "constraint gpu must be a GPU's UUID"),
        ({"min_gpu_vram_gib": "40"}, "constraint min_gpu_vram_gib must be a number, got '40'"),
        ({"min_gpu_vram_gib": True}, "constraint min_gpu_vram_gib must be a number"),
        ({"min_gpu_vram_gib": 0}, "constraint min_gpu_vram_gib must be > 0"),
        ({"gpu_model": 3}, "constraint gpu_model must be a non-empty string, got 3"),
        ({"gpu_model": ""}, "constraint gpu_model must be a non-empty string"),
        ({"labels": ["a"]}, "constraint labels must be an object"),
        ({"labels": {"rack": 1}}, "constraint label rack must be a string, got 1"),
        ({"node": "../x"}, "constraint node '../x' is not a node name"),
    ],
)
def test_bad_constraints_are_refused(
    vram_registry: Registry, constraints: dict[str, Any], message: str
) -> None:
    spec = JobSpec(
        id="c3", type="ocr.read", params={"scan": "s"}, inputs=("s",), constraints=constraints
    )
    assert invalid(vram_registry, spec).startswith(f"job c3: {message}")


@pytest.mark.parametrize("key", ["min_gpu_vram_gib", "gpu_model"])
def test_gpu_constraints_only_for_the_vram_lane(registry: Registry, key: str) -> None:
    value: Any = 8 if key == "min_gpu_vram_gib" else "A100"
    spec = replace(echo("c4"), constraints={key: value})
    assert invalid(registry, spec) == (
        f"job c4: constraint {key} asks for a GPU, but echo.echo runs on the cpu lane "
        "and never uses one"
    )


def test_an_id_of_an_api_tokens_form_is_only_that_tokens(registry: Registry) -> None:
    """``<12 hex>-...`` ids are an API submitter's own: a bundle or the local CLI
    (no token) may not take one, or that submitter would meet it over HTTP."""
    spec = JobSpec(id="0a1b2c3d4e5f-run-7", type="echo.echo", params={"text": "x"})
    with pytest.raises(ValidationError, match="belong to the API token with that id"):
        prepare(registry, spec)
    with pytest.raises(ValidationError, match="belong to the API token"):
        prepare(registry, spec, owner="ffffffffffff")
    assert prepare(registry, spec, owner="0a1b2c3d4e5f").id == "0a1b2c3d4e5f-run-7"
    # other ids with hex in them are anyone's
    for free in ("0a1b2c3d4e5-x", "0a1b2c3d4e5fx-y", "run-0a1b2c3d4e5f"):
        assert prepare(registry, replace(spec, id=free)).id == free


def test_prepare_checks_after_and_names_the_job(registry: Registry) -> None:
    out = prepare(registry, replace(echo(), after=("afterok:a", "afterany:b")))
    assert out.after == ("afterok:a", "afterany:b")
    with pytest.raises(ValidationError, match=r"job job-1: dependency 'ok:a': unknown kind"):
        prepare(registry, replace(echo(), after=("ok:a",)))
