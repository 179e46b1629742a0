"""REINFORCE-style algorithms: a baseline instead of a critic, PPO's clipped surrogate for the
mini-batch steps after the first.

    rloo          A_i = r_i - mean_{j != i in g} r_j = G / (G - 1) (r_i - mean_g r)
                  (Ahmadian et al., "Back to basics"; the leave-one-out mean is an unbiased baseline)
    reinforce_pp  A_i = (r_i - mean_batch r) / (std_batch r + eps): one baseline and scale for the
                  whole batch, no group needed; with kl_coef, the KL to v0 is a per-token reward,
                      A_it = A_i - kl_coef sum_{s >= t} kl_s,   kl_s = kl_estimate(logp_old_s, logp_ref_s)
                  (Hu, "REINFORCE++"; its default estimator is k1). The outcome part is whitened in
                  the advantages step (numpy only); the KL-to-go is added in the update, the one step
                  that has the reference's log-probs, and is not a loss term again.

Where this differs from the paper (and OpenRLHF): they whiten the per-token return
    G_it = r_i 1[t = T_i] - kl_coef sum_{s >= t} kl_s    summed to go, whitened over every token of the batch,
so longer completions weigh more in the mean and std, and the KL-to-go is scaled with the outcome.
Here the outcome is whitened per completion and the KL-to-go is subtracted unscaled. With kl_coef 0
(the demo) the two differ only in that weighting; with kl_coef > 0 the paper divides the KL-to-go by the
batch's std along with the outcome, so here it weighs about std_batch(r) times the paper's (with 0/1
rewards at most half: kl_coef here ~ 2 x kl_coef there). The paper's form needs the reference's log-probs
of the whole batch before the advantages are whitened (a reference pass ahead of the update, as PPO's
values step is); it is not built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms.grpo import STD_EPS, SURROGATE, GroupOptions, group_advantages
from rlpipe.algorithms.policy_gradient import ClippedSurrogate, PolicyGradientOptions, kl_estimate
from rlpipe.algorithms.registry import Advantages, Algorithm, LossTerms, Scored, register_algorithm
from rlpipe.spec import AlgorithmSpec, retune, section

if TYPE_CHECKING:
    from rlpipe.algorithms.registry import PolicyInputs


@section
class RlooOptions(PolicyGradientOptions):
    """RLOO's: the leave-one-out baseline needs no scale; groups may be sampled dynamically."""

    name: str = retune(AlgorithmSpec, "name", "rloo")

    dynamic_sampling: bool = retune(GroupOptions, "dynamic_sampling", False)
    max_oversample: float = retune(GroupOptions, "max_oversample", 3.0)


@section
class ReinforcePpOptions(PolicyGradientOptions):
    """REINFORCE++'s: a token mean, and k1 for the KL folded into the reward."""

    name: str = retune(AlgorithmSpec, "name", "reinforce_pp")

    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] = retune(
        PolicyGradientOptions, "loss_aggregation", "token_mean"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = retune(PolicyGradientOptions, "kl_estimator", "k1")


def rloo_advantages(scored: Scored, options: RlooOptions) -> Advantages:
    centered = group_advantages(scored.rewards, scored.group_ids, "none")
    _, inverse, counts = np.unique(scored.group_ids, return_inverse=True, return_counts=True)
    size = counts[inverse].astype(np.float64)
    return Advantages(per_sequence=centered * size / (size - 1.0))


def batch_whitened_advantages(scored: Scored, options: ReinforcePpOptions) -> Advantages:
    rewards = np.asarray(scored.rewards, dtype=np.float64)
    return Advantages(per_sequence=(rewards - rewards.mean()) / (rewards.std(ddof=1) + STD_EPS))


@dataclass(frozen=True)
class KlInRewardSurrogate:
    """REINFORCE++'s loss: the clipped surrogate on A_it = A_i - kl_coef sum_{s >= t} kl_s (module
    docstring), the KL tracked but not a loss term again."""

    kl_coef: float
    kl_estimator: str
    clipped: ClippedSurrogate  # kl_coef 0: the KL is tracked (its `kl`), not a loss term again

    @classmethod
    def from_options(cls, options: ReinforcePpOptions) -> KlInRewardSurrogate:
        clipped = ClippedSurrogate.from_options(options)
        return cls(clipped.kl_coef, clipped.kl_estimator, replace(clipped, kl_coef=0.0))

    def __call__(self, inputs: PolicyInputs) -> LossTerms:
        advantages = inputs.advantages
        if inputs.ref_logprobs is not None and self.kl_coef:
            kl = kl_estimate(inputs.old_logprobs, inputs.ref_logprobs, self.kl_estimator) * inputs.mask.to(
                inputs.logprobs.dtype
            )
            kl_to_go = kl.flip(-1).cumsum(-1).flip(-1)  # sum over s >= t
            advantages = advantages - self.kl_coef * kl_to_go.detach()
        return self.clipped(inputs, advantages=advantages)


RLOO = register_algorithm(Algorithm("rloo", frozenset({"groups"}), rloo_advantages, SURROGATE, RlooOptions))
REINFORCE_PP = register_algorithm(
    Algorithm(
        "reinforce_pp",
        frozenset(),
        batch_whitened_advantages,
        KlInRewardSurrogate.from_options,
        ReinforcePpOptions,
        kl_term="reward",
    )
)
