"""The decoupled loss for rollouts the update's starting weights did not sample (algorithm.off_policy_correction;
asynchronous runs): one no-grad pass first computes pi_prox, the log-probs under the weights the update starts
from; the clipped ratio is then taken to pi_prox, and the advantages are weighted by pi_prox / pi_behaviour
(the sampler's log-probs; rlpipe.algorithms.policy_gradient.behaviour_weights).

Also the training-inference mismatch every update reports: how far the sampler's recorded log-probs are from
the trainer's own of the same weights (`mismatch_differences`, `mismatch_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from rlpipe.algorithms.policy_gradient import ClippedOptions, behaviour_weights
from rlpipe.training.batching import MicroBatch, rank_parts, token_budget
from rlpipe.training.distributed import all_max, all_sum, world
from rlpipe.training.logprobs import completion_logprobs, sequence_key

if TYPE_CHECKING:
    from rlpipe.spec import AlgorithmSpec
    from rlpipe.training.state import Trainer


@dataclass(frozen=True)
class Correction:
    """How behaviour_weights corrects: truncate (TIS) or mask (MIS) at `threshold`, per token or sequence."""

    kind: Literal["truncate", "mask"]
    threshold: float
    level: Literal["token", "sequence", "geometric"]

    @classmethod
    def from_options(cls, options: AlgorithmSpec) -> Correction | None:
        kind = options.off_policy_correction
        if kind is None or kind == "none":
            return None
        # a correction other than none: the clipped surrogates' options (is_level); DPO's refuse one (registry)
        assert isinstance(options, ClippedOptions)
        return cls(kind, options.is_threshold, options.is_level)

    @property
    def cut(self) -> str:
        """The statistic of the weights cut: truncated_fraction or masked_fraction."""
        return {"truncate": "truncated_fraction", "mask": "masked_fraction"}[self.kind]


def decoupled(mb: MicroBatch, correction: Correction) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages weighted by pi_prox / pi_behaviour, pi_prox as the ratio's old log-probs, the is_weights'
    statistics: is_weight_mean, is_weight_max, and the cut fraction)."""
    # a correction's rows: the sampler's log-probs and attach_proximal_logprobs' pi_prox
    assert mb.proximal_logprobs is not None and mb.old_logprobs is not None
    is_weights, stats = behaviour_weights(
        mb.proximal_logprobs, mb.old_logprobs, mb.completion_mask, correction.kind, correction.threshold,
        correction.level,
    )  # fmt: skip
    return mb.advantages * is_weights, mb.proximal_logprobs, stats


def policy_logprobs(trainer: Trainer, rows: list[dict]) -> list[list[float]]:
    """completion_logprobs under the trainer's policy as it stands, with its precision."""
    spec = trainer.spec
    bf16 = spec.trainer.dtype == "bfloat16"
    pad_id, chunk_tokens = trainer.tokenizer.pad_token_id, spec.trainer.logit_chunk_tokens
    temperature = spec.rollout.temperature
    return completion_logprobs(trainer.policy, rows, pad_id, temperature, bf16, chunk_tokens, trainer.packed)


def attach_proximal_logprobs(trainer: Trainer, minis: list[list[dict]]) -> float:
    """row["proximal_logprobs"]: log pi_prox of each completion token under the weights the update starts
    from, for the rows this process trains on, before the first optimizer step. Rows the resident trainer
    computed ahead at these weights (trainer.proximal, one process) are not computed again; returns the
    fraction that were."""
    budget = token_budget(trainer.spec.trainer.micro_batch_tokens, trainer.policy.device.type)
    cache = trainer.proximal
    known = cache.get("logprobs", {}) if cache.get("sha256") == trainer.weights["sha256"] and world()[1] == 1 else {}
    reused = total = 0
    for mini in minis:
        for part, _ in rank_parts(mini, budget, packed=trainer.packed):
            missing = [row for row in part if sequence_key(row) not in known]
            computed = dict(zip(map(sequence_key, missing), policy_logprobs(trainer, missing))) if missing else {}
            for row in part:
                key = sequence_key(row)
                row["proximal_logprobs"] = known[key] if key in known else computed[key]
            total += len(part)
            reused += len(part) - len(missing)
    return reused / max(total, 1)


def sampled_by(rows: list[dict], version: int) -> torch.Tensor:
    """[B] bool: the rows `version` sampled whole (every token's, a partial rollout's token_versions)."""
    return torch.tensor([set(row.get("token_versions") or [row.get("weights_version")]) == {version} for row in rows])


def mismatch_differences(logprobs: torch.Tensor, mb: MicroBatch, sampled_by_start: torch.Tensor) -> torch.Tensor:
    """d = log pi_trainer - log pi_sampler at the model tokens of the rows the weights the trainer holds sampled
    (`sampled_by_start`, [B] bool): the same weights on both sides, so d is numerics alone (the engine's
    kernels, precision, batching), never staleness. 1-D, float32."""
    assert mb.old_logprobs is not None  # rollouts carry the sampler's log-probs
    keep = mb.completion_mask.bool() & sampled_by_start.to(mb.completion_mask.device).unsqueeze(-1)
    return (logprobs.detach().float() - mb.old_logprobs.float())[keep]


def mismatch_metrics(differences: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    """The training-inference mismatch over the measured tokens, d = log pi_trainer - log pi_sampler:
        mismatch/k3_kl         mean of exp(d) - 1 - d: k3, the unbiased estimate of KL(sampler || trainer)
                               from tokens the sampler drew (>= 0 per token)
        mismatch/abs_diff_max  max |d|;  mismatch/abs_diff_p99: its 99th percentile (several processes: the
                               largest process's)
        mismatch/tokens        tokens measured
    Nothing when no token was measured."""
    d = torch.cat(differences) if differences else torch.zeros(0)
    summed = all_sum({"k3": float((torch.expm1(d) - d).sum()), "tokens": float(d.numel())}, device)
    if summed["tokens"] == 0:
        return {}
    magnitude = d.abs()
    local_max = float(magnitude.max()) if d.numel() else 0.0
    local_p99 = float(torch.quantile(magnitude.double(), 0.99)) if d.numel() else 0.0
    return {
        "mismatch/k3_kl": summed["k3"] / summed["tokens"],
        "mismatch/abs_diff_max": all_max(local_max, device),
        "mismatch/abs_diff_p99": all_max(local_p99, device),
        "mismatch/tokens": summed["tokens"],
    }
