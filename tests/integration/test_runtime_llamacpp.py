"""A REAL llama.cpp server as a managed runtime: llama-cpp-python's
``python -m llama_cpp.server`` (its ``[server]`` extra) serving a tiny GGUF
model written here with ``gguf`` (random weights, a 33-token SentencePiece-style
vocabulary), on the CPU. It answers a real completion; its pid is then charged
on the simulated GPU (it runs on no GPU), and the client and a broker are checked
against what it really answers.

What it has, found by running it (llama-cpp-python 0.3.36, a FastAPI app,
``llama_cpp/server/app.py``): ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings`` and ``/extras/*``; ``/models``,
``/slots``, ``/metrics``, ``/health`` and ``/props`` answer FastAPI's 404. So
it is a single-model server with no busy signal and no release: it is looked at,
its memory named, and never asked.

Skipped when ``llama_cpp`` (with its server's dependencies) or ``gguf`` cannot be
imported, unless ``GPUWARDEN_REQUIRE_LLAMA=1``: then it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

try:
    import gguf
    import llama_cpp
    import llama_cpp.server.app  # noqa: F401  (its [server] extra: fastapi, uvicorn, ...)
    import numpy as np
except ImportError as missing:
    if os.environ.get("GPUWARDEN_REQUIRE_LLAMA") == "1":
        pytest.fail(
            f"GPUWARDEN_REQUIRE_LLAMA=1 but llama-cpp-python[server] or gguf is missing: {missing}",
            pytrace=False,
        )
    pytest.skip(
        f"llama-cpp-python[server] and gguf are not installed ({missing}); "
        "set GPUWARDEN_REQUIRE_LLAMA=1 to make this a failure",
        allow_module_level=True,
    )

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.gpu.sim import SimDevice
from gpuwarden.runtimes.llama import SINGLE_NOTE, LlamaServerClient
from tests.brokerkit import submit
from tests.integration.test_broker import make_config

#: the most any wait below lasts (a bound on waiting, not an assertion on speed)
WAIT_S = 120.0
VOCAB = ["<unk>", "<s>", "</s>", "▁", *"abcdefghijklmnopqrstuvwxyz", "▁hello", "▁world", "▁the"]


def write_tiny_gguf(path: Path) -> Path:
    """A llama-architecture GGUF small enough to write in a test (about 350 KB).

    What llama.cpp needs, found by taking keys out one at a time: the
    architecture; ``llama.context_length``, ``.embedding_length``,
    ``.block_count``, ``.feed_forward_length``, ``.attention.head_count``,
    ``.attention.layer_norm_rms_epsilon``; ``tokenizer.ggml.model`` and
    ``.tokens``; and the tensors ``token_embd``, ``output_norm`` and, per block,
    ``attn_norm``, ``attn_q/k/v/output``, ``ffn_norm``, ``ffn_gate/up/down``
    (``output`` may be left out: tied to ``token_embd``). Scores, token types and
    the special token ids are written too: cheap, and what a real model has.
    """
    n_vocab, n_embd, n_head, n_layer, n_ff = len(VOCAB), 64, 4, 2, 128
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("gpuwarden-tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(VOCAB)
    writer.add_token_scores([0.0] * 3 + [-1.0] * (n_vocab - 3))
    control = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    writer.add_token_types(control + [gguf.TokenType.NORMAL] * (n_vocab - 3))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        values = np.ones(shape) if ones else rng.standard_normal(shape) * 0.02
        writer.add_tensor(name, values.astype(np.float32))

    tensor("token_embd.weight", n_vocab, n_embd)  # numpy (rows, cols): GGUF {cols, rows}
    tensor("output_norm.weight", n_embd, ones=True)
    for i in range(n_layer):
        tensor(f"blk.{i}.attn_norm.weight", n_embd, ones=True)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{part}.weight", n_embd, n_embd)
        tensor(f"blk.{i}.ffn_norm.weight", n_embd, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    port = free_port()
    log = tmp_path / "llama_cpp.server.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model)]
    command += ["--port", str(port), "--host", "127.0.0.1", "--n_ctx", "128", "--n_threads", "2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:  # it answers once uvicorn runs and the model is loaded
            assert proc.poll() is None, f"llama_cpp.server exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"it never answered: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        yield Server(proc, url, str(model), log)
        assert proc.poll() is None, f"llama_cpp.server died: {log.read_text()[-2000:]}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def until(node: Node, check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        node.broker.tick()
        time.sleep(0.05)


def test_a_real_llama_cpp_server_is_named_looked_at_and_never_asked(
    server: Server, tmp_path: Path
) -> None:
    # a real completion, a few tokens from the random model
    answer = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hello world", "max_tokens": 4, "temperature": 0},
        timeout=WAIT_S,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] >= 1

    # what the client finds it has (measured, not assumed: see the docstring)
    client = LlamaServerClient(server.url, timeout_s=10)
    caps = client.probe()
    assert caps.busy_signal is BusySignal.NONE
    assert caps.release is ReleaseSafety.NOT_RELEASABLE
    assert caps.notes[0] == f"GET /models answered 404: single-model, serving {server.model}"
    assert "GET /metrics answered 404 and GET /slots 404" in caps.notes[1]
    assert SINGLE_NOTE in caps.notes
    reading = client.read()
    assert reading.activity is Activity.UNKNOWN
    assert [m.name for m in reading.loaded] == [server.model]
    client.close()

    raw = make_config(tmp_path).model_dump()
    raw["sim_gpu"]["count"] = 1
    base = Config.model_validate(raw)
    with open_node(base, mock_gpu=True) as first:  # creates the device state
        gpu = first.probe.read()[0].uuid
    device = SimDevice.open(base.state_dir / SIM_STATE_FILE)
    held = device.allocate(gpu, 16 * GIB, pid=server.proc.pid, label="llama.cpp model")
    raw["runtimes"] = [
        {"name": "llamacpp", "kind": "llama-server", "url": server.url, "idle_grace_s": 0}
    ]
    try:
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            broker = node.broker
            broker.runtimes.start()
            try:
                until(
                    node,
                    lambda: (
                        bool(broker.vram.views())
                        and broker.vram.views()[0].runtimes == (("llamacpp", 16 * GIB),)
                        and broker.status().runtimes[0]["state"] == "unknown"
                    ),
                    "its memory named and its state read",
                )
                assert broker.vram.views()[0].foreign_bytes == 0  # the runtime's, not foreign
                [row] = broker.status().runtimes
                assert (row["kind"], row["busy_signal"], row["release"]) == (
                    "llama-server",
                    "none",
                    "not-releasable",
                )
                assert server.proc.pid in row["pids"]  # type: ignore[operator]
                submit(node, JobSpec("j", "testmods.gpu", {"gib": 12}, vram_bytes=12 * GIB))
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:
                    broker.tick()
                    time.sleep(0.05)
                reason = broker.wait_reason("j") or ""
                assert "The runtime llamacpp holds 16.0 GiB" in reason, reason
                assert "cannot be asked to release" in reason, reason
                assert not [e for e in node.store.events() if e.kind.startswith("runtime_rel")]
                job = node.store.get_job("j")
                assert job is not None and job.state is JobState.QUEUED
            finally:
                broker.runtimes.stop()
    finally:
        device.free(held)
    assert server.proc.poll() is None  # looked at, never stopped
    again = httpx.post(f"{server.url}/v1/completions", json={"prompt": "the", "max_tokens": 2})
    assert again.status_code == 200  # and it still serves
