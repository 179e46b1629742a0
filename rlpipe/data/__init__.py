"""Data: the prepare step writes a run's train rows and fixed held-out rows (spec section `data`).

Rows are dicts with any columns. They come from a generator or from files, a saved dataset or a hub
id (rlpipe.data.files). Prepare renders each row's prompt and tokenizes it once
(rlpipe.data.prompts), so `prompt` holds the text the model sees and `prompt_token_ids` its ids;
every other column reaches the reward functions and the verifier as keyword lists.

A generator makes rows:
    make_rows(rng: random.Random, n: int, **options) -> list[dict]
`data.generator` is a registered name (`register_source`; built in: addition, multiplication, sorting,
verifiers: a verifiers environment's tasks),
'package.module:name' for one that module registers, or 'module:function' naming the generator itself.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlpipe.plugins import look_up
from rlpipe.store.run_root import data_counts_uri, data_uri, filesystem, move, write_json

if TYPE_CHECKING:
    from rlpipe.spec import DataSpec, EvalSetSpec, RunSpec

Rows = list[dict[str, Any]]
SOURCES: dict[str, Callable[..., Rows]] = {}


def register_source(name: str, make_rows: Callable[..., Rows]) -> Callable[..., Rows]:
    SOURCES[name] = make_rows
    return make_rows


def get_source(name: str) -> Callable[..., Rows]:
    """The generator `name` names: registered, registered by 'package.module:name', or the function
    'module:function' itself; a clear error otherwise."""
    module, _, short = name.rpartition(":")
    if module and short not in SOURCES:
        try:
            fn = getattr(importlib.import_module(module), short, None)
        except Exception as err:  # ImportError, or the module failing at import
            raise ValueError(
                f"data.generator {name!r}: cannot import {module!r} ({type(err).__name__}: {err})"
            ) from None
        if callable(fn) and short not in SOURCES:
            return fn
    return look_up(name, SOURCES, "data.generator", "data source", "rlpipe.data.register_source")[1]


def data_seed(spec: RunSpec) -> int:
    return spec.seed if spec.data.seed is None else spec.data.seed


def task_rows(spec: RunSpec) -> tuple[Rows, Rows]:
    """(train rows, held-out rows) as the data section gives them, before prompts are rendered;
    disjoint by construction (a generator's first eval_size rows are held out; files: see data)."""
    data = spec.data
    if data.generator:
        assert data.train_size is not None and data.eval_size is not None  # DataSpec sets both for a generator
        rows = get_source(data.generator)(
            random.Random(data_seed(spec)), data.train_size + data.eval_size, **data.options
        )
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"data.generator {data.generator} must return a list of dicts (rows)")
        return rows[data.eval_size :], rows[: data.eval_size]
    from rlpipe.data.files import read_rows

    assert data.path is not None  # DataSpec: without a generator, the rows come from data.path
    train = read_rows(data.path, data.format, data.config, data.split, "data.path")
    if data.eval_path is not None:
        held_out = read_rows(data.eval_path, data.format, data.config, data.split, "data.eval_path")
    elif data.eval_split is not None:
        held_out = read_rows(data.path, data.format, data.config, data.eval_split, "data.eval_split")
    else:
        train, held_out = held_out_fraction(train, data, data_seed(spec))
    return train[: data.train_size], held_out[: data.eval_size]


def held_out_fraction(rows: Rows, data: DataSpec, seed: int) -> tuple[Rows, Rows]:
    """A seeded split: round(eval_fraction x rows) rows held out, the rest train (order kept)."""
    assert data.eval_fraction is not None  # DataSpec: 0.05 for data files with no other held-out source
    count = max(1, round(len(rows) * data.eval_fraction))
    if count >= len(rows):
        raise ValueError(f"data.eval_fraction {data.eval_fraction} of {len(rows)} rows leaves none to train on")
    held = set(random.Random(f"held-out-{seed}").sample(range(len(rows)), count))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def prepared_rows(spec: RunSpec) -> tuple[Rows, Rows, dict[str, int]]:
    """(train rows, held-out rows, counts): prompts rendered and tokenized with the model's
    tokenizer, too-long prompts dropped and counted."""
    from rlpipe.data.prompts import encode_prompts
    from rlpipe.models.files import load_prompt_tokenizer

    train, held_out = task_rows(spec)
    if not train or not held_out:
        raise ValueError(f"data: {len(train)} train rows and {len(held_out)} held-out rows; both need some")
    tokenizer = load_prompt_tokenizer(spec.model.path, spec.cache_root)
    train, dropped_train = encode_prompts(train, spec.data, tokenizer)
    held_out, dropped_eval = encode_prompts(held_out, spec.data, tokenizer)
    if not train or not held_out:
        raise ValueError(
            f"data.max_prompt_tokens {spec.data.max_prompt_tokens} drops every train or held-out prompt; raise it"
        )
    counts = {
        "data/train_rows": len(train),
        "data/eval_rows": len(held_out),
        "data/dropped_too_long": dropped_train + dropped_eval,
    }
    return train, held_out, counts


def prepare_data(spec: RunSpec, run_root: str) -> dict[str, int]:
    """Write data/train.parquet and data/eval.parquet with `datasets`, and data/counts.json (which
    the warm start records with iteration 0); skip if present."""
    train_uri, eval_uri = data_uri(run_root, "train"), data_uri(run_root, "eval")
    fs, _ = filesystem(run_root)
    counts: dict[str, int] = {}
    if not (fs.exists(filesystem(train_uri)[1]) and fs.exists(filesystem(eval_uri)[1])):  # else an earlier run's
        train, held_out, counts = prepared_rows(spec)
        write_rows(eval_uri, held_out)
        write_rows(train_uri, train)
        write_json(data_counts_uri(run_root), counts)
    for eval_set in spec.evaluation.sets:  # each once, also when added on resume
        uri = data_uri(run_root, f"eval_{eval_set.name}")
        if not fs.exists(filesystem(uri)[1]):
            write_rows(uri, eval_set_rows(spec, eval_set))
    return counts


def write_rows(uri: str, rows: Rows) -> None:
    """Rows to Parquet with `datasets`, atomically (written beside, then moved)."""
    from datasets import Dataset

    fs, path = filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(filesystem(f"{uri}.tmp")[1], "wb") as f:
        Dataset.from_list(rows).to_parquet(f)
    move(f"{uri}.tmp", uri)


def eval_set_rows(spec: RunSpec, held_out: EvalSetSpec) -> Rows:
    """A named held-out set's rows (evaluation.sets), prompts rendered and tokenized as the data's are;
    a generator's are seeded apart from the training rows."""
    from rlpipe.data.prompts import encode_prompts
    from rlpipe.models.files import load_prompt_tokenizer

    key = f"evaluation set {held_out.name!r}"
    if held_out.generator is not None:
        seeded = random.Random(f"{data_seed(spec)}-eval-{held_out.name}")
        rows = get_source(held_out.generator)(seeded, held_out.size, **held_out.options)
    else:
        from rlpipe.data.files import read_rows

        assert held_out.path is not None  # EvalSetSpec: a path when there is no generator
        rows = read_rows(held_out.path, spec.data.format, spec.data.config, spec.data.split, f"{key} path")
    rows, _ = encode_prompts(rows[: held_out.size], spec.data, load_prompt_tokenizer(spec.model.path, spec.cache_root))
    if not rows:
        raise ValueError(f"{key} has no rows (or data.max_prompt_tokens drops every prompt)")
    return rows


from rlpipe.data import addition, multiplication, sorting  # noqa: E402 (the built-in sources; needs register_source above)

register_source("addition", addition.make_rows)
register_source("multiplication", multiplication.make_rows)
register_source("sorting", sorting.make_rows)


def verifiers_tasks(rng: random.Random, n: int, **options: Any) -> Rows:
    """data.generator verifiers {env_id, args, shuffle}: a verifiers environment's tasks as rows."""
    from rlpipe.rewards.verifiers_tasks import task_rows

    return task_rows(rng, n, **options)


register_source("verifiers", verifiers_tasks)
