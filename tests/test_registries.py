"""Algorithms, data sources and reward types registered from outside the package (tests/toy_plugins.py)
are selected by the spec and used by the same loop."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlpipe import loop
from rlpipe.algorithms import get_algorithm
from rlpipe.spec import parse_spec

from .conftest import tiny_spec_dict

TOY = {
    "data": {"generator": "tests.toy_plugins:doubling", "train_size": 200, "eval_size": 20},
    "algorithm": {"name": "tests.toy_plugins:sign"},
    "reward": {
        "functions": ["rlpipe.rewards.answer_checks:exact_match", {"type": "tests.toy_plugins:length", "target": 2}],
        "weights": [1.0, 0.5],
    },
}


def test_toy_plugins_run_one_iteration(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path, **TOY))
    run_root, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    loop.prepare(spec, run_root)
    rows = pq.read_table(f"{run_root}/data/train.parquet").to_pylist()
    assert all(row["prompt"].endswith("*2=") for row in rows)  # the toy data source made them
    staged, metrics = loop.warm_start(spec, run_root, cache)
    loop.sync_weights(spec, run_root, staged, 0, metrics)
    weights, metrics = loop.run_iteration(spec, run_root, loop.plan(spec, run_root).weights, 1, tmp_path, cache)
    assert weights["version"] == 1 and metrics["policy/optimizer_steps"] == 2
    batch = pq.read_table(tmp_path / "batch.parquet").to_pydict()
    assert set(batch["advantage"]) <= {-1.0, 0.0, 1.0}  # the toy algorithm's sign advantages
    lengths = batch["reward/length"]
    assert lengths == [float(len(c.strip()) == 2) for c in batch["completion"]]
    assert batch["reward"] == pytest.approx([e + 0.5 * n for e, n in zip(batch["reward/exact_match"], lengths)])


def test_unknown_names_say_what_is_registered(tmp_path: Path):
    with pytest.raises(ValueError, match=r"algorithm.name 'ppo2' is not a registered algorithm; registered: .*grpo"):
        get_algorithm("ppo2")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'"):
        get_algorithm("no_such_module:x")
    spec = parse_spec(tiny_spec_dict(tmp_path, data={"generator": "sudoku"}))
    with pytest.raises(
        ValueError, match=r"data.generator .sudoku. is not a registered data source; registered: .*addition"
    ):
        loop.prepare(spec, str(tmp_path / "run"))
