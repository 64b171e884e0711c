"""speech.check: does a synthesised (or any) speech file say what it should?

Reads the input ``audio`` (anything libsndfile reads: WAV, FLAC, OGG, ...),
makes it 16 kHz mono (soxr), transcribes it with an offline ASR engine and
scores the transcript against ``text`` by word error rate (jiwer, after
lower-casing and removing punctuation). Writes ``result.json`` to the output
folder::

    {"wer": 0.0, "transcript": "go forward ten meters", "pass": true,
     "engine": "pocketsphinx", "threshold": 0.35, ...}

and a one-line ``{"message": ...}`` to ``$GPUWARDEN_RESULT``.

Engines: ``pocketsphinx`` (the default: its US-English model ships inside the
PyPI wheel) and ``whisper`` (openai-whisper, from a checkpoint file staged under
``$GPUWARDEN_MODEL_DIR`` (``[modules.speech] model_dir``) or
``$GPUWARDEN_WEIGHTS_DIR``; never downloaded).

Exit codes: 0 the check ran (``pass`` says whether it passed: a check that
fails is still a job that did its work); 2 bad input (missing or unreadable
audio, empty text, audio too long, threshold outside [0, 1], no Whisper
checkpoint); 1 the engine itself failed. The last stderr line says why.
Follows docs/MODULE_GUIDE.md and SPEC.md section 7.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

#: the rate both engines want
RATE = 16_000
#: the longest audio checked: a synthesised sentence or paragraph is far shorter.
#: pocketsphinx decodes the file as one utterance at about 0.5-0.9 x real time on a
#: busy 2-core CPU (124 s took 110 s, 190 MiB peak), so 300 s fits timeout_s = 600
MAX_AUDIO_S = 300.0
ENGINES = ("pocketsphinx", "whisper")
DEFAULT_WHISPER_MODEL = "whisper/base.en.pt"


class InputError(Exception):
    """The job's input is wrong: exit 2 with this text as the last stderr line."""


def fail(code: int, message: str) -> NoReturn:
    result_path = os.environ.get("GPUWARDEN_RESULT")
    if result_path:
        Path(result_path).write_text(json.dumps({"message": message}))
    print(f"speech.check: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


# --- parameters ---------------------------------------------------------------


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters, checked; raises InputError naming the wrong one."""
    text = params.get("text")
    if not isinstance(text, str) or not text.strip():
        raise InputError("text is empty: give the words the audio should say")
    if not normalise(text):
        raise InputError(f"text {text[:80]!r} has no words once punctuation is removed")
    threshold = params.get("threshold", 0.35)
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not math.isfinite(threshold)
        or not 0.0 <= threshold <= 1.0
    ):
        raise InputError(f"threshold must be a WER between 0 and 1, got {threshold!r}")
    engine = params.get("engine", "pocketsphinx")
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    audio = params.get("audio")
    if not isinstance(audio, str) or not audio:
        raise InputError("audio is missing: give the file to check as an input")
    path = Path(audio)
    if not path.is_file():
        raise InputError(f"audio {path.name!r} is missing or not a regular file")
    return {
        "text": text,
        "threshold": float(threshold),
        "engine": engine,
        "audio": path,
        "whisper_model": params.get("whisper_model", DEFAULT_WHISPER_MODEL),
    }


# --- audio --------------------------------------------------------------------


def why(exc: Exception, path: Path) -> str:
    """libsndfile's message without the file's full path (the job's folders are the
    broker's business): "Error opening 'x.wav': Format not recognised."."""
    return str(exc).replace(str(path), path.name).strip()


def load_audio(path: Path) -> tuple[Any, float, int]:
    """The audio as float32 mono at 16 kHz; its length in seconds; its own rate.
    The length is checked from the header before anything is decoded."""
    import numpy as np
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except Exception as exc:  # libsndfile's own message: "Format not recognised" and the like
        raise InputError(f"audio {path.name!r} is not readable audio: {why(exc, path)}") from None
    if info.samplerate <= 0 or info.frames <= 0:
        raise InputError(f"audio {path.name!r} holds no samples")
    seconds = info.frames / info.samplerate
    if seconds > MAX_AUDIO_S:
        raise InputError(
            f"audio {path.name!r} is {seconds:.0f} s long, more than the limit of "
            f"{MAX_AUDIO_S:.0f} s: cut it into parts"
        )
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:
        raise InputError(f"audio {path.name!r} could not be decoded: {why(exc, path)}") from None
    if data.shape[0] == 0:
        raise InputError(f"audio {path.name!r} holds no samples")
    mono = data.mean(axis=1, dtype=np.float32)
    if not np.all(np.isfinite(mono)):
        raise InputError(f"audio {path.name!r} holds samples that are not finite numbers")
    if rate != RATE:
        import soxr

        mono = soxr.resample(mono, rate, RATE, quality="HQ").astype(np.float32)
    return mono, seconds, int(rate)


# --- engines ------------------------------------------------------------------


def transcribe_pocketsphinx(audio: Any, timings: dict[str, float]) -> str:
    """pocketsphinx 5 with the US-English model of its wheel, the whole file as one utterance."""
    import numpy as np
    from pocketsphinx import Decoder

    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    start = time.monotonic()
    decoder = Decoder(samprate=RATE, loglevel="ERROR")
    timings["model_load_s"] = time.monotonic() - start
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp is not None else ""


def whisper_checkpoint(name: Any, env: dict[str, str] | None = None) -> Path:
    """The checkpoint file ``name``, a path inside the module's model folder
    ($GPUWARDEN_MODEL_DIR, ``[modules.speech] model_dir``) or else the weights
    folder ($GPUWARDEN_WEIGHTS_DIR, ``[sandbox] weights_dir``), checked."""
    environ = os.environ if env is None else env
    folders = [
        (environ.get(var, ""), key)
        for var, key in (
            ("GPUWARDEN_MODEL_DIR", "[modules.speech] model_dir"),
            ("GPUWARDEN_WEIGHTS_DIR", "[sandbox] weights_dir"),
        )
    ]
    folders = [(folder, key) for folder, key in folders if folder]
    if not folders:
        raise InputError(
            "engine whisper needs a staged checkpoint: put the .pt file in the folder of "
            "the node's config key [modules.speech] model_dir, or of [sandbox] weights_dir"
            f" (whisper_model, default {DEFAULT_WHISPER_MODEL})"
        )
    if not isinstance(name, str) or not name:
        raise InputError("whisper_model is empty")
    rel = PurePosixPath(name)
    if rel.is_absolute() or any(part in ("", ".", "..") for part in rel.parts):
        raise InputError(
            f"whisper_model must be a path inside the model or weights folder, got {name!r}"
        )
    for folder, _ in folders:
        path = Path(folder) / rel
        if path.is_file():
            return path
    where = " nor in ".join(f"the {key} folder" for _, key in folders)
    raise InputError(f"whisper_model {name!r} is not a file in {where}")


def transcribe_whisper(audio: Any, checkpoint: Path, timings: dict[str, float]) -> str:
    """openai-whisper from a local checkpoint (load_model takes a path: nothing is
    downloaded), on the CPU (this is a cpu-lane type), greedy, English."""
    import whisper

    start = time.monotonic()
    model = whisper.load_model(str(checkpoint), device="cpu")
    timings["model_load_s"] = time.monotonic() - start
    result = model.transcribe(
        audio,
        language="en",
        fp16=False,
        temperature=0.0,
        condition_on_previous_text=False,
        verbose=None,
    )
    return str(result.get("text", "")).strip()


# --- scoring ------------------------------------------------------------------


def normalise(text: str) -> str:
    """Lower case, punctuation removed, single spaces: what WER is computed on."""
    import jiwer

    return str(
        jiwer.Compose(
            [
                jiwer.ToLowerCase(),
                jiwer.RemovePunctuation(),
                jiwer.RemoveMultipleSpaces(),
                jiwer.Strip(),
            ]
        )(text)
    )


def word_error_rate(reference: str, transcript: str) -> float:
    """WER of the normalised transcript against the normalised reference. An empty
    transcript is 1.0 (every word deleted); jiwer itself refuses an empty one."""
    import jiwer

    ref = normalise(reference)
    hyp = normalise(transcript)
    if not hyp:
        return 1.0
    return float(jiwer.wer(ref, hyp))


# --- the job --------------------------------------------------------------------


def main() -> int:
    started = time.monotonic()
    params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
    out_dir = Path(os.environ["GPUWARDEN_OUTPUT_DIR"])
    try:
        p = check_params(params)
        checkpoint = whisper_checkpoint(p["whisper_model"]) if p["engine"] == "whisper" else None
        audio, seconds, rate = load_audio(p["audio"])
    except InputError as exc:
        fail(2, str(exc))
    except ImportError as exc:
        fail(1, f"the speech extra is not installed ({exc}): pip install 'gpuwarden[speech]'")
    loaded = time.monotonic()
    timings: dict[str, float] = {}
    try:
        if checkpoint is not None:
            transcript = transcribe_whisper(audio, checkpoint, timings)
        else:
            transcript = transcribe_pocketsphinx(audio, timings)
    except ImportError as exc:
        fail(1, f"engine {p['engine']} is not installed ({exc})")
    except Exception as exc:
        fail(1, f"engine {p['engine']} failed: {type(exc).__name__}: {exc}")
    decoded = time.monotonic()
    wer = word_error_rate(p["text"], transcript)
    passed = wer <= p["threshold"]
    record = {
        "wer": round(wer, 4),
        "transcript": transcript,
        "pass": passed,
        "engine": p["engine"],
        "threshold": p["threshold"],
        "reference": normalise(p["text"]),
        "hypothesis": normalise(transcript),
        "audio_s": round(seconds, 3),
        "sample_rate": rate,
        # the engine's model load, then the transcription itself
        "model_load_s": round(timings.get("model_load_s", 0.0), 3),
        "decode_s": round(decoded - loaded - timings.get("model_load_s", 0.0), 3),
        "total_s": round(time.monotonic() - started, 3),
        # ru_maxrss is in KiB on Linux
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if checkpoint is not None:
        record["whisper_model"] = p["whisper_model"]
    (out_dir / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    verdict = "pass" if passed else "FAIL"
    message = (
        f"{verdict}: WER {wer:.2f} (threshold {p['threshold']:.2f}) with {p['engine']} "
        f"on {seconds:.1f} s of audio: {transcript[:200]!r}"
    )
    Path(os.environ["GPUWARDEN_RESULT"]).write_text(json.dumps({"message": message}))
    print(message, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
