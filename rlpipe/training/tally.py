"""What an update reports: its `Tally`, summed over its optimizer steps (each step's summed over processes),
and `update_metrics`, the means the iteration records (rlpipe.training.trainer.train_on_batch)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlpipe.metric_keys import CLIP_FRACTION, ENTROPY, KL_MEAN, OPTIMIZER_STEPS, POLICY_LOSS
from rlpipe.training.distributed import all_max, all_sum
from rlpipe.training.off_policy import mismatch_metrics

if TYPE_CHECKING:
    from rlpipe.algorithms.registry import LossTerms
    from rlpipe.training.state import Trainer


@dataclass
class OptimizerStepStats:
    """One optimizer step's statistics (torchtune's GRPOStats), summed over its micro-batches: token means
    weighed by each micro-batch's share of the step's completion tokens, the loss and the algorithm's own
    statistics by its loss weight; then over processes (`summed`). None: the step does not have it."""

    loss: float = 0.0
    entropy: float = 0.0
    clip_fraction: float = 0.0
    ratio: float = 0.0
    dual_clip_fraction: float | None = None  # the clipped-surrogate losses'
    kl: float = 0.0  # the estimated KL to the reference, over the tokens where it was measured
    kl_share: float = 0.0  # those tokens' share of the step's completion tokens (0: not measured)
    grad_norm: float = 0.0
    value_loss: float | None = None  # the critic's (PPO)
    value_clip_fraction: float | None = None
    critic_grad_norm: float | None = None
    off_policy: dict[str, float] = field(default_factory=dict)  # is_weight_mean, truncated_ or masked_fraction
    is_weight_max: float = 0.0  # before the correction: a max, this process's
    extra: dict[str, float] = field(default_factory=dict)  # the algorithm's own: DPO's preference_accuracy, ...

    def __iadd__(self, other: OptimizerStepStats) -> OptimizerStepStats:
        for name in SUMMED:
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, theirs if mine is None else mine if theirs is None else mine + theirs)
        self.is_weight_max = max(self.is_weight_max, other.is_weight_max)
        for name in ("off_policy", "extra"):
            mine = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] = mine.get(key, 0.0) + value
        return self

    @classmethod
    def of_micro_batch(
        cls, terms: LossTerms, loss: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, weight: float,
        share: float, is_stats: dict[str, float], kl_measured: bool,
    ) -> OptimizerStepStats:  # fmt: skip
        """One micro-batch's part: token means (entropy over its completion tokens, the clip and ratio
        statistics, the KL) by `share` = T_j / T, the loss and the algorithm's own statistics by `weight`."""
        stats = cls(
            loss=weight * loss.item(),
            entropy=share * float((entropy * mask).sum() / mask.sum().clamp(min=1)),
            clip_fraction=share * float(terms.clip_fraction),
            ratio=share * float(terms.ratio),
            kl=share * float(terms.kl) if kl_measured else 0.0,
            kl_share=share if kl_measured else 0.0,
            is_weight_max=is_stats.pop("is_weight_max", 0.0),
            off_policy={key: share * value for key, value in is_stats.items()},
            extra={key: weight * float(value) for key, value in terms.extra.items()},  # DPO's preference_accuracy
        )
        if terms.dual_clip_fraction is not None:
            stats.dual_clip_fraction = share * float(terms.dual_clip_fraction)
        return stats

    def summed(self, device: torch.device | str) -> OptimizerStepStats:
        """Each sum over the processes (is_weight_max stays this process's)."""
        flat = {name: getattr(self, name) for name in SUMMED if getattr(self, name) is not None}
        flat |= {f"off_policy/{k}": v for k, v in self.off_policy.items()}
        flat |= {f"extra/{k}": v for k, v in self.extra.items()}
        total = all_sum(flat, device)
        return dataclasses.replace(
            self,
            **{name: total[name] for name in SUMMED if name in total},
            off_policy={k: total[f"off_policy/{k}"] for k in self.off_policy},
            extra={k: total[f"extra/{k}"] for k in self.extra},
        )


SUMMED = ("loss", "entropy", "clip_fraction", "ratio", "dual_clip_fraction", "kl", "kl_share", "grad_norm",
          "value_loss", "value_clip_fraction", "critic_grad_norm")  # fmt: skip


@dataclass
class Tally:
    """What an update's metrics sum over its optimizer steps."""

    total: OptimizerStepStats = field(default_factory=OptimizerStepStats)
    optimizer_steps: int = 0
    kl_sum: float = 0.0  # each measuring step's KL: a token mean over the tokens it measured
    kl_steps: int = 0
    micro_batches: int = 0
    tokens: int = 0
    padded: int = 0  # rows x width of every forward pass: tokens plus the padding computed beside them
    mismatch: list[torch.Tensor] = field(default_factory=list)  # d per token, the first optimizer step's

    def add(self, stats: OptimizerStepStats) -> None:
        if stats.kl_share:
            self.kl_sum += stats.kl / stats.kl_share
            self.kl_steps += 1
        self.total += stats
        self.optimizer_steps += 1


def update_metrics(
    trainer: Trainer, tally: Tally, started: float, proximal_s: float, prefetched: float
) -> dict[str, float]:
    """The update's metrics: means over its optimizer steps (kl/mean over those that measured it)."""
    trained = time.time()
    device = trainer.policy.device
    summed = all_sum({"tokens": tally.tokens, "padded": tally.padded}, device)
    tokens = int(summed["tokens"])
    total, steps = tally.total, tally.optimizer_steps
    metrics = {}
    if total.value_loss is not None:
        # a critic's steps: micro_step sets value_clip_fraction beside value_loss, optimizer_step the critic's norm
        assert total.value_clip_fraction is not None and total.critic_grad_norm is not None
        metrics = {
            "critic/value_loss": total.value_loss / steps,
            "critic/value_clip_fraction": total.value_clip_fraction / steps,
            "critic/grad_norm": total.critic_grad_norm / steps,
        }
    if total.off_policy:
        metrics |= {f"off_policy/{key}": value / steps for key, value in total.off_policy.items()}
        metrics |= {
            "off_policy/is_weight_max": all_max(total.is_weight_max, device),
            "off_policy/proximal_pass_s": proximal_s,
            "off_policy/proximal_prefetched_fraction": prefetched,
        }
    if total.dual_clip_fraction is not None:
        metrics["policy/dual_clip_fraction"] = total.dual_clip_fraction / steps
    return (
        metrics
        | mismatch_metrics(tally.mismatch, device)
        | {
            POLICY_LOSS: total.loss / steps,
            CLIP_FRACTION: total.clip_fraction / steps,
            ENTROPY: total.entropy / steps,
            "policy/grad_norm": total.grad_norm / steps,
            "policy/ratio_mean": total.ratio / steps,
            KL_MEAN: tally.kl_sum / max(tally.kl_steps, 1),
            OPTIMIZER_STEPS: float(steps),
            "policy/micro_batches": float(tally.micro_batches),
            "policy/lr": trainer.optimizer.param_groups[0]["lr"],
            "throughput/update_tokens_per_s": tokens / max(trained - started, 1e-9),
            "policy/padding_share": 1.0 - tokens / max(summed["padded"], 1.0),  # of the forward passes' positions
        }
        | {f"policy/{key}": value / steps for key, value in total.extra.items()}
    )
