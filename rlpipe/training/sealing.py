"""What the trainer writes for a new whole-weights version: its tensors in storage.weights_dtype,
whole or as a delta against the version the trainer started from, and (for a narrower serving
copy) the fp32 master weights beside the optimizer state.

    stored version = cast(master weights, weights_dtype)          bit-exact what samplers load
    delta          = the elements of it whose bits differ from the parent's (rlpipe.store.weight_deltas)

A delta is written when the trainer can read its parent's stored tensors (`StoredVersion`: it sealed
or loaded that version), fewer than storage.full_every - 1 deltas precede it, and it is at most half
of the whole version's bytes; otherwise the version is whole. Sealing a delta casts, hashes and
compares each tensor on its own, a tensor per thread: no second copy of the model exists at any moment.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from rlpipe.store.run_root import filesystem, is_local, masters_uri, move
from rlpipe.store.weight_deltas import (
    WEIGHTS_DTYPES,
    StoredTensors,
    combined_sha256,
    content_sha256,
    encode_tensor,
    tensor_entry,
    write_safetensors,
)
from rlpipe.store.weights import WeightRef, stored_in, write_delta_version, write_version
from rlpipe.training.state import StoredVersion

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.training.state import Trainer

LARGEST_DELTA = 0.5  # of the whole version's bytes: beyond it, store the version whole


def stores_serving_copy(spec: RunSpec) -> bool:
    return spec.storage.weights_dtype is not None and spec.model.lora is None


def stored_names(policy: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """The names a version stores, sorted: each parameter and persistent buffer once (a tied head is
    the embedding, as save_pretrained writes it)."""
    kept = {name for name, _ in policy.named_parameters()} | {name for name, _ in policy.named_buffers()}
    return sorted(name for name in state if name in kept)


def serving_tensors(policy: torch.nn.Module, state: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> dict:
    """The policy's weights as a version stores them (stored_names), cast to `dtype`, on the CPU.
    `state`: the whole weights when the policy holds a shard (FSDP)."""
    state = state if state is not None else policy.state_dict()
    return {name: state[name].detach().to(device="cpu", dtype=dtype) for name in stored_names(policy, state)}


def stored_version(spec: RunSpec, weights: WeightRef, cache_root: str) -> StoredVersion | None:
    """What a trainer that just loaded `weights` can write the next version as a delta against: that
    version's whole files (rebuilt into the cache if it is a delta), when it was sealed in
    storage.weights_dtype."""
    if not stores_serving_copy(spec) or spec.storage.full_every == 1:
        return None
    assert spec.storage.weights_dtype is not None  # stores_serving_copy: a serving dtype is set
    if (stored := stored_in(weights, spec.storage.weights_dtype, cache_root)) is None:
        return None
    manifest, path = stored
    return StoredVersion(StoredTensors(path), weights["version"], manifest.get("chain", 0))


def load_masters(run_root: str, version: int, policy: torch.nn.Module) -> bool:
    """The fp32 master weights saved after training v(version), into the policy; False when none were."""
    from safetensors.torch import load, load_file

    final = masters_uri(run_root, version)
    fs, path = filesystem(final)
    if not fs.exists(path):
        return False
    if is_local(final):
        masters = load_file(path)
    else:
        with fs.open(path, "rb") as f:
            masters = load(f.read())
    policy.load_state_dict(masters, strict=False)
    return True


def write_masters(run_root: str, version: int, masters: dict[str, torch.Tensor]) -> None:
    """optimizer/v{N}.masters.safetensors: the fp32 weights the serving copy was cast from (written, then moved)."""
    final = masters_uri(run_root, version)
    fs, tmp_path = filesystem(final + ".tmp")
    fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(tmp_path, "wb") as f:
        write_safetensors(masters, f, {"format": "pt"})
    move(final + ".tmp", final)


def delta_against(
    parent: StoredVersion, policy: torch.nn.Module, state: dict, dtype: torch.dtype, keep: bool
) -> tuple[dict, str, dict]:
    """(the delta, the new version's weights_sha256, its tensors when `keep`). Each tensor is cast,
    hashed, compared with the parent's and dropped (or, kept, written over the parent's tensor held in
    memory), in as many threads as torch uses (torch, numpy and hashlib release the GIL): at most one
    cast tensor per thread exists at a time, never a second copy of the model."""
    in_memory = isinstance(parent.tensors, dict)

    def seal_tensor(name: str) -> tuple[str, dict[str, torch.Tensor], torch.Tensor | None]:
        new = state[name].detach().to(device="cpu", dtype=dtype)
        old = parent.tensors.get(name)
        entry, part = tensor_entry(name, new), encode_tensor(name, old, new)
        if keep and in_memory and old is not None and old.shape == new.shape and old.dtype == new.dtype:
            return entry, part, old.copy_(new)
        return entry, part, new if keep else None

    names = stored_names(policy, state)
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        sealed = list(pool.map(seal_tensor, names))
    delta = {key: tensor for _, part, _ in sealed for key, tensor in part.items()}
    kept = {name: tensor for name, (_, _, tensor) in zip(names, sealed, strict=True) if tensor is not None}
    return delta, combined_sha256(entry for entry, _, _ in sealed), kept


def seal_serving_copy(
    spec: RunSpec,
    run_root: str,
    version: int,
    iteration: int,
    parent: WeightRef,
    policy: torch.nn.Module,
    tokenizer,
    cache_root: str,
    state: dict | None,
    stored: StoredVersion | None,
) -> tuple[WeightRef, StoredVersion | None]:
    """Stage and seal v(version) as storage.weights_dtype tensors, a delta against `stored` when that
    is v(version - 1) and the rules above allow; returns the sealed version and what the next version can be a
    delta against (held in memory by a resident trainer; None for a one-update process)."""
    assert spec.storage.weights_dtype is not None  # only called where stores_serving_copy(spec)
    dtype = WEIGHTS_DTYPES[spec.storage.weights_dtype]
    state = state if state is not None else policy.state_dict()
    keep = spec.storage.full_every > 1 and spec.trainer.resident
    delta = None
    if stored is not None and stored.version == parent["version"] and stored.chain + 1 < spec.storage.full_every:
        delta, sha, tensors = delta_against(stored, policy, state, dtype, keep)
        whole_bytes = sum(state[n].numel() for n in stored_names(policy, state)) * dtype.itemsize
        if sum(t.numel() * t.element_size() for t in delta.values()) > LARGEST_DELTA * whole_bytes:
            delta = None
    if delta is None:
        tensors = serving_tensors(policy, state, dtype)
        sha = content_sha256(tensors)
    chain = 0
    if delta is not None:
        assert stored is not None  # a delta is against `stored`
        chain = stored.chain + 1
    contents = {
        "weights_sha256": sha,
        "weights_dtype": spec.storage.weights_dtype,
        "delta_of": parent["version"] if delta is not None else None,
        "chain": chain,
    }
    if delta is not None:
        args = (policy.config, tokenizer, delta, cache_root, contents)
        sealed = write_delta_version(run_root, version, iteration, parent["version"], *args)
    else:
        sealed = write_version(
            run_root, version, iteration, parent["version"], policy, tokenizer, cache_root, tensors, contents=contents
        )
    return sealed, StoredVersion(tensors, version, chain) if keep else None


def seal_new_version(trainer: Trainer, iteration: int, cache_root: str, state: dict | None) -> WeightRef:
    """Stage and seal v(N+1) from the trainer (first process): its whole weights, a serving copy
    (seal_serving_copy), or its adapters over the sealed base (model.lora). `state`: the whole
    weights gathered from the processes (FSDP)."""
    run_root, weights, new_version = trainer.run_root, trainer.weights, trainer.weights["version"] + 1
    if stores_serving_copy(trainer.spec):
        stored, trainer.stored = trainer.stored, None  # sealing writes over it: gone if sealing fails
        sealed, trainer.stored = seal_serving_copy(
            trainer.spec, run_root, new_version, iteration, weights, trainer.policy, trainer.tokenizer,
            cache_root, state, stored,
        )  # fmt: skip
        return sealed
    policy, tokenizer = trainer.policy, trainer.tokenizer
    return write_version(
        run_root, new_version, iteration, weights["version"], policy, tokenizer, cache_root, state, trainer.base
    )
