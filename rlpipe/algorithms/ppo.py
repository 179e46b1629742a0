"""PPO with a critic (Schulman et al. 2017; as InstructGPT, OpenRLHF and verl apply it to LLMs).

A value model V (rlpipe.training.critic) estimates, at each completion token t, the return still
to come. The values step records V_t of every rollout under critic v(N); the advantages step turns
rewards and values into per-token advantages with GAE (numpy only):

    r_t     = R at the completion's last token, 0 before it       (the sequence reward)
    delta_t = r_t + gamma V_{t+1} - V_t                           (V_T = 0 past the last token)
    A_t     = sum_l (gamma lambda)^l delta_{t+l}                  (GAE, Schulman et al. 2016)
    G_t     = A_t + V_t                                           (the critic's regression target)
    A_t    <- (A_t - mean A) / (std A + eps) over every token of the batch   (whiten_advantages)

In a multi-turn trajectory t runs over the model's tokens only (its loss_mask): an observation is
part of the step from one model token to the next, not a step of its own; A_t = G_t = 0 there.

The update trains the policy on PPO's clipped surrogate with the per-token A_t
(policy_gradient.clipped_policy_loss, token mean) and the critic on the clipped value loss

    L_V = 1/2 mean_t max( (V_t - G_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - G_t)^2 )

(c = value_clip), each with its own optimizer. Explained variance 1 - Var(G - V_old) / Var(G)
says how much of the return the critic predicted (1: all; <= 0: no better than a constant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms.grpo import STD_EPS, SURROGATE
from rlpipe.algorithms.policy_gradient import PolicyGradientOptions
from rlpipe.algorithms.registry import Advantages, Algorithm, Scored, ValueTerms, register_algorithm
from rlpipe.spec import AlgorithmSpec, retune, section, setting

if TYPE_CHECKING:
    import torch


@section
class PpoOptions(PolicyGradientOptions):
    """PPO's: GAE over the critic's values, the clipped value loss, the critic's learning rate; a token mean."""

    name: str = retune(AlgorithmSpec, "name", "ppo")

    loss_aggregation: Literal["sequence_mean", "token_mean", "sequence_sum"] = retune(
        PolicyGradientOptions, "loss_aggregation", "token_mean"
    )
    gamma: float = setting(default=1.0, ge=0, le=1, doc="Discount of GAE")
    lam: float = setting(default=0.95, ge=0, le=1, doc="GAE's lambda")
    value_clip: float = setting(
        default=0.2, gt=0, doc="How far a value may move from the values step's per update (clipped value loss)"
    )
    whiten_advantages: bool = setting(default=True, doc="Normalise the per-token advantages over the batch")
    critic_lr: float | None = setting(
        default=None, gt=0, doc="The critic's learning rate; the default null: trainer.lr"
    )


def gae(token_rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(A_t, G_t) of one completion from its per-token rewards r_t and values V_t (formulas above)."""
    advantages = np.zeros(len(values), dtype=np.float64)
    running = 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = token_rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + np.asarray(values, dtype=np.float64)


def ppo_advantages(scored: Scored, options: PpoOptions) -> Advantages:
    """Per-token advantages and returns of every completion: GAE on the sequence reward placed at the
    last token, advantages whitened over the batch's tokens when options.whiten_advantages."""
    if scored.values is None:
        raise ValueError("ppo's advantages need the values step's per-token values")
    advantages, returns = [], []
    masks = scored.loss_masks or [np.ones(len(v), dtype=bool) for v in scored.values]  # the model's tokens
    for reward, completion_values, model in zip(scored.rewards, scored.values, masks, strict=True):
        completion_values = np.asarray(completion_values, dtype=np.float64)
        token_rewards = np.zeros(int(model.sum()))
        if len(token_rewards):
            token_rewards[-1] = reward
        a, g = np.zeros(len(completion_values)), np.zeros(len(completion_values))
        a[model], g[model] = gae(token_rewards, completion_values[model], options.gamma, options.lam)
        advantages.append(a)
        returns.append(g)
    if options.whiten_advantages:
        every = np.concatenate([a[m] for a, m in zip(advantages, masks, strict=True)]) if advantages else np.zeros(0)
        mean, std = (every.mean(), every.std()) if len(every) else (0.0, 1.0)
        advantages = [np.where(m, (a - mean) / (std + STD_EPS), 0.0) for a, m in zip(advantages, masks, strict=True)]
    return Advantages(per_token=advantages, returns=returns)


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float | None:
    """1 - Var(G - V) / Var(G) over tokens; None (undefined) when the returns do not vary."""
    spread = np.var(returns)
    return float(1.0 - np.var(returns - values) / spread) if spread > 0 else None


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None
) -> ValueTerms:
    """The clipped value loss L_V above (token mean over `mask`); clip None: the plain squared error."""
    import torch

    mask = mask.to(values.dtype)
    tokens = mask.sum().clamp(min=1.0)
    squared = (values - returns) ** 2
    if clip is None:
        per_token = squared
        clipped_fraction = torch.zeros(())
    else:
        kept = old_values + torch.clamp(values - old_values, -clip, clip)
        squared_clipped = (kept - returns) ** 2
        per_token = torch.maximum(squared, squared_clipped)
        clipped_fraction = ((squared_clipped > squared).to(mask.dtype) * mask).sum().detach() / tokens
    loss = 0.5 * (per_token * mask).sum() / tokens
    return ValueTerms(loss, clip_fraction=clipped_fraction, value_mean=((values * mask).sum() / tokens).detach())


@dataclass(frozen=True)
class ClippedValueLoss:
    """`value_loss` with algorithm.value_clip bound."""

    clip: float | None

    def __call__(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> ValueTerms:
        return value_loss(values, old_values, returns, mask, self.clip)


def clipped_value_loss(options: PpoOptions) -> ClippedValueLoss:
    return ClippedValueLoss(options.value_clip)


PPO = register_algorithm(
    Algorithm("ppo", frozenset({"critic"}), ppo_advantages, SURROGATE, PpoOptions, clipped_value_loss)
)
