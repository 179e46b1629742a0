"""Opening a trainer from the weight store and saving it back: everything a trainer reads and writes,
in one place.

    open_trainer(v(N))  = the policy at v(N) (models.loading)           store/weights: local_path
                          + its fp32 masters and AdamW state, when saved  store/run_root: optimizer/v{N}
                          + the frozen reference, v0 (the KL, online DPO) store/weights: version_path
                          + the critic at v(N) (PPO)                      training/critic
                          + the stored tensors of v(N) (the next delta)   store/weights: stored_in
                          or, where v(N)'s state was not saved, the last checkpoint and the updates since
                          replayed from their batches (training/checkpoints)
    save_version(v(N+1)) = the new version staged and sealed           store/weights: write_version
                          + the trainer's state when a checkpoint is due (training/checkpoints)
                          + the critic's version (PPO)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rlpipe.algorithms import get_algorithm, needs_critic
from rlpipe.models.devices import resolve_device
from rlpipe.models.loading import add_lora, disable_dropout, is_adapted, load_policy, load_weights
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, optimizer_uri
from rlpipe.store.weights import WeightRef, read_weight_ref, version_path
from rlpipe.training.checkpoints import find_replay, load_sealed, matches_sealed, save_state
from rlpipe.training.critic import load_critic, save_critic
from rlpipe.training.distributed import full_model_state, init_from_torchrun, load_optimizer_state, shard, world
from rlpipe.training.sealing import load_masters, seal_new_version, stored_version, stores_serving_copy
from rlpipe.training.state import Trainer
from rlpipe.training.trainer import packs_rows, train_on_batch

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from peft import PeftModel
    from transformers import PreTrainedModel


def open_trainer(spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str) -> Trainer:
    """The trainer at `weights`: the policy with the optimizer state saved beside that version, or,
    where it was not saved (storage.optimizer_every), at the last checkpoint with the updates since
    replayed from their recorded batches (rlpipe.training.checkpoints)."""
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
        trainer.stored = stored_version(spec, weights, cache_root)
    trainer.replayed = {"trainer/replayed_updates": float(len(replay.updates)), "trainer/replay_exact": float(exact)}
    return trainer


def load_checkpoint(
    spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str, state_version: int | None = None
) -> Trainer:
    """The policy at `weights` with the trainer's state saved beside that version (or beside
    v(state_version)): its fp32 master weights, when saved (a serving-copy version, or a resident
    trainer's checkpoint), and its optimizer state (fresh where none was); the reference and the
    critic beside it."""
    state_version = weights["version"] if state_version is None else state_version
    sharded = init_from_torchrun(resolve_device(spec.trainer.device))[1] > 1  # before loading: picks the GPU
    policy, tokenizer = load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device, trainable=True)
    load_masters(run_root, state_version, policy)  # train on the masters a serving copy was cast from
    stored = None
    if stores_serving_copy(spec) and state_version == weights["version"] and world()[0] == 0:
        stored = stored_version(spec, weights, cache_root)
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
        assert not is_adapted(policy)  # model.lora trains in one process: RunSpec refuses it over several
        shard(policy, policy.device)
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the adapters
    optimizer = torch.optim.AdamW(
        trained, lr=spec.trainer.lr, betas=spec.trainer.betas, weight_decay=spec.trainer.weight_decay
    )
    fs, opt_path = filesystem(optimizer_uri(run_root, state_version))
    if fs.exists(opt_path):
        with fs.open(opt_path, "rb") as f:
            load_optimizer_state(policy, optimizer, torch.load(f, weights_only=True, map_location=policy.device))
    reference = load_reference(spec, run_root, cache_root, policy if base is not None else None, sharded)
    critic = None
    if needs_critic(spec):
        critic = load_critic(spec, run_root, weights["version"], cache_root, trainable=True, sharded=sharded)
    trainer = Trainer(spec, run_root, weights, policy, tokenizer, optimizer, reference, base, critic, stored=stored)
    trainer.packed = packs_rows(trainer)
    return trainer


def load_reference(
    spec: RunSpec, run_root: str, cache_root: str, adapted: PreTrainedModel | PeftModel | None, sharded: bool
) -> PreTrainedModel | PeftModel | None:
    """The frozen reference, v0, when the KL is in the loss or tracked, or the loss reads it (online DPO);
    with LoRA the `adapted` policy itself (its adapters disabled: no second copy). v0 is whole weights."""
    wants_reference = spec.algorithm.kl_coef > 0 or spec.algorithm.track_reference_kl
    wants_reference |= "reference" in get_algorithm(spec.algorithm.name).needs  # online DPO's loss
    if not wants_reference or adapted is not None:
        return adapted if wants_reference else None
    reference, _ = load_policy(version_path(run_root, 0, cache_root))
    # mypy reads transformers' functools.wraps(Module.to) as unbound: the device as `self`
    reference = reference.to(resolve_device(spec.trainer.device))  # type: ignore[arg-type]
    reference.eval().requires_grad_(False)
    if sharded:
        shard(reference, reference.device)
    return reference


def save_version(
    trainer: Trainer, iteration: int, cache_root: str, timings: dict | None = None, batch_path: str | None = None
) -> WeightRef:
    """Stage and seal v(N+1) and write the trainer's state beside it when a checkpoint is due
    (rlpipe.training.checkpoints: every version, or every storage.optimizer_every in the resident
    trainer, which records `batch_path` for replay and writes in the background); the trainer now
    is at v(N+1). Sharded over several processes, the whole weights and optimizer state are gathered
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
    assert sealed is not None  # the first process sealed it; the others got it by the broadcast
    trainer.weights = sealed
    return sealed
