"""Tasks: each is a function making (train, eval) rows of {prompt, reference}, plus a reward.

Adding a task = one module with `make_rows(rng, n, **options)` and a reward function,
and one entry in TASKS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlpipe.spec import section_dict
from rlpipe.tasks import addition

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

TASKS: dict[str, Callable[..., list[dict[str, str]]]] = {
    "addition": addition.make_rows,
}


def task_rows(spec: RunSpec) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train rows, eval rows) of the spec's task, seeded by task.seed (default: the run's seed);
    the eval rows are disjoint from the train rows."""
    make_rows = TASKS[spec.task.name]
    options = {k: v for k, v in section_dict(spec.task).items() if k not in ("name", "train_size", "eval_size", "seed")}
    seed = spec.seed if spec.task.seed is None else spec.task.seed
    rows = make_rows(random.Random(seed), spec.task.train_size + spec.task.eval_size, **options)
    return rows[spec.task.eval_size :], rows[: spec.task.eval_size]
