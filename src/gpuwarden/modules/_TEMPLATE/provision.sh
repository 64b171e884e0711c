#!/bin/sh
# Installs what src/ needs into the sandbox image (used by images/build.sh later).
# Example: python3 -m pip install --no-cache-dir 'torch==2.*'
set -eu
exit 0
