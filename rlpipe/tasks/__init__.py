"""Tasks: each is a function making (train, eval) rows of {prompt, reference}, plus a reward.

Adding a task = one module with `make_rows(rng, n, **options)` and a reward function,
and one entry in TASKS.
"""

from __future__ import annotations

from collections.abc import Callable

from rlpipe.tasks import addition

TASKS: dict[str, Callable[..., list[dict[str, str]]]] = {
    "addition": addition.make_rows,
}
