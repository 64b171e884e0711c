#!/bin/sh
# Installs what the speech module's programs need into the sandbox image (used by
# images/build.sh). Nothing is downloaded when a job runs.
set -eu

# torch first, pinned: a looser requirement lets pip pick a newer release and, on
# Linux, its multi-GB CUDA build. On a GPU image install the CUDA build of the same
# version instead (e.g. from the PyTorch index for your CUDA).
python3 -m pip install --no-cache-dir 'torch==2.13.0'

# --- speech.voxcpm2 (src/voxcpm_worker.py, src/voxload.py) ---------------------
# what voxcpm 2.0.3 needs to load VoxCPM2 and generate (the `speech` extra of
# pyproject.toml), at the versions its tests ran with
python3 -m pip install --no-cache-dir 'transformers==5.24.0' 'einops==0.8.2' \
	'pydantic==2.14.4' 'librosa==0.11.0' 'safetensors==0.8.0' 'soundfile==0.14.0' \
	'huggingface-hub==2.4.0' 'tqdm==4.70.1' 'numpy==2.4.6'
# voxcpm itself without its dependencies: they are the web demo (gradio), the
# denoiser (modelscope, funasr), training (datasets), and torchaudio/torchcodec,
# which only VoxCPM 1.x uses (the worker stands a placeholder in for torchaudio).
python3 -m pip install --no-cache-dir --no-deps 'voxcpm==2.0.3'
# The weights are not downloaded here: stage openbmb/VoxCPM2 under the broker's
# [sandbox] weights_dir as VoxCPM2/ (README.md).

# --- speech.check (src/check.py) ---
# pocketsphinx's wheel carries its US-English model (acoustic model, language
# model, dictionary: 37 MB); soundfile's wheel carries libsndfile; soxr resamples.
python3 -m pip install --no-cache-dir 'pocketsphinx==5.1.1' 'jiwer==4.0.0' \
	'soundfile==0.14.0' 'soxr==1.1.0' 'numpy==2.4.6'
# The optional whisper engine: openai-whisper reads a checkpoint staged in the
# weights folder ([sandbox] weights_dir); it needs torch, installed first (above: a looser
# requirement lets pip pick a newer release and its multi-GB CUDA build; speech.check
# is a cpu-lane type, so the CPU build is what it uses).
python3 -m pip install --no-cache-dir 'openai-whisper==20250625'
