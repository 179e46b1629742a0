"""Algorithms: what each needs, its advantage estimator and its policy loss; `algorithm.name`
selects one. The advantages step is `compute_advantages` below.

An algorithm is a record, not a class hierarchy (as verl's registries and torchtune's loss
modules):
    advantages(rewards, group_ids, options) -> (advantage per completion, zero-variance mask)
        numpy only: the advantages step never imports torch
    loss(logprobs, old_logprobs, advantages, mask, ref_logprobs, options) -> (loss, stats)
        torch, called by the update only
    defaults: its values of the tuned options it reads (TUNED_OPTIONS); setting one it does not
        read is an error, one left unset (null) takes its default
where `options` is the spec's `algorithm` section with the defaults filled in (`resolve_options`).
An algorithm that `needs` a "critic" (PPO) gets the values step's per-token values too, and its
advantages are per token, with the critic's regression targets:
    advantages(rewards, group_ids, options, values) -> (advantages per token, returns per token)
    value_loss(values, old_values, returns, mask, clip) -> (loss, stats)
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
Every one takes kl_coef with kl_estimator k1/k2/k3 to the frozen v0, and entropy_coef.
An algorithm that `needs` "pairs" trains on (chosen, rejected) pairs: its advantage column is the
role (+1 chosen, -1 rejected, 0 unpaired) and the update keeps each pair in one micro-batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.plugins import look_up
from rlpipe.rollouts import read_table, write_table

if TYPE_CHECKING:
    from rlpipe.spec import AlgorithmSpec, RunSpec


# Options whose meaning or default differs by algorithm; null in the spec = the algorithm's default.
TUNED_OPTIONS = (
    "beta",  # DPO
    "label_smoothing",
    "dpo_loss",
    "rpo_alpha",
    "scale_rewards",
    "clip_eps",
    "clip_eps_high",
    "loss_aggregation",
    "length_norm",
    "kl_estimator",
    "dynamic_sampling",
    "gamma",
    "lam",
    "value_clip",
    "whiten_advantages",
    "critic_lr",
)
GRPO_DEFAULTS: Mapping[str, Any] = {
    "scale_rewards": "group",
    "dynamic_sampling": False,
    "clip_eps": 0.2,
    "clip_eps_high": None,  # = clip_eps
    "loss_aggregation": "sequence_mean",
    "kl_estimator": "k3",
}


@dataclass(frozen=True)
class Algorithm:
    name: str
    needs: frozenset[str]  # what the run provides it: "groups" (G samples per prompt), "critic" (a value model)
    advantages: Callable[..., tuple[Any, Any]]
    loss: Callable[..., tuple[Any, dict[str, Any]]]
    defaults: Mapping[str, Any] = field(default_factory=lambda: dict(GRPO_DEFAULTS))
    value_loss: Callable[..., tuple[Any, dict[str, Any]]] | None = None  # with "critic"


def needs_critic(spec: RunSpec) -> bool:
    """Whether the spec's algorithm trains a value model (PPO): the iteration then has a values step."""
    return "critic" in get_algorithm(spec.algorithm.name).needs


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The algorithm `name` ('grpo', or 'package.module:name') names; a clear error otherwise."""
    return look_up(name, ALGORITHMS, "algorithm.name", "algorithm", "rlpipe.algorithms.register_algorithm")[1]


def resolve_options(spec: RunSpec) -> AlgorithmSpec:
    """The spec's algorithm section with the algorithm's defaults in place of unset (null) tuned
    options; length_norm defaults to rollout.max_new_tokens, critic_lr to trainer.lr, off_policy_correction
    to truncate in asynchronous runs (loop.max_staleness >= 1) and none otherwise. A tuned option
    the algorithm does not read is an error naming the ones it does."""
    options = spec.algorithm
    algorithm = get_algorithm(options.name)
    unread = [key for key in TUNED_OPTIONS if getattr(options, key) is not None and key not in algorithm.defaults]
    if unread:
        reads = ", ".join(k for k in TUNED_OPTIONS if k in algorithm.defaults) or "none of them"
        raise ValueError(
            f"algorithm.{unread[0]} is not an option of algorithm {algorithm.name} (its tuned options: {reads}); "
            f"remove it, or pick an algorithm that uses it"
        )
    filled = {key: value for key, value in algorithm.defaults.items() if getattr(options, key) is None}
    if "length_norm" in filled and filled["length_norm"] is None:
        filled["length_norm"] = spec.rollout.max_new_tokens
    if "critic_lr" in filled and filled["critic_lr"] is None:
        filled["critic_lr"] = spec.trainer.lr
    pairs = "pairs" in algorithm.needs
    if options.off_policy_correction is None:
        filled["off_policy_correction"] = "truncate" if spec.loop.max_staleness and not pairs else "none"
    elif pairs and options.off_policy_correction != "none":
        raise ValueError(
            f"algorithm.off_policy_correction: {algorithm.name} trains on preference pairs against its reference, "
            "with no importance ratio to correct; remove the setting (or set it to none)"
        )
    return dataclasses.replace(options, **filled)


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
    """Add the `advantage` column; count groups whose rewards were all equal. With dynamic sampling,
    the batch is the first rollout.prompts_per_iteration groups with a reward spread
    (`informative_groups`), and their advantages are computed among themselves."""
    started = time.time()
    table = read_table(scored_path)
    if "reward" not in table.column_names:
        raise ValueError(f"{scored_path} has no reward column: run score before advantages")
    group_ids = table.column("group_id").to_numpy()
    algorithm = get_algorithm(spec.algorithm.name)
    options = resolve_options(spec)
    rewards = table.column("reward").to_numpy().astype(np.float64)
    inverse, spread = group_spread(rewards, group_ids)
    metrics = {"groups/zero_variance_fraction": float(np.mean(spread == 0.0))}  # of every group sampled
    if options.dynamic_sampling:
        keep, selection = informative_groups(inverse, spread, spec.rollout.prompts_per_iteration)
        table, group_ids, rewards = table.filter(keep), group_ids[keep], rewards[keep]
        metrics |= selection
    if "critic" in algorithm.needs:
        table, metrics["advantage/abs_mean"] = critic_advantages(algorithm, table, rewards, group_ids, options, metrics)
    else:
        advantages, _ = algorithm.advantages(rewards, group_ids, options)
        table = table.append_column("advantage", [np.asarray(advantages, dtype=np.float32)])
        metrics["advantage/abs_mean"] = float(np.abs(advantages).mean())
    write_table(table, out_path)
    return metrics | {"time/advantages_s": time.time() - started}


def critic_advantages(
    algorithm: Algorithm,
    table: Any,
    rewards: np.ndarray,
    group_ids: np.ndarray,
    options: AlgorithmSpec,
    metrics: dict[str, float],
) -> tuple[Any, float]:
    """A critic algorithm's per-token `token_advantages` and `returns` columns from the values step's
    `values`; adds critic/explained_variance and critic/value_mean to `metrics`. Returns (table, mean |A|)."""
    import pyarrow as pa

    from rlpipe.algorithms.ppo import explained_variance

    if "values" not in table.column_names:
        raise ValueError(
            f"algorithm {algorithm.name} needs the values step's `values` column, which this pipeline did not "
            "compute: it was built for an algorithm without a critic. Compile it again for this spec (rlpipe compile)"
        )
    values = [np.asarray(v, dtype=np.float64) for v in table.column("values").to_pylist()]
    advantages, returns = algorithm.advantages(rewards, group_ids, options, values)
    every_value, every_return = (np.concatenate(x) if x else np.zeros(0) for x in (values, returns))
    explained = explained_variance(every_value, every_return)
    if explained is not None:  # undefined when every return is the same (a metric is never NaN)
        metrics["critic/explained_variance"] = explained
    metrics["critic/value_mean"] = float(every_value.mean()) if len(every_value) else 0.0
    as_lists = [
        pa.array([a.astype(np.float32) for a in column], type=pa.list_(pa.float32()))
        for column in (advantages, returns)
    ]
    table = table.append_column("token_advantages", as_lists[0]).append_column("returns", as_lists[1])
    every_advantage = np.concatenate(advantages) if advantages else np.zeros(1)
    return table, float(np.abs(every_advantage).mean())


from rlpipe.algorithms import dpo, grpo, ppo, reinforce  # noqa: E402, F401 (register the built-ins; need the names above)
