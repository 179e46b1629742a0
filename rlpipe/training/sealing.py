"""What the trainer writes for a new whole-weights version: its tensors in storage.weights_dtype,
whole or as a delta against the version the trainer started from, and (for a narrower serving
copy) the fp32 master weights beside the optimizer state.

    stored version = cast(master weights, weights_dtype)          bit-exact what samplers load
    delta          = the elements of it whose bits differ from the parent's (rlpipe.store.weight_deltas)

A delta is written when the trainer holds its parent's stored tensors (`Served`: it sealed or
loaded that version), fewer than storage.full_every - 1 deltas precede it, and it is at most half
of the whole version's bytes; otherwise the version is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlpipe.store.run_root import filesystem, is_local, masters_uri, move
from rlpipe.store.weight_deltas import content_sha256, encode_delta
from rlpipe.store.weights import WeightRef, read_manifest, seal, stage_delta, stage_pretrained

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

DTYPES = {"bfloat16": torch.bfloat16}
LARGEST_DELTA = 0.5  # of the whole version's bytes: beyond it, store the version whole


@dataclass
class Served:
    """The stored tensors of the version the trainer last sealed or loaded, and deltas since a whole one."""

    tensors: dict[str, torch.Tensor]
    version: int
    chain: int


def stores_serving_copy(spec: RunSpec) -> bool:
    return spec.storage.weights_dtype is not None and spec.model.lora is None


def serving_tensors(policy: torch.nn.Module, state: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> dict:
    """The policy's weights as a version stores them: each parameter and persistent buffer once (a tied
    head is the embedding, as save_pretrained writes it), cast to `dtype`, on the CPU. `state`: the
    whole weights when the policy holds a shard (FSDP)."""
    state = state if state is not None else policy.state_dict()
    kept = {name for name, _ in policy.named_parameters()} | {name for name, _ in policy.named_buffers()}
    return {name: value.detach().to(device="cpu", dtype=dtype) for name, value in state.items() if name in kept}


def served_from_version(spec: RunSpec, policy: torch.nn.Module, weights: WeightRef) -> Served | None:
    """What a trainer that just loaded `weights` can write deltas against: the policy's serving copy,
    if it hashes to what that version stored (a version sealed in another dtype cannot be a parent)."""
    if not stores_serving_copy(spec) or spec.storage.full_every == 1:
        return None
    manifest = read_manifest(weights["uri"])
    if manifest.get("weights_dtype") != spec.storage.weights_dtype:
        return None
    tensors = serving_tensors(policy, None, DTYPES[spec.storage.weights_dtype])
    if content_sha256(tensors) != manifest.get("weights_sha256"):
        return None
    return Served(tensors, weights["version"], manifest.get("chain", 0))


def load_masters(run_root: str, version: int, policy: torch.nn.Module) -> bool:
    """The fp32 master weights saved after training v(version), into the policy; False when none were."""
    from safetensors.torch import load

    fs, path = filesystem(masters_uri(run_root, version))
    if not fs.exists(path):
        return False
    with fs.open(path, "rb") as f:
        masters = load(f.read())
    policy.load_state_dict(masters, strict=False)
    return True


def save_masters(run_root: str, version: int, policy: torch.nn.Module, state: dict | None) -> None:
    """optimizer/v{N}.masters.safetensors: the fp32 weights the serving copy was cast from (written, then moved)."""
    from safetensors.torch import save, save_file

    masters = serving_tensors(policy, state, torch.float32)
    final = masters_uri(run_root, version)
    fs, tmp_path = filesystem(final + ".tmp")
    fs.makedirs(tmp_path.rsplit("/", 1)[0], exist_ok=True)
    if is_local(final):  # streamed to the file, not built in memory first
        save_file(masters, tmp_path)
    else:
        with fs.open(tmp_path, "wb") as f:
            f.write(save(masters))
    move(final + ".tmp", final)


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
    served: Served | None,
) -> tuple[WeightRef, Served | None]:
    """Stage and seal v(version) as storage.weights_dtype tensors, a delta against `served` when that
    is v(version - 1) and the rules above allow; returns its ref and what the next version can be a
    delta against."""
    tensors = serving_tensors(policy, state, DTYPES[spec.storage.weights_dtype])
    delta = None
    if served is not None and served.version == parent["version"] and served.chain + 1 < spec.storage.full_every:
        delta = encode_delta(served.tensors, tensors)
        whole_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if sum(t.numel() * t.element_size() for t in delta.values()) > LARGEST_DELTA * whole_bytes:
            delta = None
    if delta is not None:
        staged = stage_delta(run_root, version, policy.config, tokenizer, delta, cache_root)
        chain = served.chain + 1
    else:
        staged = stage_pretrained(run_root, version, policy, tokenizer, cache_root, tensors)
        chain = 0
    contents = {
        "weights_sha256": content_sha256(tensors),
        "weights_dtype": spec.storage.weights_dtype,
        "delta_of": parent["version"] if delta is not None else None,
        "chain": chain,
    }
    ref = seal(staged, version=version, iteration=iteration, parent=parent["version"], contents=contents)
    keep = spec.storage.full_every > 1
    return ref, Served(tensors, version, chain) if keep else None
