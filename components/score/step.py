"""score: run the spec's reward functions over rollouts (no torch).

A reward function is referenced as 'module:function' with TRL's batch signature
(rlpipe.rewards): fn(prompts, completions, **columns) -> list[float], where columns are the
other rollout columns (reference, prompt_id, ...).
"""

from __future__ import annotations

import time

import numpy as np

from rlpipe.rewards import call_reward
from rlpipe.rollouts import read_table, validate_rollouts, write_table
from rlpipe.spec import RunSpec


def score_rollouts(spec: RunSpec, rollouts_path: str, out_path: str) -> dict[str, float]:
    """Add `reward` (weighted sum) and `reward/<fn>` columns; return reward statistics."""
    started = time.time()
    table = read_table(rollouts_path)
    validate_rollouts(table)
    columns = table.to_pydict()
    extra = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
    weights = spec.reward.weights or [1.0] * len(spec.reward.functions)
    total = np.zeros(table.num_rows)
    for ref, weight in zip(spec.reward.functions, weights, strict=True):
        values = call_reward(ref, columns["prompt"], columns["completion"], extra, "reward.functions")
        columns[f"reward/{ref.rsplit(':', 1)[1]}"] = values
        total += weight * np.asarray(values)
    columns["reward"] = total.tolist()
    write_table(columns, out_path)
    return {
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std()),
        "reward/min": float(total.min()),
        "reward/max": float(total.max()),
        "time/score_s": time.time() - started,
    }
