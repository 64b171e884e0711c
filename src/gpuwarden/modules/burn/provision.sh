#!/bin/sh
# burn needs nothing beyond Python's standard library on the simulated GPU (it
# imports gpuwarden's simulated-GPU client, which the broker's interpreter has).
# On a real GPU it uses PyTorch if it is installed; it does not install it.
exit 0
