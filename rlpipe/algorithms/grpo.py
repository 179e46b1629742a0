"""GRPO: group-normalized advantages and the clipped policy-gradient loss with a k3 KL.

Advantages use numpy only (the advantages step stays torch-free); the loss imports torch
when called (only the update calls it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms import Algorithm, register_algorithm

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


def clipped_policy_loss(
    logprobs: "torch.Tensor",
    old_logprobs: "torch.Tensor",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    clip_eps: float,
    ref_logprobs: "torch.Tensor | None" = None,
    kl_coef: float = 0.0,
    aggregation: Literal["sequence_mean", "token_mean"] = "sequence_mean",
) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    """PPO/GRPO clipped surrogate with an optional k3 KL penalty.

    Per token t of completion i (shapes [B, T], mask marks completion tokens):
        r_it   = exp(logp_it - logp_old_it)                 (importance ratio to the sampler)
        pg_it  = -min(r_it * A_i, clip(r_it, 1-eps, 1+eps) * A_i)
        kl_it  = exp(ref_it - logp_it) - (ref_it - logp_it) - 1   (k3, >= 0, unbiased)
        l_it   = pg_it + beta * kl_it
    aggregation:
        sequence_mean  L = mean_i [ sum_t l_it m_it / sum_t m_it ]   (GRPO)
        token_mean     L = sum_it l_it m_it / sum_it m_it            (DAPO-style)
    """
    import torch

    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl
    tokens = mask.sum().clamp(min=1.0)
    if aggregation == "sequence_mean":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:
        loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(mask.dtype)  # the clip bound was the active term
        stats = {
            "clip_fraction": (was_clipped * mask).sum() / tokens,
            "kl": (kl * mask).sum() / tokens,
            "ratio": (ratio * mask).sum() / tokens,
        }
    return loss, stats


def grpo_advantages(
    rewards: np.ndarray, group_ids: np.ndarray, options: AlgorithmSpec
) -> tuple[np.ndarray, np.ndarray]:
    return group_advantages(rewards, group_ids, options.scale_rewards)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    options: AlgorithmSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=options.clip_eps,
        ref_logprobs=ref_logprobs,
        kl_coef=options.kl_coef,
        aggregation=options.loss_aggregation,
    )


GRPO = register_algorithm(Algorithm("grpo", frozenset({"groups"}), grpo_advantages, grpo_loss))
