"""Human units on the command line: sizes (``12G``, ``512M``) and durations
(``30m``, ``2h``, ``90s``). Pure; each parser raises :class:`ValueError` with a
message that names the option and shows how to write it."""

from __future__ import annotations

import math
import re

__all__ = ["DURATION_UNITS", "SIZE_UNITS", "parse_bytes", "parse_duration"]

#: size suffixes (binary: ``G`` is GiB) and what each multiplies by
SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
#: duration suffixes and their seconds
DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(_NUMBER + r"\s*([KMGT])(?:i?B)?", re.IGNORECASE)
_DURATION = re.compile(_NUMBER + r"\s*([smhd])?")


def parse_bytes(text: str, *, option: str = "--vram", example: str = "10G") -> int:
    """``"12G"`` -> 12 GiB in bytes; ``"512M"``, ``"1.5G"``, ``"64K"``, ``"1T"``
    (``GiB``/``GB`` are read as ``G``). A unit is required: a bare number is
    ambiguous. Raise :class:`ValueError` naming ``option``."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"{option} {text}: write it as a number with G or M, e.g. {example}"
            + (" (a unit is needed: G for GiB, M for MiB)" if _is_number(text) else "")
        )
    value = float(m.group(1)) * SIZE_UNITS[m.group(2).upper()]
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{option} {text}: must be more than 0, e.g. {example}")
    return math.ceil(value)


def parse_duration(text: str, *, option: str = "--for", example: str = "10m") -> float:
    """``"30m"`` -> 1800.0; ``"2h"``, ``"90s"``, ``"1d"``, ``"1.5h"``; a bare
    number is seconds. Raise :class:`ValueError` naming ``option``."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{option} {text}: write it as a number with s, m, h or d, e.g. {example}")
    value = float(m.group(1)) * DURATION_UNITS[m.group(2) or "s"]
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{option} {text}: must be more than 0, e.g. {example}")
    return value


def _is_number(text: str) -> bool:
    return re.fullmatch(_NUMBER, text.strip()) is not None
