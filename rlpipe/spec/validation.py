"""`parse_spec`: a spec dict checked against the sections (rlpipe.spec.schema, .algorithm, .training, .placement)
and built into a RunSpec, or a SpecError naming every bad key and what is allowed there.

Checked in order: keys replaced by newer ones (rlpipe.spec.migration), unknown keys, types, bounds,
choices, then each section's `__post_init__` for rules across fields.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal

from rlpipe.spec.migration import replaced_keys
from rlpipe.spec.run_spec import RunSpec


class SpecError(ValueError):
    """A run spec that cannot be used; the message names the key and what is allowed."""


SpecError.__module__ = "rlpipe.spec"  # tracebacks name it where users import it from, as before the split


def parse_spec(data: dict[str, Any], source: str = "<dict>") -> RunSpec:
    """Validate a spec dict; raise SpecError naming each bad key."""
    if replaced := replaced_keys(data):
        raise SpecError("\n  ".join([f"invalid run spec {source}:", *replaced]))
    errors: list[str] = []
    spec = _build(RunSpec, data, "", errors)
    if errors:
        raise SpecError("\n  ".join([f"invalid run spec {source}:", *errors]))
    return spec


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, data: Any, key: str, errors: list[str]) -> Any:
    """An instance of section `cls` from `data`, or None with the problems appended to `errors`."""
    if not isinstance(data, dict):
        errors.append(f"{key.rstrip('.') or '<top level>'}: expected a mapping of keys, got {data!r}")
        return None
    if variant := getattr(cls, "variant", None):  # a section whose class a key picks (algorithm: its name)
        try:
            cls, data = variant(data)
        except ValueError as err:
            errors.append(str(err))
            return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for unknown in sorted(set(data) - set(fields), key=str):
        errors.append(f"{key}{unknown}: unknown key; allowed keys here: {', '.join(sorted(fields))}")
    values, failed = {}, len(errors)
    for name, field in fields.items():
        if name in data:
            values[name] = _convert(_hints(cls)[name], data[name], f"{key}{name}", field.metadata, errors)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            errors.append(f"{key}{name}: required")
    if len(errors) > failed:
        return None
    try:
        return cls(**values)
    except ValueError as err:  # a rule across fields (__post_init__)
        errors.append(f"{key.rstrip('.') or '<top level>'}: {err}")
        return None


def _convert(hint: Any, value: Any, key: str, bounds: typing.Mapping[str, Any], errors: list[str]) -> Any:
    """`value` as type `hint` within `bounds`; appends to `errors` and returns None when it is not.

    Lenient where YAML is: ints may come as 7.0 and numbers as strings ('3e-4', which YAML 1.1
    reads as a string); numbers must be finite."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) > 1:
            return _first_arm(arms, value, key, bounds, errors)
        (hint,) = arms
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a hint is a class, never an instance
        return _build(hint, value, f"{key}.", errors)
    if origin is Literal:
        if value not in args:
            return _fail(errors, key, value, f"must be one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (list, tuple):
        return _sequence(origin, args, value, key, bounds, errors)
    if origin is dict:
        values_any = args[1] is Any
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and (values_any or isinstance(v, str)) for k, v in value.items()
        ):
            return _fail(errors, key, value, "must be a mapping" + ("" if values_any else " of strings to strings"))
        return dict(value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value if isinstance(value, bool) else _fail(errors, key, value, "must be true or false")
    if hint is str:
        if not isinstance(value, str):
            return _fail(errors, key, value, "must be a string")
        if "pattern" in bounds and not re.fullmatch(bounds["pattern"], value):
            return _fail(errors, key, value, f"must match {bounds['pattern']}")
        return value
    if hint in (int, float):
        return _bounded_number(hint, value, key, bounds, errors)
    raise TypeError(f"spec field {key} has a type parse_spec does not know: {hint!r}")


def _fail(errors: list[str], key: str, value: Any, expected: str) -> None:
    errors.append(f"{key}: {expected} (got {value!r})")


def _first_arm(arms: list[Any], value: Any, key: str, bounds: typing.Mapping[str, Any], errors: list[str]) -> Any:
    """`value` as the first of a union's types it fits, e.g. str | dict[str, Any]."""
    expected = []
    for arm in arms:
        scratch: list[str] = []
        converted = _convert(arm, value, key, bounds, scratch)
        if not scratch:
            return converted
        expected.append(scratch[0].removeprefix(f"{key}: ").rsplit(" (got", 1)[0])  # e.g. "must be >= 1"
    errors.append(f"{key}: {' or '.join(expected)} (got {value!r})")
    return None


def _sequence(
    origin: type, args: tuple[Any, ...], value: Any, key: str, bounds: typing.Mapping[str, Any], errors: list[str]
) -> Any:
    """`value` as a list[args[0]] or a tuple[*args], each item converted."""
    if not isinstance(value, (list, tuple)):
        return _fail(errors, key, value, "must be a list")
    if origin is tuple and len(value) != len(args):
        return _fail(errors, key, value, f"must be a list of {len(args)} values")
    items = [
        _convert(args[i] if origin is tuple else args[0], item, f"{key}[{i}]", {}, errors)
        for i, item in enumerate(value)
    ]
    if "min_length" in bounds and len(items) < bounds["min_length"]:
        needs = "must not be empty" if bounds["min_length"] == 1 else f"needs {bounds['min_length']} entries"
        return _fail(errors, key, value, needs)
    return tuple(items) if origin is tuple else items


def _bounded_number(hint: type, value: Any, key: str, bounds: typing.Mapping[str, Any], errors: list[str]) -> Any:
    """`value` as an int or float within the ge/gt/le/lt `bounds`."""
    number = _number(value, hint)
    if number is None:
        return _fail(errors, key, value, "must be an integer" if hint is int else "must be a number")
    for bound, holds, says in (
        ("ge", number.__ge__, ">="),
        ("gt", number.__gt__, ">"),
        ("le", number.__le__, "<="),
        ("lt", number.__lt__, "<"),
    ):
        if bound in bounds and not holds(bounds[bound]):
            return _fail(errors, key, value, f"must be {says} {bounds[bound]}")
    return number


def _number(value: Any, kind: type) -> int | float | None:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if float(value).is_integer() else None
    return float(value)
