"""Data: the prepare step writes a run's train prompts and fixed held-out set, made by its task.

A task is a function making rows of {prompt, reference, ...}: `make_rows(rng, n, **options)`.
Adding one = one module and one entry in TASKS.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlpipe.data import addition
from rlpipe.spec import section_dict
from rlpipe.store.run_root import filesystem, join, move

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


def prepare_data(spec: RunSpec, run_root: str) -> dict[str, int]:
    """Write data/train.parquet and data/eval.parquet with `datasets`; skip if present."""
    from datasets import Dataset

    train_uri, eval_uri = join(run_root, "data", "train.parquet"), join(run_root, "data", "eval.parquet")
    fs, _ = filesystem(run_root)
    if not (fs.exists(filesystem(train_uri)[1]) and fs.exists(filesystem(eval_uri)[1])):
        train, held_out = task_rows(spec)
        fs.makedirs(filesystem(join(run_root, "data"))[1], exist_ok=True)
        for uri, part in ((eval_uri, held_out), (train_uri, train)):
            tmp = f"{uri}.tmp"
            with fs.open(filesystem(tmp)[1], "wb") as f:
                Dataset.from_list(part).to_parquet(f)
            move(tmp, uri)
    return {"data/train_rows": spec.task.train_size, "data/eval_rows": spec.task.eval_size}
