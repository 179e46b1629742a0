"""advantages: GRPO group-normalized advantages per completion (no torch)."""

from __future__ import annotations

import time

import numpy as np

from rlpipe.algorithms.grpo import group_advantages
from rlpipe.rollouts import read_table, write_table
from rlpipe.spec import RunSpec


def compute_advantages(spec: RunSpec, scored_path: str, out_path: str) -> dict[str, float]:
    """Add the `advantage` column; count groups whose rewards were all equal."""
    started = time.time()
    table = read_table(scored_path)
    if "reward" not in table.column_names:
        raise ValueError(f"{scored_path} has no reward column: run score before advantages")
    group_ids = table.column("group_id").to_numpy()
    advantages, zero_variance = group_advantages(
        table.column("reward").to_numpy(), group_ids, spec.algorithm.scale_rewards
    )
    write_table(table.append_column("advantage", [advantages.astype(np.float32)]), out_path)
    groups = np.unique(group_ids)
    zero_groups = np.unique(group_ids[zero_variance])
    return {
        "groups/zero_variance_fraction": len(zero_groups) / len(groups),
        "advantage/abs_mean": float(np.abs(advantages).mean()),
        "time/advantages_s": time.time() - started,
    }
