"""Finding a registered algorithm, data source or reward type by the name a spec gives it, and plugin discovery:
importing, by name, the modules that register what a spec may name.

A user's plugin is the module of a 'package.module:name' the spec gives (`look_up` imports it). The built-in
algorithms are found the same way (`discover_built_ins`): rlpipe.spec, low in the house, keeps the registry of
algorithm options (rlpipe.spec.register_options) and never imports rlpipe.algorithms, which registers into it;
parsing a spec imports it here, by name. This is rlpipe's one by-name import of its own code across rooms
(tests/test_code_shape.py lists it).
"""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")

BUILT_IN_PLUGINS = ("rlpipe.algorithms",)  # register the built-in algorithms (and their options with the spec)


def discover_built_ins() -> None:
    """Plugin discovery: import the modules that register rlpipe's built-ins (BUILT_IN_PLUGINS), as `look_up`
    imports a user's plugin module (once: later calls find them in sys.modules)."""
    for module in BUILT_IN_PLUGINS:
        importlib.import_module(module)


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
