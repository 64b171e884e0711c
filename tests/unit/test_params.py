"""Job parameter validation against a job type's schema, and command-line coercion."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpuwarden.core.model import JobType, Lane, LaunchMode, ParamSpec, ParamType
from gpuwarden.core.params import coerce_text, validate_params, value_fits
from gpuwarden.errors import UserError, ValidationError

TEXT = ParamSpec("text", ParamType.STRING, required=True)
COUNT = ParamSpec("count", ParamType.INTEGER, default=3)
RATIO = ParamSpec("ratio", ParamType.NUMBER, default=0.5)
FLAG = ParamSpec("flag", ParamType.BOOLEAN, default=False)
MODE = ParamSpec("mode", ParamType.STRING, default="fast", choices=("fast", "slow"))
SRC = ParamSpec("src", ParamType.INPUT)
NOTE = ParamSpec("note", ParamType.STRING)
LEVEL = ParamSpec("level", ParamType.INTEGER, choices=(1, 2, 4))

ALLOWED = "count, flag, level, mode, note, ratio, src, text"


def jobtype(*params: ParamSpec, name: str = "demo.run") -> JobType:
    return JobType(
        name=name,
        module="demo",
        module_dir="/modules/demo",
        lane=Lane.CPU,
        launch=LaunchMode.HOST,
        command=("{python}", "src/run.py"),
        params=params,
    )


JT = jobtype(TEXT, COUNT, RATIO, FLAG, MODE, SRC, NOTE, LEVEL)


def problem(raw: dict[str, Any], inputs: tuple[str, ...] = ()) -> str:
    with pytest.raises(ValidationError) as info:
        validate_params(JT, raw, inputs)
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert message.startswith("job type demo.run: ")
    return message


# --- validate_params: success and defaults ---------------------------------------------


def test_defaults_filled_in() -> None:
    out = validate_params(JT, {"text": "hi"})
    assert out == {"text": "hi", "count": 3, "ratio": 0.5, "flag": False, "mode": "fast"}
    # optional parameters without a default stay absent
    assert "note" not in out
    assert "src" not in out
    assert "level" not in out


def test_given_values_win_over_defaults() -> None:
    raw = {
        "text": "",
        "count": -2,
        "ratio": 7,
        "flag": True,
        "mode": "slow",
        "note": "n",
        "level": 4,
    }
    assert validate_params(JT, raw) == raw


def test_raw_is_not_modified() -> None:
    raw = {"text": "hi"}
    validate_params(JT, raw)
    assert raw == {"text": "hi"}


def test_empty_schema_and_no_params() -> None:
    assert validate_params(jobtype(), {}) == {}


# --- missing and unknown --------------------------------------------------------------


def test_missing_required() -> None:
    assert problem({}) == "job type demo.run: missing required parameter 'text' (string)"


def test_unknown_parameter_lists_allowed_names() -> None:
    assert problem({"text": "x", "colour": "red"}) == (
        f"job type demo.run: unknown parameter 'colour' (allowed: {ALLOWED})"
    )


def test_unknown_parameter_with_empty_schema() -> None:
    with pytest.raises(ValidationError) as info:
        validate_params(jobtype(name="bare.t"), {"x": 1})
    assert str(info.value) == "job type bare.t: unknown parameter 'x' (allowed: none)"


# --- types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [(True, "bool True"), (False, "bool False"), (2.0, "float 2.0"), ("3", "str '3'")],
)
def test_integer_rejects(value: Any, shown: str) -> None:
    assert problem({"text": "x", "count": value}) == (
        f"job type demo.run: parameter 'count' must be an integer, got {shown}"
    )


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (math.nan, "float nan"),
        (math.inf, "float inf"),
        (-math.inf, "float -inf"),
        (True, "bool True"),
        ("0.5", "str '0.5'"),
        (None, "NoneType None"),
    ],
)
def test_number_rejects(value: Any, shown: str) -> None:
    assert problem({"text": "x", "ratio": value}) == (
        f"job type demo.run: parameter 'ratio' must be a number, got {shown}"
    )


@pytest.mark.parametrize("value", [0, -3, 2.5, 1e300])
def test_number_accepts_ints_and_finite_floats(value: float) -> None:
    assert validate_params(JT, {"text": "x", "ratio": value})["ratio"] == value


@pytest.mark.parametrize(("value", "shown"), [(1, "int 1"), ("true", "str 'true'")])
def test_boolean_rejects(value: Any, shown: str) -> None:
    assert problem({"text": "x", "flag": value}) == (
        f"job type demo.run: parameter 'flag' must be true or false, got {shown}"
    )


@pytest.mark.parametrize(("value", "shown"), [(5, "int 5"), (None, "NoneType None")])
def test_string_rejects(value: Any, shown: str) -> None:
    assert problem({"text": value}) == (
        f"job type demo.run: parameter 'text' must be a string, got {shown}"
    )


def test_input_must_be_a_string() -> None:
    assert problem({"text": "x", "src": 3}, ("a.txt",)) == (
        "job type demo.run: parameter 'src' must be a string naming one of the job's inputs, "
        "got int 3"
    )


@pytest.mark.parametrize(
    ("ptype", "good", "bad"),
    [
        (ParamType.STRING, ["", "x"], [1, None, True, b"x"]),
        (ParamType.INPUT, ["a.txt"], [1, None]),
        (ParamType.INTEGER, [0, -1, 10**30], [True, 1.0, "1", None]),
        (ParamType.NUMBER, [0, 1.5, -2], [True, math.nan, math.inf, "1", None]),
        (ParamType.BOOLEAN, [True, False], [0, 1, "true", None]),
    ],
    ids=lambda v: v.value if isinstance(v, ParamType) else "",
)
def test_value_fits(ptype: ParamType, good: list[Any], bad: list[Any]) -> None:
    spec = ParamSpec("p", ptype)
    assert all(value_fits(spec, v) for v in good)
    assert not any(value_fits(spec, v) for v in bad)


# --- choices and inputs ---------------------------------------------------------------


def test_string_choices() -> None:
    assert problem({"text": "x", "mode": "medium"}) == (
        "job type demo.run: parameter 'mode' must be one of ['fast', 'slow'], got 'medium'"
    )


def test_integer_choices() -> None:
    assert validate_params(JT, {"text": "x", "level": 2})["level"] == 2
    assert problem({"text": "x", "level": 3}) == (
        "job type demo.run: parameter 'level' must be one of [1, 2, 4], got 3"
    )


def test_wrong_type_is_reported_before_choices() -> None:
    message = problem({"text": "x", "level": "2"})
    assert message == "job type demo.run: parameter 'level' must be an integer, got str '2'"


def test_input_param_names_one_of_the_inputs() -> None:
    out = validate_params(JT, {"text": "x", "src": "b.txt"}, ("a.txt", "b.txt"))
    assert out["src"] == "b.txt"


def test_input_param_not_among_inputs() -> None:
    assert problem({"text": "x", "src": "c.txt"}, ("a.txt", "b.txt")) == (
        "job type demo.run: parameter 'src' names input 'c.txt', which is not among the "
        "job's inputs (a.txt, b.txt)"
    )


def test_input_param_with_no_inputs() -> None:
    assert problem({"text": "x", "src": "a.txt"}) == (
        "job type demo.run: parameter 'src' names input 'a.txt', which is not among the "
        "job's inputs (none)"
    )


def test_several_problems_reported_at_once() -> None:
    message = problem(
        {"colour": "red", "count": True, "mode": "medium", "src": "nope"}, ("in.txt",)
    )
    parts = message.removeprefix("job type demo.run: ").split("; ")
    assert parts == [
        f"unknown parameter 'colour' (allowed: {ALLOWED})",
        "missing required parameter 'text' (string)",
        "parameter 'count' must be an integer, got bool True",
        "parameter 'mode' must be one of ['fast', 'slow'], got 'medium'",
        "parameter 'src' names input 'nope', which is not among the job's inputs (in.txt)",
    ]


# --- coerce_text ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "42", "a b", "ü"])
def test_coerce_string_and_input_keep_text(text: str) -> None:
    assert coerce_text(TEXT, text) == text
    assert coerce_text(SRC, text) == text


@pytest.mark.parametrize(("text", "value"), [("42", 42), ("-7", -7), ("0", 0)])
def test_coerce_integer(text: str, value: int) -> None:
    out = coerce_text(COUNT, text)
    assert out == value
    assert type(out) is int


@pytest.mark.parametrize("text", ["4.5", "abc", "", "1e3", "true"])
def test_coerce_integer_bad(text: str) -> None:
    with pytest.raises(ValidationError) as info:
        coerce_text(COUNT, text)
    assert str(info.value) == f"--count must be an integer, got {text!r}"


@pytest.mark.parametrize(("text", "value"), [("2.5", 2.5), ("3", 3.0), ("-1e3", -1000.0)])
def test_coerce_number(text: str, value: float) -> None:
    out = coerce_text(RATIO, text)
    assert out == value
    assert type(out) is float


@pytest.mark.parametrize("text", ["x", "", "1,5"])
def test_coerce_number_bad(text: str) -> None:
    with pytest.raises(ValidationError) as info:
        coerce_text(RATIO, text)
    assert str(info.value) == f"--ratio must be a number, got {text!r}"


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "Infinity", "1e400"])
def test_coerce_number_not_finite(text: str) -> None:
    with pytest.raises(ValidationError) as info:
        coerce_text(RATIO, text)
    assert str(info.value) == f"--ratio must be a finite number, got {text!r}"


@pytest.mark.parametrize("text", ["true", "1", "yes", "on", "TRUE", "Yes", "On"])
def test_coerce_boolean_true(text: str) -> None:
    assert coerce_text(FLAG, text) is True


@pytest.mark.parametrize("text", ["false", "0", "no", "off", "FALSE", "No", "OFF"])
def test_coerce_boolean_false(text: str) -> None:
    assert coerce_text(FLAG, text) is False


@pytest.mark.parametrize("text", ["maybe", "", "2", "y", "t"])
def test_coerce_boolean_bad(text: str) -> None:
    with pytest.raises(ValidationError) as info:
        coerce_text(FLAG, text)
    assert str(info.value) == f"--flag must be true or false, got {text!r}"


def test_coerced_values_pass_validation() -> None:
    raw = {
        "text": coerce_text(TEXT, "hi"),
        "count": coerce_text(COUNT, "9"),
        "ratio": coerce_text(RATIO, "0.25"),
        "flag": coerce_text(FLAG, "yes"),
    }
    assert validate_params(JT, raw) == {
        "text": "hi",
        "count": 9,
        "ratio": 0.25,
        "flag": True,
        "mode": "fast",
    }
