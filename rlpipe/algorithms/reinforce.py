"""REINFORCE-style algorithms: a baseline instead of a critic, PPO's clipped surrogate for the
mini-batch steps after the first.

    rloo          A_i = r_i - mean_{j != i in g} r_j = G / (G - 1) (r_i - mean_g r)
                  (Ahmadian et al., "Back to basics"; the leave-one-out mean is an unbiased baseline)
    reinforce_pp  A_i = (r_i - mean_batch r) / (std_batch r + eps): one baseline and scale for the
                  whole batch, no group needed; with kl_coef, the KL to v0 is a per-token reward,
                      A_it = A_i - beta sum_{s >= t} kl_s,   kl_s = kl_estimate(logp_old_s, logp_ref_s)
                  (Hu, "REINFORCE++"; its default estimator is k1). The outcome part is whitened in
                  the advantages step (numpy only); the KL-to-go is added in the update, the one step
                  that has the reference's log-probs, and is not a loss term again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rlpipe.algorithms import Algorithm, register_algorithm
from rlpipe.algorithms.grpo import STD_EPS, group_advantages, surrogate_loss
from rlpipe.algorithms.policy_gradient import clipped_policy_loss, kl_estimate

if TYPE_CHECKING:
    import torch

    from rlpipe.spec import AlgorithmSpec


def rloo_advantages(
    rewards: np.ndarray, group_ids: np.ndarray, options: AlgorithmSpec
) -> tuple[np.ndarray, np.ndarray]:
    centered, zero_variance = group_advantages(rewards, group_ids, "none")
    _, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    size = counts[inverse].astype(np.float64)
    return centered * size / (size - 1.0), zero_variance


def batch_whitened_advantages(
    rewards: np.ndarray, group_ids: np.ndarray, options: AlgorithmSpec
) -> tuple[np.ndarray, np.ndarray]:
    rewards = np.asarray(rewards, dtype=np.float64)
    _, zero_variance = group_advantages(rewards, group_ids, "none")  # for the metric only
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + STD_EPS), zero_variance


def reinforce_pp_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    options: AlgorithmSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    per_token = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(logprobs)
    if ref_logprobs is not None and options.kl_coef:
        kl = kl_estimate(old_logprobs, ref_logprobs, options.kl_estimator) * mask.to(logprobs.dtype)
        kl_to_go = kl.flip(-1).cumsum(-1).flip(-1)  # sum over s >= t
        per_token = per_token - options.kl_coef * kl_to_go.detach()
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        per_token,
        mask,
        clip_eps=options.clip_eps,
        ref_logprobs=ref_logprobs,  # tracked (stats["kl"]); in the reward, not the loss
        kl_coef=0.0,
        aggregation=options.loss_aggregation,
        clip_eps_high=options.clip_eps_high,
        kl_estimator=options.kl_estimator,
    )


RLOO = register_algorithm(
    Algorithm(
        "rloo",
        frozenset({"groups"}),
        rloo_advantages,
        surrogate_loss,
        {
            "clip_eps": 0.2,
            "clip_eps_high": None,
            "loss_aggregation": "sequence_mean",
            "kl_estimator": "k3",
            "dynamic_sampling": False,
        },
    )
)
REINFORCE_PP = register_algorithm(
    Algorithm(
        "reinforce_pp",
        frozenset(),
        batch_whitened_advantages,
        reinforce_pp_loss,
        {"clip_eps": 0.2, "clip_eps_high": None, "loss_aggregation": "token_mean", "kl_estimator": "k1"},
    )
)
