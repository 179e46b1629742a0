"""How a spec section is declared (the bottom of rlpipe.spec: it imports nothing of rlpipe).

Each section is a frozen dataclass (`section`, as CleanRL's and TRL's configs are) whose fields carry their default,
the bounds `parse_spec` checks and their doc (`setting`); a section's `__post_init__` holds its rules across fields.
A subclass may give an inherited setting another default (`retune`): an algorithm's options do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

_Section = TypeVar("_Section")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    min_length: int | None = None,
    pattern: str | None = None,
    doc: str = "",
) -> Any:
    """A spec field: its default, the bounds `parse_spec` checks, and what it means. Give the default by keyword
    (`setting(default=3, ...)`): a type checker reads a field specifier's keywords only (PEP 681)."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt, "min_length": min_length, "pattern": pattern}
    metadata = {k: v for k, v in bounds.items() if v is not None} | ({"doc": doc} if doc else {})
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field, setting))
def section(cls: type[_Section]) -> type[_Section]:
    """A spec section: `cls` as a frozen, keyword-only dataclass (type checkers see it as one: dataclass_transform)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def retune(cls: type, name: str, default: Any) -> Any:
    """Setting `name` of section `cls`, its bounds and doc kept, with another default (for a subclass of `cls`)."""
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return dataclasses.field(default=default, metadata=field.metadata)
