#!/bin/sh
# probe needs nothing beyond Python's standard library: it must run with the
# bare python3 of a sandbox image.
exit 0
