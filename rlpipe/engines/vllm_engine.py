"""The in-step vLLM engine: `vllm.LLM` on the published weights for one generate step.

Same records as the torch engine: G seeded samples per prompt, token ids through the eos,
per-token log-probs at the sampling temperature (vLLM's processed_logprobs). An adapter version
(model.lora) is merged into the sealed base inside the engine (the worker's reload_merged): this
engine runs on CPU, where vLLM's LoRA ops cost 4.5x at every token.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from rlpipe.engines import Sampled, SampleRequest, Sampling
from rlpipe.rollouts import Completions

if TYPE_CHECKING:
    pass

# the engine in this process: no engine-core subprocess to start and feed
IN_STEP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def load_engine(model_dir: str, seed: int, gpu: bool):
    """A vllm.LLM on `model_dir` with rlpipe's in-place reload extension."""
    from rlpipe.engines.vllm_settings import (
        VLLM_CPU_ENGINE_OPTIONS,
        VLLM_CPU_ENV,
        VLLM_ENV,
        cpu_kv_cache,
    )

    env = VLLM_ENV | IN_STEP | ({} if gpu else VLLM_CPU_ENV | cpu_kv_cache(1))
    for key, value in env.items():
        os.environ.setdefault(key, value)
    from rlpipe.models.optional_imports import hide_vision_and_audio

    hide_vision_and_audio()
    from vllm import LLM

    options = {} if gpu else dict(VLLM_CPU_ENGINE_OPTIONS)
    return LLM(
        model=model_dir,
        seed=seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="rlpipe.engines.vllm_worker.PolicyReload",
        **options,
    )


def sample_groups(llm, prompt_ids: list[list[int]], sampling: Sampling, seed: int) -> Completions:
    """`sampling.samples` completions per prompt, flattened prompt-major.

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
    return completions_of(llm.generate(requests, params, use_tqdm=False))


def sample_turns(llm, sampling: Sampling, seed: int):
    """A turn sampler for rlpipe.environments.run_trajectories: one completion per sequence, through
    eos or a stop id, seeded seed + (turn's first sequence number) + k so no two draws share a stream."""
    from vllm import SamplingParams

    drawn = 0

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        nonlocal drawn
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=sampling.temperature,
                logprobs=0,
                seed=seed + drawn + k,
                stop_token_ids=sorted(stop_ids),
            )
            for k in range(len(sequences))
        ]
        drawn += len(sequences)
        outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return completions_of(outputs)

    return sample_turn


def completions_of(outputs) -> Completions:
    """vLLM's RequestOutputs as Completions, each request's samples in their order."""
    result = Completions([], [], [])
    for output in outputs:
        for completion in sorted(output.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            result.token_ids.append(token_ids)
            result.logprobs.append([lp[t].logprob for t, lp in zip(token_ids, completion.logprobs)])
            result.finish_reasons.append("stop" if completion.finish_reason == "stop" else "length")
    return result


def sample_prompts(request: SampleRequest) -> Sampled:
    """rollout.samples_per_prompt completions per prompt with vllm.LLM loaded from `weights` (an
    adapter version: its base, with the adapter merged in); with rollout.environment, multi-turn
    trajectories of `rows` (rlpipe.environments.run_trajectories)."""
    from rlpipe.engines import sample_seed
    from rlpipe.engines.vllm_settings import MERGE_METHOD
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.store.weights import adapter_base, local_path

    spec, weights, cache_root = request.spec, request.weights, request.cache_root
    prompt_ids, iteration, rows = request.prompt_ids, request.stream, request.rows
    weights_dir = local_path(weights, cache_root)
    base = adapter_base(weights_dir)
    model_dir = weights_dir if base is None else local_path(base, cache_root)
    llm = load_engine(model_dir, spec.seed, gpu=False)
    if base is not None:  # on CPU the adapter is merged into the base (rlpipe.engines.vllm_settings.serves_adapters)
        llm.collective_rpc(MERGE_METHOD, kwargs={"base_path": model_dir, "adapter_path": weights_dir})
    # rlpipe's loader, not vLLM's AutoTokenizer: that one reads the tiny model's character tokenizer as
    # Qwen2's, which drops spaces, and observations must be tokenized as the policy's tokenizer does
    tokenizer = load_tokenizer(model_dir)
    loaded = time.time()
    seed = sample_seed(spec.seed, iteration)
    environment = spec.rollout.environment
    if environment is not None:
        from rlpipe.engines import sampled_trajectories
        from rlpipe.environments import Codec, environment_factory, run_trajectories

        sampling = Sampling.of(spec)
        repeated = [row for row in rows or [] for _ in range(sampling.samples)]
        trajectories = run_trajectories(
            sample_turns(llm, sampling, seed),
            environment_factory(environment),
            repeated,
            [list(row["prompt_token_ids"]) for row in repeated],
            Codec.of(tokenizer),
            environment,
            sampling.max_new_tokens,
        )
        return sampled_trajectories(trajectories, Codec.of(tokenizer), loaded)
    completions = sample_groups(llm, prompt_ids, Sampling.of(spec), seed)
    texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    return Sampled(completions, texts, loaded, {})
