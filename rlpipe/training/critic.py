"""The critic (PPO's value model): a token-classification head with one output on the policy's
architecture, V_t = w . h_t + b at each position, started from the warm-start policy v0 with w = b = 0
(so every first advantage is the reward itself, and no random head adds noise).

Its versions are their own lineage in the weight store (critic/v{N}/, its AdamW state in
critic/optimizer/v{N}.pt): critic v(N) was trained beside policy v(N). Critic v0 is not stored: it is
v0's backbone with the zero head, rebuilt when needed. The update publishes critic v(N+1) itself,
before sync_weights commits iteration N+1: nothing outside the trainer reads critic versions, the
values step of iteration N+1 reads critic v(N) (committed with iteration N), and a rerun of an
iteration overwrites the critic version a killed attempt left.

The values step (`compute_values`) records V_t of every completion token of the iteration's rollouts
under critic v(N), the V_old of the clipped value loss and GAE's input.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlpipe.metric_keys import VALUES_LOAD, VALUES_TIME
from rlpipe.models.devices import resolve_device
from rlpipe.models.loading import configure_torch, disable_dropout
from rlpipe.rollouts import read_table, write_table
from rlpipe.store.run_root import filesystem, is_local, move, optimizer_uri
from rlpipe.store.weights import WeightRef, local_path, publish, read_weight_ref, seal, staging_uri
from rlpipe.training.batching import MicroBatch, micro_batches, pack, token_budget, window_column
from rlpipe.training.distributed import full_model_state, full_optimizer_state, load_optimizer_state, shard, world
from rlpipe.training.logprobs import model_inputs, window_of

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from transformers import PreTrainedModel

    from rlpipe.algorithms.registry import ValueLoss, ValueTerms
    from rlpipe.spec import RunSpec


@dataclass
class Critic:
    """The value model at `version` (of the critic lineage) and its optimizer (None: inference only)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer | None
    version: int


def critic_from_policy(policy_dir: str) -> PreTrainedModel:
    """The policy's backbone with a zero value head (one output, no dropout)."""
    from transformers import AutoConfig, AutoModelForTokenClassification, logging

    config = AutoConfig.from_pretrained(policy_dir, num_labels=1)
    config.classifier_dropout = 0.0
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "score.weight newly initialized": it is, on purpose (zeroed below)
    try:
        model = AutoModelForTokenClassification.from_pretrained(policy_dir, config=config)
    finally:
        logging.set_verbosity(verbosity)
    torch.nn.init.zeros_(model.score.weight)
    if model.score.bias is not None:
        torch.nn.init.zeros_(model.score.bias)
    return model


def load_critic(
    spec: RunSpec, run_root: str, version: int, cache_root: str, trainable: bool, sharded: bool = False
) -> Critic:
    """Critic v(version) onto trainer.device (v0: built from policy v0), with its optimizer state
    when `trainable`."""
    from transformers import AutoModelForTokenClassification

    from rlpipe.algorithms import resolve_options

    configure_torch(spec.trainer.threads)
    device = resolve_device(spec.trainer.device)
    if version == 0:
        base = read_weight_ref(run_root, 0)
        model = critic_from_policy(local_path(base, cache_root))  # v0 is full weights, also under model.lora
    else:
        critic_weights = read_weight_ref(run_root, version, "critic")
        model = AutoModelForTokenClassification.from_pretrained(local_path(critic_weights, cache_root))
    # transformers wraps PreTrainedModel.to with functools.wraps(Module.to): mypy then sees an unbound `self`
    model = model.to(device)  # type: ignore[arg-type]
    model.train(trainable).requires_grad_(trainable)
    if not trainable:
        return Critic(model, None, version)
    if spec.trainer.disable_dropout:
        disable_dropout(model)
    if spec.trainer.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard(model, device)
    critic_lr = resolve_options(spec).critic_lr
    assert critic_lr is not None  # a critic's algorithm (PPO) has critic_lr: resolve_options fills it from trainer.lr
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=critic_lr,
        betas=spec.trainer.betas,
        weight_decay=spec.trainer.weight_decay,
    )
    fs, path = filesystem(optimizer_uri(run_root, version, "critic"))
    if version > 0 and fs.exists(path):
        with fs.open(path, "rb") as f:
            load_optimizer_state(model, optimizer, torch.load(f, weights_only=True, map_location=device))
    return Critic(model, optimizer, version)


def token_values(model: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """V at each position of `mb`'s window: [B, T], aligned with the policy's log-probs (position p
    holds the value of the prefix up to p, before token p + 1 is chosen)."""
    return window_of(model(**model_inputs(mb)).logits[..., 0], mb).float()


def value_step(
    critic: Critic, value_loss: ValueLoss, mb: MicroBatch, scale: float, autocast: AbstractContextManager
) -> ValueTerms:
    """The critic's forward and backward pass on one micro-batch: its value loss (a token mean) with its
    gradient scaled by `scale` (processes x the micro-batch's share T_j / T of the mini-batch's tokens)."""
    with autocast:
        values = token_values(critic.model, mb)
    assert mb.old_values is not None and mb.returns is not None  # a critic's rows: the values step's and returns
    terms = value_loss(values, mb.old_values, mb.returns, mb.completion_mask)
    (scale * terms.loss).backward()
    return terms


def compute_values(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    scored_path: str,
    out_path: str,
    cache_root: str,
    critic: Critic | None = None,
) -> dict[str, float]:
    """The values step: add a `values` column (V_t of each completion token, under critic v(N)) to the
    scored rollouts. `critic`: the resident trainer's; else critic v(N) is loaded here."""
    started = time.time()
    version = int(weights["version"])
    if critic is None:
        critic = load_critic(spec, run_root, version, cache_root, trainable=False)
    loaded = time.time()
    pad_id = critic.model.config.pad_token_id or 0  # right padding under the attention mask: any id
    table = read_table(scored_path)
    rows = [row | {"_row": i} for i, row in enumerate(table.to_pylist())]
    values: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(rows)
    device = critic.model.device
    was_training = critic.model.training
    critic.model.eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.trainer.dtype == "bfloat16")
    with torch.no_grad(), autocast:
        for group in micro_batches(rows, token_budget(spec.trainer.micro_batch_tokens, device.type)):
            mb = pack(group, pad_id).to(device)
            v = token_values(critic.model, mb).cpu()
            for i, row in enumerate(group):
                start = window_column(row, mb)
                values[row["_row"]] = v[i, start : start + len(row["completion_token_ids"])].numpy()
    critic.model.train(was_training)
    import pyarrow as pa

    column = pa.array([v.astype(np.float32) for v in values], type=pa.list_(pa.float32()))
    if world()[0] == 0:
        write_table(table.append_column("values", column), out_path)
    return {VALUES_LOAD: loaded - started, VALUES_TIME: time.time() - loaded}


def save_critic(critic: Critic, run_root: str, iteration: int) -> WeightRef | None:
    """Publish critic v(version + 1) and its optimizer state (the first process writes; with several,
    every process takes part in gathering the shards). The critic now holds that version."""
    rank, processes = world()
    assert critic.optimizer is not None  # a published critic is a trained one (load_critic trainable)
    if processes > 1:
        model_state = full_model_state(critic.model)
        optimizer_state = full_optimizer_state(critic.model, critic.optimizer)
    else:
        model_state, optimizer_state = None, critic.optimizer.state_dict()
    new_version = critic.version + 1
    published = None
    if rank == 0:
        staged = staging_uri(run_root, new_version, "critic")
        fs, staged_path = filesystem(staged)
        with tempfile.TemporaryDirectory() as local:
            critic.model.save_pretrained(staged_path if is_local(staged) else local, state_dict=model_state)
            if not is_local(staged):
                fs.put(local.rstrip("/") + "/", staged_path, recursive=True)
        sealed = seal(staged, version=new_version, iteration=iteration, parent=critic.version)
        published = publish(run_root, sealed, "critic").ref
        final_opt = optimizer_uri(run_root, new_version, "critic")
        fs, tmp_path = filesystem(final_opt + ".tmp")
        fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(tmp_path, "wb") as f:
            torch.save(optimizer_state, f)
        move(final_opt + ".tmp", final_opt)
    critic.version = new_version
    return published
