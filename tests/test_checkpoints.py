"""The trainer's state costs what resume needs (storage.optimizer_every): a resident trainer writes
AdamW's moments and the fp32 masters every K versions, keeps each version's batch until then, and a
restarted trainer replays the updates since its last checkpoint, bit-exact on CPU."""

import copy
import json
from pathlib import Path

import pytest
import torch

from rlpipe import loop
from rlpipe.spec import parse_spec, spec_to_dict
from rlpipe.store.weights import read_weight_ref
from rlpipe.training.loading import open_trainer, save_version
from rlpipe.training.trainer import train_on_batch

from .conftest import initialize, tiny_spec_dict


def _iterate(tmp_path: Path, iterations: int = 4):
    """A resident trainer held in this process through `iterations` iterations (the steps around it as
    `rlpipe run` runs them); returns (spec, run_root, cache, the trainer, the last published ref)."""
    storage = {"root": str(tmp_path / "runs"), "optimizer_every": 3, "weights_dtype": "bfloat16", "full_every": 3}
    data = tiny_spec_dict(
        tmp_path,
        trainer={"resident": True, "mini_batches": 2, "warmup_steps": 0},
        loop={"iterations": 6, "iterations_per_run": 6, "eval_every": 100},
        storage=storage,
    )
    spec = parse_spec(data)
    steps_spec = parse_spec(copy.deepcopy(data) | {"trainer": {**data["trainer"], "resident": False}})
    run_root, cache = str(tmp_path / "runs" / "tiny"), str(tmp_path / "cache")
    weights = initialize(spec, run_root, cache)
    trainer = open_trainer(spec, run_root, weights, cache)
    for iteration in range(1, iterations + 1):
        work = Path(tmp_path, "work", str(iteration))
        work.mkdir(parents=True)
        rollouts, scored, batch = (str(work / f"{n}.parquet") for n in ("rollouts", "scored", "batch"))
        loop.generate(steps_spec, run_root, weights, iteration, rollouts, cache)
        loop.score(spec, rollouts, scored)
        loop.advantages(spec, scored, batch)
        train_on_batch(trainer, batch, iteration)
        staged = save_version(trainer, iteration, cache, batch_path=batch)
        weights, _ = loop.sync_weights(spec, run_root, staged, iteration, {})
    if trainer.checkpoint_writer is not None:
        trainer.checkpoint_writer.join()
    return spec, run_root, cache, trainer, weights


def test_a_restarted_trainer_replays_the_updates_since_its_last_checkpoint(tmp_path: Path):
    spec, run_root, cache, trainer, v4 = _iterate(tmp_path)
    optimizer = Path(run_root, "optimizer")
    assert sorted(p.name for p in optimizer.glob("v*")) == ["v000003.masters.safetensors", "v000003.pt"]
    assert sorted(p.name for p in (optimizer / "replay").iterdir()) == ["v000004.i000004.parquet"]
    restarted = open_trainer(spec, run_root, v4, cache)
    assert restarted.replayed == {"trainer/replayed_updates": 1.0, "trainer/replay_exact": 1.0}
    assert restarted.weights == v4
    for (name, held), (_, replayed) in zip(
        trainer.policy.named_parameters(), restarted.policy.named_parameters(), strict=True
    ):
        assert torch.equal(held, replayed), name  # the fp32 masters, bit for bit
    for held, replayed in zip(trainer.optimizer.state.values(), restarted.optimizer.state.values(), strict=True):
        assert torch.equal(held["exp_avg"], replayed["exp_avg"]) and torch.equal(
            held["exp_avg_sq"], replayed["exp_avg_sq"]
        )


def test_a_missing_replay_batch_says_what_to_do(tmp_path: Path):
    spec, run_root, cache, _, v4 = _iterate(tmp_path)
    next(Path(run_root, "optimizer", "replay").iterdir()).unlink()
    with pytest.raises(FileNotFoundError, match="batches to replay it from v3 are missing for v4"):
        open_trainer(spec, run_root, v4, cache)


def test_a_fork_between_checkpoints_replays_to_its_version(tmp_path: Path):
    from rlpipe.commands.fork import fork_run

    spec, run_root, cache, trainer, v4 = _iterate(tmp_path)
    child = str(tmp_path / "child")
    forked = fork_run(run_root, child, 4, "child", {})
    state = json.loads(Path(child, "state.json").read_text())
    assert state["forked_from"]["optimizer_state"] == "parent's (v3's, replayed to v4)"
    restarted = open_trainer(forked, child, read_weight_ref(child, 4), cache)
    assert restarted.replayed["trainer/replay_exact"] == 1.0
    for held, replayed in zip(trainer.policy.parameters(), restarted.policy.parameters(), strict=True):
        assert torch.equal(held, replayed)


def test_a_run_resumed_with_another_cadence_still_replays(tmp_path: Path):
    """storage is free to change on resume: an update step (optimizer_every 1, not resident) asked for a
    version the resident trainer never wrote state for replays it all the same."""
    spec, run_root, cache, trainer, v4 = _iterate(tmp_path)
    data = tiny_spec_dict(
        tmp_path, trainer={"mini_batches": 2, "warmup_steps": 0}, storage=spec_to_dict(spec)["storage"]
    )
    data["storage"]["optimizer_every"] = 1
    resumed = open_trainer(parse_spec(data), run_root, v4, cache)
    assert resumed.replayed == {"trainer/replayed_updates": 1.0, "trainer/replay_exact": 1.0}
    for held, replayed in zip(trainer.policy.parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(held, replayed)
