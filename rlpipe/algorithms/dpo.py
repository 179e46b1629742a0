"""DPO: the policy learns a preference y_w > y_l directly, with no reward model and no sampling in the
loss (Rafailov et al., "Direct Preference Optimization"). With the sequence log-ratios to the frozen
reference
    h_w = sum_t m_t (log pi(y_w,t | x, y_w,<t) - log pi_ref(...))     (y_w: chosen)
    h_l = sum_t m_t (log pi(y_l,t | ...)       - log pi_ref(...))     (y_l: rejected)
    z   = beta (h_w - h_l)
the loss per pair, averaged over pairs, is
    dpo_loss sigmoid  L = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)   (eps: label_smoothing,
                                                                            cDPO; 0 = plain DPO)
    dpo_loss ipo      L = (h_w - h_l - 1 / (2 beta))^2                       (Azar et al., IPO)
plus, with rpo_alpha > 0, the chosen completion's negative log-likelihood per token (RPO: Pang et al.,
"Iterative Reasoning Preference Optimization"; TRL's rpo_alpha)
    L += alpha * ( -sum_t m_t log pi(y_w,t | ...) / sum_t m_t ),
and grad L = -beta sigmoid(-z) (grad log pi(y_w) - grad log pi(y_l)) for plain DPO: the chosen
sequence's log-probability rises and the rejected one's falls, most where the policy still ranks
them wrongly. beta r_w = beta h_w and beta r_l are the implicit rewards; preference accuracy is the
fraction of pairs with h_w > h_l, the reward margin mean beta (h_w - h_l).

Two algorithms share the loss:
    dpo         offline: its own pipeline (pipelines/dpo_pipeline.py) over a preference set (built
                from the task once, or read from prompt/chosen/rejected files), the reference
                log-probs computed once and stored beside the pairs (rlpipe/dpo_loop.py)
    online_dpo  the RL DAG: each iteration samples G completions per prompt from v(N), scores them,
                and the advantages step pairs them within each group (`preference_roles`): the
                best with the worst, the second best with the second worst, ..., while the better
                one's reward is strictly higher (Guo et al., "Direct language model alignment from
                online AI feedback"; the reference is the frozen v0)

online_dpo's default rpo_alpha is 1.0, dpo's 0: on the demo, plain online DPO (rpo_alpha 0) unlearns
(held-out greedy accuracy 0.412 -> 0.180 in 25 iterations at beta 0.1; 0.412 -> 0.134 -> 0.426 at beta
1.0), while with the NLL term it climbs (0.412 -> 0.652). Plain DPO has no trust region: with sequence
sums and beta 0.1, z saturates only after tens of nats, so each step keeps pushing the rejected
completions down, and the probability it removes lands on other wrong answers as much as on the
chosen one; the chosen log-probabilities fall too ("likelihood displacement", Razin et al. 2024;
Pal et al. 2024), the KL to v0 grows to tens of nats per token, and greedy decoding follows the mass.
The NLL term keeps the chosen (correct) answers likely.

The advantages step marks each completion's role in the `advantage` column: +1 chosen, -1 rejected,
0 unpaired (it trains nothing). The update keeps each pair together, chosen then rejected, in one
micro-batch (`paired_rows`; rlpipe.training.batching splits in units of 2 rows), so the loss sees rows
(2k, 2k+1) as pair k.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from rlpipe.algorithms.policy_gradient import kl_estimate
from rlpipe.algorithms.registry import Advantages, Algorithm, LossTerms, Scored, register_algorithm
from rlpipe.spec import AlgorithmSpec, retune, section, setting

if TYPE_CHECKING:
    import torch

    from rlpipe.algorithms.registry import PolicyInputs

CHOSEN, REJECTED = 1.0, -1.0


@section
class DpoOptions(AlgorithmSpec):
    """DPO's: the temperature beta, the loss's form, label smoothing and the chosen answer's NLL (RPO)."""

    name: str = retune(AlgorithmSpec, "name", "dpo")

    beta: float = setting(
        default=0.1,
        gt=0,
        doc="DPO's temperature (dpo, online_dpo): it scales the policy-to-reference log-ratios in the preference "
        "loss, and a larger one keeps the policy closer to the reference. Not a KL coefficient (that is kl_coef)",
    )
    label_smoothing: float = setting(default=0.0, ge=0, lt=0.5, doc="Chance a label is flipped (cDPO)")
    dpo_loss: Literal["sigmoid", "ipo"] = setting(
        default="sigmoid", doc="DPO's loss: sigmoid (DPO) or ipo (IPO's squared loss)"
    )
    rpo_alpha: float = setting(
        default=0.0, ge=0, doc="Weight of the chosen completion's NLL per token added to the loss (RPO)"
    )


@section
class OnlineDpoOptions(DpoOptions):
    """Online DPO's: RPO's NLL on by default (module docstring: without it, the demo unlearns)."""

    name: str = retune(AlgorithmSpec, "name", "online_dpo")

    rpo_alpha: float = retune(DpoOptions, "rpo_alpha", 1.0)


def preference_roles(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Online DPO's pairs, as roles: +1 chosen, -1 rejected, 0 unpaired. In each group (the G samples
    of one prompt), sorted by reward (ties by position), the i-th best is paired with the i-th worst
    for i < G/2 while its reward is strictly higher; so every chosen completion of a group beats every
    rejected one (with 0/1 rewards: min(correct, wrong) pairs)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    roles = np.zeros(len(rewards))
    for group in np.unique(group_ids):
        rows = np.flatnonzero(group_ids == group)
        best = rows[np.lexsort((rows, -rewards[rows]))]  # reward descending, then position
        worst = rows[np.lexsort((rows, rewards[rows]))]  # reward ascending, then position
        for high, low in zip(best[: len(rows) // 2], worst[: len(rows) // 2]):
            if rewards[high] <= rewards[low]:
                break
            roles[high], roles[low] = CHOSEN, REJECTED
    return roles


def online_advantages(scored: Scored, options: DpoOptions) -> Advantages:
    """online_dpo's `advantage` column: each completion's role (`preference_roles`)."""
    return Advantages(per_sequence=preference_roles(scored.rewards, scored.group_ids))


def offline_only(scored: Scored, options: DpoOptions) -> Advantages:
    raise ValueError(
        "algorithm.name dpo trains on a fixed preference set in its own pipeline (rlpipe run and rlpipe compile "
        "pick it); it has no advantages step. For pairs sampled each iteration use algorithm.name: online_dpo"
    )


def paired_rows(rows: list[dict], seed: int) -> list[dict]:
    """The batch's pairs, shuffled by `seed`, flattened chosen-then-rejected: [c_1, r_1, c_2, r_2, ...].
    A group's chosen rows (advantage > 0) are matched with its rejected rows (advantage < 0) in
    sample_index order; unpaired rows (advantage 0) are dropped."""
    groups: dict[int, tuple[list[dict], list[dict]]] = {}
    for row in rows:
        if row["advantage"]:
            groups.setdefault(row["group_id"], ([], []))[row["advantage"] < 0].append(row)
    pairs = []
    for group, (chosen, rejected) in sorted(groups.items()):
        if len(chosen) != len(rejected):
            raise ValueError(
                f"group {group} has {len(chosen)} chosen and {len(rejected)} rejected rows; a preference batch "
                "pairs them one to one (advantage +1 chosen, -1 rejected)"
            )
        by_index = lambda r: r["sample_index"]  # noqa: E731
        pairs += list(zip(sorted(chosen, key=by_index), sorted(rejected, key=by_index)))
    random.Random(seed).shuffle(pairs)
    return [row for pair in pairs for row in pair]


def sequence_log_ratios(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """h_i = sum_t m_it (log pi_it - log pi_ref_it): each sequence's log pi(y|x) - log pi_ref(y|x)."""
    return ((logprobs - ref_logprobs) * mask.to(logprobs.dtype)).sum(-1)


@dataclass(frozen=True)
class PreferenceLoss:
    """The DPO loss (module docstring) with its options bound, over rows (2k, 2k+1) = (chosen, rejected)
    of pair k, averaged over pairs. The reference's per-token log-probs are computed once (dpo) or by the
    update's reference forward (online_dpo)."""

    name: str  # the algorithm's, for errors
    beta: float
    kind: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    kl_estimator: str = "k3"  # the tracked KL to the reference

    @classmethod
    def from_options(cls, options: DpoOptions) -> PreferenceLoss:
        return cls(options.name, options.beta, options.dpo_loss, options.label_smoothing, options.rpo_alpha)

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss per pair, z = beta (h_w - h_l)) from the pairs' sequence log-ratios h_w, h_l."""
        import torch.nn.functional as F

        z = self.beta * (chosen - rejected)
        if self.kind == "ipo":
            return (chosen - rejected - 1.0 / (2.0 * self.beta)) ** 2, z
        if self.kind != "sigmoid":
            raise ValueError(f"algorithm.dpo_loss must be sigmoid or ipo, got {self.kind!r}")
        eps = self.label_smoothing
        return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z), z

    def __call__(self, inputs: PolicyInputs) -> LossTerms:
        import torch

        logprobs, ref_logprobs, mask = inputs.logprobs, inputs.ref_logprobs, inputs.mask
        if ref_logprobs is None:
            raise ValueError(f"algorithm {self.name} needs the reference's log-probs (the frozen v0)")
        roles = inputs.advantages[:, 0]  # per sequence: the role, the same along the row
        if len(roles) % 2 or not (bool((roles[0::2] > 0).all()) and bool((roles[1::2] < 0).all())):
            raise ValueError("a DPO micro-batch must hold whole pairs, chosen (advantage +1) then rejected (-1)")
        h = sequence_log_ratios(logprobs, ref_logprobs, mask)
        losses, z = self.pair_losses(h[0::2], h[1::2])
        mask_f = mask.to(logprobs.dtype)
        chosen_nll = -(logprobs * mask_f).sum(-1)[0::2] / mask_f.sum(-1)[0::2].clamp(min=1.0)
        if self.rpo_alpha:
            losses = losses + self.rpo_alpha * chosen_nll
        loss, tokens = losses.mean(), mask_f.sum().clamp(min=1.0)
        with torch.no_grad():
            kl = kl_estimate(logprobs, ref_logprobs, self.kl_estimator)
            extra = {
                "preference_accuracy": (z > 0).to(logprobs.dtype).mean(),
                "reward_margin": z.mean(),
                "chosen_reward": self.beta * h[0::2].mean(),
                "rejected_reward": self.beta * h[1::2].mean(),
                "chosen_nll": chosen_nll.mean(),
            }
            return LossTerms(
                loss,
                clip_fraction=torch.zeros((), dtype=logprobs.dtype, device=logprobs.device),
                kl=(kl * mask_f).sum() / tokens,
                ratio=(torch.exp(logprobs - inputs.old_logprobs) * mask_f).sum() / tokens,
                extra=extra,
            )


DPO = register_algorithm(
    Algorithm("dpo", frozenset({"pairs"}), offline_only, PreferenceLoss.from_options, DpoOptions, kl_term="none")
)
ONLINE_DPO = register_algorithm(
    Algorithm(
        "online_dpo",
        frozenset({"groups", "pairs", "reference"}),
        online_advantages,
        PreferenceLoss.from_options,
        OnlineDpoOptions,
        kl_term="none",
    )
)
