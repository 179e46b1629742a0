"""What an update reports: its `Tally`, summed over its optimizer steps (each step's summed over processes),
and `update_metrics`, the means the iteration records (rlpipe.training.trainer.train_on_batch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlpipe.metric_keys import CLIP_FRACTION, ENTROPY, KL_MEAN, OPTIMIZER_STEPS, POLICY_LOSS
from rlpipe.training.distributed import all_max, all_sum
from rlpipe.training.off_policy import mismatch_metrics

if TYPE_CHECKING:
    from rlpipe.training.off_policy import Correction
    from rlpipe.training.trainer import Trainer

STANDARD_STATS = {"loss", "clip_fraction", "kl", "entropy", "grad_norm", "ratio"}  # reported under their own names


@dataclass
class Tally:
    """What an update's metrics sum over its optimizer steps (each step's summed over processes)."""

    totals: dict[str, float]
    off_policy: tuple[str, ...]  # the correction's statistics, () without one
    steps: int = 0
    kl_steps: int = 0
    micro_steps: int = 0
    tokens: int = 0
    padded: int = 0  # rows x width of every forward pass: tokens plus the padding computed beside them
    weight_max: float = 0.0  # the largest importance weight before the correction
    mismatch: list[torch.Tensor] = field(default_factory=list)  # d per token, the first optimizer step's

    @classmethod
    def start(cls, critic: bool, correction: Correction | None) -> Tally:
        totals = dict.fromkeys(("loss", "clip_fraction", "kl", "entropy", "grad_norm", "ratio"), 0.0)
        if critic:
            totals |= dict.fromkeys(("value_loss", "value_clip_fraction", "critic_grad_norm"), 0.0)
        return cls(totals, ("is_weight_mean", correction.cut) if correction else ())

    def add(self, step: dict[str, float], kl_measured: bool) -> None:
        for key, value in step.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        self.kl_steps += int(kl_measured)
        self.steps += 1


def update_metrics(
    trainer: Trainer, tally: Tally, started: float, proximal_s: float, prefetched: float
) -> dict[str, float]:
    """The update's metrics: means over its optimizer steps (kl/mean over those that measured it)."""
    trained = time.time()
    device = trainer.policy.device
    summed = all_sum({"tokens": tally.tokens, "padded": tally.padded}, device)
    tokens = int(summed["tokens"])
    totals, steps = tally.totals, tally.steps
    metrics = {}
    if trainer.critic is not None:
        metrics = {
            "critic/value_loss": totals["value_loss"] / steps,
            "critic/value_clip_fraction": totals["value_clip_fraction"] / steps,
            "critic/grad_norm": totals["critic_grad_norm"] / steps,
        }
    if tally.off_policy:
        metrics |= {f"off_policy/{key}": totals[key] / steps for key in tally.off_policy}
        metrics |= {
            "off_policy/is_weight_max": all_max(tally.weight_max, device),
            "off_policy/proximal_pass_s": proximal_s,
            "off_policy/proximal_prefetched_fraction": prefetched,
        }
    return (
        metrics
        | mismatch_metrics(tally.mismatch, device)
        | {
            POLICY_LOSS: totals["loss"] / steps,
            CLIP_FRACTION: totals["clip_fraction"] / steps,
            ENTROPY: totals["entropy"] / steps,
            "policy/grad_norm": totals["grad_norm"] / steps,
            "policy/ratio_mean": totals["ratio"] / steps,
            KL_MEAN: totals["kl"] / max(tally.kl_steps, 1),
            OPTIMIZER_STEPS: float(steps),
            "policy/micro_batches": float(tally.micro_steps),
            "policy/lr": trainer.optimizer.param_groups[0]["lr"],
            "throughput/update_tokens_per_s": tokens / max(trained - started, 1e-9),
            "policy/padding_share": 1.0 - tokens / max(summed["padded"], 1.0),  # of the forward passes' positions
        }
        | {f"policy/{key}": totals[key] / steps for key in totals.keys() - STANDARD_STATS - set(tally.off_policy)}
    )
