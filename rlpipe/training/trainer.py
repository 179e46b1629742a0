"""update: one iteration of policy-gradient training on the batch; stages weights v(N+1).

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
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlpipe.algorithms import PolicyInputs, get_algorithm, needs_critic, resolve_options
from rlpipe.algorithms.policy_gradient import aggregate
from rlpipe.metric_keys import OPTIMIZER_STEPS, UPDATE_LOAD, UPDATE_TIME
from rlpipe.models.devices import resolve_device
from rlpipe.models.loading import add_lora, disable_dropout, is_adapted, load_weights
from rlpipe.rollouts import read_table
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, optimizer_uri
from rlpipe.store.weights import WeightRef, as_weight_ref, read_weight_ref
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
from rlpipe.training.checkpoints import find_replay, load_sealed, matches_sealed, save_state
from rlpipe.training.critic import load_critic, save_critic, value_step
from rlpipe.training.distributed import (
    clip_grad_norm,
    full_model_state,
    init_from_torchrun,
    load_optimizer_state,
    shard,
    update_in_processes,
    world,
)
from rlpipe.training.logprobs import completion_logprobs_and_entropy
from rlpipe.training.off_policy import (
    Correction,
    attach_proximal_logprobs,
    decoupled,
    mismatch_differences,
    sampled_by,
)
from rlpipe.training.sealing import load_masters, seal_new_version, served_from_version, stores_serving_copy
from rlpipe.training.state import Trainer
from rlpipe.training.tally import OptimizerStepStats, Tally, update_metrics

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from rlpipe.algorithms.policy_gradient import Aggregation
    from rlpipe.algorithms.registry import PolicyLoss, ValueLoss


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient went NaN/inf; nothing was published."""


def load_trainer(spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str) -> Trainer:
    """The trainer at `weights`: the policy with the optimizer state saved beside that version, or,
    where it was not saved (storage.optimizer_every), at the last checkpoint with the updates since
    replayed from their recorded batches (rlpipe.training.checkpoints)."""
    weights = as_weight_ref(weights)
    replay = find_replay(spec, run_root, weights["version"])
    if replay is None:
        return load_checkpoint(spec, run_root, weights, cache_root)
    if replay.checkpoint == 0:  # the run's start: v0's weights, a fresh optimizer
        trainer = load_checkpoint(spec, run_root, read_weight_ref(run_root, 0), cache_root)
    else:  # v(N)'s files for the model's shape and tokenizer; the checkpoint's masters replace every weight
        trainer = load_checkpoint(spec, run_root, weights, cache_root, state_version=replay.checkpoint)
        trainer.weights = {**weights, "version": replay.checkpoint}
    for version, iteration, batch in replay.updates:
        train_on_batch(trainer, batch, iteration)
        trainer.weights = {**trainer.weights, "version": version}
    exact = matches_sealed(trainer, weights, cache_root)
    if not exact:  # continue from the weights the samplers hold, with the replayed moments
        load_sealed(trainer, weights, cache_root)
    trainer.weights = weights
    if world()[0] == 0:
        trainer.served = served_from_version(spec, weights, cache_root)
    trainer.replayed = {"trainer/replayed_updates": float(len(replay.updates)), "trainer/replay_exact": float(exact)}
    return trainer


def load_checkpoint(
    spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str, state_version: int | None = None
) -> Trainer:
    """The policy at `weights` with the trainer's state saved beside that version (or beside
    v(state_version)): its fp32 master weights, when saved (a serving-copy version, or a resident
    trainer's checkpoint), and its optimizer state (fresh where none was)."""
    weights = as_weight_ref(weights)
    state_version = weights["version"] if state_version is None else state_version
    sharded = init_from_torchrun(resolve_device(spec.trainer.device))[1] > 1  # before loading: picks the GPU
    policy, tokenizer = load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device, trainable=True)
    load_masters(run_root, state_version, policy)  # train on the masters a serving copy was cast from
    served = None
    if stores_serving_copy(spec) and state_version == weights["version"] and world()[0] == 0:
        served = served_from_version(spec, weights, cache_root)
    base = None
    if spec.model.lora is not None:
        base = read_weight_ref(run_root, 0)
        if not is_adapted(policy):  # v0: the adapters start here
            policy = add_lora(policy, spec.model.lora)
    policy.train()
    if spec.trainer.disable_dropout:
        disable_dropout(policy)
    if spec.trainer.gradient_checkpointing:  # only while training: sampling in eval mode keeps its KV cache
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard(policy, policy.device)
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the adapters
    optimizer = torch.optim.AdamW(
        trained, lr=spec.trainer.lr, betas=spec.trainer.betas, weight_decay=spec.trainer.weight_decay
    )
    fs, opt_path = filesystem(optimizer_uri(run_root, state_version))
    if fs.exists(opt_path):
        with fs.open(opt_path, "rb") as f:
            load_optimizer_state(policy, optimizer, torch.load(f, weights_only=True, map_location=policy.device))
    reference = None
    wants_reference = spec.algorithm.kl_coef > 0 or spec.algorithm.track_reference_kl
    wants_reference |= "reference" in get_algorithm(spec.algorithm.name).needs  # online DPO's loss
    if wants_reference and base is not None:
        reference = policy  # the base = the policy with its adapters disabled: no second copy
    elif wants_reference:
        reference, _ = load_weights(read_weight_ref(run_root, 0), cache_root, spec.trainer.threads, spec.trainer.device)
        reference.eval().requires_grad_(False)
        if sharded:
            shard(reference, reference.device)
    critic = None
    if needs_critic(spec):
        critic = load_critic(spec, run_root, weights["version"], cache_root, trainable=True, sharded=sharded)
    trainer = Trainer(spec, run_root, weights, policy, tokenizer, optimizer, reference, base, critic, served=served)
    trainer.packed = packs_rows(trainer)
    return trainer


def packs_rows(trainer: Trainer) -> bool:
    """trainer.padding_free for this trainer: when asked, every model (policy, reference, critic) gets
    rlpipe.training.packed_attention's attention. Raises ValueError when one cannot attend within packed rows."""
    from rlpipe.training.packed_attention import packable, use_packed_attention

    if not trainer.spec.trainer.padding_free:
        return False
    models = [trainer.policy, trainer.reference, trainer.critic.model if trainer.critic else None]
    models = [m for m in models if m is not None]
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
    advantages, old_logprobs, is_stats = mb.advantages, mb.old_logprobs, {}
    if objective.correction is not None:
        advantages, old_logprobs, is_stats = decoupled(mb, objective.correction)
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
        value = value_step(trainer.critic, objective.value_loss, mb, processes * share, autocast(trainer))
        stats.value_loss, stats.value_clip_fraction = share * value.loss.item(), share * float(value.clip_fraction)
    return stats


def reference_logprobs(trainer: Trainer, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """log pi_ref of each target under the frozen reference (with LoRA: the policy, adapters off)."""
    policy, reference = trainer.policy, trainer.reference
    adapters_off = policy.disable_adapter() if reference is policy else contextlib.nullcontext()
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
        trainer.critic.optimizer.step()


def save_trained(
    trainer: Trainer, iteration: int, cache_root: str, timings: dict | None = None, batch_path: str | None = None
) -> WeightRef:
    """Stage and seal v(N+1) and write the trainer's state beside it when a checkpoint is due
    (rlpipe.training.checkpoints: every version, or every storage.optimizer_every in the resident
    trainer, which records `batch_path` for replay and writes in the background); the trainer now
    holds v(N+1). Sharded over several processes, the whole weights and optimizer state are gathered
    and the first process writes them (the others get its WeightRef)."""
    run_root, weights = trainer.run_root, trainer.weights
    rank, processes = world()
    new_version = weights["version"] + 1
    model_state = full_model_state(trainer.policy) if processes > 1 else None  # a collective: every process
    sealed = seal_new_version(trainer, iteration, cache_root, model_state) if rank == 0 else None
    staged_at = time.time()
    save_state(trainer, new_version, iteration, model_state, batch_path)
    if timings is not None:
        timings["weights/stage_optimizer_s"] = time.time() - staged_at  # AdamW state (and masters); the rest: v(N+1)
    if trainer.critic is not None:
        save_critic(trainer.critic, run_root, iteration)
    if processes > 1:
        shared = [sealed]
        torch.distributed.broadcast_object_list(shared, src=0)
        sealed = shared[0]
    trainer.weights = sealed
    return sealed


def update_policy(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """Train on the batch from weights v(N) in this process (or, with trainer.gpus > 1, in that many
    torchrun processes); stage v(N+1) and its optimizer state."""
    if spec.trainer.gpus > 1 and "RANK" not in os.environ:
        return update_in_processes(spec, run_root, weights, batch_path, iteration, cache_root)
    t0 = time.time()
    trainer = load_trainer(spec, run_root, weights, cache_root)
    loaded = time.time()
    metrics = train_on_batch(trainer, batch_path, iteration)
    trained = time.time()
    timings: dict[str, float] = {}
    sealed = save_trained(trainer, iteration, cache_root, timings)
    done = time.time()
    return sealed, metrics | timings | {
        UPDATE_LOAD: loaded - t0,
        UPDATE_TIME: done - loaded,
        "weights/stage_s": done - trained,  # within time/update_s
    }


def main(argv: list[str] | None = None) -> None:
    """One torchrun process of update_in_processes: `python -m rlpipe.training.trainer REQUEST`."""
    import json
    import sys

    from rlpipe.spec import parse_spec

    with open((argv or sys.argv[1:])[0]) as f:
        request = json.load(f)
    spec = parse_spec(request["spec"])
    staged, metrics = update_policy(
        spec,
        request["run_root"],
        request["weights"],
        request["batch_path"],
        request["iteration"],
        request["cache_root"],
    )
    if world()[0] == 0:
        with open(request["result"], "w") as f:
            json.dump({"staged": staged, "metrics": metrics}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
