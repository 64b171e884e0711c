"""Validation of job parameters against a job type's parameter schema (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpuwarden.core.model import JobType, ParamSpec, ParamType
from gpuwarden.errors import ValidationError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def value_fits(spec: ParamSpec, value: Any) -> bool:
    match spec.type:
        case ParamType.STRING | ParamType.INPUT:
            return isinstance(value, str)
        case ParamType.INTEGER:
            return isinstance(value, int) and not isinstance(value, bool)
        case ParamType.NUMBER:
            return (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        case ParamType.BOOLEAN:
            return isinstance(value, bool)
    return False  # pragma: no cover - exhaustive above


def validate_params(
    jobtype: JobType, raw: Mapping[str, Any], inputs: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check ``raw`` against the type's schema; return the parameters with defaults
    filled in. Raise :class:`ValidationError` naming every problem at once."""
    problems: list[str] = []
    known = {p.name for p in jobtype.params}
    for name in raw:
        if name not in known:
            allowed = ", ".join(sorted(known)) or "none"
            problems.append(f"unknown parameter {name!r} (allowed: {allowed})")
    out: dict[str, Any] = {}
    for spec in jobtype.params:
        if spec.name not in raw:
            if spec.required:
                problems.append(f"missing required parameter {spec.name!r} ({spec.type.value})")
            elif spec.default is not None:
                out[spec.name] = spec.default
            continue
        value = raw[spec.name]
        if not value_fits(spec, value):
            problems.append(
                f"parameter {spec.name!r} must be {_article(spec.type)}, "
                f"got {type(value).__name__} {value!r}"
            )
            continue
        if spec.choices and value not in spec.choices:
            problems.append(
                f"parameter {spec.name!r} must be one of {list(spec.choices)!r}, got {value!r}"
            )
            continue
        if spec.type is ParamType.INPUT and value not in inputs:
            problems.append(
                f"parameter {spec.name!r} names input {value!r}, which is not among the "
                f"job's inputs ({', '.join(inputs) or 'none'})"
            )
            continue
        out[spec.name] = value
    if problems:
        raise ValidationError(f"job type {jobtype.name}: " + "; ".join(problems))
    return out


def coerce_text(spec: ParamSpec, text: str) -> Any:
    """Turn a command-line string into the parameter's type, or raise ValidationError."""
    match spec.type:
        case ParamType.STRING | ParamType.INPUT:
            return text
        case ParamType.INTEGER:
            try:
                return int(text)
            except ValueError:
                raise ValidationError(f"--{spec.name} must be an integer, got {text!r}") from None
        case ParamType.NUMBER:
            try:
                value = float(text)
            except ValueError:
                raise ValidationError(f"--{spec.name} must be a number, got {text!r}") from None
            if not math.isfinite(value):
                raise ValidationError(f"--{spec.name} must be a finite number, got {text!r}")
            return value
        case ParamType.BOOLEAN:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValidationError(f"--{spec.name} must be true or false, got {text!r}")
    raise AssertionError(spec.type)  # pragma: no cover


def _article(t: ParamType) -> str:
    return {
        ParamType.STRING: "a string",
        ParamType.INPUT: "a string naming one of the job's inputs",
        ParamType.INTEGER: "an integer",
        ParamType.NUMBER: "a number",
        ParamType.BOOLEAN: "true or false",
    }[t]
