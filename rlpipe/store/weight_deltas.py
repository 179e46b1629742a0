"""Weight versions stored as deltas against their parent: the elements whose bits changed.

An RL step at lr 1e-6..1e-5 moves every fp32 master weight a little, but leaves ~99% of the
**bf16** weights a sampler serves bit-identical (an AdamW step of ~lr is far below bf16's
resolution, 2^-8 of the weight, except where a weight sits near a rounding boundary). So a
version stored as a bf16 serving copy (storage.weights_dtype) is mostly its parent:

    delta.safetensors   for each tensor t of the version (n elements, k of them changed):
        "t#index"  int32 [k]         flat positions whose bit patterns differ from the parent's
      or, where that is larger (k > n / 32: 4 bytes a change against a bit an element),
        "t#mask"   uint8 [n / 8]     the same positions as a bitmap (numpy.packbits, big-endian bits)
      and
        "t#value"  dtype [k]         the new elements there
      or, where the parent has no t of the same shape and dtype:
        "t#whole"  the tensor

The bitmap keeps deltas small where steps are large against bf16's resolution (a ~1M-parameter model
at lr 1e-5 changes ~28% of its bf16 weights an iteration: 6 bytes a change would be 85% of a whole
copy, the bitmap form 34%).

Applying it to the parent's tensors gives the version's, bit for bit (XOR-free: positions and
values). A version's `weights_sha256` (in its manifest) hashes its tensors' contents, so a
reconstruction is checked against what the trainer sealed:

    weights_sha256 = sha256( for each tensor t, by name:  "name \0 dtype \0 shape \0 sha256(bytes of t)\n" )

Two levels, so the tensors hash in parallel threads (hashlib releases the GIL): 1 GB of bf16 weights
is ~0.6 s of sha256 on one core here, the largest part of sealing a delta.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

DELTA_FILE = "delta.safetensors"
WEIGHTS_DTYPES = {"bfloat16": torch.bfloat16}  # storage.weights_dtype -> the dtype a serving copy is sealed in
INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> same-width int


def content_sha256(tensors: Mapping[str, torch.Tensor], threads: int | None = None) -> str:
    """weights_sha256 of `tensors` (module docstring): the same weights give the same hash however they
    are laid out in files. Hashed in `threads` threads (default: torch's)."""
    names = sorted(tensors)
    with ThreadPoolExecutor(threads or torch.get_num_threads()) as pool:
        return combined_sha256(pool.map(lambda name: tensor_entry(name, tensors[name]), names))


def tensor_entry(name: str, tensor: torch.Tensor) -> str:
    """One tensor's line in weights_sha256: its name, dtype, shape and the sha256 of its bytes, hashed
    where they lie (no copy)."""
    tensor = tensor.detach().contiguous().cpu()
    data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12; it is a buffer on 3.11 too
    digest = hashlib.sha256(data).hexdigest()  # type: ignore[arg-type]
    return f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0{digest}\n"


def combined_sha256(entries: Iterable[str]) -> str:
    """weights_sha256 from the tensors' entries (tensor_entry), in name order."""
    digest = hashlib.sha256()
    for entry in entries:
        digest.update(entry.encode())
    return digest.hexdigest()


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_safetensors(tensors: Mapping[str, torch.Tensor], file: BinaryIO, metadata: dict[str, str]) -> None:
    """`tensors` in the safetensors format, each written from its own memory: safetensors' save_file
    first copies every tensor to bytes, a second copy of the model (2 GB of masters at 0.5B)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write(struct.pack("<Q", len(encoded)) + encoded)
    for tensor in tensors.values():
        if tensor.numel():
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12; it is a buffer on 3.11 too
            file.write(memoryview(data))  # type: ignore[arg-type]


class StoredTensors(Mapping):
    """The tensors of a whole version's safetensors files, each read when asked for (memory-mapped):
    a parent to write a delta against without holding it in memory."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(file, "pt") as opened:
                self.files |= dict.fromkeys(opened.keys(), file)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], "pt") as opened:
            return opened.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, flat: equal bits <=> equal integers (NaNs included)."""
    return tensor.detach().contiguous().reshape(-1).view(INTEGER_VIEW[tensor.element_size()])


def encode_delta(parent: Mapping[str, torch.Tensor], child: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta.safetensors tensors that turn `parent` into `child` (module docstring), on the CPU."""
    delta: dict[str, torch.Tensor] = {}
    for name, new in child.items():
        delta |= encode_tensor(name, parent.get(name), new)
    return delta


def encode_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor's part of a delta: its changed positions (as indices or a bitmap, whichever is
    smaller) and values, or the whole tensor. On the CPU: numpy's nonzero is ~2x torch's here, and
    releases the GIL for tensors sealed in parallel."""
    new = new.detach().cpu()
    if old is None or old.shape != new.shape or old.dtype != new.dtype or new.numel() >= 2**31:
        return {f"{name}#whole": new.contiguous()}
    new_bits = bits(new).numpy()
    changed = bits(old.cpu()).numpy() != new_bits
    positions = np.flatnonzero(changed)
    value = {f"{name}#value": torch.from_numpy(new_bits[positions]).view(new.dtype)}
    if 32 * len(positions) > new.numel():
        return {f"{name}#mask": torch.from_numpy(np.packbits(changed))} | value
    return {f"{name}#index": torch.from_numpy(positions.astype(np.int32))} | value


def changed_positions(delta: Mapping[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
    """The flat positions tensor `name`'s delta changes (int64), from its index or its bitmap."""
    if f"{name}#index" in delta:
        return delta[f"{name}#index"].to(torch.long)
    mask = np.unpackbits(delta[f"{name}#mask"].cpu().numpy(), count=numel)
    return torch.from_numpy(np.flatnonzero(mask))


def apply_delta(tensors: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (the parent's, changed in place) with `delta` applied; tensors the delta does not
    name are dropped, so the result has exactly the version's tensors."""
    names = {key.rsplit("#", 1)[0] for key in delta}
    for name in names:
        if f"{name}#whole" in delta:
            tensors[name] = delta[f"{name}#whole"]
            continue
        target = tensors[name]
        index = changed_positions(delta, name, target.numel()).to(target.device)
        target.view(-1).index_copy_(0, index, delta[f"{name}#value"].to(target.device))
    for name in set(tensors) - names:
        del tensors[name]
    return tensors


@torch.no_grad()
def apply_delta_to_model(model: torch.nn.Module, delta: dict[str, torch.Tensor]) -> int:
    """A sampler's in-place move to the next version: the delta's elements written into the model's
    parameters (held in the version's dtype or a wider one, which holds its values exactly). Returns
    the elements written. Raises KeyError for a tensor the model lacks: reload the whole version."""
    state = model.state_dict(keep_vars=True)
    written = 0
    for key, values in delta.items():
        name, part = key.rsplit("#", 1)
        target = state[name]
        if part == "whole":
            target.copy_(values)
        elif part == "value":
            index = changed_positions(delta, name, target.numel()).to(target.device)
            target.view(-1).index_copy_(0, index, values.to(device=target.device, dtype=target.dtype))
        written += values.numel() if part in ("whole", "value") else 0
    return written
