"""The sampler engine: long-lived vLLM servers (rlpipe.clients.sampler_client); the generate
step is an HTTP client and imports no torch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.engines import Policy, Sampled, sample_seed
from rlpipe.store.weights import stored_path

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def sample_prompts(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    cache_root: str,
    prompt_ids: list[list[int]],
    iteration: int,
    policy: Policy | None = None,
) -> Sampled:
    """rollout.samples_per_prompt completions per prompt from the samplers, after making sure every
    ready replica serves `weights` (reloaded in place when it does not; an adapter version's
    requests name its adapter where the samplers serve adapters)."""
    from tokenizers import Tokenizer

    from rlpipe.clients.sampler_client import (
        adapter_name,
        ensure_version,
        generate_groups,
        ready_replicas,
        sampler_weights_dir,
    )
    from rlpipe.vllm_environment import serves_adapters

    s = spec.samplers
    urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    weights_dir = sampler_weights_dir(weights["uri"])
    adapters = serves_adapters(spec)
    metrics = ensure_version(urls, weights_dir, weights["version"], s.request_timeout_s, adapters)
    tokenizer = Tokenizer.from_file(str(Path(stored_path(weights, cache_root)) / "tokenizer.json"))  # a delta's too
    loaded = time.time()
    r = spec.rollout
    sampling = {"max_tokens": r.max_new_tokens, "temperature": r.temperature}
    completions, client_metrics = generate_groups(
        urls,
        prompt_ids,
        r.samples_per_prompt,
        sampling,
        sample_seed(spec.seed, iteration),
        weights["version"],
        s.requests_per_replica,
        s.request_timeout_s,
        adapter_name(weights_dir, weights["version"]) if adapters else None,
    )
    texts = tokenizer.decode_batch(completions.token_ids, skip_special_tokens=True)
    metrics |= client_metrics | {"samplers/ready": float(len(urls))}
    return Sampled(completions, texts, loaded, metrics)
