#!/bin/sh
# Installs what src/ needs into the sandbox image (used by images/build.sh later).
set -eu

# --- speech.voxcpm2 (src/voxcpm_worker.py, src/voxload.py) ---------------------
# torch first, pinned: a looser requirement lets pip pick a newer release and, on
# Linux, its multi-GB CUDA build. On a GPU image install the CUDA build of the same
# version instead (e.g. from the PyTorch index for your CUDA).
python3 -m pip install --no-cache-dir 'torch==2.13.0'
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
