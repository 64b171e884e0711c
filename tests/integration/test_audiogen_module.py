"""The audiogen module (modules/audiogen): Stable Audio Open through diffusers'
StableAudioPipeline, for real, on a tiny random model.

The model is built here with the libraries' own classes (a T5 encoder, the DiT, the
Oobleck VAE, the projection model, the cosine DPM-Solver scheduler, and a Unigram T5
tokenizer made locally, so nothing is downloaded) and saved with ``save_pretrained``
in the real model's on-disk layout. Its VAE runs at 16 Hz with a hop of 4 and its
DiT takes 8 latent frames, so its longest clip is 8 * 4 / 16 = 2 s (32 samples):
seconds stay small and every job takes seconds. Two broken copies sit beside it: one
lacks a file, one a tensor in a safetensors file.

The job's functions are called directly first (parameters, the layout and key
checks, the token limit); then jobs run through a real node on the simulated GPU,
as processes of the broker (``launch = "container"`` run unsandboxed, and once in
bubblewrap), with the tiny model staged as the node's ``[sandbox] weights_dir``, and
once as the module's own folder (``[modules.audiogen] model_dir``) with no weights
dir, beside a job of another module that must not see it.

Without the ``audiogen`` extra every test here skips, saying how to install it;
with ``GPUWARDEN_REQUIRE_AUDIOGEN=1`` (set by .ci/run) it fails instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from tests.brokerkit import run_until, submit
from tests.conftest import need_tool
from tests.modulekit import module_from_file, skip_or_fail

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "src" / "gpuwarden" / "modules"
JOB = MODULES / "audiogen" / "src" / "stableaudio.py"
REQUIRE_ENV = "GPUWARDEN_REQUIRE_AUDIOGEN"
NOT_INSTALLED = (
    "the audiogen extra is not installed: pip install torch==2.13.0 && pip install -e '.[audiogen]'"
)
#: the tiny model: its VAE's rate, hop and the DiT's latent frames; so its longest clip
RATE, HOP, FRAMES = 16, 4, 8
MAX_SECONDS = FRAMES * HOP / RATE  # 2.0
TOKEN_LIMIT = 16
GOOD, NO_FILE, NO_KEY = "stable-audio-open-1.0", "missing-file", "missing-key"
DELETED_FILE = "vae/diffusion_pytorch_model.safetensors"
DROPPED_FILE, DROPPED_KEY = "transformer/diffusion_pytorch_model.safetensors", "proj_out.weight"
WORDS = "a hammer hitting wooden surface rain dog barking music drum loop low quality"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def extra() -> None:
    """The audiogen extra imports (once per module: importing it takes seconds)."""
    for name in ("torch", "diffusers", "transformers", "torchsde", "soundfile", "safetensors"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            skip_or_fail(REQUIRE_ENV, f"{NOT_INSTALLED} ({name}: {exc})")


@pytest.fixture(scope="module")
def job(extra: None) -> Iterator[ModuleType]:
    """modules/audiogen/src/stableaudio.py, imported from its path as the broker never
    would. It sets Hugging Face variables at import; they are put back afterwards."""
    with module_from_file(JOB, "gpuwarden_test_audiogen_job") as module:
        yield module


def build_tiny_pipeline(folder: Path) -> None:
    """A random StableAudioPipeline of the real classes, saved in the real layout."""
    import torch
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    # transformers 5 reloads a T5 tokenizer only from a Unigram model (WordLevel
    # saves, then fails to load)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in WORDS.split()]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer = T5TokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=TOKEN_LIMIT,
        extra_ids=0,
    )
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(pieces), d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4)
    )
    transformer = StableAudioDiTModel(
        sample_size=FRAMES,
        in_channels=3,
        num_layers=2,
        attention_head_dim=4,
        num_key_value_attention_heads=2,
        out_channels=3,
        cross_attention_dim=4,
        time_proj_dim=8,
        global_states_input_dim=8,
        cross_attention_input_dim=4,
    )
    scheduler = CosineDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    # ratios of 2 or more, as the real VAE's [2, 4, 4, 8, 8]: then the decoder gives
    # exactly frames x hop samples (a ratio of 1 loses one)
    vae = AutoencoderOobleck(
        encoder_hidden_size=6,
        downsampling_ratios=[2, 2],
        decoder_channels=3,
        decoder_input_channels=3,
        audio_channels=2,
        channel_multiples=[2, 4],
        sampling_rate=RATE,
    )
    projection = StableAudioProjectionModel(
        text_encoder_dim=32, conditioning_dim=4, min_value=0, max_value=32
    )
    pipe = StableAudioPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        projection_model=projection,
    )
    pipe.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def weights(extra: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weights dir: the tiny model (GOOD) and two broken copies of it (NO_FILE
    lacks DELETED_FILE; NO_KEY's DROPPED_FILE lacks DROPPED_KEY), each fault
    checked to be really there. Readable by anyone (a sandbox's user reads it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("audiogen-weights")
    start = time.monotonic()
    build_tiny_pipeline(root / GOOD)
    print(f"\ntiny StableAudioPipeline built and saved in {time.monotonic() - start:.2f} s")
    for name in (NO_FILE, NO_KEY):
        shutil.copytree(root / GOOD, root / name)
    (root / NO_FILE / DELETED_FILE).unlink()
    tensors = load_file(str(root / NO_KEY / DROPPED_FILE))
    assert DROPPED_KEY in tensors
    del tensors[DROPPED_KEY]
    save_file(tensors, str(root / NO_KEY / DROPPED_FILE), metadata={"format": "pt"})
    # the faults are real: the file is gone, the key is gone and nothing else
    assert (root / GOOD / DELETED_FILE).is_file()
    assert not (root / NO_FILE / DELETED_FILE).exists()
    with safe_open(str(root / GOOD / DROPPED_FILE), "pt") as f:
        good_keys = set(f.keys())
    with safe_open(str(root / NO_KEY / DROPPED_FILE), "pt") as f:
        assert set(f.keys()) == good_keys - {DROPPED_KEY}
    os.chmod(root, 0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture
def weights_env(weights: Path) -> Iterator[Path]:
    """GPUWARDEN_WEIGHTS_DIR as a job sees it, for the direct calls."""
    old = os.environ.get("GPUWARDEN_WEIGHTS_DIR")
    os.environ["GPUWARDEN_WEIGHTS_DIR"] = str(weights)
    try:
        yield weights
    finally:
        if old is None:
            os.environ.pop("GPUWARDEN_WEIGHTS_DIR", None)
        else:
            os.environ["GPUWARDEN_WEIGHTS_DIR"] = old


@pytest.fixture(scope="module")
def loaded(job: ModuleType, weights: Path) -> Any:
    start = time.monotonic()
    result = job.load(job.check_layout(weights / GOOD), device="cpu")
    print(f"\ntiny pipeline loaded (keys checked) in {time.monotonic() - start:.2f} s")
    return result


# --- the job's functions, called directly ---------------------------------------


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({}, "prompt is required"),
        ({"prompt": "   "}, "prompt is required"),
        ({"prompt": "x" * 4001}, "prompt is 4001 characters long; at most 4000"),
        ({"prompt": "rain", "seconds": 0}, "seconds must be greater than 0"),
        ({"prompt": "rain", "seconds": -1.5}, "seconds must be greater than 0"),
        ({"prompt": "rain", "seconds": float("nan")}, "seconds must be a finite number"),
        ({"prompt": "rain", "steps": 0}, "steps must be 1 to 1000"),
        ({"prompt": "rain", "steps": 1001}, "steps must be 1 to 1000"),
        ({"prompt": "rain", "guidance": 31}, "guidance must be 0 to 30"),
        ({"prompt": "rain", "seed": -1}, "seed must be 0 to"),
        ({"prompt": "rain", "model": "../etc"}, "model must be the name of a folder"),
        ({"prompt": "rain", "model": ".."}, "model must be the name of a folder"),
        ({"prompt": "rain", "wav": "mp3"}, "wav must be one of pcm16, float32"),
    ],
)
def test_bad_parameters_are_refused_with_a_reason(
    job: ModuleType, params: dict[str, Any], reason: str
) -> None:
    with pytest.raises(job.JobError, match=reason.replace("(", r"\(")):
        job.parse_params(params)


def test_defaults_and_a_drawn_seed(job: ModuleType) -> None:
    p = job.parse_params({"prompt": "rain on a tin roof", "negative_prompt": ""})
    assert (p.seconds, p.steps, p.guidance, p.model, p.wav) == (
        10.0,
        100,
        7.0,
        "stable-audio-open-1.0",
        "pcm16",
    )
    assert p.negative_prompt is None and not p.seed_given and 0 <= p.seed < 2**31


def test_the_layout_gives_the_models_longest_clip(job: ModuleType, weights: Path) -> None:
    layout = job.check_layout(weights / GOOD)
    assert layout.max_seconds == MAX_SECONDS and layout.sampling_rate == RATE
    assert sorted(layout.weights) == ["projection_model", "text_encoder", "transformer", "vae"]
    job.check_seconds(MAX_SECONDS, layout)
    with pytest.raises(
        job.JobError, match=r"seconds 2\.5 is more than this model's maximum of 2\.00 s"
    ):
        job.check_seconds(2.5, layout)


def test_a_missing_file_is_named_before_anything_loads(job: ModuleType, weights: Path) -> None:
    with pytest.raises(job.JobError) as caught:
        job.check_layout(weights / NO_FILE)
    assert f"is incomplete: missing {DELETED_FILE}" in str(caught.value)


def test_no_weights_dir_or_no_such_model_says_what_to_stage(job: ModuleType, weights: Path) -> None:
    with pytest.raises(job.JobError) as caught:
        job.find_model_dir(GOOD, env={})
    said = str(caught.value)  # both ways to stage it
    assert said.startswith("no model folder: this node's config gives the audiogen module none")
    assert "[modules.audiogen] model_dir" in said and "[sandbox] weights_dir" in said
    looked = "no model folder 'other': looked in the weights"
    with pytest.raises(job.JobError, match=looked) as caught:
        job.find_model_dir("other", env={"GPUWARDEN_WEIGHTS_DIR": str(weights)})
    assert GOOD in str(caught.value)  # it says what is there
    found = job.find_model_dir(GOOD, env={"GPUWARDEN_WEIGHTS_DIR": str(weights)})
    assert found == weights / GOOD
    # staged at the weights dir's top: found there too
    assert job.find_model_dir(GOOD, env={"GPUWARDEN_WEIGHTS_DIR": str(weights / GOOD)}) == (
        weights / GOOD
    )
    # the module's own folder (GPUWARDEN_MODEL_DIR) first: the model itself, or a
    # folder of models; then the weights dir
    own = {"GPUWARDEN_MODEL_DIR": str(weights / GOOD), "GPUWARDEN_WEIGHTS_DIR": str(weights)}
    assert job.find_model_dir(GOOD, env=own) == weights / GOOD
    assert job.find_model_dir(NO_KEY, env=own) == weights / NO_KEY  # from the weights dir
    models = {"GPUWARDEN_MODEL_DIR": str(weights)}
    assert job.find_model_dir(NO_FILE, env=models) == weights / NO_FILE
    with pytest.raises(job.JobError) as caught:
        job.find_model_dir("other", env={"GPUWARDEN_MODEL_DIR": str(weights / GOOD)})
    assert "looked in " + str(weights / GOOD / "other") in str(caught.value)
    assert "<model_dir>/other/ or <weights_dir>/other/" in str(caught.value)


def test_the_libraries_load_a_missing_key_silently_so_the_job_checks(
    job: ModuleType, weights: Path
) -> None:
    """Why the key check exists: diffusers loads the folder without the key and
    leaves that weight unset; the job's load names it instead."""
    from diffusers import StableAudioPipeline

    pipe = StableAudioPipeline.from_pretrained(
        str(weights / NO_KEY), local_files_only=True, use_safetensors=True
    )
    import torch
    from safetensors.torch import load_file

    # loaded without a word, with something else in the weight's place
    saved = load_file(str(weights / GOOD / DROPPED_FILE))[DROPPED_KEY]
    assert pipe.transformer.proj_out.weight.shape == saved.shape
    assert not torch.equal(pipe.transformer.proj_out.weight.detach(), saved)
    with pytest.raises(job.JobError) as caught:
        job.load(job.check_layout(weights / NO_KEY), device="cpu")
    message = str(caught.value)
    assert f"{DROPPED_FILE} lacks 1 of the model's" in message
    assert f"weights: {DROPPED_KEY}" in message


def test_the_good_model_loads_with_every_key(job: ModuleType, loaded: Any) -> None:
    assert loaded.device == "cpu" and loaded.dtype == "float32"
    assert loaded.notes == []  # no unexpected keys either
    # the T5 embedding is saved once (shared.weight) and tied: not reported missing
    assert loaded.param_count > 0


def test_a_prompt_past_the_token_limit_is_refused(job: ModuleType, loaded: Any) -> None:
    fits = " ".join(["rain"] * (TOKEN_LIMIT - 1))  # + the end marker = the limit
    assert job.check_tokens(loaded.pipe, "prompt", fits) == TOKEN_LIMIT
    with pytest.raises(
        job.JobError, match=f"prompt is {TOKEN_LIMIT + 1} tokens long; .* at most {TOKEN_LIMIT}"
    ):
        job.check_tokens(loaded.pipe, "prompt", fits + " rain")
    with pytest.raises(job.JobError, match="negative_prompt is"):
        job.check_tokens(loaded.pipe, "negative_prompt", fits + " rain")


def test_generate_writes_the_wav_in_process(job: ModuleType, loaded: Any, tmp_path: Path) -> None:
    import soundfile as sf

    p = job.parse_params(
        {"prompt": "rain", "seconds": 0.5, "steps": 2, "seed": 3, "wav": "float32"}
    )
    start = time.monotonic()
    record = job.generate(loaded, p, tmp_path)
    print(f"\nin-process job of 0.5 s, 2 steps: {time.monotonic() - start:.2f} s")
    info = sf.info(str(tmp_path / "audio.wav"))
    assert (info.samplerate, info.channels, info.frames) == (RATE, 2, 8)
    assert info.subtype == "FLOAT"
    assert record["samples"] == 8 and record["seed"] == 3 and record["seed_given"]


# --- jobs through a node on the simulated GPU ------------------------------------


def make_config(
    tmp_path: Path, weights: Path, runtime: str, *, model_dir: Path | None = None
) -> Config:
    """A node on the simulated GPU: the tiny model in ``weights`` as the weights dir,
    or with ``model_dir`` as the audiogen module's own folder and no weights dir."""
    top: dict[str, Any] = (
        {"container_runtime": "bubblewrap"}
        if runtime == "bubblewrap"
        else {"allow_unsandboxed_containers": True}
    )
    if model_dir is None:
        top["sandbox"] = {"weights_dir": str(weights)}
    else:
        top["modules"] = {"audiogen": {"model_dir": str(model_dir)}}
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "audiogennode",
            "gpu": "sim",
            "module_paths": [MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 1},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            **top,
        }
    )


@pytest.fixture
def node(tmp_path: Path, weights: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    runtime = getattr(request, "param", "local")
    if runtime == "bubblewrap":
        need_tool("bwrap")
    with open_node(make_config(tmp_path, weights, runtime), mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(2)


def ended(node: Node, *ids: str) -> bool:
    return all((j := node.store.get_job(i)) is not None and j.state.terminal for i in ids)


def out_dir(node: Node, job_id: str) -> Path:
    return node.config.state_dir / "jobs" / job_id / "attempt-1" / "out"


def message(node: Node, job_id: str) -> str:
    """The job's message (its message.json, as result.json has it)."""
    job = node.store.get_job(job_id)
    assert job is not None and job.result is not None
    return str(job.result["message"])


def explain(node: Node, job_id: str) -> str:
    job = node.store.get_job(job_id)
    attempts = node.store.attempts(job_id)
    tail = attempts[-1].stderr[-3000:] if attempts else ""
    result = job.result if job else None
    return f"{job.state if job else None}: {job.reason if job else ''} {result}\n{tail}"


def check_good_job(node: Node, job_id: str, seconds: float) -> dict[str, Any]:
    import soundfile as sf

    job = node.store.get_job(job_id)
    assert job is not None and job.state is JobState.DONE, explain(node, job_id)
    info = sf.info(str(out_dir(node, job_id) / "audio.wav"))
    # the VAE's rate, stereo, int(seconds * rate) samples: what the pipeline keeps
    assert (info.samplerate, info.channels, info.frames) == (RATE, 2, int(seconds * RATE))
    assert info.subtype == "PCM_16"
    record = json.loads((out_dir(node, job_id) / "audio.json").read_text())
    assert record["sampling_rate"] == RATE and record["channels"] == 2
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    # on the simulated GPU it held its float16 weights' bytes
    assert record["sim_gpu_bytes"] > 0
    assert message(node, job_id).startswith(
        f"wrote {int(seconds * RATE) / RATE:.2f} s of {RATE} Hz stereo audio to audio.wav"
    )
    return record


def test_jobs_through_the_broker(node: Node) -> None:
    """A good job, one past the model's longest clip, and one on each broken
    folder: all on one node, one after another on its simulated GPU."""
    seconds = 1.3  # 20.8 samples: the pipeline keeps int(1.3 * 16) = 20
    submit(
        node,
        JobSpec(
            id="good",
            type="audiogen.stableaudio",
            params={
                "prompt": "a dog barking",
                "negative_prompt": "low quality",
                "seconds": seconds,
                "steps": 3,
                "seed": 7,
            },
            outputs=("audio.wav", "audio.json"),
        ),
        JobSpec(
            id="toolong",
            type="audiogen.stableaudio",
            params={"prompt": "rain", "seconds": 5.0, "steps": 3},
        ),
        JobSpec(
            id="nofile",
            type="audiogen.stableaudio",
            params={"prompt": "rain", "seconds": 1.0, "steps": 3, "model": NO_FILE},
        ),
        JobSpec(
            id="nokey",
            type="audiogen.stableaudio",
            params={"prompt": "rain", "seconds": 1.0, "steps": 3, "model": NO_KEY},
        ),
    )
    start = time.monotonic()
    run_until(node, lambda: ended(node, "good", "toolong", "nofile", "nokey"), timeout=400)
    print(f"\nfour jobs through the broker in {time.monotonic() - start:.1f} s")
    record = check_good_job(node, "good", seconds)
    print(f"good job: load {record['load_s']} s, generate {record['generate_s']} s")

    failures = {
        "toolong": "seconds 5 is more than this model's maximum of 2.00 s",
        "nofile": f"is incomplete: missing {DELETED_FILE}",
        "nokey": f"{DROPPED_FILE} lacks 1 of the model's",
    }
    for job_id, reason in failures.items():
        job = node.store.get_job(job_id)
        assert job is not None and job.state is JobState.FAILED, explain(node, job_id)
        assert reason in message(node, job_id), explain(node, job_id)
        assert not (out_dir(node, job_id) / "audio.wav").exists()
        attempts = node.store.attempts(job_id)
        assert len(attempts) == 1 and attempts[0].exit_code == 1  # its own failure: no retry
    assert f"weights: {DROPPED_KEY}" in message(node, "nokey")


@pytest.mark.parametrize("node", ["bubblewrap"], indirect=True)
def test_a_job_in_bubblewrap_reads_the_mounted_weights(node: Node) -> None:
    """The same job sandboxed: the weights reach it read-only at /gpuwarden/weights."""
    submit(
        node,
        JobSpec(
            id="sandboxed",
            type="audiogen.stableaudio",
            params={"prompt": "rain on a tin roof", "seconds": 0.75, "steps": 2, "seed": 1},
        ),
    )
    run_until(node, lambda: ended(node, "sandboxed"), timeout=300)
    record = check_good_job(node, "sandboxed", 0.75)
    assert record["model_dir"] == "/gpuwarden/weights/stable-audio-open-1.0"


@pytest.mark.parametrize("runtime", ["bubblewrap", "local"])
def test_the_modules_own_model_dir_without_a_weights_dir(
    tmp_path: Path, weights: Path, runtime: str
) -> None:
    """``[modules.audiogen] model_dir`` set to the tiny model and no weights dir: the
    job reads it (read-only at /gpuwarden/model in bubblewrap, the host path
    unsandboxed) and is done with the right WAV; a job of another module on the same
    node (probe.sandbox, which lists its environment's names and its mounts) is
    given neither the variable nor the mount."""
    if runtime == "bubblewrap":
        need_tool("bwrap")
    config = make_config(tmp_path, weights, runtime, model_dir=weights / GOOD)
    assert config.sandbox.weights_dir is None
    with open_node(config, mock_gpu=True) as node:
        node.broker.recover()
        try:
            submit(
                node,
                JobSpec(
                    id="own",
                    type="audiogen.stableaudio",
                    params={"prompt": "rain on a tin roof", "seconds": 0.75, "steps": 2},
                ),
                JobSpec(id="other", type="probe.sandbox", params={}),
            )
            run_until(node, lambda: ended(node, "own", "other"), timeout=300)
            record = check_good_job(node, "own", 0.75)
            inside = "/gpuwarden/model" if runtime == "bubblewrap" else str(weights / GOOD)
            assert record["model_dir"] == inside
            other = node.store.get_job("other")
            assert other is not None and other.state is JobState.DONE, explain(node, "other")
            report = json.loads((out_dir(node, "other") / "report.json").read_text())
            assert report["job_type"] == "probe.sandbox"
            assert "GPUWARDEN_MODEL_DIR" not in report["env_keys"]
            assert "GPUWARDEN_WEIGHTS_DIR" not in report["env_keys"]
            if runtime == "bubblewrap":
                targets = {m["target"] for m in report["mounts"]}
                assert "/gpuwarden/module" in targets  # it does list the sandbox's mounts
                assert not any(t.startswith("/gpuwarden/model") for t in targets)
        finally:
            node.broker.shutdown(2)
