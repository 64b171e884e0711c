"""parse_manifest: the strict reading of a bundle's manifest.json."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import BundleLimits, manifest_doc, parse_manifest


def _doc(*jobs: dict[str, Any], **top: Any) -> bytes:
    doc: dict[str, Any] = {"version": 1, "jobs": list(jobs)}
    doc.update(top)
    return json.dumps(doc).encode()


def _job(**overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {"id": "hello-1", "type": "echo.echo"}
    job.update(overrides)
    return job


def test_full_example() -> None:
    data = _doc(
        {
            "id": "hello-1",
            "type": "echo.echo",
            "params": {"text": "hi", "n": [1, {"x": None}]},
            "inputs": ["a.txt", "sub/b.bin"],
            "outputs": ["hello.txt"],
            "priority": -3,
            "vram_gib": 8,
        },
        {"id": "B_2.x", "type": "sd.txt2img", "vram_gib": 0.5},
    )
    jobs = parse_manifest(data)
    assert jobs == (
        JobSpec(
            id="hello-1",
            type="echo.echo",
            params={"text": "hi", "n": [1, {"x": None}]},
            inputs=("a.txt", "sub/b.bin"),
            outputs=("hello.txt",),
            priority=-3,
            vram_bytes=8 * GIB,
        ),
        JobSpec(id="B_2.x", type="sd.txt2img", vram_bytes=GIB // 2),
    )


def test_defaults() -> None:
    (job,) = parse_manifest(_doc(_job()))
    assert job == JobSpec(id="hello-1", type="echo.echo")
    assert job.params == {} and job.inputs == () and job.outputs == ()
    assert job.priority == 0 and job.vram_bytes is None


def test_utf8_bom_and_non_ascii_params() -> None:
    data = b"\xef\xbb\xbf" + _doc(_job(params={"text": "grüß dich ✓"}))
    (job,) = parse_manifest(data)
    assert job.params == {"text": "grüß dich ✓"}


def test_tiny_vram_rounds_up_to_one_byte() -> None:
    (job,) = parse_manifest(_doc(_job(vram_gib=1e-12)))
    assert job.vram_bytes == 1


def test_max_jobs_boundary() -> None:
    jobs = [_job(id=f"j{i}") for i in range(3)]
    assert len(parse_manifest(_doc(*jobs), limits=BundleLimits(max_jobs=3))) == 3
    with pytest.raises(BundleError, match=r"has 4 jobs, more than the limit of 3"):
        parse_manifest(_doc(*jobs, _job(id="j3")), limits=BundleLimits(max_jobs=3))


def test_default_max_jobs_is_1000() -> None:
    jobs = [_job(id=f"j{i}") for i in range(1001)]
    with pytest.raises(BundleError, match=r"1001 jobs, more than the limit of 1000"):
        parse_manifest(_doc(*jobs))


def test_manifest_too_big() -> None:
    data = _doc(_job(params={"pad": "x" * 2000}))
    with pytest.raises(BundleError, match=r"more than the limit"):
        parse_manifest(data, limits=BundleLimits(max_manifest_bytes=1000))


def test_where_is_named() -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_doc(_job(priority="high")), where="bundle x.zip: manifest.json")
    assert info.value.message == (
        'bundle x.zip: manifest.json: jobs[0].priority must be an integer, got "high"'
    )


def test_error_names_the_job_index() -> None:
    data = _doc(_job(id="a"), _job(id="b"), _job(id="c", priority="high"))
    with pytest.raises(BundleError) as info:
        parse_manifest(data)
    assert info.value.message == 'manifest.json: jobs[2].priority must be an integer, got "high"'


BAD: list[tuple[str, bytes, str]] = [
    # --- the document
    ("not utf-8", b'{"version": 1, "jobs": ["\xff"]}', r"not UTF-8 text"),
    ("not json", b'{"version": 1, "jobs": [', r"not valid JSON"),
    ("empty", b"", r"not valid JSON"),
    ("trailing garbage", _doc(_job()) + b" x", r"not valid JSON"),
    ("NaN", b'{"version": 1, "jobs": [{"id": "a", "type": "m.t", "vram_gib": NaN}]}', r"NaN"),
    ("duplicate key", b'{"version": 1, "version": 1, "jobs": []}', r'duplicate key "version"'),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, r"nested too deeply|not valid JSON"),
    ("array", b"[]", r"must be a JSON object, got array"),
    ("string", b'"hi"', r"must be a JSON object, got string"),
    ("null", b"null", r"must be a JSON object, got null"),
    # --- top level
    ("unknown top key", _doc(_job(), extra=1), r'unknown key "extra" \(allowed: version, jobs\)'),
    ("missing version", json.dumps({"jobs": [_job()]}).encode(), r'missing required key "version"'),
    ("version 2", _doc(_job(), version=2), r"version must be 1, got 2"),
    ("version string", _doc(_job(), version="1"), r'version must be 1, got "1"'),
    ("version true", _doc(_job(), version=True), r"version must be 1, got true"),
    ("version float", _doc(_job(), version=1.0), r"version must be 1, got 1.0"),
    ("missing jobs", b'{"version": 1}', r'missing required key "jobs"'),
    ("jobs object", b'{"version": 1, "jobs": {}}', r"jobs must be an array, got object"),
    ("jobs empty", _doc(), r"jobs is empty"),
    ("job not object", _doc("x"), r"jobs\[0\] must be an object, got string"),  # type: ignore[arg-type]
    # --- job keys
    ("unknown job key", _doc(_job(gpu=1)), r'jobs\[0\]: unknown key "gpu"'),
    ("missing id", _doc({"type": "m.t"}), r'jobs\[0\]: missing required key "id"'),
    ("missing type", _doc({"id": "a"}), r'jobs\[0\]: missing required key "type"'),
    # --- id
    ("id int", _doc(_job(id=5)), r"jobs\[0\]\.id must be a string, got 5"),
    ("id empty", _doc(_job(id="")), r'jobs\[0\]\.id "" is not a valid job id'),
    ("id space", _doc(_job(id="a b")), r'jobs\[0\]\.id "a b" is not a valid job id'),
    ("id slash", _doc(_job(id="a/b")), r"not a valid job id"),
    ("id dot first", _doc(_job(id=".a")), r"not a valid job id"),
    ("id dash first", _doc(_job(id="-a")), r"not a valid job id"),
    ("id dotdot", _doc(_job(id="..")), r"not a valid job id"),
    ("id newline", _doc(_job(id="a\n")), r"not a valid job id"),
    ("id too long", _doc(_job(id="a" * 129)), r"not a valid job id"),
    ("id unicode", _doc(_job(id="jöb")), r"not a valid job id"),
    (
        "duplicate id",
        _doc(_job(id="a"), _job(id="b"), _job(id="a")),
        r'\[2\]\.id "a" repeats jobs\[0\]\.id',
    ),
    # --- type
    ("type int", _doc(_job(type=3)), r"jobs\[0\]\.type must be a string, got 3"),
    ("type no dot", _doc(_job(type="echo")), r"type must look like 'module.type', got \"echo\""),
    ("type empty part", _doc(_job(type="echo.")), r"must look like 'module.type'"),
    ("type two dots", _doc(_job(type="a.b.c")), r"must look like 'module.type'"),
    # --- params
    ("params list", _doc(_job(params=[1])), r"jobs\[0\]\.params must be an object, got array"),
    ("params null", _doc(_job(params=None)), r"params must be an object, got null"),
    # --- inputs / outputs
    (
        "inputs string",
        _doc(_job(inputs="a.txt")),
        r"\.inputs must be an array of paths, got string",
    ),
    ("inputs item int", _doc(_job(inputs=[1])), r"jobs\[0\]\.inputs\[0\] must be a string, got 1"),
    (
        "inputs absolute",
        _doc(_job(inputs=["/etc/passwd"])),
        r'\[0\] "/etc/passwd" is not a relative path: .*absolute',
    ),
    ("inputs drive", _doc(_job(inputs=["C:/x"])), r"absolute"),
    ("inputs dotdot", _doc(_job(inputs=["a/../../b"])), r"'\.\.' component"),
    ("inputs backslash", _doc(_job(inputs=["a\\b"])), r"backslash"),
    ("inputs nul", _doc(_job(inputs=["a\u0000b"])), r"NUL"),
    ("inputs empty", _doc(_job(inputs=[""])), r"empty"),
    ("inputs trailing slash", _doc(_job(inputs=["sub/"])), r"empty or '\.' component"),
    ("inputs dot", _doc(_job(inputs=["./a"])), r"empty or '\.' component"),
    (
        "inputs duplicate",
        _doc(_job(inputs=["a", "b", "a"])),
        r'\[2\] "a" repeats jobs\[0\]\.inputs\[0\]',
    ),
    (
        "outputs dotdot",
        _doc(_job(outputs=["../x"])),
        r'outputs\[0\] "\.\./x" is not a relative path',
    ),
    ("outputs object", _doc(_job(outputs={})), r"outputs must be an array of paths, got object"),
    # --- priority
    ("priority string", _doc(_job(priority="high")), r'\.priority must be an integer, got "high"'),
    ("priority float", _doc(_job(priority=1.5)), r"priority must be an integer, got 1.5"),
    ("priority bool", _doc(_job(priority=True)), r"priority must be an integer, got true"),
    ("priority null", _doc(_job(priority=None)), r"priority must be an integer, got null"),
    ("priority huge", _doc(_job(priority=2**63)), r"priority is out of range"),
    # --- vram_gib
    ("vram zero", _doc(_job(vram_gib=0)), r"jobs\[0\]\.vram_gib must be greater than 0, got 0"),
    ("vram negative", _doc(_job(vram_gib=-2)), r"vram_gib must be greater than 0, got -2"),
    ("vram negative float", _doc(_job(vram_gib=-0.5)), r"greater than 0, got -0.5"),
    ("vram string", _doc(_job(vram_gib="8")), r'vram_gib must be a number, got "8"'),
    ("vram bool", _doc(_job(vram_gib=True)), r"vram_gib must be a number, got true"),
    ("vram null", _doc(_job(vram_gib=None)), r"vram_gib must be a number, got null"),
    ("vram absurd", _doc(_job(vram_gib=1e300)), r"vram_gib must be at most"),
]


@pytest.mark.parametrize(("data", "match"), [(d, m) for _, d, m in BAD], ids=[c for c, _, _ in BAD])
def test_invalid(data: bytes, match: str) -> None:
    with pytest.raises(BundleError, match=match) as info:
        parse_manifest(data)
    assert info.value.message.startswith("manifest.json: ")


def test_error_values_are_shortened() -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_doc(_job(priority="x" * 500)))
    assert len(info.value.message) < 150
    assert info.value.message.endswith('..."') or info.value.message.endswith("...")


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("env", {"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD"),
        ("env", {"LD_LIBRARY_PATH": "/tmp", "NVIDIA_VISIBLE_DEVICES": "all"}, "NVIDIA_VISIBLE"),
        ("mounts", ["/etc:/etc"], "extra mounts"),
        ("volumes", ["/:/host"], "extra mounts"),
        ("devices", ["/dev/nvidia0"], "devices"),
        ("privileged", True, "privileges"),
        # a count is a request for that many GPUs (the broker picks them); names are not
        ("gpus", ["GPU-0", "GPU-1"], "devices"),
        ("gpus", "all", "devices"),
        ("gpus", True, "devices"),
    ],
)
def test_a_job_cannot_widen_its_sandbox(key: str, value: Any, named: str) -> None:
    with pytest.raises(BundleError) as err:
        parse_manifest(_doc(_job(**{key: value})))
    text = str(err.value)
    assert f"jobs[0]: key {key!r}: a job cannot set" in text and named in text


def test_constraints_are_read_and_checked() -> None:
    want = {"min_gpu_vram_gib": 40.5, "gpu_model": "A100", "labels": {"rack": "b"}, "node": "n2"}
    [job] = parse_manifest(_doc(_job(constraints=want)))
    assert job.constraints == want
    [plain] = parse_manifest(_doc(_job()))
    assert plain.constraints == {}


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ([], "constraints must be an object"),
        ({"zone": "x"}, "unknown constraint 'zone'"),
        ({"min_gpu_vram_gib": -1}, "constraint min_gpu_vram_gib must be > 0"),
        ({"labels": {"k": None}}, "constraint label k must be a string"),
    ],
)
def test_bad_constraints_are_refused(constraints: Any, message: str) -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_doc(_job(constraints=constraints)))
    assert f"jobs[0].constraints: {message}" in str(info.value)


def test_constraints_survive_writing_a_bundle() -> None:
    spec = JobSpec(id="w1", type="echo.echo", constraints={"node": "n1"})
    [back] = parse_manifest(json.dumps(manifest_doc([spec])).encode())
    assert back.constraints == {"node": "n1"}


def test_after_is_read_and_checked() -> None:
    [job] = parse_manifest(_doc(_job(after=["afterok:prep", "afternotok:x.1"])))
    assert job.after == ("afterok:prep", "afternotok:x.1")
    [plain] = parse_manifest(_doc(_job()))
    assert plain.after == ()
    [back] = parse_manifest(json.dumps(manifest_doc([job])).encode())
    assert back.after == job.after


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ("afterok:a", "after must be an array of strings"),
        ([1], "a dependency must be a string"),
        (["a"], "is not KIND:ID"),
        (["before:a"], "unknown kind 'before'"),
        (["afterok:a", "afterok:a"], "named twice"),
    ],
)
def test_bad_after_is_refused(after: Any, message: str) -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_doc(_job(after=after)))
    assert "jobs[0].after" in str(info.value)
    assert message in str(info.value)
