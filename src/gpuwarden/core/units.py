"""Human units on the command line: ``10G`` of memory, ``10m`` of time. Pure."""

from __future__ import annotations

import math
import re

#: a binary multiple per suffix (``10G`` is 10 GiB, as ``nvidia-smi`` and Slurm mean it)
BYTE_UNITS = {"": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: seconds per suffix
TIME_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")


def parse_bytes(text: str, option: str = "--vram") -> int:
    """``10G``, ``512M``, ``1.5G``, ``24GiB`` or a bare number of GiB, in bytes;
    :class:`ValueError` naming ``option`` and the form it takes."""
    match = _BYTES.match(str(text))
    if match is None:
        raise ValueError(
            f"{option} {text}: write it as a number with G or M, e.g. {option} 10G or "
            f"{option} 512M (a bare number is GiB)"
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    value = number * BYTE_UNITS[unit]
    if not math.isfinite(value) or value > 1 << 60:
        raise ValueError(f"{option} {text}: too large")
    return int(value)


def parse_duration(text: str, option: str = "--for") -> float:
    """``90s``, ``10m``, ``2h``, ``1d`` or a bare number of seconds, in seconds;
    :class:`ValueError` naming ``option`` and the form it takes."""
    match = _TIME.match(str(text))
    if match is None:
        raise ValueError(
            f"{option} {text}: write it as a number with s, m, h or d, e.g. {option} 10m "
            f"or {option} 2h (a bare number is seconds)"
        )
    value = float(match.group(1)) * TIME_UNITS[match.group(2)]
    if not math.isfinite(value) or value > 1e9:
        raise ValueError(f"{option} {text}: too long")
    return value


def bytes_text(value: int) -> str:
    """``10G``, ``512M``, ``1.5G``: the short form of a byte count."""
    if value >= 1 << 30:
        gib = value / (1 << 30)
        return f"{gib:g}G" if round(gib, 2) == gib else f"{gib:.2f}G"
    return f"{value / (1 << 20):g}M"
