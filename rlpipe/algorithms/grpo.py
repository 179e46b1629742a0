"""GRPO and its variants: group-relative advantages with the clipped policy-gradient loss.

    grpo     A_i = (r_i - mean_g r) / (std_g r + eps), clip eps 0.2, sequence mean       (DeepSeekMath)
    dr_grpo  A_i =  r_i - mean_g r, token sums / a constant length: neither the std nor
             1/|o_i| biases the update (Liu et al., "Understanding R1-Zero-like training")
    dapo     GRPO's advantages, clip-higher eps_low 0.2 / eps_high 0.28, token mean
             (Yu et al., DAPO; its overlong shaping is the length_penalty reward type)
    gspo     one importance ratio per sequence, the geometric mean of its token ratios,
             clipped at 3e-4 / 4e-4 (Zheng et al., GSPO)

Advantages use numpy only (the advantages step stays torch-free); the losses import torch
when called (only the update calls them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms import GRPO_DEFAULTS, Algorithm, register_algorithm
from rlpipe.algorithms.policy_gradient import clipped_policy_loss

if TYPE_CHECKING:
    import torch

    from rlpipe.spec import AlgorithmSpec

STD_EPS = 1e-4  # as TRL: keeps (r - mean) / (std + eps) finite for tiny spreads


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    scale: Literal["group", "batch", "none"] = "group",
) -> tuple[np.ndarray, np.ndarray]:
    """GRPO advantages, one per completion.

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     scale="group" (GRPO)
        A_i = (r_i - mean_g(r)) / (std_batch(r) + eps) scale="batch"
        A_i =  r_i - mean_g(r)                          scale="none"  (Dr. GRPO)

    std is the unbiased sample std (Bessel), as in TRL. Returns (advantages,
    zero_variance) where zero_variance[i] says completion i's group had identical
    rewards (so its advantage is 0 and it carries no gradient).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    _, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    if np.any(counts < 2):
        raise ValueError("every group needs >= 2 completions for a group baseline (rollout.samples_per_prompt >= 2)")
    sums = np.bincount(inverse, weights=rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    group_var = np.bincount(inverse, weights=centered**2) / (counts - 1)
    group_std = np.sqrt(group_var)
    zero_variance = group_std[inverse] == 0.0
    if scale == "group":
        advantages = centered / (group_std[inverse] + STD_EPS)
    elif scale == "batch":
        advantages = centered / (rewards.std(ddof=1) + STD_EPS)
    elif scale == "none":
        advantages = centered
    else:
        raise ValueError(f"algorithm.scale_rewards must be group, batch or none, got {scale!r}")
    return advantages, zero_variance


def grpo_advantages(
    rewards: np.ndarray, group_ids: np.ndarray, options: AlgorithmSpec
) -> tuple[np.ndarray, np.ndarray]:
    return group_advantages(rewards, group_ids, options.scale_rewards)


def surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    options: AlgorithmSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (rlpipe.algorithms.policy_gradient) with the algorithm's options."""
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=options.clip_eps,
        ref_logprobs=ref_logprobs,
        kl_coef=options.kl_coef,
        aggregation=options.loss_aggregation,
        clip_eps_high=options.clip_eps_high,
        kl_estimator=options.kl_estimator,
        length_norm=options.length_norm or 1,
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    options: AlgorithmSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence's ratio s_i = exp( sum_t m_it (logp_it - logp_old_it) / sum_t m_it ),
        L = -mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    computed per token as GSPO-token does: s_it = sg[s_i] exp(logp_it - sg[logp_it]) has the value
    s_i and the gradient s_i grad logp_it, so the sequence mean of the token terms is L with L's gradient."""
    mask_f = mask.to(logprobs.dtype)
    log_ratio = ((logprobs - old_logprobs) * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)
    ratio = (log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()).exp()
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=options.clip_eps,
        ref_logprobs=ref_logprobs,
        kl_coef=options.kl_coef,
        aggregation="sequence_mean",
        clip_eps_high=options.clip_eps_high,
        kl_estimator=options.kl_estimator,
        ratio=ratio,
    )


GROUPS = frozenset({"groups"})
GRPO = register_algorithm(Algorithm("grpo", GROUPS, grpo_advantages, surrogate_loss, GRPO_DEFAULTS))
DR_GRPO = register_algorithm(
    Algorithm(
        "dr_grpo",
        GROUPS,
        grpo_advantages,
        surrogate_loss,
        GRPO_DEFAULTS | {"scale_rewards": "none", "loss_aggregation": "sequence_sum", "length_norm": None},
    )
)
DAPO = register_algorithm(
    Algorithm(
        "dapo",
        GROUPS,
        grpo_advantages,
        surrogate_loss,
        GRPO_DEFAULTS | {"clip_eps_high": 0.28, "loss_aggregation": "token_mean", "dynamic_sampling": True},
    )
)
GSPO = register_algorithm(
    Algorithm(
        "gspo",
        GROUPS,
        grpo_advantages,
        gspo_loss,
        {
            "scale_rewards": "group",
            "clip_eps": 3e-4,
            "clip_eps_high": 4e-4,
            "kl_estimator": "k3",
            "dynamic_sampling": False,
        },
    )
)
