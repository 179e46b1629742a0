"""The trainer's device memory given back between its turns on a shared device (sharing.enabled): its optimizer
state moved to host memory (pinned: a device-to-host copy with non_blocking allocates it so) and its gradients
dropped, its weights moved too when asked, and all of it moved back to where each tensor was. Copies, not
recomputations: the state that comes back is the state that left, bit for bit.

Gradients are dropped rather than moved: every optimizer step starts with zero_grad(set_to_none=True)
(rlpipe.training.trainer.accumulate_gradients), so the ones the last step left are never read again.

On a CPU trainer the device is the host: nothing moves (Tensor.to returns the tensor itself), and the bytes are
counted as those that would move on a GPU, in ~0 seconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlpipe.training.state import Trainer

HOST = torch.device("cpu")


@dataclass
class Offloaded:
    """Where each moved tensor lives when on the device: (the state dict holding it, its key, its device), and
    the models moved whole with their device."""

    states: list[tuple[dict[str, Any], str, torch.device]]
    models: list[tuple[torch.nn.Module, torch.device]]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def trainer_models(trainer: Trainer) -> list[torch.nn.Module]:
    """The models the trainer holds: the policy, the frozen reference (unless it is the policy: LoRA), the critic."""
    models: list[torch.nn.Module] = [trainer.policy]
    if trainer.reference is not None and trainer.reference is not trainer.policy:
        models.append(trainer.reference)
    if trainer.critic is not None:
        models.append(trainer.critic.model)
    return models


def offload(trainer: Trainer, weights: bool) -> tuple[Offloaded, int]:
    """Move the optimizers' state on the trainer's device to host memory, drop the gradients, and with `weights`
    move the models too: (what to move back, the bytes the device gave back)."""
    device = trainer.policy.device
    if device != HOST and trainer.checkpoint_writer is not None:  # it reads the state about to move
        trainer.checkpoint_writer.join()
        trainer.checkpoint_writer = None
    models = trainer_models(trainer)
    critic = trainer.critic.optimizer if trainer.critic is not None else None
    optimizers = [trainer.optimizer] + ([critic] if critic is not None else [])
    moved = Offloaded([], [])
    freed = 0
    for model in models:
        for parameter in model.parameters():
            if parameter.grad is not None:
                freed += nbytes(parameter.grad)
                parameter.grad = None
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == device:
                    moved.states.append((state, key, value.device))
                    freed += nbytes(value)
                    state[key] = value.to(HOST, non_blocking=True)
    if weights:
        for model in models:
            freed += sum(nbytes(t) for t in (*model.parameters(), *model.buffers()) if t.device == device)
            moved.models.append((model, device))
            model.to(HOST, non_blocking=True)
    settle(device, empty_cache=True)
    return moved, freed


def onload(offloaded: Offloaded) -> int:
    """Move back what `offload` moved, each tensor to the device it left; returns the bytes moved."""
    moved = 0
    devices = {device for *_, device in offloaded.states} | {device for _, device in offloaded.models}
    for model, device in offloaded.models:
        moved += sum(nbytes(t) for t in (*model.parameters(), *model.buffers()))
        model.to(device, non_blocking=True)
    for state, key, device in offloaded.states:
        moved += nbytes(state[key])
        state[key] = state[key].to(device, non_blocking=True)
    for device in devices:
        settle(device)
    return moved


def settle(device: torch.device, empty_cache: bool = False) -> None:
    """Wait for the copies issued with non_blocking (a host tensor is not read before its copy is done), and hand
    the cached blocks back to the device (for the samplers to take)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if empty_cache:
            torch.cuda.empty_cache()
