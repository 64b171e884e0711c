"""speech.check (modules/speech): an offline ASR quality check, run for real.

Every job runs through a real broker (``gpuwarden --mock-gpu run-once``: a node
with the simulated GPU, as the embed tests do), in bubblewrap or as a host
process, on real audio: pocketsphinx's own recordings (Debian
``pocketsphinx-testdata``: "go forward ten meters", the ``cards`` set),
espeak-ng speech, white noise, and broken inputs. Nothing is downloaded: the
pocketsphinx wheel ships its English model; the Whisper test builds a tiny
random checkpoint.

Without the ``speech`` extra (or the Debian packages) every test skips, saying
what to install; with ``GPUWARDEN_REQUIRE_SPEECH=1`` (set by .ci/run) it fails
instead, so CI cannot pass by skipping.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import need_tool
from tests.modulekit import module_from_file, skip_or_fail

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "src" / "gpuwarden" / "modules"
CHECK = MODULES / "speech" / "src" / "check.py"
REQUIRE_ENV = "GPUWARDEN_REQUIRE_SPEECH"
NOT_INSTALLED = "the speech extra is not installed: pip install -e '.[speech]'"
TESTDATA = Path("/usr/share/pocketsphinx/test/data")
NO_TESTDATA = f"{TESTDATA} is missing: apt-get install pocketsphinx-testdata"
#: goforward.raw: 16 kHz, signed 16-bit little-endian, mono
GOFORWARD_TEXT = "Go forward, ten meters."
ESPEAK_TEXT = "The quick brown fox jumps over the lazy dog."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def extra() -> None:
    for name in ("pocketsphinx", "jiwer", "soundfile", "soxr", "numpy"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            skip_or_fail(REQUIRE_ENV, f"{NOT_INSTALLED} ({name}: {exc})")
    if not (TESTDATA / "goforward.raw").is_file():
        skip_or_fail(REQUIRE_ENV, NO_TESTDATA)


@pytest.fixture(scope="module")
def check(extra: None) -> Iterator[ModuleType]:
    """modules/speech/src/check.py, imported from its path (the broker never imports it)."""
    with module_from_file(CHECK, "gpuwarden_test_speech_check") as module:
        yield module


def goforward_wav(folder: Path) -> Path:
    """goforward.raw as a WAV file (soundfile, no sox)."""
    import numpy as np
    import soundfile as sf

    pcm = np.frombuffer((TESTDATA / "goforward.raw").read_bytes(), dtype="<i2")
    path = folder / "goforward.wav"
    sf.write(path, pcm, 16000, subtype="PCM_16")
    return path


def rms(path: Path) -> float:
    import numpy as np
    import soundfile as sf

    data, _ = sf.read(path, dtype="float32", always_2d=True)
    return float(np.sqrt(np.mean(np.square(data))))


def run_once(
    tmp: Path, audio: Path | None, *params: str, runtime: str = "local", config: str = ""
) -> tuple[int, str, dict[str, Any] | None]:
    """One speech.check job through a broker; its exit status, output and result.json."""
    if runtime == "bubblewrap":
        need_tool("bwrap")
        setting = 'container_runtime = "bubblewrap"\n'
    else:
        setting = "allow_unsandboxed_containers = true\n"
    cfg = tmp / "gpuwarden.toml"
    cfg.write_text(setting + f'module_paths = ["{MODULES}"]\n' + config)
    inputs = ["--input", str(audio), "--audio", audio.name] if audio is not None else []
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "--config",
            str(cfg),
            "--mock-gpu",
            "run-once",
            "speech.check",
            *inputs,
            *params,
            "--keep",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")},
    )
    out = r.stdout + r.stderr
    result = None
    kept = re.search(r"^kept\s+(\S+)", r.stdout, re.MULTILINE)
    if kept:
        kept_dir = Path(kept.group(1))
        record = kept_dir / "outputs" / "result.json"
        if record.is_file():
            result = json.loads(record.read_text())
        shutil.rmtree(kept_dir)
    return r.returncode, out, result


def assert_done(rc: int, out: str, result: dict[str, Any] | None) -> dict[str, Any]:
    assert rc == 0, out
    assert re.search(r"^status\s+done", out, re.MULTILINE), out
    assert result is not None, out
    assert set(result) >= {"wer", "transcript", "pass", "engine", "threshold"}
    return result


def assert_failed(rc: int, out: str, result: dict[str, Any] | None, reason: str) -> None:
    """The job failed on its own input (exit 2), with ``reason`` in its reason."""
    assert rc == 1, out
    assert re.search(r"^status\s+failed", out, re.MULTILINE), out
    line = re.search(r"^reason\s+(.*)$", out, re.MULTILINE)
    assert line, out
    assert "the job exited with code 2: speech.check: " in line.group(1), out
    assert reason in line.group(1), out
    assert result is None  # a failed job's outputs are not returned


# --- scoring, called directly ----------------------------------------------------


def test_wer_is_normalised_and_an_empty_transcript_is_1(check: ModuleType) -> None:
    assert check.normalise("  Go, FORWARD!  ten   meters. ") == "go forward ten meters"
    assert check.word_error_rate(GOFORWARD_TEXT, "go forward ten meters") == 0.0
    assert check.word_error_rate(GOFORWARD_TEXT, "go backward ten meters") == 0.25
    assert check.word_error_rate(GOFORWARD_TEXT, "") == 1.0
    assert check.word_error_rate(GOFORWARD_TEXT, " ?! ") == 1.0  # nothing left once normalised
    # insertions count: a WER can pass 1
    assert check.word_error_rate("yes", "no no no") == 3.0


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"text": ""}, "text is empty"),
        ({"text": "  \n"}, "text is empty"),
        ({"text": "?!."}, "has no words once punctuation is removed"),
        ({"threshold": 1.5}, "threshold must be a WER between 0 and 1, got 1.5"),
        ({"threshold": -0.1}, "threshold must be a WER between 0 and 1"),
        ({"threshold": True}, "threshold must be a WER between 0 and 1"),
        ({"engine": "vosk"}, "engine must be one of pocketsphinx, whisper"),
        ({"audio": ""}, "audio is missing"),
    ],
)
def test_bad_params_are_named(
    check: ModuleType, tmp_path: Path, params: dict[str, Any], reason: str
) -> None:
    wav = goforward_wav(tmp_path)
    good = {"audio": str(wav), "text": GOFORWARD_TEXT, "threshold": 0.35, "engine": "pocketsphinx"}
    assert check.check_params(good)["threshold"] == 0.35
    with pytest.raises(check.InputError, match=re.escape(reason)):
        check.check_params({**good, **params})


def test_audio_is_resampled_to_16k_mono(check: ModuleType, tmp_path: Path) -> None:
    """A 44.1 kHz stereo FLAC is read, downmixed and resampled to 16 kHz."""
    import numpy as np
    import soundfile as sf

    t = np.arange(44100 * 2) / 44100
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    path = tmp_path / "tone.flac"
    sf.write(path, np.stack([tone, tone], axis=1), 44100)
    assert sf.info(path).channels == 2 and sf.info(path).samplerate == 44100
    audio, seconds, rate = check.load_audio(path)
    assert rate == 44100 and seconds == pytest.approx(2.0)
    assert audio.ndim == 1 and audio.dtype == np.float32
    assert abs(len(audio) - 32000) <= 1
    assert float(np.sqrt(np.mean(audio**2))) == pytest.approx(0.3 / np.sqrt(2), rel=0.02)


def test_empty_and_non_finite_audio_are_refused(check: ModuleType, tmp_path: Path) -> None:
    import numpy as np
    import soundfile as sf

    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.int16), 16000)
    assert sf.info(empty).frames == 0  # the fault is real
    with pytest.raises(check.InputError, match=re.escape("audio 'empty.wav' holds no samples")):
        check.load_audio(empty)
    nan = tmp_path / "nan.wav"
    sf.write(nan, np.full(1600, np.nan, dtype=np.float32), 16000, subtype="FLOAT")
    assert np.isnan(sf.read(nan)[0]).all()  # the fault is real
    with pytest.raises(check.InputError, match="holds samples that are not finite numbers"):
        check.load_audio(nan)


# --- through the broker --------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["bubblewrap", "local"])
def test_real_speech_passes(extra: None, tmp_path: Path, runtime: str) -> None:
    """pocketsphinx's own recording of "go forward ten meters" (converted to WAV
    here) passes, sandboxed in bubblewrap and as a host process."""
    wav = goforward_wav(tmp_path)
    rc, out, result = run_once(
        tmp_path, wav, "--text", GOFORWARD_TEXT, "--want", "result.json", runtime=runtime
    )
    result = assert_done(rc, out, result)
    print(f"\ngoforward ({runtime}): {json.dumps(result)}")
    assert result["transcript"] == "go forward ten meters"
    assert result["wer"] == 0.0 and result["pass"] is True
    assert result["engine"] == "pocketsphinx" and result["threshold"] == 0.35
    assert result["audio_s"] == pytest.approx(2.786, abs=0.01)
    assert "pass: WER 0.00 (threshold 0.35) with pocketsphinx" in out


def test_cards_recording_with_its_transcript_passes(extra: None, tmp_path: Path) -> None:
    """cards/005.wav against its line of cards.transcription."""
    lines = (TESTDATA / "cards" / "cards.transcription").read_text().splitlines()
    text = next(x for x in lines if x.endswith("(005)"))
    text = text.replace("<s>", "").replace("</s>", "").replace("(005)", "").strip()
    assert text == "eight of spades four of clubs seven of hearts"
    rc, out, result = run_once(tmp_path, TESTDATA / "cards" / "005.wav", "--text", text)
    result = assert_done(rc, out, result)
    print(f"\ncards/005: {json.dumps(result)}")
    assert result["pass"] is True and result["wer"] <= 0.35


def test_white_noise_fails_the_check(extra: None, tmp_path: Path) -> None:
    import numpy as np
    import soundfile as sf

    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 16000 * 3).astype(np.float32)
    wav = tmp_path / "noise.wav"
    sf.write(wav, noise, 16000)
    # it really is loud noise, not silence or a broken file
    assert sf.info(wav).duration == pytest.approx(3.0)
    assert rms(wav) > 0.25
    rc, out, result = run_once(tmp_path, wav, "--text", GOFORWARD_TEXT)
    result = assert_done(rc, out, result)  # the check ran: its verdict is in the result
    print(f"\nwhite noise: {json.dumps(result)}")
    assert result["pass"] is False
    assert result["wer"] >= 0.75
    assert "FAIL: WER" in out


def test_espeak_speech_is_scored(extra: None, tmp_path: Path) -> None:
    """espeak-ng's synthetic voice: pocketsphinx does poorly on it, so the test
    reports the WER and checks the verdict agrees with it, not that it passes."""
    if shutil.which("espeak-ng") is None:
        skip_or_fail(REQUIRE_ENV, "espeak-ng is not installed: apt-get install espeak-ng")
    wav = tmp_path / "espeak.wav"
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), ESPEAK_TEXT],
        check=True,
        timeout=60,
    )
    assert rms(wav) > 0.01  # espeak-ng really spoke
    rc, out, result = run_once(tmp_path, wav, "--text", ESPEAK_TEXT, "--threshold", "0.35")
    result = assert_done(rc, out, result)
    print(f"\nespeak-ng: {json.dumps(result)}")
    assert result["sample_rate"] == 22050  # resampled to 16 kHz for the engine
    assert result["wer"] >= 0.0
    assert result["pass"] is (result["wer"] <= 0.35)


# --- bad inputs, through the broker ----------------------------------------------


def test_unreadable_audio_fails_with_the_reason(extra: None, tmp_path: Path) -> None:
    import soundfile as sf

    bad = tmp_path / "broken.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00not really a wave file")
    with pytest.raises(sf.LibsndfileError):  # the fault is real
        sf.info(bad)
    rc, out, result = run_once(tmp_path, bad, "--text", GOFORWARD_TEXT)
    assert_failed(rc, out, result, "audio 'broken.wav' is not readable audio: Error opening")
    assert str(tmp_path) not in re.search(r"^reason\s+(.*)$", out, re.MULTILINE).group(1)  # type: ignore[union-attr]


def test_too_long_audio_fails_before_decoding(extra: None, tmp_path: Path) -> None:
    import numpy as np
    import soundfile as sf

    long = tmp_path / "long.wav"
    sf.write(long, np.zeros(1000 * 301, dtype=np.int16), 1000)  # 301 s at 1 kHz: 0.6 MB
    assert sf.info(long).duration > 300  # the fault is real
    rc, out, result = run_once(tmp_path, long, "--text", GOFORWARD_TEXT)
    assert_failed(rc, out, result, "audio 'long.wav' is 301 s long, more than the limit of 300 s")


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (["--text", "   "], "text is empty: give the words the audio should say"),
        (
            ["--text", GOFORWARD_TEXT, "--threshold", "1.5"],
            "threshold must be a WER between 0 and 1, got 1.5",
        ),
        (
            ["--text", GOFORWARD_TEXT, "--threshold", "-0.1"],
            "threshold must be a WER between 0 and 1, got -0.1",
        ),
    ],
)
def test_bad_params_fail_the_job(
    extra: None, tmp_path: Path, params: list[str], reason: str
) -> None:
    wav = goforward_wav(tmp_path)
    value = params[params.index("--threshold") + 1] if "--threshold" in params else "0.35"
    text = params[params.index("--text") + 1]
    assert not text.strip() or not 0 <= float(value) <= 1  # the fault is real
    rc, out, result = run_once(tmp_path, wav, *params)
    assert_failed(rc, out, result, reason)


def test_missing_audio_is_refused_at_submission(extra: None, tmp_path: Path) -> None:
    missing = tmp_path / "missing.wav"
    assert not missing.exists()  # the fault is real
    rc, out, _ = run_once(tmp_path, None, "--audio", missing.name, "--text", GOFORWARD_TEXT)
    assert rc == 2, out
    assert "parameter 'audio' names input 'missing.wav', which is not among the job's inputs" in out
    rc, out, _ = run_once(tmp_path, None, "--text", GOFORWARD_TEXT)
    assert rc == 2, out
    assert "audio" in out and "required" in out, out


def test_whisper_without_staged_weights_fails_with_the_reason(extra: None, tmp_path: Path) -> None:
    wav = goforward_wav(tmp_path)
    rc, out, result = run_once(tmp_path, wav, "--text", GOFORWARD_TEXT, "--engine", "whisper")
    assert_failed(
        rc,
        out,
        result,
        "engine whisper needs a staged checkpoint: put the .pt file in the folder of the "
        "node's config key [modules.speech] model_dir, or of",
    )


# --- the whisper engine, on a tiny random checkpoint ------------------------------


@pytest.fixture(scope="module")
def whisper_weights(extra: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weights folder holding whisper/tiny_random.pt: a 7 MB openai-whisper
    checkpoint of random weights (the real tokenizer assets ship in the wheel), saved
    the way real checkpoints are. It transcribes gibberish, through the real code path."""
    try:
        import torch
        from whisper.model import ModelDimensions, Whisper
    except ImportError as exc:
        skip_or_fail(REQUIRE_ENV, f"{NOT_INSTALLED} (openai-whisper: {exc})")
    weights = tmp_path_factory.mktemp("weights")
    (weights / "whisper").mkdir()
    dims = ModelDimensions(
        n_mels=80,
        n_audio_ctx=1500,
        n_audio_state=32,
        n_audio_head=2,
        n_audio_layer=1,
        n_vocab=51864,  # English-only vocabulary
        n_text_ctx=448,
        n_text_state=32,
        n_text_head=2,
        n_text_layer=1,
    )
    torch.manual_seed(0)
    torch.save(
        {"dims": dims.__dict__, "model_state_dict": Whisper(dims).state_dict()},
        weights / "whisper" / "tiny_random.pt",
    )
    weights.chmod(0o755)
    return weights


@pytest.mark.parametrize("key", ["weights_dir", "model_dir"])
def test_whisper_checkpoint_from_the_weights_folder(
    whisper_weights: Path, tmp_path: Path, key: str
) -> None:
    """engine whisper loads the staged checkpoint (never a download) in bubblewrap,
    where the weights folder ([sandbox] weights_dir) or the speech module's own
    folder ([modules.speech] model_dir) is mounted read-only, and scores what it
    heard."""
    staged = {
        "weights_dir": f'[sandbox]\nweights_dir = "{whisper_weights}"\n',
        "model_dir": f'[modules.speech]\nmodel_dir = "{whisper_weights}"\n',
    }[key]
    wav = goforward_wav(tmp_path)
    rc, out, result = run_once(
        tmp_path,
        wav,
        "--text",
        GOFORWARD_TEXT,
        "--engine",
        "whisper",
        "--whisper_model",
        "whisper/tiny_random.pt",
        runtime="bubblewrap",
        config=staged,
    )
    result = assert_done(rc, out, result)
    print(f"\nwhisper tiny random: wer {result['wer']}, transcript {result['transcript'][:80]!r}")
    assert result["engine"] == "whisper"
    assert result["whisper_model"] == "whisper/tiny_random.pt"
    assert isinstance(result["transcript"], str)
    assert result["pass"] is (result["wer"] <= 0.35)
    assert result["model_load_s"] > 0


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../outside.pt", "whisper_model must be a path inside the model or weights folder"),
        ("/etc/passwd", "whisper_model must be a path inside the model or weights folder"),
        (
            "whisper/base.en.pt",
            "whisper_model 'whisper/base.en.pt' is not a file in the [sandbox] weights_dir folder",
        ),
    ],
)
def test_whisper_model_must_be_a_file_in_the_weights_folder(
    check: ModuleType,
    whisper_weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    reason: str,
) -> None:
    monkeypatch.setenv("GPUWARDEN_WEIGHTS_DIR", str(whisper_weights))
    assert not (whisper_weights / name).is_file() or name.startswith("/")
    with pytest.raises(check.InputError, match=re.escape(reason)):
        check.whisper_checkpoint(name)
    assert check.whisper_checkpoint("whisper/tiny_random.pt").is_file()


def test_whisper_model_is_found_in_the_model_folder_first(
    check: ModuleType, whisper_weights: Path, tmp_path: Path
) -> None:
    """[modules.speech] model_dir first, then [sandbox] weights_dir; a message that
    names both when it is in neither, and both ways to stage when none is set."""
    name = "whisper/tiny_random.pt"
    empty = tmp_path / "empty"
    empty.mkdir()
    both = {"GPUWARDEN_MODEL_DIR": str(whisper_weights), "GPUWARDEN_WEIGHTS_DIR": str(empty)}
    assert check.whisper_checkpoint(name, both) == whisper_weights / name
    swapped = {"GPUWARDEN_MODEL_DIR": str(empty), "GPUWARDEN_WEIGHTS_DIR": str(whisper_weights)}
    assert check.whisper_checkpoint(name, swapped) == whisper_weights / name
    with pytest.raises(check.InputError) as caught:
        check.whisper_checkpoint("nope.pt", both)
    assert "not a file in the [modules.speech] model_dir folder nor in the [sandbox]" in str(
        caught.value
    )
    with pytest.raises(check.InputError, match=r"\[modules\.speech\] model_dir, or of \[sandbox\]"):
        check.whisper_checkpoint(name, {})


# --- after a synthesis job: the `after` dependency ---------------------------------


@pytest.fixture
def broker(extra: None, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A broker (``gpuwarden serve``, simulated GPU, bubblewrap with host jobs
    allowed) on a state folder of its own; its config and the folder for results."""
    need_tool("bwrap")
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        'container_runtime = "bubblewrap"\nallow_host_jobs = true\n'
        f'module_paths = ["{MODULES}"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "--config", str(cfg), "--mock-gpu", "serve"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        gw(cfg, "status", "--wait", "60")
        yield cfg, tmp_path / "results"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def gw(cfg: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")},
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def show(cfg: Path, job: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(gw(cfg, "show", job, "--json").stdout)
    return doc


def test_a_check_waits_for_the_job_it_names_in_after(
    broker: tuple[Path, Path], tmp_path: Path
) -> None:
    """The README's chain: a check submitted with ``--after afterok:PRODUCER`` is
    held until the producer is done, then runs. echo.echo stands in for
    speech.voxcpm2 (another module); the file checked is given at submission,
    since no job's output can become another's input (README)."""
    cfg, results = broker
    wav = goforward_wav(tmp_path)
    gw(cfg, "submit", "echo.echo", "--id", "tts-1", "--text", "stand-in", "--sleep_s", "3")
    r = gw(
        cfg,
        "submit",
        "speech.check",
        "--id",
        "tts-1-check",
        "--after",
        "afterok:tts-1",
        "--input",
        str(wav),
        "--audio",
        wav.name,
        "--text",
        GOFORWARD_TEXT,
        "--wait",
        "--results-dir",
        str(results),
    )
    record = json.loads((results / "result.json").read_text())
    assert record["pass"] is True and record["wer"] == 0.0, r.stdout
    producer, checker = show(cfg, "tts-1"), show(cfg, "tts-1-check")
    assert producer["state"] == "done" and checker["state"] == "done"
    assert checker["after"] == ["afterok:tts-1"]
    # it started only once the producer had ended
    ended = producer["attempts_detail"][-1]["ended_at"]
    assert checker["attempts_detail"][0]["started_at"] >= ended


def test_a_check_after_a_failed_producer_fails_without_running(
    broker: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg, _ = broker
    wav = goforward_wav(tmp_path)
    gw(
        cfg,
        "submit",
        "echo.echo",
        "--id",
        "tts-2",
        "--text",
        "x",
        "--exit_code",
        "3",
        "--wait",
        check=False,
    )
    assert show(cfg, "tts-2")["state"] == "failed"  # the fault is real
    r = gw(
        cfg,
        "submit",
        "speech.check",
        "--id",
        "tts-2-check",
        "--after",
        "afterok:tts-2",
        "--input",
        str(wav),
        "--audio",
        wav.name,
        "--text",
        GOFORWARD_TEXT,
        "--wait",
        check=False,
    )
    checker = show(cfg, "tts-2-check")
    assert checker["state"] == "failed", r.stdout + r.stderr
    assert checker["reason"] == "dependency afterok:tts-2 can never hold: tts-2 failed"
    assert checker["attempts_detail"] == []  # it never ran
