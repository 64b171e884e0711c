"""speech.voxcpm2: text to speech with VoxCPM2, served warm.

A serve worker (launch mode ``serve``, SPEC.md and :mod:`gpuwarden.server.worker`):
``load`` runs once per worker and loads VoxCPM2 from a staged folder (the node's
``[modules.speech] model_dir``, else under ``[sandbox] weights_dir``; never the
network) and checks it (:mod:`voxload`); ``handle`` runs once per job and
writes ``speech.wav`` (mono, at the model's rate: 48 kHz for VoxCPM2) and
``result.json`` to the job's output folder.

The voice comes from a reference recording (the input ``reference``): with its
transcript (``reference_text``) the model continues it (continuation cloning),
without one it takes the recording's timbre only. The encoded reference (the
*prompt cache*) is kept in a bounded LRU keyed by the sha256 of the recording's
bytes and the transcript, so jobs in the same voice skip re-encoding it.

Long texts are split at sentence boundaries into chunks of at most
``chunk_chars`` characters (:data:`MAX_CHUNK_CHARS` by default), spoken one by
one and joined. With
``stream = true`` the audio is written as it comes, as ``chunks/0001.wav``,
``chunks/0002.wav``, ... (each file complete when it appears), and the joined
``speech.wav`` at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import voxload

#: the model folder's name under the weights mount (``[sandbox] weights_dir``); the
#: module's own folder (``[modules.speech] model_dir``) is the model itself
WEIGHTS_SUBDIRS = ("VoxCPM2", "openbmb/VoxCPM2", "")
#: the longest text of one job, in characters
MAX_TEXT_CHARS = 5000
#: the longest chunk the model is given at once, in characters (the default of
#: the parameter chunk_chars, and its range)
MAX_CHUNK_CHARS = 300
CHUNK_CHARS_RANGE = (20, 1000)
#: the longest reference recording, in seconds: the encoded reference sits in the
#: model's context window for every chunk (twice with a transcript)
MAX_REFERENCE_S = 30.0
#: the largest reference file, in bytes (it is read whole to be hashed)
MAX_REFERENCE_BYTES = 64 * 1024 * 1024
#: the longest transcript of the reference, in characters
MAX_REFERENCE_TEXT_CHARS = 1000
CFG_RANGE = (1.0, 10.0)
TIMESTEPS_RANGE = (1, 100)
MAX_STEPS_RANGE = (1, 8192)
SEED_RANGE = (0, 2**63 - 1)
#: encoded reference voices kept (each is a few hundred KB of latents at most)
PROMPT_CACHE_SIZE = 16
#: stream = true: a chunk file is written once this much audio has come
STREAM_FLUSH_S = 1.0
#: the model's shortest answer, in LM steps (upstream's default)
MIN_STEPS = 2
#: sentence ends: . ! ? and their CJK forms, an ellipsis, a line break
#: (written as escapes: U+3002, U+FF01, U+FF1F, U+2026; U+FF0C, U+FF1B, U+FF1A)
_SENTENCE_END = re.compile("(?<=[.!?\u3002\uff01\uff1f\u2026])\\s+|(?<=[\u3002\uff01\uff1f])|\n+")
_CLAUSE_END = re.compile("(?<=[,;:\uff0c\uff1b\uff1a])\\s*")


@dataclass
class Speaker:
    """What ``load`` returns and every ``handle`` call gets."""

    loaded: voxload.Loaded
    device: str
    #: sha256 key -> the model's prompt cache (an LRU, PROMPT_CACHE_SIZE entries)
    prompts: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    sim_bytes: int = 0
    sim_client: Any = None


# --- the model folder, the device and the load ---------------------------------


def find_model_dir(weights_dir: str, model_dir: str = "") -> Path:
    """The VoxCPM2 folder: the module's own folder (``$GPUWARDEN_MODEL_DIR``, the
    node's ``[modules.speech] model_dir``) when it is set, that folder itself or its
    ``VoxCPM2/``; else under the weights mount (``[sandbox] weights_dir``):
    ``VoxCPM2/``, ``openbmb/VoxCPM2/`` or the mount itself. The first that holds
    a config.json."""
    if not model_dir and not weights_dir:
        raise voxload.WeightsError(
            "no model folder: stage the files of "
            f"{voxload.UPSTREAM} in a folder and set [modules.speech] model_dir to it in "
            "the broker's config (mounted read-only at /gpuwarden/model), or set "
            "[sandbox] weights_dir to a folder holding VoxCPM2/ (mounted read-only at "
            "/gpuwarden/weights); see the speech module's README.md"
        )
    if model_dir:
        base, where = Path(model_dir), "the module's model folder ([modules.speech] model_dir)"
        candidates = [base, base / "VoxCPM2"]
    else:
        base, where = Path(weights_dir), "the weights folder ([sandbox] weights_dir)"
        candidates = [base / sub if sub else base for sub in WEIGHTS_SUBDIRS]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    if model_dir:  # the module's folder is the model: let the check name what is missing
        return base
    for folder in candidates:  # a partial folder: let the check name what is missing
        if folder.is_dir() and folder != base:
            return folder
    raise voxload.WeightsError(
        f"no VoxCPM2 model folder in {where} {base}: looked for "
        f"{', '.join(str(c) for c in candidates)} (each with a config.json); stage the "
        f"files of {voxload.UPSTREAM} as {base / 'VoxCPM2'}, or in a folder of their own "
        "set as [modules.speech] model_dir (see the speech module's README.md)"
    )


def pick_device(gpu: str) -> str:
    """``cuda`` when the worker was given a GPU and PyTorch sees it, else ``cpu``."""
    import torch

    return "cuda" if gpu.strip() and torch.cuda.is_available() else "cpu"


def load(ctx: Any) -> Speaker:
    """Load VoxCPM2 once, onto the worker's GPU (``ctx.gpu``) or the CPU."""
    voxload.stay_offline()
    # anything the libraries cache goes to the worker's scratch folder
    scratch = Path(ctx.scratch_dir)
    os.environ.setdefault("HF_HOME", str(scratch / "hf"))
    os.environ.setdefault("NUMBA_CACHE_DIR", str(scratch / "numba"))
    os.environ.setdefault("MPLCONFIGDIR", str(scratch / "mpl"))
    folder = find_model_dir(
        os.environ.get("GPUWARDEN_WEIGHTS_DIR", ""), os.environ.get("GPUWARDEN_MODEL_DIR", "")
    )
    voxload.check_folder(folder)  # a partial folder fails here, before seconds of imports
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(f"{voxload.NOT_INSTALLED} ({exc})") from exc
    device = pick_device(ctx.gpu)
    loaded = voxload.load(folder, device)
    speaker = Speaker(loaded=loaded, device=device)
    warmup_s = warm_up(speaker, scratch)
    hold_on_simulated_gpu(speaker, ctx.gpu)
    print(
        f"loaded VoxCPM2 from {folder} on {device} in {loaded.load_s:.2f} s "
        f"(then a warm-up in {warmup_s:.2f} s) "
        f"({loaded.params} parameters, {loaded.param_bytes} bytes, "
        f"{loaded.files.nbytes} bytes of weight files, {loaded.sample_rate} Hz, "
        f"optimize {'on' if loaded.optimized else 'off'}, denoiser off, "
        f"torchaudio {'placeholder' if loaded.torchaudio_placeholder else 'installed'}, "
        f"{torch.get_num_threads()} CPU threads)",
        flush=True,
    )
    for note in loaded.notes:
        print(f"note: {note}", flush=True)
    return speaker


def warm_up(speaker: Speaker, scratch: Path) -> float:
    """Encode one second of quiet noise and speak one word, so that the first job
    does not pay for the first calls' set-up (librosa's lazy imports, torch's first
    runs: tens of seconds on a busy CPU). Returns the seconds it took."""
    import numpy as np

    start = time.perf_counter()
    path = scratch / "warmup.wav"
    rng = np.random.default_rng(0)
    write_wav(path, (rng.standard_normal(16000) * 0.01).astype(np.float32), 16000)
    prompt = speaker.loaded.model.build_prompt_cache(reference_wav_path=str(path))
    speaker.loaded.model.generate_with_prompt_cache(
        target_text="Hello.",
        prompt_cache=prompt,
        min_len=MIN_STEPS,
        max_len=MIN_STEPS,
        inference_timesteps=1,
        retry_badcase=False,
    )
    path.unlink()
    return time.perf_counter() - start


def hold_on_simulated_gpu(speaker: Speaker, gpu: str) -> None:
    """Under gpuwarden's simulated GPU (``--mock-gpu``) the model runs on the CPU
    but holds its parameters' bytes on the simulated GPU it was given, so the
    broker sees it there as it would on a real one."""
    if speaker.device != "cpu" or not gpu.strip() or not os.environ.get("GPUWARDEN_SIM_GPU"):
        return
    from gpuwarden.gpu import simclient

    client = simclient.attach()
    client.allocate(speaker.loaded.param_bytes, label="speech.voxcpm2 weights")
    speaker.sim_client = client
    speaker.sim_bytes = speaker.loaded.param_bytes


def device_bytes(speaker: Speaker) -> int:
    """Bytes of the model's parameters in GPU memory (on the simulated GPU under
    ``--mock-gpu``); 0 on the CPU."""
    if speaker.sim_bytes:
        return speaker.sim_bytes
    return sum(
        p.numel() * p.element_size()
        for p in speaker.loaded.model.parameters()
        if p.device.type == "cuda"
    )


# --- parameters -------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    text: str
    reference: Path
    reference_text: str | None
    cfg: float
    timesteps: int
    seed: int | None
    stream: bool
    max_steps: int
    retry_badcase: bool
    chunk_chars: int


def _number(params: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is out of range: give {lo:g} to {hi:g}")
    return float(value)


def _integer(
    params: dict[str, Any], name: str, default: int | None, lo: int, hi: int
) -> int | None:
    value = params.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is out of range: give {lo} to {hi}")
    return value


def _flag(params: dict[str, Any], name: str, default: bool) -> bool:
    value = params.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def clean_text(text: str) -> str:
    """Whitespace made single spaces (as voxcpm's own generate does), ends trimmed."""
    return re.sub(r"\s+", " ", text).strip()


def parse(params: dict[str, Any]) -> Request:
    """The job's parameters, checked; a ValueError names what is wrong."""
    raw = params.get("text")
    if not isinstance(raw, str):
        raise ValueError("text is required: give the text to speak")
    if len(raw) > MAX_TEXT_CHARS:
        raise ValueError(
            f"text is too long: {len(raw)} characters, at most {MAX_TEXT_CHARS} in one job "
            "(split it into several jobs)"
        )
    text = clean_text(raw)
    if not text:
        raise ValueError("text is empty: give the text to speak")
    ref = params.get("reference")
    if not ref:
        raise ValueError(
            "no reference recording: give the voice to speak in as the input 'reference' "
            "(a WAV, FLAC or OGG of 3 to 30 s; with reference_text, its transcript)"
        )
    ref_text = params.get("reference_text")
    if ref_text is not None:
        if not isinstance(ref_text, str):
            raise ValueError(f"reference_text must be a string, got {ref_text!r}")
        ref_text = clean_text(ref_text) or None
        if ref_text is not None and len(ref_text) > MAX_REFERENCE_TEXT_CHARS:
            raise ValueError(
                f"reference_text is too long: {len(ref_text)} characters, "
                f"at most {MAX_REFERENCE_TEXT_CHARS}"
            )
    cfg = _number(params, "cfg", 2.0, *CFG_RANGE)
    timesteps = _integer(params, "timesteps", 10, *TIMESTEPS_RANGE)
    max_steps = _integer(params, "max_steps", 2000, *MAX_STEPS_RANGE)
    chunk_chars = _integer(params, "chunk_chars", MAX_CHUNK_CHARS, *CHUNK_CHARS_RANGE)
    assert timesteps is not None and max_steps is not None and chunk_chars is not None
    return Request(
        text=text,
        reference=Path(str(ref)),
        reference_text=ref_text,
        cfg=cfg,
        timesteps=timesteps,
        seed=_integer(params, "seed", None, *SEED_RANGE),
        stream=_flag(params, "stream", False),
        max_steps=max_steps,
        retry_badcase=_flag(params, "retry_badcase", True),
        chunk_chars=chunk_chars,
    )


# --- text chunks ------------------------------------------------------------------


def _hard_split(piece: str, limit: int) -> list[str]:
    """A piece longer than ``limit``: at clause marks, then at spaces, then anywhere."""
    out: list[str] = []
    for clause in _pack(_CLAUSE_END.split(piece), limit, " "):
        rest = clause
        while len(rest) > limit:
            cut = rest.rfind(" ", 0, limit + 1)
            cut = cut if cut > 0 else limit
            out.append(rest[:cut].strip())
            rest = rest[cut:].strip()
        if rest:
            out.append(rest)
    return out


def _pack(pieces: list[str], limit: int, joiner: str) -> list[str]:
    """Join consecutive pieces while the result stays within ``limit``."""
    chunks: list[str] = []
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        if chunks and len(chunks[-1]) + len(joiner) + len(piece) <= limit:
            chunks[-1] = f"{chunks[-1]}{joiner}{piece}"
        else:
            chunks.append(piece)
    return chunks


def split_text(text: str, limit: int = MAX_CHUNK_CHARS) -> list[str]:
    """``text`` in chunks of at most ``limit`` characters, cut at sentence ends
    (whole sentences packed together), a longer sentence at clause marks, then at
    spaces."""
    sentences: list[str] = []
    for raw in _SENTENCE_END.split(text):
        sentence = raw.strip()
        if len(sentence) > limit:
            sentences.extend(_hard_split(sentence, limit))
        elif sentence:
            sentences.append(sentence)
    return [clean_text(c) for c in _pack(sentences, limit, " ")]


# --- the reference voice ------------------------------------------------------------


def read_reference(path: Path) -> bytes:
    """The reference recording's bytes; a ValueError when it is not there or too big."""
    if not path.is_file():
        raise ValueError(f"the reference recording {path.name} is not among the job's inputs")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"the reference recording {path.name} is empty")
    if size > MAX_REFERENCE_BYTES:
        raise ValueError(
            f"the reference recording {path.name} is too big: {size} bytes, "
            f"at most {MAX_REFERENCE_BYTES}"
        )
    return path.read_bytes()


def reference_seconds(path: Path) -> float:
    """The recording's length; a ValueError when it cannot be read as audio."""
    import librosa

    try:
        seconds = float(librosa.get_duration(path=str(path)))
    except Exception as exc:  # soundfile's and audioread's errors have no common base
        raise ValueError(
            f"the reference recording {path.name} cannot be read as audio "
            f"({type(exc).__name__}: {exc}); give a WAV, FLAC or OGG file"
        ) from None
    if seconds <= 0:
        raise ValueError(f"the reference recording {path.name} holds no audio")
    if seconds > MAX_REFERENCE_S:
        raise ValueError(
            f"the reference recording {path.name} is too long: {seconds:.1f} s, "
            f"at most {MAX_REFERENCE_S:g} s (cut it to a few clean sentences)"
        )
    return seconds


def prompt_key(data: bytes, reference_text: str | None) -> str:
    h = hashlib.sha256(data)
    # timbre-only and continuation prompts of one recording differ
    h.update(b"\0text\0" if reference_text is not None else b"\0timbre\0")
    h.update((reference_text or "").encode("utf-8"))
    return h.hexdigest()


def prompt_for(speaker: Speaker, req: Request) -> tuple[dict[str, Any], str, bool, float]:
    """The encoded reference: from the LRU (a hit), or encoded now and kept.
    Returns it, its key, whether it was a hit, and the seconds spent encoding."""
    data = read_reference(req.reference)
    key = prompt_key(data, req.reference_text)
    cached = speaker.prompts.get(key)
    if cached is not None:
        speaker.prompts.move_to_end(key)
        return cached, key, True, 0.0
    reference_seconds(req.reference)
    start = time.perf_counter()
    path = str(req.reference)
    try:
        prompt = speaker.loaded.model.build_prompt_cache(
            prompt_text=req.reference_text,
            prompt_wav_path=path if req.reference_text is not None else None,
            reference_wav_path=path,
        )
    except (RuntimeError, ValueError, OSError, EOFError) as exc:
        raise ValueError(
            f"the reference recording {req.reference.name} could not be encoded "
            f"({type(exc).__name__}: {exc})"
        ) from None
    encode_s = time.perf_counter() - start
    speaker.prompts[key] = prompt
    while len(speaker.prompts) > PROMPT_CACHE_SIZE:
        speaker.prompts.popitem(last=False)
    return prompt, key, False, encode_s


def check_context(speaker: Speaker, prompt: dict[str, Any], chunk: str, max_steps: int) -> None:
    """The prompt, the chunk and the longest answer must fit the model's context
    window (``max_length`` in config.json), or the model would run past it."""
    model = speaker.loaded.model
    limit = int(model.config.max_length)
    ref = prompt.get("ref_audio_feat")
    cont = prompt.get("audio_feat")
    ref_steps = 0 if ref is None else int(ref.shape[0]) + 2
    cont_steps = 0 if cont is None else int(cont.shape[0])
    text_tokens = len(model.text_tokenizer((prompt.get("prompt_text") or "") + chunk)) + 1
    chunk_tokens = len(model.text_tokenizer(chunk))
    answer = min(int(chunk_tokens * 6.0 + 10), max_steps)  # as voxcpm bounds it
    need = ref_steps + cont_steps + text_tokens + answer
    if need > limit:
        raise ValueError(
            f"too long for the model's context of {limit} steps: the reference takes "
            f"{ref_steps + cont_steps}, the text {text_tokens} and the answer up to {answer}; "
            "use a shorter reference recording (or leave out reference_text) or a lower max_steps"
        )


# --- writing ------------------------------------------------------------------------------


def write_wav(path: Path, audio: Any, rate: int) -> None:
    """A mono 16-bit WAV, written to a temporary name and renamed, so that it is
    complete whenever it is seen."""
    import numpy as np
    import soundfile as sf

    tmp = path.with_name(f".{path.name}.part")
    sf.write(str(tmp), np.clip(audio, -1.0, 1.0), rate, subtype="PCM_16", format="WAV")
    tmp.replace(path)


class ChunkWriter:
    """stream = true: the audio written as it comes, one file per
    :data:`STREAM_FLUSH_S` seconds (and at the end of each text chunk)."""

    def __init__(self, folder: Path, rate: int) -> None:
        self.folder = folder
        self.rate = rate
        self.pending: list[Any] = []
        self.pending_n = 0
        self.files: list[str] = []
        folder.mkdir()

    def add(self, piece: Any) -> None:
        self.pending.append(piece)
        self.pending_n += len(piece)
        if self.pending_n >= STREAM_FLUSH_S * self.rate:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        import numpy as np

        name = f"{len(self.files) + 1:04d}.wav"
        write_wav(self.folder / name, np.concatenate(self.pending), self.rate)
        self.files.append(f"{self.folder.name}/{name}")
        self.pending, self.pending_n = [], 0


# --- one job ------------------------------------------------------------------------------


def speak(speaker: Speaker, req: Request, prompt: dict[str, Any], chunk: str, out: Any) -> Any:
    """One chunk of text as audio (a 1-D float32 array); pieces go to ``out``
    (a ChunkWriter) as they come when streaming."""
    import numpy as np

    model = speaker.loaded.model
    kwargs = {
        "target_text": chunk,
        "prompt_cache": prompt,
        "min_len": MIN_STEPS,
        "max_len": req.max_steps,
        "inference_timesteps": req.timesteps,
        "cfg_value": req.cfg,
    }
    if not req.stream:
        wav, _, _ = model.generate_with_prompt_cache(**kwargs, retry_badcase=req.retry_badcase)
        return wav.squeeze(0).float().cpu().numpy().astype(np.float32)
    pieces = []
    result = model.generate_with_prompt_cache_streaming(**kwargs, retry_badcase=False)
    try:
        for wav, _, _ in result:
            piece = wav.squeeze(0).float().cpu().numpy().astype(np.float32)
            pieces.append(piece)
            out.add(piece)
    finally:
        result.close()
    out.flush()
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def handle(speaker: Speaker, job: Any) -> str:
    """Speak the job's text in the reference's voice; write speech.wav and result.json."""
    import numpy as np
    import torch

    req = parse(job.params)
    chunks = split_text(req.text, req.chunk_chars)
    prompt, key, hit, encode_s = prompt_for(speaker, req)
    for chunk in chunks:
        check_context(speaker, prompt, chunk, req.max_steps)
    if req.seed is not None:  # voxcpm 2.0.3's generate has no seed argument
        torch.manual_seed(req.seed)
    rate = speaker.loaded.sample_rate
    out_dir = Path(job.output_dir)
    writer = ChunkWriter(out_dir / "chunks", rate) if req.stream else None
    start = time.perf_counter()
    audio = np.concatenate([speak(speaker, req, prompt, c, writer) for c in chunks])
    generate_s = time.perf_counter() - start
    write_wav(out_dir / "speech.wav", audio, rate)
    seconds = len(audio) / rate
    record = {
        "model": voxload.UPSTREAM,
        "model_dir": str(speaker.loaded.files.folder),
        "device": speaker.device,
        "file": "speech.wav",
        "sample_rate": rate,
        "channels": 1,
        "samples": len(audio),
        "duration_s": round(seconds, 3),
        "text_chars": len(req.text),
        "chunks": len(chunks),
        "chunk_chars": [len(c) for c in chunks],
        "stream": req.stream,
        "chunk_files": writer.files if writer is not None else [],
        "prompt_cache": {
            "hit": hit,
            "key": key[:16],
            "mode": prompt.get("mode"),
            "entries": len(speaker.prompts),
            "encode_s": round(encode_s, 3),
        },
        "cfg": req.cfg,
        "timesteps": req.timesteps,
        "max_steps": req.max_steps,
        "retry_badcase": req.retry_badcase and not req.stream,
        "seed": req.seed,
        "generate_s": round(generate_s, 3),
        "rtf": round(generate_s / seconds, 3) if seconds else None,
    }
    (out_dir / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    noun = "chunk" if len(chunks) == 1 else "chunks"
    return (
        f"spoke {seconds:.2f} s of audio at {rate} Hz ({len(chunks)} {noun}) on "
        f"{speaker.device} in {generate_s:.1f} s; prompt cache {'hit' if hit else 'miss'}"
    )


def main() -> None:
    try:
        from gpuwarden.server.worker import serve
    except ImportError:
        print(
            "speech.voxcpm2: gpuwarden.server is not importable; "
            "the type's command must use {python}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    serve(load, handle, device_bytes=device_bytes)


if __name__ == "__main__":
    main()
