"""The in-step vLLM engine: `vllm.LLM` on the published weights for one generate step.

Same records as the torch engine: G seeded samples per prompt, token ids through the eos,
per-token log-probs at the sampling temperature (vLLM's processed_logprobs). An adapter version
(model.lora) is served as vLLM serves LoRA: the engine loads the sealed base with LoRA enabled
and every request names the adapter (a LoRARequest), so only the adapter's bytes are new.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.engines import Policy, Sampled, Sampling
from rlpipe.rollouts import Completions

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef

# the engine in this process: no engine-core subprocess to start and feed
IN_STEP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def load_engine(model_dir: str, seed: int, gpu: bool, lora_rank: int | None = None):
    """A vllm.LLM on `model_dir` with rlpipe's in-place reload extension; `lora_rank`: serve LoRA
    adapters of that rank on it."""
    from rlpipe.vllm_environment import (
        VLLM_CPU_ENGINE_OPTIONS,
        VLLM_CPU_ENVIRONMENT,
        VLLM_ENVIRONMENT,
        cpu_kv_cache,
        max_lora_rank,
    )

    environment = VLLM_ENVIRONMENT | IN_STEP | ({} if gpu else VLLM_CPU_ENVIRONMENT | cpu_kv_cache(1))
    for key, value in environment.items():
        os.environ.setdefault(key, value)
    from rlpipe.optional_imports import hide_vision_and_audio

    hide_vision_and_audio()
    from vllm import LLM

    options = {} if gpu else dict(VLLM_CPU_ENGINE_OPTIONS)
    if lora_rank is not None:
        options |= {"enable_lora": True, "max_lora_rank": max_lora_rank(lora_rank)}
    return LLM(
        model=model_dir,
        seed=seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="rlpipe.services.sampler_worker.PolicyReload",
        **options,
    )


def sample_groups(llm, prompt_ids: list[list[int]], sampling: Sampling, seed: int, lora_request=None) -> Completions:
    """`sampling.samples` completions per prompt, flattened prompt-major (`lora_request`: with that adapter).

    vLLM seeds sample j of a request with seed + j, so prompt i gets seed + i * samples: every
    sample of the batch has its own seed (seed + i would give prompt i+1's sample j-1 the same
    random stream as prompt i's sample j).
    """
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=sampling.samples,
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            logprobs=0,
            seed=seed + i * sampling.samples,
            ignore_eos=sampling.ignore_eos,
        )
        for i in range(len(prompt_ids))
    ]
    requests = [{"prompt_token_ids": p} for p in prompt_ids]
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
    result = Completions([], [], [])
    for output in outputs:
        for completion in sorted(output.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            result.token_ids.append(token_ids)
            result.logprobs.append([lp[t].logprob for t, lp in zip(token_ids, completion.logprobs)])
            result.finish_reasons.append("stop" if completion.finish_reason == "stop" else "length")
    return result


def sample_prompts(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    cache_root: str,
    prompt_ids: list[list[int]],
    iteration: int,
    policy: Policy | None = None,
) -> Sampled:
    """rollout.samples_per_prompt completions per prompt with vllm.LLM loaded from `weights` (an
    adapter version: its base, sampling with the adapter)."""
    from rlpipe.engines import sample_seed
    from rlpipe.store.weights import ADAPTER_CONFIG, adapter_base, local_path

    weights_dir = local_path(weights, cache_root)
    base = adapter_base(weights_dir)
    if base is None:
        llm, lora_request = load_engine(weights_dir, spec.seed, gpu=False), None
    else:
        from vllm.lora.request import LoRARequest

        rank = json.loads((Path(weights_dir) / ADAPTER_CONFIG).read_text())["r"]
        llm = load_engine(local_path(base, cache_root), spec.seed, gpu=False, lora_rank=rank)
        lora_request = LoRARequest(f"v{weights['version']}", 1, weights_dir)
    tokenizer = llm.get_tokenizer()
    loaded = time.time()
    seed = sample_seed(spec.seed, iteration)
    completions = sample_groups(llm, prompt_ids, Sampling.of(spec), seed, lora_request=lora_request)
    texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    return Sampled(completions, texts, loaded, {})
