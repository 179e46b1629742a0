"""Algorithms: what each needs, its advantage estimator and its policy loss; `algorithm.name`
selects one. The record and its typed parts are in registry.py; the advantages step is
`compute_advantages` below.

    advantages(Scored, options) -> Advantages    per completion (per_sequence), or per token with the
                                                 critic's returns (per_token, returns: PPO)
    loss(options) -> PolicyLoss                  PolicyLoss(PolicyInputs) -> LossTerms, every tensor [B, T]
    value_loss(options) -> ValueLoss             with "critic" (PPO)

Register one with `register_algorithm`; `algorithm.name` is a registered name, or
'package.module:name' for one that module registers (imported first, in every step's process, so a
KFP task finds it too).

Built in (formulas beside the code):
    grpo          group-normalised advantages, clipped surrogate, sequence mean     (grpo.py)
    dr_grpo       no std scaling, token sums over a constant length (no length bias) (grpo.py)
    dapo          clip-higher (eps_low 0.2, eps_high 0.28), token mean              (grpo.py)
    gspo          sequence-level importance ratio, clipped at 3e-4 / 4e-4           (grpo.py)
    rloo          leave-one-out baseline                                            (reinforce.py)
    reinforce_pp  batch-whitened advantages, the KL folded into the token reward    (reinforce.py)
    ppo           a critic: GAE per-token advantages, clipped value loss             (ppo.py)
    dpo           offline DPO over a preference set, its own pipeline                (dpo.py)
    online_dpo    DPO on pairs sampled and ranked by the reward each iteration       (dpo.py)
Every one takes entropy_coef; all but the DPOs take kl_coef with kl_estimator k2/k3 to the frozen v0 in the
loss (k1 only in reinforce_pp's reward: as a loss term its expected gradient is 0), and dual_clip.
An algorithm that `needs` "pairs" trains on (chosen, rejected) pairs: its advantage column is the
role (+1 chosen, -1 rejected, 0 unpaired) and the update keeps each pair in one micro-batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.algorithms import dpo, grpo, ppo, reinforce  # noqa: F401 (register the built-ins)
from rlpipe.algorithms.ppo import explained_variance
from rlpipe.algorithms.registry import (
    ALGORITHMS,
    Advantages,
    Algorithm,
    LossTerms,
    PolicyInputs,
    Scored,
    ValueTerms,
    get_algorithm,
    needs_critic,
    register_algorithm,
    resolve_options,
)
from rlpipe.metric_keys import ZERO_VARIANCE_GROUPS
from rlpipe.rollouts import read_table, write_table

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

__all__ = [
    "ALGORITHMS",
    "Advantages",
    "Algorithm",
    "LossTerms",
    "PolicyInputs",
    "Scored",
    "ValueTerms",
    "compute_advantages",
    "get_algorithm",
    "needs_critic",
    "register_algorithm",
    "resolve_options",
]


def group_spread(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's group index, each group's reward variance mean_g (r - mean_g r)^2)."""
    _, inverse = np.unique(group_ids, return_inverse=True)
    counts = np.bincount(inverse)
    means = np.bincount(inverse, weights=rewards) / counts
    return inverse, np.bincount(inverse, weights=(rewards - means[inverse]) ** 2) / counts


def informative_groups(inverse: np.ndarray, spread: np.ndarray, wanted: int) -> tuple[np.ndarray, dict[str, float]]:
    """Dynamic sampling (DAPO): the rows of the first `wanted` groups, in group order, whose rewards
    are not all equal (spread > 0); when fewer exist, all of those (and if none, the first `wanted`
    groups, which train nothing). Returns (row mask, metrics)."""
    informative = np.flatnonzero(spread > 0.0)
    kept = informative[:wanted] if len(informative) else np.arange(min(wanted, len(spread)))
    metrics = {
        "dynamic_sampling/groups_sampled": float(len(spread)),
        "dynamic_sampling/zero_spread_dropped": float(len(spread) - len(informative)),
        "dynamic_sampling/groups_kept": float(len(kept)),
        "dynamic_sampling/short": float(max(0, wanted - len(informative))),
    }
    return np.isin(inverse, kept), metrics


def compute_advantages(spec: RunSpec, scored_path: str, out_path: str) -> dict[str, float]:
    """Add the `advantage` column (or, per token, `token_advantages` and `returns`); count groups whose
    rewards were all equal. With dynamic sampling, the batch is the first rollout.prompts_per_iteration
    groups with a reward spread (`informative_groups`), and their advantages are computed among themselves."""
    started = time.time()
    table = read_table(scored_path)
    if "reward" not in table.column_names:
        raise ValueError(f"{scored_path} has no reward column: run score before advantages")
    group_ids = table.column("group_id").to_numpy()
    algorithm = get_algorithm(spec.algorithm.name)
    options = resolve_options(spec)
    rewards = table.column("reward").to_numpy().astype(np.float64)
    inverse, spread = group_spread(rewards, group_ids)
    metrics = {ZERO_VARIANCE_GROUPS: float(np.mean(spread == 0.0))}  # of every group sampled
    if options.dynamic_sampling:
        keep, selection = informative_groups(inverse, spread, spec.rollout.prompts_per_iteration)
        table, group_ids, rewards = table.filter(keep), group_ids[keep], rewards[keep]
        metrics |= selection
    values = critic_values(algorithm, table, metrics) if "critic" in algorithm.needs else None
    masks = None
    if "loss_mask" in table.column_names:  # trajectories: the model's tokens are the steps of a critic's GAE
        masks = [np.asarray(m, dtype=bool) for m in table.column("loss_mask").to_pylist()]
    estimate = algorithm.advantages(Scored(rewards, group_ids, values, masks), options)
    if estimate.per_sequence is not None:
        table = table.append_column("advantage", [np.asarray(estimate.per_sequence, dtype=np.float32)])
        metrics["advantage/abs_mean"] = float(np.abs(estimate.per_sequence).mean())
    else:
        table, metrics["advantage/abs_mean"] = token_columns(table, estimate, values, metrics)
    write_table(table, out_path)
    return metrics | {"time/advantages_s": time.time() - started}


def critic_values(algorithm: Algorithm[Any], table: Any, metrics: dict[str, float]) -> list[np.ndarray]:
    """The values step's `values` column, one float64 array per completion; adds critic/value_mean to `metrics`."""
    if "values" not in table.column_names:
        raise ValueError(
            f"algorithm {algorithm.name} needs the values step's `values` column, which this pipeline did not "
            "compute: it was built for an algorithm without a critic. Compile it again for this spec (rlpipe compile)"
        )
    values = [np.asarray(v, dtype=np.float64) for v in table.column("values").to_pylist()]
    every_value = np.concatenate(values) if values else np.zeros(0)
    metrics["critic/value_mean"] = float(every_value.mean()) if len(every_value) else 0.0
    return values


def token_columns(
    table: Any, estimate: Advantages, values: list[np.ndarray] | None, metrics: dict[str, float]
) -> tuple[Any, float]:
    """The `token_advantages` and `returns` columns of a per-token estimate; with the critic's values,
    critic/explained_variance in `metrics`. Returns (table, mean |A| over tokens)."""
    import pyarrow as pa

    def column(arrays: list[np.ndarray]) -> pa.Array:
        return pa.array([a.astype(np.float32) for a in arrays], type=pa.list_(pa.float32()))

    if values is not None and estimate.returns is not None:
        every_value = np.concatenate(values) if values else np.zeros(0)
        every_return = np.concatenate(estimate.returns) if estimate.returns else np.zeros(0)
        explained = explained_variance(every_value, every_return)
        if explained is not None:  # undefined when every return is the same (a metric is never NaN)
            metrics["critic/explained_variance"] = explained
    assert estimate.per_token is not None  # Advantages holds per_sequence or per_token, and this one is per token
    table = table.append_column("token_advantages", column(estimate.per_token))
    if estimate.returns is not None:
        table = table.append_column("returns", column(estimate.returns))
    every_advantage = np.concatenate(estimate.per_token) if estimate.per_token else np.zeros(1)
    return table, float(np.abs(every_advantage).mean())
