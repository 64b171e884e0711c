"""Clients for the managed runtimes' own HTTP APIs (:mod:`gpuwarden.core.runtime`
holds the vocabulary and the rule of when one may be asked)."""
