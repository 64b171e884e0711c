"""speech.voxcpm2 (modules/speech): VoxCPM2 text to speech in a serve worker.

The model is a tiny *random* VoxCPM2 (a few hundred thousand parameters) built
here in the real on-disk layout (config.json, the tokenizer files,
model.safetensors, audiovae.safetensors) and loaded through voxcpm's own
``VoxCPM(...)``, so the real loading, prompt-encoding and generating code runs;
its speech is noise, so only what the broker and the worker promise is checked
(the file's rate, channels and length, the prompt cache, the errors). Its stop
head is random too, so every job passes a small ``max_steps`` and
``retry_badcase = false``. The reference recordings are spoken by espeak-ng.

First ``load`` and ``handle`` are called in this process; then jobs run through
an in-process broker as a warm server sandboxed in bubblewrap, with the weights
under ``[sandbox] weights_dir`` (and once as ``[modules.speech] model_dir``, with no
weights dir). The first generate of a process takes seconds
(one-time set-up in torch and librosa), so one server is shared by those jobs.

Without the speech extra and voxcpm every test that needs them skips, saying how
to install them; with ``GPUWARDEN_REQUIRE_SPEECH=1`` (set by .ci/run) they fail
instead, so CI cannot pass by skipping.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuwarden.server.worker import JobContext, LoadContext
from tests.modulekit import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "src" / "gpuwarden" / "modules" / "speech"
WORKER = SPEECH / "src" / "voxcpm_worker.py"
REQUIRE_ENV = "GPUWARDEN_REQUIRE_SPEECH"
NOT_INSTALLED = (
    "the speech extra or voxcpm is not installed: pip install torch==2.13.0 -e '.[speech]' "
    "&& pip install --no-deps voxcpm==2.0.3"
)
RATE = 48_000
#: samples per generated model step: 4 patches of the decoder's 1920-sample hop
STEP = 7680
HOP = 1920
#: every job: a short answer, no retries (the tiny model's stop head is random)
QUICK = {"max_steps": 4, "retry_badcase": False, "timesteps": 2}
REF_TEXT = "Hello there, this is my voice."

#: the first job of a sandboxed server imports torch and voxcpm and warms the model
#: up: 45-75 s on a busy 2-core machine, past the suite's default of 120 s per test
#: when the machine is busier still
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def import_worker() -> ModuleType:
    """modules/speech/src/voxcpm_worker.py, imported from its path (with voxload
    beside it) as the broker never would."""
    src = str(WORKER.parent)
    if src not in sys.path:
        sys.path.insert(0, src)
    name = "gpuwarden_test_voxcpm_worker"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker() -> Iterator[ModuleType]:
    """The worker module; the Hugging Face variables it sets are put back after."""
    saved = dict(os.environ)
    try:
        yield import_worker()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def voxcpm(worker: ModuleType) -> Iterator[ModuleType]:
    """voxcpm, imported the way the worker imports it (with the torchaudio
    placeholder where torchaudio is missing). The placeholder is taken out of
    sys.modules afterwards, so the tests after these see no torchaudio, as before."""
    for name in ("torch", "transformers", "librosa", "soundfile", "safetensors"):
        if importlib.util.find_spec(name) is None:
            skip_or_fail(REQUIRE_ENV, f"{NOT_INSTALLED} ({name} is missing)")
    voxload = sys.modules["voxload"]
    try:
        try:
            module, _ = voxload.import_voxcpm()
        except RuntimeError as exc:
            skip_or_fail(REQUIRE_ENV, str(exc))
        yield module
    finally:
        if isinstance(sys.modules.get("torchaudio"), voxload._MissingTorchaudio):
            del sys.modules["torchaudio"]


# --- the tiny model and the recordings ------------------------------------------------------


def build_tiny_voxcpm2(folder: Path) -> None:
    """A random VoxCPM2 with the real layout and the real rates (16 kHz in, 48 kHz out)
    (recipe: shared/research/modules.md, section 1)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaTokenizerFast
    from voxcpm.model.voxcpm2 import VoxCPM2Model, VoxCPMConfig
    from voxcpm.modules.audiovae import AudioVAEConfigV2, AudioVAEV2

    folder.mkdir(parents=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()\"", "▁"]:
        vocab[c] = len(vocab)
    while len(vocab) < 128:  # ids 101-104 are the audio marker tokens
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁")
    tok.decoder = decoders.Metaspace(replacement="▁")
    LlamaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(folder))
    hd = 16
    lm = {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 512,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0] * (hd // 2),
            "short_factor": [1.0] * (hd // 2),
            "original_max_position_embeddings": 512,
        },
        "vocab_size": 128,
        "use_mup": False,
        "scale_emb": 1.0,
        "dim_model_base": 32,
        "scale_depth": 1.0,
        "rope_theta": 10000.0,
        "kv_channels": hd,
    }
    small = {"hidden_dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 1, "kv_channels": hd}
    cfg = {
        "architecture": "voxcpm2",
        "lm_config": lm,
        "patch_size": 4,
        "feat_dim": 8,
        "residual_lm_num_layers": 1,
        "scalar_quantization_latent_dim": 16,
        "scalar_quantization_scale": 9,
        "encoder_config": small,
        "dit_config": {**small, "cfm_config": {}},
        "audio_vae_config": {
            "encoder_dim": 8,
            "encoder_rates": [2, 5, 8, 8],
            "latent_dim": 8,
            "decoder_dim": 64,
            "decoder_rates": [8, 6, 5, 2, 2, 2],
            "depthwise": True,
            "sample_rate": 16000,
            "out_sample_rate": RATE,
            "cond_dim": 8,
        },
        "max_length": 256,
        "device": "cpu",
        "dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = VoxCPM2Model(
        VoxCPMConfig.model_validate(cfg),
        LlamaTokenizerFast.from_pretrained(str(folder)),
        AudioVAEV2(AudioVAEConfigV2(**cfg["audio_vae_config"])),
        device="cpu",
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    vae = {k.removeprefix("audio_vae."): v for k, v in state.items() if k.startswith("audio_vae.")}
    save_file(vae, str(folder / "audiovae.safetensors"))
    rest = {k: v for k, v in state.items() if not k.startswith("audio_vae.")}
    save_file(rest, str(folder / "model.safetensors"))


#: how long building the tiny model took (for the report in the log)
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def weights(voxcpm: ModuleType) -> Iterator[Path]:
    """A weights folder as ``[sandbox] weights_dir`` names it: ``<dir>/VoxCPM2/``.
    World-readable, as the sandbox's user must read it."""
    root = Path(tempfile.mkdtemp(prefix="gw-vox-weights-"))
    root.chmod(0o755)
    start = time.monotonic()
    build_tiny_voxcpm2(root / "VoxCPM2")
    TIMES["build_s"] = time.monotonic() - start
    for f in (root / "VoxCPM2").iterdir():  # safetensors writes mode 600; staging makes 644
        f.chmod(0o644)
    print(f"built the tiny VoxCPM2 in {TIMES['build_s']:.2f} s")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def espeak(path: Path, text: str, *, speed: int = 150) -> Path:
    if shutil.which("espeak-ng") is None:
        skip_or_fail(REQUIRE_ENV, "espeak-ng is not installed (apt-get install espeak-ng)")
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", str(speed), "-w", str(path), text],
        check=True,
        capture_output=True,
    )
    path.chmod(0o644)
    return path


@pytest.fixture(scope="module")
def voices() -> Iterator[Path]:
    """A folder of reference recordings: two voices, a long one and a broken one."""
    folder = Path(tempfile.mkdtemp(prefix="gw-vox-voices-"))
    folder.chmod(0o755)
    espeak(folder / "ref.wav", REF_TEXT)
    espeak(folder / "other.wav", "A second speaker says something else.", speed=120)
    espeak(folder / "long.wav", " ".join(["This recording is far too long."] * 20), speed=80)
    (folder / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEnot really audio at all")
    (folder / "broken.wav").chmod(0o644)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def speaker(worker: ModuleType, weights: Path) -> Iterator[Any]:
    """The worker's ``load``, in this process, from the weights folder."""
    scratch = Path(tempfile.mkdtemp(prefix="gw-vox-load-"))
    saved = os.environ.get("GPUWARDEN_WEIGHTS_DIR")
    os.environ["GPUWARDEN_WEIGHTS_DIR"] = str(weights)
    try:
        start = time.monotonic()
        loaded = worker.load(LoadContext(gpu="", scratch_dir=scratch))
        TIMES["load_s"] = time.monotonic() - start
        yield loaded
    finally:
        if saved is None:
            os.environ.pop("GPUWARDEN_WEIGHTS_DIR", None)
        else:
            os.environ["GPUWARDEN_WEIGHTS_DIR"] = saved
        shutil.rmtree(scratch, ignore_errors=True)


def run_job(
    worker: ModuleType, speaker: Any, tmp: Path, **params: Any
) -> tuple[str, dict[str, Any]]:
    """One job through ``handle``; its message and its result.json."""
    out = tmp / "out"
    scratch = tmp / "scratch"
    out.mkdir(parents=True)
    scratch.mkdir()
    job = JobContext(
        job_id="vox-test",
        attempt=1,
        params={**QUICK, **params},
        input_dir=tmp,
        output_dir=out,
        scratch_dir=scratch,
    )
    start = time.monotonic()
    message = worker.handle(speaker, job)
    print(f"job took {time.monotonic() - start:.2f} s: {message}")
    return message, json.loads((out / "result.json").read_text())


def wav_info(path: Path) -> tuple[int, int, int, int]:
    """rate, channels, sample width and frames of a WAV file."""
    with wave.open(str(path)) as w:
        return w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()


def assert_speech(path: Path, chunks: int, max_steps: int) -> int:
    """48 kHz mono 16-bit, and a length the request allows: whole decoder hops,
    at least the model's minimum answer, at most max_steps (+1) steps per chunk."""
    rate, channels, width, frames = wav_info(path)
    assert (rate, channels, width) == (RATE, 1, 2)
    assert frames % HOP == 0, frames
    assert chunks * STEP <= frames <= chunks * (max_steps + 1) * STEP, (frames, chunks)
    return frames


# --- without the model: parameters and text chunks ----------------------------------------------


def test_long_texts_split_at_sentence_ends_within_the_bound(worker: ModuleType) -> None:
    text = "First sentence here. Second one? Third! " + "word " * 150 + "end."
    chunks = worker.split_text(worker.clean_text(text), 60)
    assert chunks[0] == "First sentence here. Second one? Third!"
    assert all(0 < len(c) <= 60 for c in chunks)
    assert " ".join(chunks) == worker.clean_text(text)  # nothing lost, nothing added
    assert worker.split_text("Short.", 60) == ["Short."]
    assert worker.split_text("a" * 130, 50) == ["a" * 50, "a" * 50, "a" * 30]


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"reference": "r.wav"}, "text is required"),
        ({"text": "  \n ", "reference": "r.wav"}, "text is empty"),
        ({"text": "x" * 5001, "reference": "r.wav"}, "text is too long: 5001 characters"),
        ({"text": "hi"}, "no reference recording"),
        ({"text": "hi", "reference": "r.wav", "cfg": 0.5}, "cfg = 0.5 is out of range"),
        ({"text": "hi", "reference": "r.wav", "cfg": 11}, "cfg = 11 is out of range"),
        ({"text": "hi", "reference": "r.wav", "timesteps": 0}, "timesteps = 0 is out of range"),
        ({"text": "hi", "reference": "r.wav", "timesteps": 101}, "timesteps = 101 is out"),
        ({"text": "hi", "reference": "r.wav", "max_steps": 0}, "max_steps = 0 is out of range"),
        ({"text": "hi", "reference": "r.wav", "seed": -1}, "seed = -1 is out of range"),
        ({"text": "hi", "reference": "r.wav", "chunk_chars": 5}, "chunk_chars = 5 is out of"),
        ({"text": "hi", "reference": "r.wav", "stream": "yes"}, "stream must be true or false"),
    ],
)
def test_bad_parameters_are_named(worker: ModuleType, params: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        worker.parse(params)


def test_prompt_keys_differ_by_recording_and_transcript(worker: ModuleType) -> None:
    a = worker.prompt_key(b"voice", None)
    assert a == worker.prompt_key(b"voice", None)
    assert len({a, worker.prompt_key(b"voice", ""), worker.prompt_key(b"voice", "hi")}) == 3
    assert a != worker.prompt_key(b"voice2", None)


def test_no_weights_dir_is_a_clear_load_failure(worker: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(worker.voxload.WeightsError) as caught:
        worker.find_model_dir("")
    said = str(caught.value)  # both ways to stage it
    assert "set [modules.speech] model_dir" in said and "[sandbox] weights_dir" in said
    with pytest.raises(worker.voxload.WeightsError, match="no VoxCPM2 model folder in the weights"):
        worker.find_model_dir(str(tmp_path))
    with pytest.raises(
        worker.voxload.WeightsError, match="set as \\[modules\\.speech\\] model_dir"
    ):
        worker.find_model_dir(str(tmp_path))
    # the module's own folder is the model itself (its check names what it lacks)
    assert worker.find_model_dir("", str(tmp_path)) == tmp_path
    assert worker.find_model_dir(str(tmp_path / "w"), str(tmp_path)) == tmp_path
    (tmp_path / "VoxCPM2").mkdir()
    (tmp_path / "VoxCPM2" / "config.json").write_text("{}")
    assert worker.find_model_dir("", str(tmp_path)) == tmp_path / "VoxCPM2"


# --- load and handle, in this process ----------------------------------------------------------


def test_the_torchaudio_placeholder_stands_in_and_says_why(voxcpm: ModuleType) -> None:
    """voxcpm imports torchaudio for its 1.x model only; where it is missing, the
    placeholder lets VoxCPM2 load, and any use says what is wrong."""
    placeholder = sys.modules.get("torchaudio")
    voxload = sys.modules["voxload"]
    if not isinstance(placeholder, voxload._MissingTorchaudio):
        pytest.skip("torchaudio is installed here: no placeholder is needed")
    with pytest.raises(
        ImportError, match=r"torchaudio is not installed; only VoxCPM 1\.x needs it"
    ):
        placeholder.load("x.wav")
    from voxcpm.model import voxcpm as v1

    with pytest.raises(ImportError, match=r"only VoxCPM 1\.x needs it"):
        v1.torchaudio.functional.resample  # noqa: B018


def test_load_checks_and_reports_the_model(worker: ModuleType, speaker: Any) -> None:
    loaded = speaker.loaded
    assert loaded.sample_rate == RATE
    assert speaker.device == "cpu" and loaded.optimized is False
    assert loaded.files.model.name == "model.safetensors"
    assert loaded.files.vae.name == "audiovae.safetensors"
    assert 100_000 < loaded.params < 1_000_000  # tiny
    assert worker.device_bytes(speaker) == 0  # on the CPU
    print(f"tiny model: built in {TIMES['build_s']:.2f} s, loaded in {TIMES['load_s']:.2f} s")


def test_continuation_cloning_writes_48k_mono_and_caches_the_voice(
    worker: ModuleType, speaker: Any, voices: Path, tmp_path: Path
) -> None:
    ref = str(voices / "ref.wav")
    msg, first = run_job(
        worker,
        speaker,
        tmp_path / "a",
        text="Good morning.",
        reference=ref,
        reference_text=REF_TEXT,
    )
    assert first["prompt_cache"]["hit"] is False and first["prompt_cache"]["mode"] == (
        "ref_continuation"
    )
    assert first["sample_rate"] == RATE and first["channels"] == 1 and first["chunks"] == 1
    frames = assert_speech(tmp_path / "a" / "out" / "speech.wav", 1, QUICK["max_steps"])
    assert first["samples"] == frames
    assert msg.endswith("prompt cache miss") and "at 48000 Hz (1 chunk) on cpu" in msg

    _, second = run_job(
        worker,
        speaker,
        tmp_path / "b",
        text="Good evening.",
        reference=ref,
        reference_text=REF_TEXT,
    )
    assert second["prompt_cache"]["hit"] is True
    assert second["prompt_cache"]["key"] == first["prompt_cache"]["key"]

    # the same recording without its transcript is another prompt (timbre only)
    _, timbre = run_job(worker, speaker, tmp_path / "c", text="Good night.", reference=ref)
    assert timbre["prompt_cache"]["hit"] is False
    assert timbre["prompt_cache"]["mode"] == "reference"


def test_a_seed_makes_a_job_repeatable(
    worker: ModuleType, speaker: Any, voices: Path, tmp_path: Path
) -> None:
    ref = str(voices / "other.wav")
    for name in ("a", "b"):
        run_job(worker, speaker, tmp_path / name, text="Same words.", reference=ref, seed=7)
    a = (tmp_path / "a" / "out" / "speech.wav").read_bytes()
    assert a == (tmp_path / "b" / "out" / "speech.wav").read_bytes()


def test_a_long_text_is_spoken_in_chunks_and_streamed(
    worker: ModuleType, speaker: Any, voices: Path, tmp_path: Path
) -> None:
    """The tiny model's tokenizer has one token per character and a context of
    256, so the chunks here are at most 100 characters."""
    text = " ".join(f"Sentence number {i} is here." for i in range(8))  # 223 characters
    _, record = run_job(
        worker,
        speaker,
        tmp_path,
        text=text,
        reference=str(voices / "ref.wav"),
        stream=True,
        chunk_chars=100,
    )
    out = tmp_path / "out"
    assert record["chunks"] == len(worker.split_text(text, 100)) == 3
    assert all(n <= 100 for n in record["chunk_chars"])
    frames = assert_speech(out / "speech.wav", 3, QUICK["max_steps"])
    files = record["chunk_files"]
    assert files and files == [f"chunks/{i:04d}.wav" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in (out / "chunks").iterdir()) == [Path(f).name for f in files]
    parts = [wav_info(out / f) for f in files]
    assert all(p[:3] == (RATE, 1, 2) for p in parts)
    assert sum(p[3] for p in parts) == frames  # the chunks are the joined file, in order


@pytest.mark.parametrize(
    ("name", "extra", "reason"),
    [
        ("missing.wav", {}, "the reference recording missing.wav is not among the job's inputs"),
        ("broken.wav", {}, "the reference recording broken.wav cannot be read as audio"),
        ("long.wav", {}, r"the reference recording long.wav is too long: \d+\.\d s, at most 30 s"),
    ],
)
def test_bad_references_fail_the_job_with_a_reason(
    worker: ModuleType,
    speaker: Any,
    voices: Path,
    tmp_path: Path,
    name: str,
    extra: dict[str, Any],
    reason: str,
) -> None:
    with pytest.raises(ValueError, match=reason):
        run_job(worker, speaker, tmp_path, text="Hello.", reference=str(voices / name), **extra)
    assert not (tmp_path / "out" / "speech.wav").exists()


def test_a_prompt_too_long_for_the_context_is_refused(
    worker: ModuleType, speaker: Any, voices: Path, tmp_path: Path
) -> None:
    """The tiny model's context is 256 steps: a 20 s reference with its transcript
    does not fit beside the text."""
    long_ref = espeak(tmp_path / "twenty.wav", " ".join(["One more sentence to say."] * 12))
    with pytest.raises(ValueError, match="too long for the model's context of 256 steps"):
        run_job(
            worker,
            speaker,
            tmp_path / "job",
            text="Hello.",
            reference=str(long_ref),
            reference_text="One more sentence to say.",
        )


# --- wrong or partial weights: a load that names what is wrong ---------------------------------


def copy_weights(weights: Path, dest: Path) -> Path:
    shutil.copytree(weights / "VoxCPM2", dest)
    return dest


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        ("config.json", "missing config.json"),
        ("tokenizer.json", "missing tokenizer.json"),
        ("model.safetensors", r"missing model.safetensors \(or pytorch_model.bin\)"),
        ("audiovae.safetensors", r"missing audiovae.safetensors \(or audiovae.pth\)"),
    ],
)
def test_a_partial_folder_fails_the_load_naming_the_file(
    worker: ModuleType, weights: Path, tmp_path: Path, remove: str, named: str
) -> None:
    folder = copy_weights(weights, tmp_path / "VoxCPM2")
    (folder / remove).unlink()
    with pytest.raises(worker.voxload.WeightsError, match=named):
        worker.voxload.load(folder, "cpu")


def test_missing_and_unexpected_keys_fail_the_load_naming_them(
    worker: ModuleType, weights: Path, tmp_path: Path
) -> None:
    """voxcpm loads with strict=False: a checkpoint short of a tensor (or with a
    foreign one) would load silently; the worker's own check refuses it."""
    from safetensors.torch import load_file, save_file

    folder = copy_weights(weights, tmp_path / "VoxCPM2")
    state = load_file(str(folder / "model.safetensors"))
    gone = "stop_head.weight"
    del state[gone]
    state["an_old_head.weight"] = state["stop_proj.weight"].clone()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(worker.voxload.WeightsError) as caught:
        worker.voxload.load(folder, "cpu")
    text = str(caught.value)
    assert f"model.safetensors lacks 1 model keys: {gone}" in text
    assert "model.safetensors has 1 unexpected keys: an_old_head.weight" in text

    # a buffer the model sets from its config may be left out; a parameter may not
    vae = load_file(str(folder / "audiovae.safetensors"))
    del vae["decoder.sr_bin_boundaries"]
    save_file(vae, str(folder / "audiovae.safetensors"))
    save_file(
        load_file(str(weights / "VoxCPM2" / "model.safetensors")), str(folder / "model.safetensors")
    )
    loaded = worker.voxload.load(folder, "cpu")
    assert loaded.notes == [
        "the checkpoint leaves out 1 buffers set from the config: "
        "audio_vae.decoder.sr_bin_boundaries"
    ]
    save_file(dict(list(vae.items())[:3]), str(folder / "audiovae.safetensors"))
    save_file(
        load_file(str(weights / "VoxCPM2" / "model.safetensors")), str(folder / "model.safetensors")
    )
    with pytest.raises(
        worker.voxload.WeightsError,
        match=r"audiovae.safetensors lacks \d+ audio VAE keys: audio_vae\.",
    ):
        worker.voxload.load(folder, "cpu")


def test_the_upstream_pth_layout_loads_and_is_checked(
    worker: ModuleType, weights: Path, tmp_path: Path
) -> None:
    """openbmb/VoxCPM2 ships audiovae.pth, not audiovae.safetensors; a checkpoint
    may also be pytorch_model.bin. Both load, and their keys are checked too."""
    import torch
    from safetensors.torch import load_file

    folder = copy_weights(weights, tmp_path / "VoxCPM2")
    vae = load_file(str(folder / "audiovae.safetensors"))
    torch.save({"state_dict": vae}, folder / "audiovae.pth")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "audiovae.safetensors").unlink()
    (folder / "model.safetensors").unlink()
    loaded = worker.voxload.load(folder, "cpu")
    assert (loaded.files.model.name, loaded.files.vae.name) == ("pytorch_model.bin", "audiovae.pth")
    assert loaded.sample_rate == RATE

    del vae[next(iter(vae))]
    torch.save({"state_dict": vae}, folder / "audiovae.pth")
    with pytest.raises(worker.voxload.WeightsError, match=r"audiovae\.pth lacks 1 audio VAE keys"):
        worker.voxload.load(folder, "cpu")


def test_a_voxcpm1_folder_is_refused(worker: ModuleType, weights: Path, tmp_path: Path) -> None:
    folder = copy_weights(weights, tmp_path / "VoxCPM2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architecture"] = "voxcpm"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(worker.voxload.WeightsError, match="architecture 'voxcpm', not 'voxcpm2'"):
        worker.voxload.load(folder, "cpu")


# --- through the broker: a warm server sandboxed in bubblewrap ----------------------------------


def broker_config(tmp: Path, weights_dir: Path | None, *, model_dir: Path | None = None) -> Any:
    """A node sandboxing in bubblewrap: the model under ``[sandbox] weights_dir``, or
    as the speech module's own folder (``[modules.speech] model_dir``)."""
    from gpuwarden.config import Config

    staged: dict[str, Any] = {}
    if weights_dir is not None:
        staged["sandbox"] = {"weights_dir": str(weights_dir)}
    if model_dir is not None:
        staged["modules"] = {"speech": {"model_dir": str(model_dir)}}
    return Config.model_validate(
        {
            "state_dir": tmp / "state",
            "node_name": "speechnode",
            "gpu": "sim",
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.05, "kill_grace_s": 2},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": 600, "stop_grace_s": 1},
            "container_runtime": "bubblewrap",
            **staged,
        }
    )


def submit_speech(node: Any, job_id: str, inputs: Path | None, **params: Any) -> None:
    from gpuwarden.core.model import JobSpec
    from gpuwarden.intake.jobs import prepare
    from gpuwarden.store.base import Submission

    names = tuple(p.name for p in inputs.iterdir()) if inputs is not None else ()
    spec = prepare(
        node.broker.registry,
        JobSpec(id=job_id, type="speech.voxcpm2", params={**QUICK, **params}, inputs=names),
    )
    origin = Submission(input_dir=str(inputs) if inputs is not None else None)
    node.store.submit([spec], now=time.time(), origin=origin)


def wait_ended(node: Any, *ids: str, timeout: float) -> None:
    from tests.brokerkit import run_until

    def ended() -> bool:
        return all((j := node.store.get_job(i)) is not None and j.state.terminal for i in ids)

    run_until(node, ended, timeout=timeout)


def server_events(node: Any, kind: str) -> list[Any]:
    return [e for e in node.store.events(limit=100_000) if e.kind == kind]


def job_inputs(tmp: Path, name: str, *files: Path) -> Path:
    folder = tmp / "inputs" / name
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    for f in files:
        shutil.copy(f, folder / f.name)
        (folder / f.name).chmod(0o644)
    return folder


@pytest.fixture(scope="module")
def node_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gw-vox-node-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_jobs_through_the_broker_in_bubblewrap_share_one_server_and_its_prompt_cache(
    voxcpm: ModuleType, weights: Path, voices: Path, node_tmp: Path
) -> None:
    """Three jobs on one warm server in bubblewrap, the weights read-only under
    /gpuwarden/weights: two in the same voice (the second hits the prompt cache)
    and one without its reference (a clear job error; the server goes on)."""
    from gpuwarden.app import open_node
    from gpuwarden.core.states import JobState
    from tests.conftest import need_tool

    need_tool("bwrap")
    ref = job_inputs(node_tmp, "ref", voices / "ref.wav")
    with open_node(broker_config(node_tmp, weights), mock_gpu=True) as node:
        node.broker.recover()
        try:
            start = time.monotonic()
            submit_speech(
                node, "s1", ref, text="Good morning.", reference="ref.wav", reference_text=REF_TEXT
            )
            wait_ended(node, "s1", timeout=600)
            first_s = time.monotonic() - start
            start = time.monotonic()
            submit_speech(
                node, "s2", ref, text="Good evening.", reference="ref.wav", reference_text=REF_TEXT
            )
            wait_ended(node, "s2", timeout=300)
            second_s = time.monotonic() - start
            submit_speech(node, "s3", None, text="No voice given.")
            wait_ended(node, "s3", timeout=300)
            jobs = {i: node.store.get_job(i) for i in ("s1", "s2", "s3")}
            print(f"through the broker: first job {first_s:.1f} s, second {second_s:.1f} s")
            for i in ("s1", "s2"):
                j = jobs[i]
                assert j is not None and j.state is JobState.DONE, (i, j and j.reason)
            records = []
            for i in ("s1", "s2"):
                out = Path(jobs[i].result["output_dir"])  # type: ignore[union-attr]
                assert_speech(out / "speech.wav", 1, QUICK["max_steps"])
                records.append(json.loads((out / "result.json").read_text()))
            assert [r["prompt_cache"]["hit"] for r in records] == [False, True]
            assert records[0]["model_dir"] == "/gpuwarden/weights/VoxCPM2"  # the read-only mount
            s3 = jobs["s3"]
            assert s3 is not None and s3.state is JobState.FAILED, s3
            assert "no reference recording" in s3.reason, s3.reason
            # one server loaded the model once for all three jobs
            assert len(server_events(node, "warm_server_loaded")) == 1
        finally:
            node.broker.shutdown(5)


def test_a_wrong_weights_folder_fails_the_load_through_the_broker_naming_the_file(
    voxcpm: ModuleType, weights: Path, voices: Path, node_tmp: Path
) -> None:
    from gpuwarden.app import open_node
    from gpuwarden.core.states import JobState
    from tests.conftest import need_tool

    need_tool("bwrap")
    broken = node_tmp / "broken-weights"
    broken.mkdir()
    broken.chmod(0o755)
    copy_weights(weights, broken / "VoxCPM2")
    (broken / "VoxCPM2" / "model.safetensors").unlink()
    ref = job_inputs(node_tmp, "ref-broken", voices / "ref.wav")
    with open_node(broker_config(node_tmp / "broken", broken), mock_gpu=True) as node:
        node.broker.recover()
        try:
            submit_speech(node, "w1", ref, text="Hello.", reference="ref.wav")
            wait_ended(node, "w1", timeout=300)
            job = node.store.get_job("w1")
            assert job is not None and job.state is not JobState.DONE, job
            assert "missing model.safetensors (or pytorch_model.bin)" in job.reason, job.reason
            assert "WeightsError" in job.reason, job.reason
        finally:
            node.broker.shutdown(5)


def test_the_modules_own_model_dir_without_a_weights_dir_in_bubblewrap(
    voxcpm: ModuleType, weights: Path, voices: Path, node_tmp: Path
) -> None:
    """``[modules.speech] model_dir`` set to the VoxCPM2 folder itself and no weights
    dir: the warm server loads it read-only from /gpuwarden/model and speaks."""
    from gpuwarden.app import open_node
    from gpuwarden.core.states import JobState
    from tests.conftest import need_tool

    need_tool("bwrap")
    ref = job_inputs(node_tmp, "ref-own", voices / "ref.wav")
    config = broker_config(node_tmp / "own", None, model_dir=weights / "VoxCPM2")
    assert config.sandbox.weights_dir is None
    with open_node(config, mock_gpu=True) as node:
        node.broker.recover()
        try:
            submit_speech(node, "m1", ref, text="Good morning.", reference="ref.wav")
            wait_ended(node, "m1", timeout=600)
            job = node.store.get_job("m1")
            assert job is not None and job.state is JobState.DONE, job and job.reason
            out = Path(job.result["output_dir"])
            assert_speech(out / "speech.wav", 1, QUICK["max_steps"])
            record = json.loads((out / "result.json").read_text())
            assert record["model_dir"] == "/gpuwarden/model"  # the module's read-only mount
        finally:
            node.broker.shutdown(5)
