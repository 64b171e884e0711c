"""Operator tools built on the node: the demo and `gpuwarden doctor`."""
