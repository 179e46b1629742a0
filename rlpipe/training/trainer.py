"""The optimizer loop: one iteration of policy-gradient training on the batch, in place on a Trainer
(opened and saved by rlpipe.training.loading; the door to it is rlpipe.training.session).

`train_on_batch` is the optimizer loop: the batch's rows in mini-batches (trainer.mini_batches optimizer
steps per epoch, PPO style), each split into micro-batches of at most trainer.micro_batch_tokens whose
gradients accumulate (rlpipe.training.batching). Each micro-batch computes its algorithm's `Objective`:
the registered policy loss with its options (rlpipe.algorithms), minus the entropy bonus, on advantages
the off-policy correction may weight (rlpipe.training.off_policy), with PPO's value loss on the critic
beside it (rlpipe.training.critic). The sampler's log-probs are pi_old, so no extra forward pass is spent
recomputing them, unless algorithm.off_policy_correction asks for the decoupled loss.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlpipe.algorithms import PolicyInputs, get_algorithm, resolve_options
from rlpipe.algorithms.policy_gradient import aggregate
from rlpipe.metric_keys import OPTIMIZER_STEPS
from rlpipe.models.loading import is_adapted
from rlpipe.rollouts import read_table
from rlpipe.spec import RunSpec
from rlpipe.training.batching import (
    MicroBatch,
    micro_batch_weight,
    mini_batches,
    pack,
    rank_parts,
    token_budget,
    trained_tokens,
    update_order,
)
from rlpipe.training.critic import value_step
from rlpipe.training.distributed import clip_grad_norm, world
from rlpipe.training.logprobs import completion_logprobs_and_entropy
from rlpipe.training.off_policy import (
    Correction,
    attach_proximal_logprobs,
    decoupled,
    mismatch_differences,
    sampled_by,
)
from rlpipe.training.state import Trainer
from rlpipe.training.tally import OptimizerStepStats, Tally, update_metrics

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from rlpipe.algorithms.policy_gradient import Aggregation
    from rlpipe.algorithms.registry import PolicyLoss, ValueLoss


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient went NaN/inf; nothing was published."""


def packs_rows(trainer: Trainer) -> bool:
    """trainer.padding_free for this trainer: when asked, every model (policy, reference, critic) gets
    rlpipe.training.packed_attention's attention. Raises ValueError when one cannot attend within packed rows."""
    from rlpipe.training.packed_attention import packable, use_packed_attention

    if not trainer.spec.trainer.padding_free:
        return False
    candidates = [trainer.policy, trainer.reference, trainer.critic.model if trainer.critic else None]
    models = [m for m in candidates if m is not None]
    for model in models:
        if (why := packable(model)) is not None:
            raise ValueError(
                f"trainer.padding_free: true, but the model cannot attend within packed rows: {why}; "
                "set trainer.padding_free to false"
            )
        use_packed_attention(model)
    return True


def autocast(trainer: Trainer) -> torch.autocast:
    """bf16 compute, fp32 master weights: autocast runs the matmuls in bf16, the parameters, their
    gradients and AdamW's moments stay fp32, and log-probs are taken in fp32 (token_logprobs)."""
    enabled = trainer.spec.trainer.dtype == "bfloat16"
    return torch.autocast(trainer.policy.device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class Objective:
    """What every micro-batch of an update computes, configured once from the spec:
        L = loss_terms(logprobs, old_logprobs, A, mask, ref_logprobs) - entropy_coef H
    (H aggregated as the loss is), on advantages weighted by the off-policy correction when there is one,
    and the critic's value loss beside it (PPO)."""

    loss_terms: PolicyLoss  # the algorithm's, its options bound
    value_loss: ValueLoss | None
    entropy_coef: float
    aggregation: Aggregation
    length_norm: int
    correction: Correction | None
    temperature: float
    critic_lr: float | None
    reference_each_step: bool  # the KL is in the loss, or the loss reads the reference (online DPO)
    unit: int  # rows that stay together: 2 for preference pairs (chosen, rejected)

    @classmethod
    def for_spec(cls, spec: RunSpec) -> Objective:
        algorithm = get_algorithm(spec.algorithm.name)
        options = resolve_options(spec)  # the algorithm's defaults for what the spec leaves unset
        return cls(
            loss_terms=algorithm.loss(options),
            value_loss=algorithm.value_loss(options) if algorithm.value_loss else None,
            entropy_coef=options.entropy_coef,
            aggregation=options.loss_aggregation or "sequence_mean",
            length_norm=options.length_norm or 1,
            correction=Correction.from_options(options),
            temperature=spec.rollout.temperature,
            critic_lr=options.critic_lr,
            reference_each_step=options.kl_coef > 0 or "reference" in algorithm.needs,
            unit=2 if "pairs" in algorithm.needs else 1,
        )


def train_on_batch(trainer: Trainer, batch_path: str, iteration: int) -> dict[str, float]:
    """One iteration of mini-batch steps on the batch; the trainer's policy and optimizer move on
    in place. Each mini-batch is one optimizer step; within it, micro-batches of at most
    trainer.micro_batch_tokens accumulate their gradients. Raises NonFiniteLossError before the step
    that would apply a NaN/inf gradient."""
    started = time.time()
    spec = trainer.spec
    objective = Objective.for_spec(spec)
    pairs = objective.unit == 2  # DPO: [chosen, rejected] pairs, kept together (rlpipe.algorithms.dpo)
    rows = update_order(read_table(batch_path).to_pylist(), pairs, spec.seed * 1_000_003 + iteration)
    if pairs and not rows:
        return {OPTIMIZER_STEPS: 0.0, "policy/pairs": 0.0}
    minis = mini_batches(rows, spec.trainer.mini_batches, objective.unit)
    tally = Tally()
    if trainer.checkpoint_writer is not None:  # the last checkpoint reads what the optimizer steps change
        trainer.checkpoint_writer.join()
        trainer.checkpoint_writer = None
    prefetched = attach_proximal_logprobs(trainer, minis) if objective.correction else 0.0
    proximal_s = time.time() - started
    steps_before = (
        (iteration - 1) * spec.trainer.epochs * len(minis)
    )  # before this iteration: where the learning rate's warmup and decay stand
    for _ in range(spec.trainer.epochs):
        for mini in minis:
            set_learning_rates(trainer, objective, steps_before + tally.optimizer_steps)
            stats = accumulate_gradients(trainer, objective, mini, tally)
            optimizer_step(trainer, stats, iteration)
            tally.add(stats)
    metrics = update_metrics(trainer, tally, started, proximal_s, prefetched)
    return metrics | ({"policy/pairs": len(rows) / 2} if pairs else {})


def set_learning_rates(trainer: Trainer, objective: Objective, global_step: int) -> None:
    """Linear warmup: lr_s = lr * min(1, (s + 1) / warmup), s = optimizer steps so far in the run."""
    spec = trainer.spec
    warmup = min(1.0, (global_step + 1) / max(spec.trainer.warmup_steps, 1))
    for group in trainer.optimizer.param_groups:
        group["lr"] = spec.trainer.lr * warmup
    if trainer.critic is not None:
        # the trainer's critic is a trained one (load_critic trainable), its lr filled by resolve_options
        assert trainer.critic.optimizer is not None and objective.critic_lr is not None
        for group in trainer.critic.optimizer.param_groups:
            group["lr"] = objective.critic_lr * warmup


def accumulate_gradients(trainer: Trainer, objective: Objective, mini: list[dict], tally: Tally) -> OptimizerStepStats:
    """Forward and backward passes over this process's micro-batches of a mini-batch, their gradients
    accumulating (weights: micro_batch_weight); gradients scale by the number of processes, which FSDP
    averages over. Returns the step's statistics, summed over processes."""
    completion_tokens = float(sum(map(trained_tokens, mini)))
    # The frozen reference costs a forward pass: every micro-batch when the KL is in the loss; when it is
    # only tracked (kl_coef 0), the iteration's first micro-batch estimates kl/mean.
    tracked = trainer.reference is not None and tally.optimizer_steps == 0
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.critic is not None:
        assert trainer.critic.optimizer is not None  # the trainer's critic is a trained one (load_critic trainable)
        trainer.critic.optimizer.zero_grad(set_to_none=True)
    stats = OptimizerStepStats()
    budget = token_budget(trainer.spec.trainer.micro_batch_tokens, trainer.policy.device.type)
    for j, (part, present) in enumerate(rank_parts(mini, budget, objective.unit, trainer.packed)):
        use_reference = (trainer.reference is not None and objective.reference_each_step) or (tracked and j == 0)
        mb = pack(part, trainer.tokenizer.pad_token_id, trainer.packed).to(trainer.policy.device.type)
        weight = present * micro_batch_weight(mb, len(mini), completion_tokens, objective.aggregation)
        share = present * float(mb.completion_mask.sum()) / max(completion_tokens, 1.0)  # of token means
        # before the first optimizer step the policy is the weights that sampled this iteration's rows (all
        # of them at s=0): their forward pass measures the training-inference mismatch at no extra cost
        measure = None
        if tally.optimizer_steps == 0 and present and mb.old_logprobs is not None:
            measure = sampled_by(part, trainer.weights["version"])
        stats += micro_step(trainer, objective, mb, weight, share, use_reference, measure, tally.mismatch)
        tally.tokens += int(present * mb.tokens)
        tally.padded += int(present * mb.input_ids.numel())
        tally.micro_batches += 1
    return stats.summed(trainer.policy.device.type)


def micro_step(
    trainer: Trainer,
    objective: Objective,
    mb: MicroBatch,
    weight: float,
    share: float,
    use_reference: bool,
    measure: torch.Tensor | None = None,
    mismatch: list[torch.Tensor] | None = None,
) -> OptimizerStepStats:
    """One micro-batch's forward and backward passes: the policy's loss back-propagated with weight
    `weight`, the critic's (a token mean) with `share` = T_j / T, both times the number of processes.
    Returns its part of the step's statistics: token means by `share`, the loss and the algorithm's own
    statistics by `weight`. `measure` ([B] bool): rows the policy's weights sampled, whose log-prob
    differences to the sampler's are appended to `mismatch`."""
    processes = world()[1]
    logprobs, entropy = completion_logprobs_and_entropy(
        trainer.policy,
        mb,
        objective.temperature,
        trainer.spec.trainer.logit_chunk_tokens,
        entropy_grad=objective.entropy_coef > 0,
        precision=autocast(trainer),
    )
    if measure is not None and mismatch is not None:
        mismatch.append(mismatch_differences(logprobs, mb, measure))
    ref_logprobs = mb.ref_logprobs  # computed once (offline DPO), else the reference's
    if use_reference and ref_logprobs is None:
        ref_logprobs = reference_logprobs(trainer, mb, objective.temperature)
    advantages, old_logprobs = mb.advantages, mb.old_logprobs
    is_stats: dict[str, float] = {}
    if objective.correction is not None:
        advantages, old_logprobs, is_stats = decoupled(mb, objective.correction)
    # rollouts carry the sampler's log-probs (rlpipe.rollouts' schema; offline DPO's rows the reference's)
    assert old_logprobs is not None
    terms = objective.loss_terms(PolicyInputs(logprobs, old_logprobs, advantages, mb.completion_mask, ref_logprobs))
    loss = terms.loss
    if objective.entropy_coef:  # L - c H, H aggregated as the loss is
        mask_f = mb.completion_mask.to(entropy.dtype)
        loss = loss - objective.entropy_coef * aggregate(entropy, mask_f, objective.aggregation, objective.length_norm)
        entropy = entropy.detach()
    (processes * weight * loss).backward()
    mask, measured = mb.completion_mask, ref_logprobs is not None
    stats = OptimizerStepStats.of_micro_batch(terms, loss, entropy, mask, weight, share, is_stats, measured)
    if trainer.critic is not None:
        assert objective.value_loss is not None  # a critic's algorithm (PPO) registers a value loss
        value = value_step(trainer.critic, objective.value_loss, mb, processes * share, autocast(trainer))
        stats.value_loss, stats.value_clip_fraction = share * value.loss.item(), share * float(value.clip_fraction)
    return stats


def reference_logprobs(trainer: Trainer, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """log pi_ref of each target under the frozen reference (with LoRA: the policy, adapters off)."""
    policy, reference = trainer.policy, trainer.reference
    assert reference is not None  # asked for only where the trainer holds one (micro_step's use_reference)
    adapters_off: contextlib.AbstractContextManager = contextlib.nullcontext()
    if reference is policy:
        assert is_adapted(policy)  # the reference is the policy itself only with LoRA (load_reference)
        adapters_off = policy.disable_adapter()
    with torch.no_grad(), adapters_off:
        chunk_tokens = trainer.spec.trainer.logit_chunk_tokens
        return completion_logprobs_and_entropy(reference, mb, temperature, chunk_tokens, precision=autocast(trainer))[0]


def optimizer_step(trainer: Trainer, stats: OptimizerStepStats, iteration: int) -> None:
    """Clip the policy's gradients (and the critic's) to trainer.max_grad_norm and step, recording the norms
    in `stats`; a non-finite loss or norm raises NonFiniteLossError before anything moves."""
    max_norm = trainer.spec.trainer.max_grad_norm
    stats.grad_norm = float(clip_grad_norm(trainer.policy, max_norm))
    if trainer.critic is not None:
        stats.critic_grad_norm = float(clip_grad_norm(trainer.critic.model, max_norm))
    finite = [stats.loss, stats.value_loss or 0.0, stats.grad_norm, stats.critic_grad_norm or 0.0]
    if not all(math.isfinite(value) for value in finite):
        raise NonFiniteLossError(
            f"iteration {iteration}: loss {stats.loss} / grad norm {stats.grad_norm} is not finite; "
            "nothing was published. Lower trainer.lr or trainer.max_grad_norm, or check the reward "
            "functions for extreme values; then run again: the loop resumes from the last version."
        )
    trainer.optimizer.step()
    if trainer.critic is not None:
        assert trainer.critic.optimizer is not None  # the trainer's critic is a trained one (load_critic trainable)
        trainer.critic.optimizer.step()
