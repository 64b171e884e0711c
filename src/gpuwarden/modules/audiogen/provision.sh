#!/bin/sh
# Installs what src/stableaudio.py needs into the sandbox image (used by
# images/build.sh later). torch first, pinned: a looser requirement lets pip pick a
# newer release and, on Linux, its multi-GB CUDA build. On a GPU image install the
# CUDA build of the same version instead (e.g. from the PyTorch index for your CUDA).
# The others are the versions the module was tested with (transformers 5.x; 4.44 and
# later work too). torchsde: the pipeline's default scheduler needs it. soundfile's
# wheel carries libsndfile.
# The model is NOT installed here: its weights are staged on the node and mounted
# read-only through [sandbox] weights_dir (see README.md). Nothing is downloaded
# when a job runs.
set -eu
python3 -m pip install --no-cache-dir 'torch==2.13.0'
python3 -m pip install --no-cache-dir 'diffusers==0.42.1' 'transformers==5.24.0' \
	'torchsde==0.2.6' 'soundfile==0.14.0' 'safetensors==0.8.0'
