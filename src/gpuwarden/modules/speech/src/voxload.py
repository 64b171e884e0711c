"""Loading VoxCPM2 from a staged folder, and checking what was loaded.

``voxcpm`` 2.0.3 loads a model folder with ``VoxCPM2Model.from_local``, which
calls ``load_state_dict(strict=False)``: a folder with the wrong or a partial
checkpoint loads *silently*, and the model then speaks noise. So this module
checks the folder's files before the load (naming each missing one) and the
checkpoint's keys after it (naming the missing and unexpected ones), and fails
the load with a message that says what is wrong.

It also deals with one packaging wrinkle: ``import voxcpm`` imports the
VoxCPM 1.x model (``voxcpm/model/voxcpm.py``), which imports ``torchaudio`` at
module level, although only that 1.x model uses it (VoxCPM2 reads audio with
librosa). Where torchaudio cannot be imported, :func:`import_voxcpm` puts a
placeholder in ``sys.modules`` first, whose every attribute raises an
``ImportError`` that says so; VoxCPM2 never touches it.

Nothing here reaches the network: the folder is used as it is, and the
Hugging Face libraries are told to stay offline before they are imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the message of every use of the torchaudio placeholder
TORCHAUDIO_MISSING = (
    "torchaudio is not installed; only VoxCPM 1.x needs it "
    "(VoxCPM2 reads audio with librosa): install the torchaudio build that "
    "matches your torch to use a VoxCPM 1.x model"
)
NOT_INSTALLED = (
    "voxcpm is not installed in the broker's Python: pip install -e '.[speech]' "
    "and then pip install --no-deps voxcpm==2.0.3 (see the speech module's README.md)"
)
#: where the upstream weights come from (for messages)
UPSTREAM = "openbmb/VoxCPM2"
#: the tokenizer files LlamaTokenizerFast.from_pretrained(folder) needs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: one of each pair must be there (from_local takes the first when both are)
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
VAE_FILES = ("audiovae.safetensors", "audiovae.pth")
#: most keys named in one message (then a count of the rest)
SHOW_KEYS = 8


class WeightsError(RuntimeError):
    """The model folder is not a complete VoxCPM2 checkpoint."""


def stay_offline() -> None:
    """Never reach for the hub; no progress bars in the worker's log. Call before
    anything imports huggingface_hub or transformers."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _MissingTorchaudio(types.ModuleType):
    """Stands in for torchaudio where it cannot be imported: any use raises."""

    def __init__(self, cause: str) -> None:
        super().__init__("torchaudio", TORCHAUDIO_MISSING)
        self._gw_cause = cause

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # import machinery and introspection probe these
            raise AttributeError(name)
        raise ImportError(f"{TORCHAUDIO_MISSING} (asked for torchaudio.{name}; {self._gw_cause})")


def import_voxcpm() -> tuple[Any, bool]:
    """``voxcpm`` and whether the torchaudio placeholder was needed.

    The libraries that look up whether torchaudio is installed (transformers,
    librosa) are imported first, so they see the truth rather than the
    placeholder."""
    stay_offline()
    placeholder = False
    try:
        import librosa  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"{NOT_INSTALLED} ({exc})") from exc
    if "torchaudio" not in sys.modules:
        try:
            import torchaudio  # noqa: F401
        except (ImportError, OSError) as exc:  # OSError: a build whose libraries fail to load
            sys.modules["torchaudio"] = _MissingTorchaudio(f"{type(exc).__name__}: {exc}")
            placeholder = True
    else:
        placeholder = isinstance(sys.modules["torchaudio"], _MissingTorchaudio)
    try:
        import voxcpm
    except ImportError as exc:
        raise RuntimeError(f"{NOT_INSTALLED} ({exc})") from exc
    return voxcpm, placeholder


@dataclass(frozen=True)
class ModelFiles:
    """The files of a checked model folder."""

    folder: Path
    config: dict[str, Any]
    model: Path  # model.safetensors or pytorch_model.bin
    vae: Path  # audiovae.safetensors or audiovae.pth
    nbytes: int  # of the two weight files


def check_folder(folder: Path) -> ModelFiles:
    """Check that ``folder`` holds a VoxCPM2 checkpoint's files, before loading it.
    Raises :class:`WeightsError` naming every missing file."""
    if not folder.is_dir():
        raise WeightsError(
            f"the VoxCPM2 model folder {folder} does not exist or is not a folder: "
            f"stage the files of {UPSTREAM} there (see the speech module's README.md)"
        )
    missing = [name for name in ("config.json", *TOKENIZER_FILES) if not (folder / name).is_file()]
    picked: dict[tuple[str, ...], Path] = {}
    for pair in (MODEL_FILES, VAE_FILES):
        found = [folder / name for name in pair if (folder / name).is_file()]
        if found:
            picked[pair] = found[0]
        else:
            missing.append(f"{pair[0]} (or {pair[1]})")
    if missing:
        raise WeightsError(
            f"the VoxCPM2 model folder {folder} is incomplete: missing {', '.join(missing)}; "
            f"stage every file of {UPSTREAM} (see the speech module's README.md)"
        )
    model, vae = picked[MODEL_FILES], picked[VAE_FILES]
    unreadable = [
        p.name
        for p in (folder / "config.json", *(folder / n for n in TOKENIZER_FILES), model, vae)
        if not os.access(p, os.R_OK)
    ]
    if unreadable:  # safetensors says "No such file or directory" for these
        raise WeightsError(
            f"the VoxCPM2 model folder {folder} has files this worker (uid {os.getuid()}) "
            f"cannot read: {', '.join(unreadable)}; make them readable, e.g. "
            "chmod -R o+rX on the weights folder (safetensors writes its files mode 600)"
        )
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{folder / 'config.json'} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{folder / 'config.json'} is not a JSON object")
    arch = str(config.get("architecture", "voxcpm")).lower()
    if arch != "voxcpm2":
        raise WeightsError(
            f"{folder / 'config.json'} says architecture {arch!r}, not 'voxcpm2': "
            f"this type serves VoxCPM2 ({UPSTREAM}) only"
        )
    return ModelFiles(folder, config, model, vae, model.stat().st_size + vae.stat().st_size)


def checkpoint_keys(path: Path) -> set[str]:
    """The tensor names in a checkpoint file, without loading the tensors where the
    format allows (safetensors: the header only; .pth/.bin: memory-mapped)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    import torch

    ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise WeightsError(f"{path} holds no state dict")
    return set(state)


def _some(keys: set[str]) -> str:
    ordered = sorted(keys)
    shown = ", ".join(ordered[:SHOW_KEYS])
    more = len(ordered) - SHOW_KEYS
    return f"{shown} and {more} more" if more > 0 else shown


def check_keys(tts_model: Any, files: ModelFiles) -> list[str]:
    """Compare the checkpoint's keys with the model's, as ``from_local`` does not
    (``strict=False``): a missing parameter or an unexpected key fails the load,
    named. A missing *buffer* does not: the model sets its buffers itself from
    config.json (the VAE's ``sr_bin_boundaries``), so a checkpoint may leave them
    out; it is returned as a note."""
    expected = {k for k in tts_model.state_dict() if "lora_" not in k}
    params = {k for k, _ in tts_model.named_parameters()}
    model_keys = checkpoint_keys(files.model)
    vae_keys = {f"audio_vae.{k}" for k in checkpoint_keys(files.vae)}
    given = model_keys | vae_keys
    missing = (expected - given) & params
    unexpected = given - expected
    notes = []
    if buffers := (expected - given) - params:
        notes.append(
            f"the checkpoint leaves out {len(buffers)} buffers set from the config: "
            f"{_some(buffers)}"
        )
    if not missing and not unexpected:
        return notes
    parts = []
    for name, path, is_vae in (
        ("model", files.model, False),
        ("audio VAE", files.vae, True),
    ):
        gone = {k for k in missing if k.startswith("audio_vae.") == is_vae}
        extra = {k for k in unexpected if k.startswith("audio_vae.") == is_vae}
        if gone:
            parts.append(f"{path.name} lacks {len(gone)} {name} keys: {_some(gone)}")
        if extra:
            parts.append(f"{path.name} has {len(extra)} unexpected keys: {_some(extra)}")
    raise WeightsError(
        f"the checkpoint in {files.folder} does not match the VoxCPM2 model its config.json "
        f"describes: {'; '.join(parts)} (wrong or partial weights: stage {UPSTREAM} again)"
    )


@dataclass
class Loaded:
    """A loaded, checked VoxCPM2."""

    tts: Any  # voxcpm.VoxCPM
    files: ModelFiles
    device: str
    optimized: bool
    torchaudio_placeholder: bool
    load_s: float
    params: int
    param_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> Any:
        return self.tts.tts_model

    @property
    def sample_rate(self) -> int:
        return int(self.tts.tts_model.sample_rate)


def load(folder: Path, device: str) -> Loaded:
    """Check ``folder``, load VoxCPM2 from it onto ``device`` (``cpu`` or ``cuda``),
    denoiser off, ``torch.compile`` only on CUDA; then check the keys."""
    start = time.monotonic()
    files = check_folder(folder)
    voxcpm, placeholder = import_voxcpm()
    optimize = device.startswith("cuda")
    tts = voxcpm.VoxCPM(
        voxcpm_model_path=str(folder),
        zipenhancer_model_path=None,
        enable_denoiser=False,
        optimize=optimize,
        device=device,
    )
    if type(tts.tts_model).__name__ != "VoxCPM2Model":  # pragma: no cover - checked above
        raise WeightsError(f"{folder} loaded as {type(tts.tts_model).__name__}, not VoxCPM2Model")
    notes = check_keys(tts.tts_model, files)
    params = list(tts.tts_model.parameters())
    return Loaded(
        tts=tts,
        files=files,
        device=device,
        optimized=optimize,
        torchaudio_placeholder=placeholder,
        load_s=time.monotonic() - start,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        notes=notes,
    )
