"""Algorithms, data sources and reward types registered from outside the package (tests/toy_plugins.py)
are selected by the spec and used by the same loop."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlpipe import loop
from rlpipe.algorithms import compute_advantages, get_algorithm, resolve_options
from rlpipe.spec import SpecError, json_schema, parse_spec, spec_from_json, spec_to_json

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


def test_a_toy_algorithm_brings_its_own_options(tmp_path: Path):
    """tests/toy_plugins.py's `sign` declares SignOptions beside it and registers them with it: a spec using them
    validates (bounds, unknown keys) and resolves, and crosses KFP unchanged, with nothing of rlpipe.spec changed."""
    from tests.toy_plugins import SignOptions

    algorithm = {"name": "tests.toy_plugins:sign", "dead_zone": 0.25, "scale": 2.0, "clip_eps": 0.1}
    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm=algorithm))
    assert type(spec.algorithm) is SignOptions and get_algorithm(spec.algorithm.name).options is SignOptions
    options = resolve_options(spec)
    assert (options.dead_zone, options.scale, options.clip_eps, options.loss_aggregation) == (
        0.25,
        2.0,
        0.1,
        "sequence_mean",
    )
    assert spec_from_json(spec_to_json(spec)) == spec
    with pytest.raises(SpecError, match=r"algorithm.scale: must be > 0"):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "tests.toy_plugins:sign", "scale": 0}))
    with pytest.raises(
        SpecError, match=r"algorithm.beta is not an option of algorithm tests.toy_plugins:sign .*dead_zone"
    ):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "tests.toy_plugins:sign", "beta": 0.1}))
    with pytest.raises(SpecError, match=r"algorithm.dead_zone is not an option of algorithm grpo .*sign"):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"dead_zone": 0.1}))
    assert "dead_zone" not in json_schema()["properties"]["algorithm"]["properties"]  # the schema lists rlpipe's own

    import pyarrow as pa

    scored = tmp_path / "scored.parquet"
    rows = [
        {"group_id": 0, "reward": r, "prompt_id": 0, "completion_token_ids": [5], "logprobs": [-1.0]}
        for r in (1, 0, 0.7)
    ]
    pq.write_table(pa.Table.from_pylist(rows), scored)
    compute_advantages(spec, str(scored), str(tmp_path / "batch.parquet"))  # mean 0.567: +0.43, -0.57, +0.13
    assert pq.read_table(tmp_path / "batch.parquet").column("advantage").to_pylist() == [2.0, -2.0, 0.0]


def test_unknown_names_say_what_is_registered(tmp_path: Path):
    with pytest.raises(ValueError, match=r"algorithm.name 'ppo2' is not a registered algorithm; registered: .*grpo"):
        get_algorithm("ppo2")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'"):
        get_algorithm("no_such_module:x")
    with pytest.raises(SpecError, match=r"algorithm.name 'ppo2' is not a registered algorithm"):
        parse_spec({"name": "x", "algorithm": {"name": "ppo2"}})  # named before any step runs
    spec = parse_spec(tiny_spec_dict(tmp_path, data={"generator": "sudoku"}))
    with pytest.raises(
        ValueError, match=r"data.generator .sudoku. is not a registered data source; registered: .*addition"
    ):
        loop.prepare(spec, str(tmp_path / "run"))
