"""Intake: how jobs come in. Queue roots and their bundles (read, checked, answered
with a result bundle), and the checks every job spec passes before it is stored,
whichever way it came (:mod:`gpuwarden.api` submits through :mod:`.jobs` too)."""
