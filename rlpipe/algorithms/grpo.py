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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms.policy_gradient import ClippedOptions, ClippedSurrogate, PolicyGradientOptions
from rlpipe.algorithms.registry import Advantages, Algorithm, LossTerms, Scored, register_algorithm
from rlpipe.spec import AlgorithmSpec, retune, section, setting

if TYPE_CHECKING:
    from rlpipe.algorithms.registry import PolicyInputs

STD_EPS = 1e-4  # as TRL: keeps (r - mean) / (std + eps) finite for tiny spreads


@section
class GroupOptions:
    """How a group's rewards become advantages, and which groups train (beside an algorithm's other options)."""

    scale_rewards: Literal["group", "batch", "none"] = setting(
        default="group", doc="Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO)"
    )
    dynamic_sampling: bool = setting(
        default=False,
        doc="DAPO's dynamic sampling: drop groups whose rewards are all equal and fill the batch with more "
        "sampled prompts, up to max_oversample",
    )
    max_oversample: float = setting(
        default=3.0,
        ge=1,
        doc="Dynamic sampling's cap: prompts sampled per iteration at most this x prompts_per_iteration",
    )


@section
class GrpoOptions(GroupOptions, PolicyGradientOptions):
    """GRPO's options: group-normalised advantages, the clipped surrogate, a sequence mean."""

    name: str = retune(AlgorithmSpec, "name", "grpo")


@section
class DrGrpoOptions(GrpoOptions):
    """Dr. GRPO's: no std scaling, token sums over a constant length."""

    name: str = retune(AlgorithmSpec, "name", "dr_grpo")

    scale_rewards: Literal["group", "batch", "none"] = retune(GrpoOptions, "scale_rewards", "none")
    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] = retune(
        GrpoOptions, "loss_aggregation", "sequence_sum"
    )


@section
class DapoOptions(GrpoOptions):
    """DAPO's: clip-higher, a token mean, dynamic sampling."""

    name: str = retune(AlgorithmSpec, "name", "dapo")

    clip_eps_high: float | None = retune(GrpoOptions, "clip_eps_high", 0.28)
    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] = retune(
        GrpoOptions, "loss_aggregation", "token_mean"
    )
    dynamic_sampling: bool = retune(GrpoOptions, "dynamic_sampling", True)


@section
class GspoOptions(GroupOptions, ClippedOptions):
    """GSPO's: one ratio per sequence (its loss is a sequence mean: no loss_aggregation), clipped much tighter."""

    name: str = retune(AlgorithmSpec, "name", "gspo")

    clip_eps: float = retune(ClippedOptions, "clip_eps", 3e-4)
    clip_eps_high: float | None = retune(ClippedOptions, "clip_eps_high", 4e-4)
    is_level: Literal["token", "sequence", "geometric"] = retune(ClippedOptions, "is_level", "geometric")


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    scale: Literal["group", "batch", "none"] = "group",
) -> np.ndarray:
    """GRPO advantages, one per completion.

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     scale="group" (GRPO)
        A_i = (r_i - mean_g(r)) / (std_batch(r) + eps) scale="batch"
        A_i =  r_i - mean_g(r)                          scale="none"  (Dr. GRPO)

    std is the unbiased sample std (Bessel), as in TRL. A group whose rewards are all equal gets
    A_i = 0 (it carries no gradient).
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
    if scale == "group":
        return centered / (group_std[inverse] + STD_EPS)
    if scale == "batch":
        return centered / (rewards.std(ddof=1) + STD_EPS)
    if scale == "none":
        return centered
    raise ValueError(f"algorithm.scale_rewards must be group, batch or none, got {scale!r}")


def grpo_advantages(scored: Scored, options: GroupOptions) -> Advantages:
    return Advantages(per_sequence=group_advantages(scored.rewards, scored.group_ids, options.scale_rewards))


@dataclass(frozen=True)
class SequenceRatioSurrogate:
    """GSPO: the sequence's ratio s_i = exp( sum_t m_it (logp_it - logp_old_it) / sum_t m_it ),
        L = -mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    computed per token as GSPO-token does: s_it = sg[s_i] exp(logp_it - sg[logp_it]) has the value
    s_i and the gradient s_i grad logp_it, so the sequence mean of the token terms is L with L's gradient."""

    clipped: ClippedSurrogate  # aggregating by sequence_mean

    @classmethod
    def from_options(cls, options: ClippedOptions) -> SequenceRatioSurrogate:
        return cls(replace(ClippedSurrogate.from_options(options), aggregation="sequence_mean"))

    def __call__(self, inputs: PolicyInputs) -> LossTerms:
        logprobs, mask_f = inputs.logprobs, inputs.mask.to(inputs.logprobs.dtype)
        log_ratio = ((logprobs - inputs.old_logprobs) * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)
        ratio = (log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()).exp()
        return self.clipped(inputs, ratio=ratio)


GROUPS = frozenset({"groups"})
SURROGATE = ClippedSurrogate.from_options
GRPO = register_algorithm(Algorithm("grpo", GROUPS, grpo_advantages, SURROGATE, GrpoOptions))
DR_GRPO = register_algorithm(Algorithm("dr_grpo", GROUPS, grpo_advantages, SURROGATE, DrGrpoOptions))
DAPO = register_algorithm(Algorithm("dapo", GROUPS, grpo_advantages, SURROGATE, DapoOptions))
GSPO = register_algorithm(Algorithm("gspo", GROUPS, grpo_advantages, SequenceRatioSurrogate.from_options, GspoOptions))
