"""What the trainer's state costs: AdamW's moments (and, for serving-copy versions, the fp32 master
weights) are written when resume needs them, not every version.

The contract (storage.optimizer_every = K):
  - the update step (a process per update) writes its state beside every version: the next update,
    another process, starts from it;
  - the resident trainer keeps its state in memory and writes it every K versions (and at the end of
    training, and of every loop.iterations_per_run block), in a background thread off the critical
    path (the next update waits for it before its first optimizer step). Beside every version it
    keeps the batch that trained it, a few MB: optimizer/replay/v{N}.i{iteration}.parquet, deleted
    once a later checkpoint is written.
  - a trainer asked for v(N) whose state was not written (a restarted trainer, a resumed run) loads
    the last checkpoint v(k) and replays the updates k+1 .. N from their batches, in order, with their
    iterations' seeds. On one CPU process that is bit-exact: the replayed v(N) hashes to the sealed
    one (checked). Where it is not (GPU kernels' float nondeterminism), the trainer continues from the
    sealed v(N) weights, which samplers hold, with the replayed moments, and reports
    trainer/replay_exact 0.
Kill -9 anywhere: a checkpoint is written to .tmp and moved; a version is published by sync_weights
whether or not its checkpoint finished, and resume replays from the last checkpoint that did.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlpipe.store.run_root import filesystem, is_local, join, move, optimizer_uri, replay_dir

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef
    from rlpipe.training.state import Trainer


def keeps_state_in_memory(spec: RunSpec) -> bool:
    """Whether checkpoints may be skipped (storage.optimizer_every > 1 in the resident trainer)."""
    return spec.trainer.resident and spec.storage.optimizer_every > 1


def checkpoint_due(spec: RunSpec, version: int, iteration: int) -> bool:
    if not keeps_state_in_memory(spec):
        return True
    block_end = iteration % spec.loop.iterations_per_run == 0
    return version % spec.storage.optimizer_every == 0 or iteration >= spec.loop.iterations or block_end


def record_replay(run_root: str, version: int, iteration: int, batch_path: str) -> None:
    """Keep the batch that trained v(version), written then moved (a killed copy leaves only .tmp)."""
    final = join(replay_dir(run_root), f"v{version:06d}.i{iteration:06d}.parquet")
    fs, tmp = filesystem(final + ".tmp")
    fs.makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)
    if is_local(final) and "://" not in batch_path:
        shutil.copyfile(batch_path, tmp)
    else:
        source_fs, source = filesystem(batch_path)
        with source_fs.open(source, "rb") as src, fs.open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    move(final + ".tmp", final)


@dataclass(frozen=True)
class Replay:
    """Resume v(version) from the checkpoint at v(checkpoint) by replaying `updates`: (version, iteration,
    batch uri) in order."""

    checkpoint: int
    updates: list[tuple[int, int, str]]


def find_replay(spec: RunSpec, run_root: str, version: int) -> Replay | None:
    """None when v(version)'s own state is there, or no state nor batch was ever kept (v0, a fork that
    starts AdamW anew); else the last checkpoint below it and the recorded batches since, all of which
    must be there (whatever storage.optimizer_every says now: a resumed run may have changed it)."""
    fs, state = filesystem(optimizer_uri(run_root, version))
    if version == 0 or fs.exists(state):
        return None
    fs, replays = filesystem(replay_dir(run_root))
    recorded = {}
    if fs.exists(replays):
        for path in fs.ls(replays, detail=False):
            name = path.rsplit("/", 1)[-1]
            if name.endswith(".parquet") and int(name[1:7]) <= version:
                recorded[int(name[1:7])] = (int(name[9:15]), join(replay_dir(run_root), name))
    checkpoint = version - 1
    while checkpoint > 0 and not fs.exists(filesystem(optimizer_uri(run_root, checkpoint))[1]):
        checkpoint -= 1
    if not recorded and checkpoint == 0:  # no state was ever kept here (v0's successor, a fresh fork)
        return None
    missing = [v for v in range(checkpoint + 1, version + 1) if v not in recorded]
    if missing:
        raise FileNotFoundError(
            f"the trainer's state at v{version} was not written (storage.optimizer_every "
            f"{spec.storage.optimizer_every}) and the batches to replay it from v{checkpoint} are missing for "
            f"{', '.join(f'v{v}' for v in missing)}; resume from a version with optimizer state (rlpipe fork "
            "--iteration), or start the trainer fresh by deleting the run's optimizer/ directory"
        )
    return Replay(checkpoint, [(v, *recorded[v]) for v in range(checkpoint + 1, version + 1)])


def write_checkpoint(run_root: str, version: int, optimizer_state: dict, masters: dict | None) -> None:
    """optimizer/v{N}.pt (and v{N}.masters.safetensors), each written to .tmp and moved; then the replay
    batches up to v{N} are no longer needed."""
    from rlpipe.training.sealing import write_masters

    if masters is not None:
        write_masters(run_root, version, masters)
    final = optimizer_uri(run_root, version)
    fs, tmp_path = filesystem(final + ".tmp")
    fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(tmp_path, "wb") as f:
        torch.save(optimizer_state, f)
    move(final + ".tmp", final)
    fs, replays = filesystem(replay_dir(run_root))
    if fs.exists(replays):
        for path in fs.ls(replays, detail=False):
            name = path.rsplit("/", 1)[-1]
            if name.startswith("v") and int(name[1:7]) <= version:
                fs.rm(path)


def sealed_dtype(manifest: dict) -> torch.dtype:
    """The dtype a version stores: its weights_dtype (a serving copy), else the trainer's float32."""
    from rlpipe.store.weight_deltas import WEIGHTS_DTYPES

    weights_dtype = manifest.get("weights_dtype")  # None: not a serving copy
    return torch.float32 if weights_dtype is None else WEIGHTS_DTYPES.get(weights_dtype, torch.float32)


def save_state(
    trainer: Trainer, version: int, iteration: int, model_state: dict | None, batch_path: str | None
) -> None:
    """After sealing v(version): keep its batch for replay (resident trainer, storage.optimizer_every > 1),
    and write the trainer's state when a checkpoint is due: AdamW's moments and the fp32 masters (for a
    serving-copy version, or a replay's start), in the background in the resident trainer (the next
    update joins it before its first optimizer step). Gathering a sharded state is a collective."""
    from rlpipe.training.distributed import full_optimizer_state, world
    from rlpipe.training.sealing import serving_tensors, stores_serving_copy

    spec, run_root, rank = trainer.spec, trainer.run_root, world()[0]
    if rank == 0 and batch_path is not None and keeps_state_in_memory(spec):
        record_replay(run_root, version, iteration, batch_path)
    if not checkpoint_due(spec, version, iteration):
        return
    if world()[1] > 1:
        optimizer_state = full_optimizer_state(trainer.policy, trainer.optimizer)
    else:
        optimizer_state = trainer.optimizer.state_dict()
    with_masters = stores_serving_copy(spec) or keeps_state_in_memory(spec)
    masters = serving_tensors(trainer.policy, model_state, torch.float32) if with_masters else None
    if rank == 0 and keeps_state_in_memory(spec):
        write = (run_root, version, optimizer_state, masters)
        trainer.checkpoint_writer = threading.Thread(target=write_checkpoint, args=write, daemon=True)
        trainer.checkpoint_writer.start()
    elif rank == 0:
        write_checkpoint(run_root, version, optimizer_state, masters)


def matches_sealed(trainer: Trainer, weights: WeightRef, cache_root: str) -> bool:
    """Whether the trainer's weights, cast as the version stores them, hash to the sealed version's."""
    from rlpipe.store.weight_deltas import StoredTensors, content_sha256
    from rlpipe.store.weights import local_path, read_manifest
    from rlpipe.training.distributed import full_model_state, world
    from rlpipe.training.sealing import serving_tensors

    manifest = read_manifest(weights["uri"])
    stored = manifest.get("weights_sha256") or content_sha256(StoredTensors(local_path(weights, cache_root)))
    state = full_model_state(trainer.policy) if world()[1] > 1 else None
    return content_sha256(serving_tensors(trainer.policy, state, sealed_dtype(manifest))) == stored


def load_sealed(trainer: Trainer, weights: WeightRef, cache_root: str) -> None:
    """The sealed version's weights (upcast) into the trainer's policy, every process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlpipe.store.weight_deltas import StoredTensors
    from rlpipe.store.weights import local_path
    from rlpipe.training.distributed import world

    sealed = {name: t.float() for name, t in StoredTensors(local_path(weights, cache_root)).items()}
    if world()[1] > 1:
        set_model_state_dict(trainer.policy, sealed, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        trainer.policy.load_state_dict(sealed, strict=False)
