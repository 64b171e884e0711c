"""Intake: queue roots and bundles (the HTTP API comes later)."""
