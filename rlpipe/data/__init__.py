"""Data: the prepare step writes a run's train rows and fixed held-out rows, made by its source.

A data source makes rows: dicts with a "prompt" and any other columns (e.g. "reference"), which
reach the reward functions and the verifier as keyword lists.
    make_rows(rng: random.Random, n: int, **options) -> list[dict]
`options` are the spec's `task` section besides name, sizes and seed. Register one with
`register_source`; `task.name` is a registered name, or 'package.module:name' for one that module
registers (imported first, in every step's process).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlpipe.plugins import look_up
from rlpipe.spec import section_dict
from rlpipe.store.run_root import data_uri, filesystem, move

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

Rows = list[dict[str, Any]]
SOURCES: dict[str, Callable[..., Rows]] = {}


def register_source(name: str, make_rows: Callable[..., Rows]) -> Callable[..., Rows]:
    SOURCES[name] = make_rows
    return make_rows


def get_source(name: str) -> Callable[..., Rows]:
    """The data source `name` ('addition', or 'package.module:name') names; a clear error otherwise."""
    return look_up(name, SOURCES, "task.name", "data source", "rlpipe.data.register_source")[1]


def task_rows(spec: RunSpec) -> tuple[Rows, Rows]:
    """(train rows, eval rows) of the spec's task, seeded by task.seed (default: the run's seed);
    the eval rows are disjoint from the train rows."""
    make_rows = get_source(spec.task.name)
    options = {k: v for k, v in section_dict(spec.task).items() if k not in ("name", "train_size", "eval_size", "seed")}
    seed = spec.seed if spec.task.seed is None else spec.task.seed
    rows = make_rows(random.Random(seed), spec.task.train_size + spec.task.eval_size, **options)
    return rows[spec.task.eval_size :], rows[: spec.task.eval_size]


def prepare_data(spec: RunSpec, run_root: str) -> dict[str, int]:
    """Write data/train.parquet and data/eval.parquet with `datasets`; skip if present."""
    from datasets import Dataset

    train_uri, eval_uri = data_uri(run_root, "train"), data_uri(run_root, "eval")
    fs, _ = filesystem(run_root)
    if not (fs.exists(filesystem(train_uri)[1]) and fs.exists(filesystem(eval_uri)[1])):
        train, held_out = task_rows(spec)
        fs.makedirs(filesystem(data_uri(run_root, "train"))[1].rsplit("/", 1)[0], exist_ok=True)
        for uri, part in ((eval_uri, held_out), (train_uri, train)):
            tmp = f"{uri}.tmp"
            with fs.open(filesystem(tmp)[1], "wb") as f:
                Dataset.from_list(part).to_parquet(f)
            move(tmp, uri)
    return {"data/train_rows": spec.task.train_size, "data/eval_rows": spec.task.eval_size}


from rlpipe.data import addition  # noqa: E402 (registers the built-in sources; needs register_source above)

register_source("addition", addition.make_rows)
