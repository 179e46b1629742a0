"""Data-parallel training over several processes with FSDP2 (`torch.distributed.fsdp.fully_shard`),
launched by torchrun (`update_in_processes`; each process runs rlpipe.training.session.main): NCCL on
GPUs, gloo on CPU (where the tests run the same code).

Each process holds 1/world of every parameter, gradient and AdamW moment. A mini-batch's micro-batches
are the same on every process (so the collectives line up); each process takes every world-th row
of each. FSDP averages gradients over processes, so each process back-propagates world x its rows'
share of the one-pass loss: the mean over processes is then the one-pass gradient.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from rlpipe.metric_keys import UPDATE_TIME

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside torchrun."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_from_torchrun(device: torch.device, timeout_s: float | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env);
    (0, 1) when not launched by torchrun. NCCL for GPUs, gloo for CPU; `timeout_s` bounds how long a
    collective waits for the other processes (torch's default when None). A group already joined
    must suit `device` (the resident trainer joins it before the first request names one)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        torch.distributed.init_process_group(backend, timeout=timeout)
    elif torch.distributed.get_backend() != backend:
        raise ValueError(
            f"trainer.device {device.type}: this trainer's processes joined a {torch.distributed.get_backend()} "
            f"process group, which {backend} would need; set trainer.device to match, or restart the trainer"
        )
    return world()


def shard(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """FSDP2: each decoder layer its own unit (gathered just for its forward and backward), then the
    rest (embeddings, final norm, head) as the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world()[1],))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every FSDP unit holds its whole weights, gathered once on entry (a collective), and
    keeps them through the forward passes, which then run no collectives; resharded on exit. For
    sampling: a decode loop's forward count depends on when its rows stop, which the processes need
    not agree on, and each token would otherwise all-gather the whole model. A no-op unsharded."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule)  # is_sharded(model) just said so
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        # what fully_shard sets: layers reshard after forward; the root (used again first in backward) does not
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `model` to a total norm of at most `max_norm`; the norm before clipping
    (over every shard: a sharded model's norm is a DTensor, made whole here)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def all_sum(values: dict[str, float], device: torch.device | str) -> dict[str, float]:
    """Each value summed over the processes (unchanged in one process)."""
    if world()[1] == 1:
        return values
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist(), strict=True))


def all_max(value: float, device: torch.device) -> float:
    """The largest of each process's `value` (unchanged in one process)."""
    if world()[1] == 1:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict on CPU, on every process (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # a model's full state dict: whole tensors (full_state_dict gathers DTensors; no optimizer-style nesting)
    state = cast(
        dict[str, torch.Tensor],
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
    # tied weights (lm_head = embed_tokens) come back as separate copies; keep the one named_parameters
    # names, as save_pretrained does for an unsharded model
    kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: value for name, value in state.items() if name in kept}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state keyed by parameter name (a collective); loads back into any world size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved optimizer state into any world size: one process saves torch's own form (keyed
    by the index of the trained parameters), several save it keyed by parameter name (full_optimizer_state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    by_index = all(isinstance(group_param, int) for group in state["param_groups"] for group_param in group["params"])
    if by_index and world()[1] == 1:
        optimizer.load_state_dict(state)
        return
    if by_index:  # the optimizer's parameters are the model's, in named_parameters order
        names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
        state = {
            "state": {names[index]: value for index, value in state["state"].items()},
            "param_groups": [
                group | {"params": [names[i] for i in group["params"]]} for group in state["param_groups"]
            ],
        }
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def update_in_processes(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """The update under torchrun with trainer.gpus processes on this node (one per GPU); the first
    process's result. A process that fails fails the step, and nothing was sealed."""
    import json
    import subprocess
    import sys
    import tempfile
    import time

    from rlpipe.spec import spec_to_dict

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rlpipe-update-") as tmp:
        request: dict[str, Any] = {
            "spec": spec_to_dict(spec),
            "run_root": run_root,
            "weights": weights,
            "batch_path": batch_path,
            "iteration": iteration,
            "cache_root": cache_root,
            "result": f"{tmp}/result.json",
        }
        with open(f"{tmp}/request.json", "w") as f:
            json.dump(request, f)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(spec.trainer.gpus), "-m", "rlpipe.training.session"]
        done = subprocess.run([*command, f"{tmp}/request.json"], capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(
                f"update under torchrun ({spec.trainer.gpus} processes) failed with exit code "
                f"{done.returncode}; nothing was published:\n{tail}"
            )
        with open(request["result"]) as f:
            result = json.load(f)
    metrics = result["metrics"] | {"policy/processes": float(spec.trainer.gpus)}
    metrics["overhead/update_launch_s"] = time.time() - started - metrics.get(UPDATE_TIME, 0.0)
    return result["staged"], metrics
