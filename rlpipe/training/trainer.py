"""update: one iteration of policy-gradient training on the batch; stages weights v(N+1).

Mini-batches (PPO style): the batch is shuffled and split into `trainer.mini_batches`
optimizer steps per epoch. The sampler's log-probs are pi_old, so no extra forward pass
is spent recomputing them; unless algorithm.off_policy_correction (on for asynchronous runs) asks
for the decoupled loss: then one no-grad pass first computes pi_prox, the log-probs under the weights
the update starts from, and the sampler's become the behaviour policy of the importance weights
(rlpipe.algorithms.policy_gradient.behaviour_weights).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlpipe.algorithms import get_algorithm, needs_critic, resolve_options
from rlpipe.algorithms.dpo import pair_micro_batches, paired_rows
from rlpipe.algorithms.policy_gradient import aggregate, behaviour_weights
from rlpipe.devices import resolve_device
from rlpipe.modeling import add_lora, is_adapted, load_weights
from rlpipe.rollouts import read_table
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, move, optimizer_uri
from rlpipe.store.weights import WeightRef, as_ref, read_ref, seal, stage_pretrained
from rlpipe.training.critic import Critic, load_critic, save_critic, token_values
from rlpipe.training.distributed import (
    all_max,
    all_sum,
    full_model_state,
    full_optimizer_state,
    init_from_torchrun,
    load_optimizer_state,
    shard,
    world,
)

if TYPE_CHECKING:  # transformers is imported through rlpipe.modeling (rlpipe.optional_imports)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


STANDARD_STATS = {"loss", "clip_fraction", "kl", "entropy", "grad_norm", "ratio"}  # reported under their own names


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient went NaN/inf; nothing was published."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(target_t | prefix) under softmax(logits / T), for each position."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs, and the entropy H_t = -sum_v p_v log p_v of each position (with a gradient
    only for an entropy bonus), from one log-softmax over the vocabulary."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


PER_TOKEN = {  # row column -> packed name
    "logprobs": "old_logprobs",
    "ref_logprobs": "ref_logprobs",  # offline DPO: the reference's, computed once
    "token_advantages": "advantages",  # a critic's (PPO), with:
    "returns": "returns",
    "values": "old_values",
    "proximal_logprobs": "proximal_logprobs",  # the update's starting weights' (off_policy_correction)
}


def pack(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion; tensors aligned to next-token targets (length L-1).

    completion_mask[t] = 1 where target t is a completion token; the per-token columns the rows
    have (PER_TOKEN: sampler log-probs, stored reference log-probs, a critic's advantages, returns
    and values) are laid out on those positions. Without token_advantages, `advantages` is one per
    row (0 before the advantages step).
    """
    width = max(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, width - 1))
    per_token = {name: torch.zeros((n, width - 1)) for column, name in PER_TOKEN.items() if column in rows[0]}
    for i, row in enumerate(rows):
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        sequence = prompt + completion
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        attention[i, : len(sequence)] = 1
        start = len(prompt) - 1  # target index of the first completion token
        completion_mask[i, start : start + len(completion)] = 1
        for column, name in PER_TOKEN.items():
            if name in per_token:
                per_token[name][i, start : start + len(completion)] = torch.tensor(row[column])
    if "advantages" not in per_token:
        per_token["advantages"] = torch.tensor([row.get("advantage", 0.0) for row in rows], dtype=torch.float32)
    return {"input_ids": input_ids, "attention": attention, "completion_mask": completion_mask} | per_token


@dataclass
class Trainer:
    """What training holds between optimizer steps: the policy at `weights`, its optimizer, the
    frozen reference (when the KL is used; with LoRA the policy itself, adapters disabled), the
    sealed base its adapters apply to (LoRA), the critic at the same version (PPO), and the spec
    it was built for."""

    spec: RunSpec
    run_root: str
    weights: WeightRef
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    reference: PreTrainedModel | None
    base: WeightRef | None = None
    critic: Critic | None = None
    # pi_prox computed ahead for the next batch: {"sha256": of the weights, "logprobs": {sequence_key: [...]}}
    proximal: dict = field(default_factory=dict)


def load_trainer(spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str) -> Trainer:
    """The policy at `weights` with the optimizer state saved beside that version."""
    weights = as_ref(weights)
    sharded = init_from_torchrun(resolve_device(spec.trainer.device))[1] > 1  # before loading: picks the GPU
    policy, tokenizer = load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device, trainable=True)
    base = None
    if spec.model.lora is not None:
        base = read_ref(run_root, 0)
        if not is_adapted(policy):  # v0: the adapters start here
            policy = add_lora(policy, spec.model.lora)
    policy.train()
    if spec.trainer.gradient_checkpointing:  # only while training: sampling in eval mode keeps its KV cache
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard(policy, policy.device)
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the adapters
    optimizer = torch.optim.AdamW(
        trained, lr=spec.trainer.lr, betas=spec.trainer.betas, weight_decay=spec.trainer.weight_decay
    )
    fs, opt_path = filesystem(optimizer_uri(run_root, weights["version"]))
    if fs.exists(opt_path):
        with fs.open(opt_path, "rb") as f:
            load_optimizer_state(policy, optimizer, torch.load(f, weights_only=True, map_location=policy.device))
    reference = None
    wants_reference = spec.algorithm.kl_coef > 0 or spec.algorithm.track_reference_kl
    wants_reference |= "reference" in get_algorithm(spec.algorithm.name).needs  # online DPO's loss
    if wants_reference and base is not None:
        reference = policy  # the base = the policy with its adapters disabled: no second copy
    elif wants_reference:
        reference, _ = load_weights(read_ref(run_root, 0), cache_root, spec.trainer.threads, spec.trainer.device)
        reference.eval().requires_grad_(False)
        if sharded:
            shard(reference, reference.device)
    critic = None
    if needs_critic(spec):
        critic = load_critic(spec, run_root, weights["version"], cache_root, trainable=True, sharded=sharded)
    return Trainer(spec, run_root, weights, policy, tokenizer, optimizer, reference, base, critic)


def micro_batches(rows: list[dict], budget: int | None) -> list[list[dict]]:
    """A mini-batch's rows in groups whose padded size (rows x longest sequence) fits `budget`
    tokens (trainer.micro_batch_tokens); a row longer than the budget goes alone. Rows are sorted
    by length first, so little of each group is padding. budget None: one group."""
    if budget is None:
        return [rows]
    groups: list[list[dict]] = [[]]
    width = 0
    for row in sorted(rows, key=lambda r: len(r["prompt_token_ids"]) + len(r["completion_token_ids"])):
        length = len(row["prompt_token_ids"]) + len(row["completion_token_ids"])
        if groups[-1] and max(width, length) * (len(groups[-1]) + 1) > budget:
            groups.append([])
            width = 0
        groups[-1].append(row)
        width = max(width, length)
    return groups


def micro_batch_weight(mb: dict[str, torch.Tensor], rows: int, tokens: float, aggregation: str) -> float:
    """The share w_j of micro-batch j in its mini-batch's loss, so that sum_j w_j L_j = L:
        sequence_mean, sequence_sum  w_j = n_j / n          (n: sequences)
        token_mean                   w_j = T_j / T          (T: completion tokens)
    Gradients accumulate as sum_j w_j grad L_j = grad L: the one-pass update."""
    if aggregation in ("sequence_mean", "sequence_sum"):
        return len(mb["advantages"]) / rows
    return float(mb["completion_mask"].sum()) / max(tokens, 1.0)


def rank_parts(mini: list[dict], budget: int | None, pairs: bool) -> list[tuple[list[dict], float]]:
    """This process's micro-batches of a mini-batch, as (rows, weight 1.0 or 0.0). Every process forms
    the same micro-batches (FSDP's collectives line up) and takes every world-th row (pair) of each;
    one with no row of a micro-batch computes that micro-batch's first row with weight 0."""
    rank, processes = world()
    unit = 2 if pairs else 1  # rows that stay together
    split = pair_micro_batches if pairs else micro_batches
    parts = []
    for group in split(mini, budget * processes if budget else None):
        part = [r for k in range(rank * unit, len(group), processes * unit) for r in group[k : k + unit]]
        parts.append((part or group[:unit], float(bool(part))))
    return parts


def sequence_key(row: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a completion's log-probs depend on: its prompt and completion token ids."""
    return tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"])


@torch.no_grad()
def completion_logprobs(
    model: PreTrainedModel, rows: list[dict], pad_id: int, temperature: float, bf16: bool = False
) -> list[list[float]]:
    """log pi(token | prefix) of each row's completion tokens after its prompt (rows with prompt_token_ids
    and completion_token_ids), as the update computes them: right-padded, softmax(logits / T) in fp32;
    one no-grad forward pass over `rows`."""
    mb = pack(rows, pad_id)
    input_ids = mb["input_ids"].to(model.device)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, attention_mask=mb["attention"].to(model.device)).logits[:, :-1]
    logprobs = token_logprobs(logits, input_ids[:, 1:], temperature).cpu()
    found = []
    for i, row in enumerate(rows):
        start = len(row["prompt_token_ids"]) - 1
        found.append(logprobs[i, start : start + len(row["completion_token_ids"])].tolist())
    return found


def policy_logprobs(trainer: Trainer, rows: list[dict]) -> list[list[float]]:
    """completion_logprobs under the trainer's policy as it stands, with its precision."""
    spec = trainer.spec
    bf16 = spec.trainer.dtype == "bfloat16"
    return completion_logprobs(trainer.policy, rows, trainer.tokenizer.pad_token_id, spec.rollout.temperature, bf16)


def attach_proximal_logprobs(trainer: Trainer, minis: list[list[dict]]) -> float:
    """row["proximal_logprobs"]: log pi_prox of each completion token under the weights the update starts
    from, for the rows this process trains on, before the first optimizer step. Rows the resident trainer
    computed ahead at these weights (trainer.proximal, one process) are not computed again; returns the
    fraction that were."""
    budget = trainer.spec.trainer.micro_batch_tokens
    cache = trainer.proximal
    known = cache.get("logprobs", {}) if cache.get("sha256") == trainer.weights["sha256"] and world()[1] == 1 else {}
    reused = total = 0
    for mini in minis:
        for part, _ in rank_parts(mini, budget, pairs=False):
            missing = [row for row in part if sequence_key(row) not in known]
            computed = dict(zip(map(sequence_key, missing), policy_logprobs(trainer, missing))) if missing else {}
            for row in part:
                key = sequence_key(row)
                row["proximal_logprobs"] = known[key] if key in known else computed[key]
            total += len(part)
            reused += len(part) - len(missing)
    return reused / max(total, 1)


def train_on_batch(trainer: Trainer, batch_path: str, iteration: int) -> dict[str, float]:
    """One iteration of mini-batch steps on the batch; the trainer's policy and optimizer move on
    in place. Each mini-batch is one optimizer step; within it, micro-batches of at most
    trainer.micro_batch_tokens accumulate their gradients. Raises NonFiniteLossError before the step
    that would apply a NaN/inf gradient."""
    spec, policy, optimizer, reference = trainer.spec, trainer.policy, trainer.optimizer, trainer.reference
    critic = trainer.critic
    algorithm = get_algorithm(spec.algorithm.name)
    options = resolve_options(spec)  # the algorithm's defaults for what the spec leaves unset
    aggregation = options.loss_aggregation or "sequence_mean"
    started = time.time()
    device = policy.device
    rank, processes = world()
    # bf16 compute, fp32 master weights: autocast runs the matmuls in bf16, the parameters, their
    # gradients and AdamW's moments stay fp32, and log-probs are taken in fp32 (token_logprobs)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.trainer.dtype == "bfloat16")
    rows = read_table(batch_path).to_pylist()
    pairs = "pairs" in algorithm.needs  # DPO: [chosen, rejected] pairs, kept together (rlpipe.algorithms.dpo)
    if pairs:
        rows = paired_rows(rows, spec.seed * 1_000_003 + iteration)
        if not rows:
            return {"policy/optimizer_steps": 0.0, "policy/pairs": 0.0}
    else:
        random.Random(spec.seed * 1_000_003 + iteration).shuffle(rows)
    temperature = spec.rollout.temperature
    totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "ratio": 0.0}
    if critic is not None:
        totals |= {"value_loss": 0.0, "value_clip_fraction": 0.0, "critic_grad_norm": 0.0}
    steps = kl_steps = micro_steps = 0
    tokens = 0
    size = math.ceil(len(rows) / spec.trainer.mini_batches)
    size += size % 2 if pairs else 0
    steps_per_iteration = spec.trainer.epochs * math.ceil(len(rows) / size)
    correction = options.off_policy_correction
    cut = {"truncate": "truncated_fraction", "mask": "masked_fraction"}.get(correction)
    off_policy = {"is_weight_mean": 0.0, cut: 0.0} if cut else {}
    weight_max = 0.0
    if off_policy:
        prefetched = attach_proximal_logprobs(
            trainer, [rows[start : start + size] for start in range(0, len(rows), size)]
        )
    proximal_s = time.time() - started
    for _ in range(spec.trainer.epochs):
        for start in range(0, len(rows), size):
            # linear warmup: lr_s = lr * min(1, (s + 1) / warmup), s = optimizer steps so far in the run
            global_step = (iteration - 1) * steps_per_iteration + steps
            warmup = min(1.0, (global_step + 1) / max(spec.trainer.warmup_steps, 1))
            for group in optimizer.param_groups:
                group["lr"] = spec.trainer.lr * warmup
            if critic is not None:
                for group in critic.optimizer.param_groups:
                    group["lr"] = options.critic_lr * warmup
                critic.optimizer.zero_grad(set_to_none=True)
            mini = rows[start : start + size]
            completion_tokens = float(sum(len(r["completion_token_ids"]) for r in mini))
            budget = spec.trainer.micro_batch_tokens
            # The frozen reference costs a forward pass: every mini-batch when the KL is in the loss;
            # when it is only tracked (kl_coef 0), the iteration's first mini-batch estimates kl/mean.
            use_reference = reference is not None and (
                options.kl_coef > 0 or steps == 0 or "reference" in algorithm.needs
            )
            kl_measured = use_reference
            optimizer.zero_grad(set_to_none=True)
            step = {key: 0.0 for key in totals | off_policy}
            # gradients scale by `processes`: FSDP averages them over the processes
            for part, present in rank_parts(mini, budget, pairs):
                mb = {k: v.to(device) for k, v in pack(part, trainer.tokenizer.pad_token_id).items()}
                weight = present * micro_batch_weight(mb, len(mini), completion_tokens, aggregation)
                share = present * float(mb["completion_mask"].sum()) / max(completion_tokens, 1.0)  # of token means
                targets = mb["input_ids"][:, 1:]
                with autocast:
                    logits = policy(input_ids=mb["input_ids"], attention_mask=mb["attention"]).logits[:, :-1]
                logprobs, entropy = token_logprobs_and_entropy(logits, targets, temperature, options.entropy_coef > 0)
                ref_logprobs = mb.get("ref_logprobs")  # computed once (offline DPO), else the reference's
                kl_measured |= ref_logprobs is not None
                if use_reference and ref_logprobs is None:
                    adapters_off = policy.disable_adapter() if reference is policy else contextlib.nullcontext()
                    with torch.no_grad(), autocast, adapters_off:
                        ref_logits = reference(input_ids=mb["input_ids"], attention_mask=mb["attention"]).logits
                    ref_logprobs = token_logprobs(ref_logits[:, :-1], targets, temperature)
                old_logprobs, advantages = mb["old_logprobs"], mb["advantages"]
                if off_policy:  # decoupled: the ratio to pi_prox, the advantage weighted by pi_prox / pi_behaviour
                    weights, is_stats = behaviour_weights(
                        mb["proximal_logprobs"], old_logprobs, mb["completion_mask"], correction,
                        options.is_threshold, options.is_level,
                    )  # fmt: skip
                    advantages = (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages) * weights
                    old_logprobs = mb["proximal_logprobs"]
                    weight_max = max(weight_max, is_stats.pop("is_weight_max"))
                    for key, value in is_stats.items():
                        step[key] += share * value
                loss, stats = algorithm.loss(
                    logprobs, old_logprobs, advantages, mb["completion_mask"], ref_logprobs, options
                )
                if options.entropy_coef:  # L - c H, H aggregated as the loss is
                    mask_f = mb["completion_mask"].to(entropy.dtype)
                    loss = loss - options.entropy_coef * aggregate(
                        entropy, mask_f, aggregation, options.length_norm or 1
                    )
                    entropy = entropy.detach()
                (processes * weight * loss).backward()
                if critic is not None:  # the value loss is a token mean: micro-batch j weighs T_j / T
                    with autocast:
                        values = token_values(critic.model, mb["input_ids"], mb["attention"])
                    value_loss, value_stats = algorithm.value_loss(
                        values, mb["old_values"], mb["returns"], mb["completion_mask"], options.value_clip
                    )
                    (processes * share * value_loss).backward()
                    step["value_loss"] += share * value_loss.item()
                    step["value_clip_fraction"] += share * float(value_stats["value_clip_fraction"])
                mask = mb["completion_mask"]  # entropy: averaged over completion tokens
                step["entropy"] += share * float((entropy * mask).sum() / mask.sum().clamp(min=1))
                step["loss"] += weight * loss.item()
                for key in ("clip_fraction", "ratio") + (("kl",) if kl_measured else ()):
                    step[key] += share * float(stats[key])
                for key in stats.keys() - STANDARD_STATS:  # the algorithm's own (DPO: preference_accuracy, ...)
                    step[key] = step.get(key, 0.0) + weight * float(stats[key])
                tokens += int(present * mb["attention"].sum())
                micro_steps += 1
            step = all_sum(step, device)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), spec.trainer.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if critic is not None:
                critic_norm = torch.nn.utils.clip_grad_norm_(critic.model.parameters(), spec.trainer.max_grad_norm)
                critic_norm = critic_norm.full_tensor() if hasattr(critic_norm, "full_tensor") else critic_norm
                step["critic_grad_norm"] = float(critic_norm)
            finite = [step["loss"], step.get("value_loss", 0.0), float(grad_norm), step.get("critic_grad_norm", 0.0)]
            if not all(math.isfinite(value) for value in finite):
                raise NonFiniteLossError(
                    f"iteration {iteration}: loss {step['loss']} / grad norm {grad_norm.item()} is not finite; "
                    "nothing was published. Lower trainer.lr or trainer.max_grad_norm, or check the reward "
                    "functions for extreme values; then run again: the loop resumes from the last version."
                )
            optimizer.step()
            if critic is not None:
                critic.optimizer.step()
            step["grad_norm"] = float(grad_norm)
            for key, value in step.items():
                totals[key] = totals.get(key, 0.0) + value
            kl_steps += int(kl_measured)
            steps += 1
    trained = time.time()
    tokens = int(all_sum({"tokens": tokens}, device)["tokens"])
    critic_metrics = {}
    if critic is not None:
        critic_metrics = {
            "critic/value_loss": totals["value_loss"] / steps,
            "critic/value_clip_fraction": totals["value_clip_fraction"] / steps,
            "critic/grad_norm": totals["critic_grad_norm"] / steps,
        }
    if off_policy:
        critic_metrics |= {f"off_policy/{key}": totals[key] / steps for key in off_policy}
        critic_metrics |= {
            "off_policy/is_weight_max": all_max(weight_max, device),
            "off_policy/proximal_pass_s": proximal_s,
            "off_policy/proximal_prefetched_fraction": prefetched,
        }
    return (
        critic_metrics
        | {
            "policy/loss": totals["loss"] / steps,
            "policy/clip_fraction": totals["clip_fraction"] / steps,
            "policy/entropy": totals["entropy"] / steps,
            "policy/grad_norm": totals["grad_norm"] / steps,
            "policy/ratio_mean": totals["ratio"] / steps,
            "kl/mean": totals["kl"] / max(kl_steps, 1),
            "policy/optimizer_steps": float(steps),
            "policy/micro_batches": float(micro_steps),
            "policy/lr": optimizer.param_groups[0]["lr"],
            "throughput/update_tokens_per_s": tokens / max(trained - started, 1e-9),
        }
        | {f"policy/{key}": totals[key] / steps for key in totals.keys() - STANDARD_STATS - off_policy.keys()}
        | ({"policy/pairs": len(rows) / 2} if pairs else {})
    )


def save_trained(trainer: Trainer, iteration: int, cache_root: str) -> WeightRef:
    """Stage and seal v(N+1) and save its optimizer state beside it; the trainer now holds v(N+1).
    Sharded over several processes, the whole weights and optimizer state are gathered and the
    first process writes them (the others get its WeightRef)."""
    run_root, weights = trainer.run_root, trainer.weights
    rank, processes = world()
    new_version = weights["version"] + 1
    if processes > 1:  # collectives: every process takes part
        model_state = full_model_state(trainer.policy)
        optimizer_state = full_optimizer_state(trainer.policy, trainer.optimizer)
    else:
        model_state, optimizer_state = None, trainer.optimizer.state_dict()
    ref: WeightRef | None = None
    if rank == 0:
        staged = stage_pretrained(
            run_root, new_version, trainer.policy, trainer.tokenizer, cache_root, model_state, trainer.base
        )
        ref = seal(staged, version=new_version, iteration=iteration, parent=weights["version"])
        final_opt = optimizer_uri(run_root, new_version)
        fs, tmp_path = filesystem(final_opt + ".tmp")
        fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(tmp_path, "wb") as f:
            torch.save(optimizer_state, f)
        move(final_opt + ".tmp", final_opt)
    if trainer.critic is not None:
        save_critic(trainer.critic, run_root, iteration)
    if processes > 1:
        shared = [ref]
        torch.distributed.broadcast_object_list(shared, src=0)
        ref = shared[0]
    trainer.weights = ref
    return ref


def update_policy(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """Train on the batch from weights v(N) in this process (or, with trainer.gpus > 1, in that many
    torchrun processes); stage v(N+1) and its optimizer state."""
    if spec.trainer.gpus > 1 and "RANK" not in os.environ:
        from rlpipe.training.distributed import update_in_processes

        return update_in_processes(spec, run_root, weights, batch_path, iteration, cache_root)
    t0 = time.time()
    trainer = load_trainer(spec, run_root, weights, cache_root)
    loaded = time.time()
    metrics = train_on_batch(trainer, batch_path, iteration)
    trained = time.time()
    ref = save_trained(trainer, iteration, cache_root)
    done = time.time()
    return ref, metrics | {
        "overhead/update_load_s": loaded - t0,
        "time/update_s": done - loaded,
        "weights/stage_s": done - trained,  # within time/update_s
    }
