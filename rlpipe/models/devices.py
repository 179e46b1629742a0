"""trainer.device resolved to a torch.device, the one rule every torch step, the resident trainer
and the pre-flight check use (torch only: the check must not pay transformers' import)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """trainer.device as a torch.device: auto = the GPU when one is visible. Asking for cuda
    without one is an error, never a silent CPU run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"trainer.device is {name} but torch sees no GPU (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'no'}); set trainer.device: auto or cpu, or run where a GPU is visible"
        )
    return torch.device(name)
