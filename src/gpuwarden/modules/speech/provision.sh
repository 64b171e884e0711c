#!/bin/sh
# Installs what the speech module's programs need into the sandbox image (used by
# images/build.sh). Nothing is downloaded when a job runs.
set -eu

# --- speech.check (src/check.py) ---
# pocketsphinx's wheel carries its US-English model (acoustic model, language
# model, dictionary: 37 MB); soundfile's wheel carries libsndfile; soxr resamples.
python3 -m pip install --no-cache-dir 'pocketsphinx==5.1.1' 'jiwer==4.0.0' \
	'soundfile==0.14.0' 'soxr==1.1.0' 'numpy==2.4.6'
# The optional whisper engine: openai-whisper reads a checkpoint staged in the
# weights folder ([sandbox] weights_dir); it needs torch, pinned first (a looser
# requirement lets pip pick a newer release and its multi-GB CUDA build; speech.check
# is a cpu-lane type, so the CPU build is what it uses).
python3 -m pip install --no-cache-dir 'torch==2.13.0'
python3 -m pip install --no-cache-dir 'openai-whisper==20250625'
