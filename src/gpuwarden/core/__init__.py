"""The pure domain: values, the transition table, policy and classification.

Nothing in this package performs I/O, starts threads, reads the clock or imports
anything from outside ``gpuwarden.core`` but :mod:`gpuwarden.errors` (and the
standard library's pure modules). ``now`` is always an argument.
"""
