"""Each step as a plain function, without KFP: generate -> score -> advantages -> update -> sync."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe.algorithms import compute_advantages
from rlpipe.data.order import prompt_indices
from rlpipe.engines import generate_rollouts
from rlpipe.loop import sync_weights
from rlpipe.models.loading import load_policy
from rlpipe.rewards import RewardError, score_rollouts
from rlpipe.rollouts import ROLLOUT_SCHEMA
from rlpipe.spec import parse_spec, spec_to_dict
from rlpipe.store.run_root import read_state
from rlpipe.store.weights import latest_version, local_path, read_weight_ref
from rlpipe.training.batching import pack
from rlpipe.training.logprobs import completion_logits, token_logprobs
from rlpipe.training.session import update_policy
from rlpipe.training.trainer import NonFiniteLossError


def bad_reward(prompts, completions, **_):
    raise ZeroDivisionError("oops")


def nan_reward(prompts, completions, **_):
    return [float("nan")] * len(prompts)


def test_light_steps_do_not_import_torch():
    code = (
        "import sys\n"
        "import rlpipe.rewards, rlpipe.algorithms\n"
        "import rlpipe.store.commit, rlpipe.loop, rlpipe.data\n"
        "import rlpipe.evaluation.accuracy, rlpipe.tracking.mlflow_runs\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_cursor_covers_the_train_set_once_per_epoch():
    first_epoch = [i for it in range(1, 6) for i in prompt_indices(100, 20, it, seed=0)]
    assert sorted(first_epoch) == list(range(100))
    assert prompt_indices(100, 30, 4, 0)[:10] == prompt_indices(100, 10, 10, 0)  # crosses into epoch 1


def test_one_iteration_end_to_end(initialized_run, tmp_path: Path):
    spec, run_root, cache = initialized_run
    weights = read_weight_ref(run_root, 0)
    metrics = generate_rollouts(spec, run_root, weights, 1, str(tmp_path / "r.parquet"), cache)
    rollouts = pq.read_table(tmp_path / "r.parquet")
    assert rollouts.schema.names == ROLLOUT_SCHEMA.names + ["reference"]  # then the data's columns
    assert rollouts.num_rows == 8 * 4
    assert set(rollouts.column("weights_version").to_pylist()) == {0}
    assert metrics["throughput/generate_tokens_per_s"] > 0

    # sampling log-probs equal a fresh forward pass of the same weights
    model, tokenizer = load_policy(local_path(weights, cache))
    rows = [{**r, "advantage": 0.0} for r in rollouts.to_pylist()]
    mb = pack(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = completion_logits(model, mb)
    recomputed = token_logprobs(logits, mb.targets, spec.rollout.temperature)
    assert torch.allclose(recomputed * mb.completion_mask, mb.old_logprobs, atol=1e-4)

    score_metrics = score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    assert 0.0 <= score_metrics["reward/mean"] <= 1.0
    adv_metrics = compute_advantages(spec, str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet"))
    batch = pq.read_table(tmp_path / "b.parquet")
    assert np.isfinite(batch.column("advantage").to_numpy()).all()
    assert 0.0 <= adv_metrics["groups/zero_variance_fraction"] <= 1.0

    staged, update_metrics = update_policy(spec, run_root, weights, str(tmp_path / "b.parquet"), 1, cache)
    assert staged["version"] == 1
    assert update_metrics["policy/optimizer_steps"] == 2
    assert latest_version(run_root) == 0  # staged, not yet visible
    published, merged = sync_weights(spec, run_root, staged, 1, {**metrics, **update_metrics})
    assert latest_version(run_root) == 1 and published["version"] == 1
    assert read_state(run_root)["iteration"] == 1
    assert Path(run_root, "optimizer", "v000001.pt").exists()
    assert "policy/loss" in merged

    # a retried sync after its own commit is a no-op; an out-of-order commit is refused
    again, extra = sync_weights(spec, run_root, staged, 1, {})
    assert again == published and extra == {}
    with pytest.raises(RuntimeError, match="cannot commit iteration 3"):
        sync_weights(spec, run_root, staged, 3, {})


def test_failing_reward_function_names_itself(initialized_run, tmp_path: Path):
    spec, run_root, cache = initialized_run
    generate_rollouts(spec, run_root, read_weight_ref(run_root, 0), 1, str(tmp_path / "r.parquet"), cache)
    for ref, match in (
        ("tests.test_steps:bad_reward", "tests.test_steps:bad_reward raised ZeroDivisionError: oops"),
        ("tests.test_steps:nan_reward", "rewards must be finite"),
        ("tests.test_steps:missing", "has no function 'missing'"),
        ("no_such_module:f", "cannot import module 'no_such_module'"),
    ):
        bad = parse_spec({**spec_to_dict(spec), "reward": {"functions": [ref]}})
        with pytest.raises(RewardError, match=match):
            score_rollouts(bad, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
        assert not (tmp_path / "s.parquet").exists()


def test_nan_loss_stops_before_anything_is_published(initialized_run, tmp_path: Path):
    spec, run_root, cache = initialized_run
    generate_rollouts(spec, run_root, read_weight_ref(run_root, 0), 1, str(tmp_path / "r.parquet"), cache)
    score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    compute_advantages(spec, str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet"))
    table = pq.read_table(tmp_path / "b.parquet")
    poisoned = table.set_column(
        table.schema.get_field_index("advantage"), "advantage", [[float("nan")] * table.num_rows]
    )
    pq.write_table(poisoned, tmp_path / "b.parquet")
    with pytest.raises(NonFiniteLossError, match="nothing was published"):
        update_policy(spec, run_root, read_weight_ref(run_root, 0), str(tmp_path / "b.parquet"), 1, cache)
    assert latest_version(run_root) == 0
    assert read_state(run_root)["iteration"] == 0


def test_data_seed_fixes_the_data_across_run_seeds(tmp_path: Path):
    """data.seed pins the problems and the train/eval split; by default they follow the run's seed."""
    from rlpipe.data import prepare_data

    def eval_prompts(name: str, **data) -> list[str]:
        spec = parse_spec({"name": name, "seed": int(name[-1]), "data": {"train_size": 50, "eval_size": 20, **data}})
        prepare_data(spec, str(tmp_path / name))
        return pq.read_table(tmp_path / name / "data" / "eval.parquet").column("prompt").to_pylist()

    assert eval_prompts("pinned0", seed=0) == eval_prompts("pinned1", seed=0)
    assert eval_prompts("default0") != eval_prompts("default1")
