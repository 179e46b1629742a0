"""The policy-gradient loss every online algorithm shares: a clipped importance-weighted
surrogate, a KL estimator to the frozen reference, and how token losses become one number.

Shapes are [B, T] (B completions, T tokens; `mask` marks completion tokens). Torch is imported
when a function is called: only the update calls these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlpipe.algorithms.registry import LossTerms
from rlpipe.spec import AlgorithmSpec, section, setting

if TYPE_CHECKING:
    import torch

    from rlpipe.algorithms.registry import PolicyInputs

Aggregation = Literal["sequence_mean", "token_mean", "sequence_sum"]


@section
class ClippedOptions(AlgorithmSpec):
    """The clipped surrogate's options (gspo; with an aggregation, `PolicyGradientOptions`)."""

    clip_eps: float = setting(default=0.2, gt=0, doc="Lower clip range of the ratio")
    clip_eps_high: float | None = setting(
        default=None, gt=0, doc="Upper clip range of the ratio (DAPO's clip-higher: 0.28); the default null: clip_eps"
    )
    dual_clip: float = setting(
        default=3.0,
        ge=0,
        doc="Dual clip c (verl's clip_ratio_c): a negative advantage's token loss is capped at -c A, so a ratio "
        "far above 1 cannot grow it without bound. > 1, or 0 to turn it off",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = setting(
        default="k3",
        doc="KL estimator: k1 = log pi - log ref (in a reward only: as a loss term its expected gradient is 0), "
        "k2 = squared / 2, k3 = GRPO's",
    )
    is_level: Literal["token", "sequence", "geometric"] = setting(
        default="token",
        doc="off_policy_correction's importance weight per token, per sequence (the product of its tokens'), or "
        "the sequence's geometric mean (gspo's, whose objective is per sequence)",
    )

    def __post_init__(self) -> None:
        if 0 < self.dual_clip <= 1:
            raise ValueError(
                f"algorithm.dual_clip {self.dual_clip}: the cap -c A on a negative advantage's loss needs c > 1 "
                "(verl's clip_ratio_c is 3); set it above 1, or 0 to turn the dual clip off"
            )


@section
class PolicyGradientOptions(ClippedOptions):
    """The clipped surrogate's options and how token losses become one number (grpo, rloo, reinforce_pp, ppo)."""

    loss_aggregation: Aggregation = setting(
        default="sequence_mean",
        doc="Token losses to one: per-sequence mean, token mean (DAPO), or sums over length_norm (Dr. GRPO)",
    )
    length_norm: int | None = setting(
        default=None, ge=1, doc="sequence_sum's divisor; the default null: rollout.max_new_tokens"
    )


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence"),
    with d = log ref - log pi:
        k1 = -d                       unbiased, can be negative
        k2 = d^2 / 2                  biased, low variance
        k3 = exp(d) - d - 1           unbiased, >= 0 (GRPO's)
    """
    import torch

    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"algorithm.kl_estimator must be k1, k2 or k3, got {estimator!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, length_norm: int = 1
) -> torch.Tensor:
    """One loss from token losses l_it:
    sequence_mean  L = mean_i [ sum_t l_it m_it / sum_t m_it ]   (GRPO: each completion weighs the same)
    token_mean     L = sum_it l_it m_it / sum_it m_it            (DAPO: each token weighs the same)
    sequence_sum   L = mean_i [ sum_t l_it m_it ] / length_norm  (Dr. GRPO: no 1/|o_i|, so no length
                                                                  bias; length_norm a constant)
    """
    if aggregation == "sequence_mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if aggregation == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregation == "sequence_sum":
        return (per_token * mask).sum(-1).mean() / length_norm
    raise ValueError(
        f"algorithm.loss_aggregation must be sequence_mean, token_mean or sequence_sum, got {aggregation!r}"
    )


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "sequence_mean",
    clip_eps_high: float | None = None,
    kl_estimator: str = "k3",
    length_norm: int = 1,
    ratio: torch.Tensor | None = None,
    dual_clip: float | None = None,
) -> LossTerms:
    """PPO's clipped surrogate with the dual clip and an optional KL penalty, per token t of completion i:
        r_it  = exp(logp_it - logp_old_it)        (importance ratio to the sampler; `ratio` overrides it)
        pg_it = -min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it)
        pg_it = min(pg_it, -c A_it)  if A_it < 0  (dual clip, Ye et al. 2020; verl's clip_ratio_c c = 3)
        l_it  = pg_it + kl_coef kl_it             (kl_estimate)
    then aggregated (`aggregate`). Every tensor is [B, T], `advantages` too (a per-sequence A_i along
    its row). eps_high = eps_low unless given (DAPO's clip-higher: eps_high > eps_low lets unlikely
    tokens rise). With A < 0 the clipped surrogate is -A max(r, 1 - eps), unbounded in r: a ratio of e^5
    would weigh one token ~150 times; the dual clip caps it at -c A (no gradient past r = c). On-policy
    ratios are ~1, so it acts only on stale or mismatched tokens. dual_clip None or 0: off.
    """
    import torch

    if advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be [B, T] as the log-probs are, {tuple(logprobs.shape)}; got "
            f"{tuple(advantages.shape)} (a per-sequence A_i goes along its row: A.unsqueeze(-1).expand_as)"
        )
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs) if ratio is None else ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, aggregation, length_norm)
    tokens = mask.sum().clamp(min=1.0)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(mask.dtype)  # the clip bound was the active term
        return LossTerms(
            loss,
            clip_fraction=(was_clipped * mask).sum() / tokens,
            kl=(kl * mask).sum() / tokens,
            ratio=(ratio * mask).sum() / tokens,
            dual_clip_fraction=(dual_clipped.to(mask.dtype) * mask).sum() / tokens,
        )


@dataclass(frozen=True)
class ClippedSurrogate:
    """`clipped_policy_loss` with its options bound (grpo, dr_grpo, dapo, rloo, ppo)."""

    clip_eps: float
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: Aggregation = "sequence_mean"
    length_norm: int = 1
    dual_clip: float | None = None

    @classmethod
    def from_options(cls, options: ClippedOptions) -> ClippedSurrogate:
        return cls(
            clip_eps=options.clip_eps,
            clip_eps_high=options.clip_eps_high,
            kl_coef=options.kl_coef,
            kl_estimator=options.kl_estimator,
            aggregation=options.loss_aggregation or "sequence_mean",
            length_norm=options.length_norm or 1,
            dual_clip=options.dual_clip,
        )

    def __call__(
        self, inputs: PolicyInputs, advantages: torch.Tensor | None = None, ratio: torch.Tensor | None = None
    ) -> LossTerms:
        """The loss of `inputs`; `advantages` and `ratio` replace theirs (REINFORCE++, GSPO)."""
        return clipped_policy_loss(
            inputs.logprobs,
            inputs.old_logprobs,
            inputs.advantages if advantages is None else advantages,
            inputs.mask,
            self.clip_eps,
            inputs.ref_logprobs,
            self.kl_coef,
            self.aggregation,
            self.clip_eps_high,
            self.kl_estimator,
            self.length_norm,
            ratio,
            self.dual_clip,
        )


def behaviour_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    correction: Literal["truncate", "mask"],
    threshold: float,
    level: Literal["token", "sequence", "geometric"] = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights for rollouts that pi_behaviour sampled (a stale version, or a sampler's own
    numerics) while the update's trust region is around pi_prox (the weights it starts from): per
    token t of completion i,
        log w_it = log pi_prox_it - log pi_behaviour_it
        token      w_it
        sequence   w_i = exp(sum_t m_it log w_it)                   (the sequence's likelihood ratio)
        geometric  w_i = exp(sum_t m_it log w_it / sum_t m_it)
        truncate   w <- min(w, C)                                   (TIS)
        mask       w <- w 1[1/C <= w <= C]                          (MIS: those tokens/sequences train nothing)
    The clipped surrogate weighs token t by w (decoupled PPO, r = pi_theta / pi_prox); since w >= 0,
        -w min(r A, clip(r) A) = -min(r wA, clip(r) wA),
    so the weights multiply the advantages. Returns (w as [B, T], stats over the weighted units: tokens,
    or sequences): is_weight_mean and is_weight_max before truncation or masking, truncated_fraction or
    masked_fraction.
    """
    import torch

    mask = mask.to(proximal.dtype)
    log_w = (proximal - behaviour) * mask
    if level == "token":
        unit_log_w, units = log_w, mask.bool()
    elif level in ("sequence", "geometric"):
        unit_log_w = log_w.sum(-1)
        if level == "geometric":
            unit_log_w = unit_log_w / mask.sum(-1).clamp(min=1.0)
        units = mask.sum(-1) > 0
        log_w = unit_log_w.unsqueeze(-1).expand_as(proximal)
    else:
        raise ValueError(f"algorithm.is_level must be token, sequence or geometric, got {level!r}")
    log_c = math.log(threshold)
    if correction == "truncate":
        is_weights, cut = torch.exp(log_w.clamp(max=log_c)), unit_log_w > log_c
    elif correction == "mask":
        is_weights = torch.where(log_w.abs() > log_c, torch.zeros_like(log_w), torch.exp(log_w.clamp(-log_c, log_c)))
        cut = unit_log_w.abs() > log_c
    else:
        raise ValueError(f"algorithm.off_policy_correction must be none, truncate or mask, got {correction!r}")
    raw = torch.exp(unit_log_w[units].clamp(max=50.0))  # the weights before the correction (kept finite)
    count = max(int(units.sum()), 1)
    stats = {
        "is_weight_mean": float(raw.sum()) / count,
        "is_weight_max": float(raw.max()) if raw.numel() else 0.0,
        "truncated_fraction" if correction == "truncate" else "masked_fraction": float(cut[units].sum()) / count,
    }
    return is_weights * mask, stats
