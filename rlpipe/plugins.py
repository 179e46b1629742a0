"""Finding a registered algorithm, data source or reward type by the name a spec gives it."""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")


def look_up(name: str, registry: dict[str, T], key: str, kind: str, register: str) -> tuple[str, T]:
    """(registered name, entry) for `name`: a registered name, or 'package.module:name' for one that
    module registers when imported (here, in every step's process). ValueError names the spec `key`,
    what is registered and `register`, the function that registers a `kind`."""
    module, _, short = name.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except Exception as err:  # ImportError, or the module failing at import
            raise ValueError(f"{key} {name!r}: cannot import {module!r} ({type(err).__name__}: {err})") from None
    if short not in registry:
        raise ValueError(
            f"{key} {name!r} is not a registered {kind}; registered: {', '.join(sorted(registry))} "
            f"(or 'package.module:name' for one that module registers with {register})"
        )
    return short, registry[short]
