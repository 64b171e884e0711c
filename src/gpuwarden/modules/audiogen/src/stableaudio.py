"""audiogen.stableaudio: music, ambience and sound effects from a text prompt.

A oneshot job (one process per attempt, SPEC.md section 7): it loads Stable Audio
Open 1.0 with diffusers' ``StableAudioPipeline`` from a folder staged on disk (the
node's ``[modules.audiogen] model_dir`` or ``[sandbox] weights_dir``, read-only;
never the network), generates one clip and writes ``out/audio.wav`` (and
``out/audio.json``, what was made and how).

The model folder is ``$GPUWARDEN_MODEL_DIR`` itself (or ``$GPUWARDEN_MODEL_DIR/<model>``),
else ``$GPUWARDEN_WEIGHTS_DIR/<model>`` (``model`` parameter, default
``stable-audio-open-1.0``), in the diffusers layout (see README.md).
Before anything runs the loader checks what it loads: every file the layout
needs, and every weight each model expects against the keys in its safetensors
(diffusers and transformers load a checkpoint that lacks keys without failing:
the missing weights stay at random or uninitialised values). A fault fails the
job with a message naming the missing files or keys.

Parameters: ``prompt`` (required), ``negative_prompt``, ``seconds``, ``steps``,
``guidance``, ``seed``, ``model``, ``wav`` (``pcm16`` or ``float32``).

On a GPU the model runs in float16; on the CPU in float32. Under gpuwarden's
simulated GPU (``--mock-gpu``) it runs on the CPU and holds the bytes its float16
weights would take on the simulated GPU it was given, so the broker sees it there.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before anything imports huggingface_hub, transformers or diffusers: never reach
# for the hub, and no progress bars in the job's log.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["DIFFUSERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "stable-audio-open-1.0"
#: a staged model's folder name under the weights dir: one plain name, no path
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: characters of a prompt looked at, at most, before it is tokenised (the token
#: limit below is the real one; this keeps the tokeniser's work bounded)
MAX_PROMPT_CHARS = 4000
MIN_STEPS, MAX_STEPS = 1, 1000
MIN_GUIDANCE, MAX_GUIDANCE = 0.0, 30.0
MAX_SEED = 2**63 - 1
WAV_SUBTYPES = {"pcm16": "PCM_16", "float32": "FLOAT"}

#: the pipeline's parts, in the diffusers layout: folder -> (config file, weights
#: file name stem or None for a part without weights)
WEIGHTED = {
    "transformer": ("config.json", "diffusion_pytorch_model"),
    "vae": ("config.json", "diffusion_pytorch_model"),
    "projection_model": ("config.json", "diffusion_pytorch_model"),
    "text_encoder": ("config.json", "model"),
}
PIPELINE_CLASS = "StableAudioPipeline"

NOT_INSTALLED = (
    "the audiogen extra is not installed in the broker's Python: "
    "pip install torch==2.13.0 && pip install 'gpuwarden[audiogen]' (from a checkout: "
    "pip install -e '.[audiogen]'; see the audiogen module's README.md)"
)


class JobError(Exception):
    """The job's own failure: bad parameters or a bad weights folder. Its text is
    the job's message; it is not retried (exit 1)."""


# --- parameters ----------------------------------------------------------------


@dataclass
class Params:
    prompt: str
    negative_prompt: str | None
    seconds: float
    steps: int
    guidance: float
    seed: int
    seed_given: bool
    model: str
    wav: str


def _number(params: dict[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise JobError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(params: dict[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobError(f"{name} must be an integer, got {value!r}")
    return value


def _text(params: dict[str, Any], name: str) -> str | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise JobError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_PROMPT_CHARS:
        raise JobError(
            f"{name} is {len(value)} characters long; at most {MAX_PROMPT_CHARS} are accepted "
            "(and the text encoder reads only its first tokens: see the token limit)"
        )
    return value


def parse_params(params: dict[str, Any]) -> Params:
    """The job's parameters, checked; every problem but the model-dependent limits
    (the longest clip, the token limit: :func:`check_against_model`)."""
    prompt = _text(params, "prompt")
    if prompt is None or not prompt.strip():
        raise JobError("prompt is required and must not be empty: describe the sound to make")
    negative = _text(params, "negative_prompt")
    if negative is not None and not negative.strip():
        negative = None
    seconds = _number(params, "seconds", 10.0)
    if seconds <= 0:
        raise JobError(f"seconds must be greater than 0, got {seconds:g}")
    steps = _integer(params, "steps", 100)
    if not MIN_STEPS <= steps <= MAX_STEPS:
        raise JobError(f"steps must be {MIN_STEPS} to {MAX_STEPS}, got {steps}")
    guidance = _number(params, "guidance", 7.0)
    if not MIN_GUIDANCE <= guidance <= MAX_GUIDANCE:
        raise JobError(f"guidance must be {MIN_GUIDANCE:g} to {MAX_GUIDANCE:g}, got {guidance:g}")
    seed_given = params.get("seed") is not None
    seed = _integer(params, "seed", 0) if seed_given else secrets.randbelow(2**31)
    if not 0 <= seed <= MAX_SEED:
        raise JobError(f"seed must be 0 to {MAX_SEED}, got {seed}")
    model = params.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not MODEL_NAME.match(model) or model in (".", ".."):
        raise JobError(
            f"model must be the name of a folder in the weights dir (letters, digits, . _ -), "
            f"got {model!r}"
        )
    wav = params.get("wav", "pcm16")
    if wav not in WAV_SUBTYPES:
        raise JobError(f"wav must be one of {', '.join(WAV_SUBTYPES)}, got {wav!r}")
    return Params(prompt, negative, seconds, steps, guidance, seed, seed_given, model, wav)


# --- the weights folder ----------------------------------------------------------


@dataclass
class Layout:
    """A staged model folder whose files are all there (:func:`check_layout`)."""

    root: Path
    #: part -> its safetensors files (one, or the shards its index names)
    weights: dict[str, list[Path]] = field(default_factory=dict)
    #: the model's longest clip in seconds, from its configs (no weights read)
    max_seconds: float = 0.0
    sampling_rate: int = 0


def find_model_dir(model: str, env: dict[str, str] | None = None) -> Path:
    """The model folder: the module's own (``$GPUWARDEN_MODEL_DIR``, the node's
    ``[modules.audiogen] model_dir``) first, then ``$GPUWARDEN_WEIGHTS_DIR/<model>``
    (``[sandbox] weights_dir``, or the weights dir itself when the model is staged
    at its top: it holds ``model_index.json``).

    The module's folder is the model itself for the default model; a folder
    ``<model>`` inside it is taken for any model (several staged side by side)."""
    environ = os.environ if env is None else env
    own = environ.get("GPUWARDEN_MODEL_DIR", "")
    weights = environ.get("GPUWARDEN_WEIGHTS_DIR", "")
    if not own and not weights:
        raise JobError(
            "no model folder: this node's config gives the audiogen module none. Stage "
            "Stable Audio Open 1.0 (diffusers layout) in a folder and set [modules.audiogen] "
            f"model_dir to it, or put it in <weights_dir>/{DEFAULT_MODEL}/ and set "
            "[sandbox] weights_dir (see the audiogen module's README.md)"
        )
    looked: list[str] = []
    if own:
        root = Path(own)
        if (root / model).is_dir():
            return root / model
        if model == DEFAULT_MODEL:
            return root  # the module's folder is the model: check_layout says what it lacks
        looked.append(f"{root / model} ([modules.audiogen] model_dir)")
    if weights:
        root = Path(weights)
        if (root / model).is_dir():
            return root / model
        if model == DEFAULT_MODEL and (root / "model_index.json").is_file():
            return root
        try:
            held = sorted(p.name for p in root.iterdir())
        except OSError as exc:
            raise JobError(f"the weights dir {root} cannot be read: {exc}") from None
        looked.append(f"the weights dir {root} (it holds: {', '.join(held[:20]) or 'nothing'})")
    raise JobError(
        f"no model folder {model!r}: looked in {' and in '.join(looked)}; stage it as "
        f"<model_dir>/{model}/ or <weights_dir>/{model}/"
    )


def _read_json(path: Path, root: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read {path.relative_to(root)} in {root}: {exc}") from None
    if not isinstance(data, dict):
        raise JobError(f"{path.relative_to(root)} in {root} is not a JSON object")
    return data


def _weight_files(part_dir: Path, stem: str, root: Path, missing: list[str]) -> list[Path]:
    """A part's safetensors: ``<stem>.safetensors``, or the shards of
    ``<stem>.safetensors.index.json``. What is absent is added to ``missing``."""
    single = part_dir / f"{stem}.safetensors"
    index = part_dir / f"{stem}.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index, root).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise JobError(f"{index.relative_to(root)} in {root} has no weight_map")
        shards = [part_dir / name for name in sorted(set(weight_map.values()))]
        missing += [str(s.relative_to(root)) for s in shards if not s.is_file()]
        return shards
    missing.append(str(single.relative_to(root)))
    return []


def check_layout(root: Path) -> Layout:
    """Every file a StableAudioPipeline folder needs, in one pass: a folder that
    lacks any fails with all of them named. Reads only the small JSON files."""
    layout = Layout(root=root)
    missing: list[str] = []
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise JobError(
            f"{root} is not a diffusers model folder: model_index.json is missing "
            "(stage the model in the diffusers layout: see the audiogen README.md)"
        )
    index = _read_json(index_file, root)
    if index.get("_class_name") != PIPELINE_CLASS:
        raise JobError(
            f"{root}/model_index.json is for {index.get('_class_name')!r}, not {PIPELINE_CLASS}"
        )
    for part, (config, stem) in WEIGHTED.items():
        if not (root / part / config).is_file():
            missing.append(f"{part}/{config}")
        layout.weights[part] = _weight_files(root / part, stem, root, missing)
    if not (root / "scheduler" / "scheduler_config.json").is_file():
        missing.append("scheduler/scheduler_config.json")
    tokenizer = root / "tokenizer"
    if not (tokenizer / "tokenizer_config.json").is_file():
        missing.append("tokenizer/tokenizer_config.json")
    if not (tokenizer / "tokenizer.json").is_file() and not (tokenizer / "spiece.model").is_file():
        missing.append("tokenizer/tokenizer.json (or tokenizer/spiece.model)")
    if missing:
        raise JobError(
            f"the model folder {root} is incomplete: missing {', '.join(missing)} "
            "(stage every file of the diffusers layout: see the audiogen README.md)"
        )
    transformer = _read_json(root / "transformer" / "config.json", root)
    vae = _read_json(root / "vae" / "config.json", root)
    try:
        sample_size = int(transformer["sample_size"])
        hop = math.prod(int(r) for r in vae["downsampling_ratios"])
        rate = int(vae["sampling_rate"])
    except (KeyError, TypeError, ValueError) as exc:
        raise JobError(
            f"transformer/config.json or vae/config.json in {root} lacks {exc} "
            "(sample_size, downsampling_ratios, sampling_rate)"
        ) from None
    if sample_size <= 0 or hop <= 0 or rate <= 0:
        raise JobError(
            f"nonsense sizes in {root}: sample_size {sample_size}, hop {hop}, rate {rate}"
        )
    # as StableAudioPipeline computes it: transformer.config.sample_size * vae.hop_length
    # / vae.config.sampling_rate (hop_length = the product of the downsampling ratios)
    layout.max_seconds = sample_size * hop / rate
    layout.sampling_rate = rate
    return layout


def check_seconds(seconds: float, layout: Layout) -> None:
    if seconds > layout.max_seconds:
        raise JobError(
            f"seconds {seconds:g} is more than this model's maximum of "
            f"{layout.max_seconds:.2f} s (transformer sample_size x VAE hop length / "
            f"sampling rate); ask for at most {math.floor(layout.max_seconds * 100) / 100:g}"
        )
    if int(seconds * layout.sampling_rate) < 1:
        raise JobError(
            f"seconds {seconds:g} is shorter than one sample at {layout.sampling_rate} Hz"
        )


def file_keys(files: list[Path], root: Path) -> set[str]:
    """The tensor names in safetensors files (their headers only)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys.update(handle.keys())
        except Exception as exc:  # a truncated or foreign file: name it
            raise JobError(f"cannot read {path.relative_to(root)} in {root}: {exc}") from None
    return keys


def missing_keys(module: Any, present: set[str]) -> list[str]:
    """The module's state-dict keys absent from ``present``, but for a key tied to
    (sharing its tensor with) a key that is present: T5's ``encoder.embed_tokens``
    is its ``shared`` embedding, saved once."""
    state = module.state_dict()
    by_tensor: dict[tuple[int, tuple[int, ...]], set[str]] = {}
    for key, tensor in state.items():
        by_tensor.setdefault((tensor.data_ptr(), tuple(tensor.shape)), set()).add(key)
    missing = []
    for key, tensor in state.items():
        if key in present:
            continue
        tied = by_tensor[(tensor.data_ptr(), tuple(tensor.shape))]
        if tensor.numel() and tied & present:
            continue
        missing.append(key)
    return sorted(missing)


def check_keys(pipe: Any, layout: Layout) -> list[str]:
    """Every weight each model expects is in its safetensors; else fail, naming
    the keys. Returns notes on unexpected keys (present in a file, not in the model:
    logged, not fatal)."""
    faults, notes = [], []
    for part, files in layout.weights.items():
        module = getattr(pipe, part)
        present = file_keys(files, layout.root)
        missing = missing_keys(module, present)
        names = ", ".join(str(f.relative_to(layout.root)) for f in files)
        if missing:
            shown = ", ".join(missing[:10]) + (
                f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            )
            total = len(module.state_dict())
            faults.append(f"{names} lacks {len(missing)} of the model's {total} weights: {shown}")
        unexpected = present - set(module.state_dict())
        if unexpected:
            notes.append(f"{names}: {len(unexpected)} keys the model does not use (ignored)")
    if faults:
        raise JobError(
            f"the weights in {layout.root} are incomplete (the libraries would load them "
            "with random values in their place): " + "; ".join(faults)
        )
    return notes


# --- the model --------------------------------------------------------------------


@dataclass
class Loaded:
    pipe: Any
    device: str
    dtype: str
    param_count: int
    load_s: float
    notes: list[str]


def pick_device(torch: Any, env: dict[str, str] | None = None) -> str:
    """``cuda`` when the job was given a GPU and PyTorch sees it, else ``cpu``."""
    environ = os.environ if env is None else env
    given = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return "cuda" if given and torch.cuda.is_available() else "cpu"


def load(layout: Layout, device: str | None = None) -> Loaded:
    """The pipeline from ``layout.root`` (local files only, safetensors only), its
    keys checked, on ``device`` (default: the GPU if given, else the CPU)."""
    start = time.monotonic()
    try:
        import torch
        from diffusers import StableAudioPipeline
    except ImportError as exc:
        raise JobError(f"{NOT_INSTALLED} ({exc})") from None
    try:  # no "Loading pipeline components" bars in the log
        from diffusers.utils import logging as df_logging

        df_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - depends on the diffusers version
        pass
    device = device or pick_device(torch)
    dtype = torch.float16 if device == "cuda" else torch.float32
    try:
        with warnings.catch_warnings():
            # diffusers 0.3x names it torch_dtype; later ones accept it and warn that
            # it becomes dtype (removed in 1.0). Given at load, not cast afterwards,
            # so that transformers keeps T5's float32-only layers in float32.
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = StableAudioPipeline.from_pretrained(
                str(layout.root), torch_dtype=dtype, local_files_only=True, use_safetensors=True
            )
    except Exception as exc:
        raise JobError(f"loading {layout.root} failed: {type(exc).__name__}: {exc}") from None
    notes = check_keys(pipe, layout)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    params = sum(p.numel() for part in WEIGHTED for p in getattr(pipe, part).parameters())
    return Loaded(
        pipe=pipe,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        param_count=params,
        load_s=time.monotonic() - start,
        notes=notes,
    )


def check_tokens(pipe: Any, name: str, text: str | None) -> int:
    """The text's length in the text encoder's tokens; refused past its limit
    (the pipeline would cut the rest off silently, with only a warning)."""
    if text is None:
        return 0
    limit = int(pipe.tokenizer.model_max_length)
    count = len(pipe.tokenizer(text, truncation=False)["input_ids"])
    if count > limit:
        raise JobError(
            f"{name} is {count} tokens long; the text encoder reads at most {limit} "
            "(the end marker included): shorten it"
        )
    return count


def hold_on_simulated_gpu(loaded: Loaded) -> int:
    """Under ``--mock-gpu`` (the model runs on the CPU) hold, on the simulated GPU
    the job was given, the bytes its float16 weights would take on a real one."""
    if loaded.device != "cpu" or not os.environ.get("GPUWARDEN_SIM_GPU"):
        return 0
    if not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return 0
    from gpuwarden.gpu import simclient

    nbytes = loaded.param_count * 2
    simclient.attach().allocate(nbytes, label="audiogen.stableaudio float16 weights")
    return nbytes


def generate(loaded: Loaded, p: Params, out_dir: Path) -> dict[str, Any]:
    """One clip into ``out_dir/audio.wav``; returns what ``audio.json`` records."""
    import numpy as np
    import soundfile as sf
    import torch

    pipe = loaded.pipe
    tokens = check_tokens(pipe, "prompt", p.prompt)
    negative_tokens = check_tokens(pipe, "negative_prompt", p.negative_prompt)
    generator = torch.Generator("cpu").manual_seed(p.seed)
    start = time.monotonic()
    with torch.inference_mode():
        audio = pipe(
            prompt=p.prompt,
            negative_prompt=p.negative_prompt,
            audio_start_in_s=0.0,
            audio_end_in_s=p.seconds,
            num_inference_steps=p.steps,
            guidance_scale=p.guidance,
            num_waveforms_per_prompt=1,
            generator=generator,
        ).audios[0]
    generate_s = time.monotonic() - start
    samples = audio.T.float().cpu().numpy()  # (samples, channels)
    if not np.isfinite(samples).all():
        raise JobError("the model produced non-finite samples (NaN or inf): nothing written")
    peak = float(np.abs(samples).max()) if samples.size else 0.0
    if p.wav == "pcm16":
        samples = np.clip(samples, -1.0, 1.0)
    rate = int(pipe.vae.config.sampling_rate)
    path = out_dir / "audio.wav"
    sf.write(str(path), samples, rate, subtype=WAV_SUBTYPES[p.wav], format="WAV")
    return {
        "file": "audio.wav",
        "prompt": p.prompt,
        "negative_prompt": p.negative_prompt,
        "prompt_tokens": tokens,
        "negative_prompt_tokens": negative_tokens,
        "seconds": p.seconds,
        "samples": int(samples.shape[0]),
        "channels": int(samples.shape[1]),
        "sampling_rate": rate,
        "wav": p.wav,
        "peak": round(peak, 4),
        "clipped": p.wav == "pcm16" and peak > 1.0,
        "steps": p.steps,
        "guidance": p.guidance,
        "seed": p.seed,
        "seed_given": p.seed_given,
        "device": loaded.device,
        "dtype": loaded.dtype,
        "load_s": round(loaded.load_s, 3),
        "generate_s": round(generate_s, 3),
    }


# --- the job ----------------------------------------------------------------------


def run(params: dict[str, Any], out_dir: Path) -> str:
    """The whole job; returns its message. Raises JobError for its own failures."""
    p = parse_params(params)
    layout = check_layout(find_model_dir(p.model))
    check_seconds(p.seconds, layout)  # before the seconds-long imports and the load
    loaded = load(layout)
    for note in loaded.notes:
        print(f"note: {note}", flush=True)
    print(
        f"loaded {layout.root} on {loaded.device} ({loaded.dtype}, "
        f"{loaded.param_count} parameters) in {loaded.load_s:.2f} s",
        flush=True,
    )
    held = hold_on_simulated_gpu(loaded)
    record = generate(loaded, p, out_dir)
    record["model"] = p.model
    record["model_dir"] = str(layout.root)
    record["sim_gpu_bytes"] = held
    (out_dir / "audio.json").write_text(json.dumps(record, indent=2) + "\n")
    layout_str = "stereo" if record["channels"] == 2 else f"{record['channels']}-channel"
    return (
        f"wrote {record['samples'] / record['sampling_rate']:.2f} s of "
        f"{record['sampling_rate']} Hz {layout_str} audio to audio.wav "
        f"({p.steps} steps, seed {p.seed}) on {loaded.device} in {record['generate_s']:.1f} s "
        f"(load {loaded.load_s:.1f} s)"
    )


def _write_message(text: str) -> None:
    path = os.environ.get("GPUWARDEN_RESULT")
    if path:
        Path(path).write_text(json.dumps({"message": text}))


def main() -> int:
    try:
        params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
        out_dir = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
        os.environ.setdefault("HF_HOME", str(Path(os.environ["GPUWARDEN_SCRATCH_DIR"]) / "hf"))
    except (KeyError, OSError, ValueError) as exc:
        print(f"audiogen.stableaudio: not started as a gpuwarden job: {exc}", file=sys.stderr)
        return 2
    try:
        message = run(params, out_dir)
    except JobError as exc:
        print(f"audiogen.stableaudio: {exc}", file=sys.stderr, flush=True)
        _write_message(str(exc))
        return 1
    print(message, flush=True)
    _write_message(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
