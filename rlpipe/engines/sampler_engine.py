"""The sampler engine: long-lived vLLM servers, asked over HTTP (rlpipe.engines.sampler_requests); the
generate step imports no torch. The servers already serve the version to sample: sync_weights reloads them, and
a replica that restarted since catches up first (rlpipe.services.samplers.client.serve_version)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.engines import Sampled, SampleRequest, sample_seed
from rlpipe.rollouts import Completions
from rlpipe.store.weights import stored_path

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


def sample_prompts(request: SampleRequest) -> Sampled:
    """rollout.samples_per_prompt completions per prompt from the ready replicas, which serve `weights`
    (an adapter version's requests name its adapter where the samplers serve adapters) and report log-probs
    at rollout.temperature (checked once per replica: check_logprobs); with rollout.environment,
    multi-turn trajectories of `rows`, each turn one request per sequence."""
    from tokenizers import Tokenizer

    from rlpipe.engines.logprobs_check import check_logprobs
    from rlpipe.engines.sampler_requests import adapter_name, generate_groups, ready_replicas, sampler_weights_dir
    from rlpipe.engines.vllm_settings import serves_adapters

    spec, run_root, weights, cache_root = request.spec, request.run_root, request.weights, request.cache_root
    prompt_ids, iteration, rows = request.prompt_ids, request.stream, request.rows
    s = spec.samplers
    urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    weights_dir = sampler_weights_dir(weights["uri"])
    adapters = serves_adapters(spec)
    metrics: dict[str, float] = {}
    check_logprobs(urls, run_root, prompt_ids[0], spec.rollout.temperature, s.request_timeout_s)
    tokenizer = Tokenizer.from_file(str(Path(stored_path(weights, cache_root)) / "tokenizer.json"))  # a delta's too
    loaded = time.time()
    r = spec.rollout
    model = adapter_name(weights_dir, weights["version"]) if adapters else None
    seed = sample_seed(spec.seed, iteration)
    if r.environment is not None:
        return sample_trajectories(spec, urls, rows or [], seed, weights["version"], model, tokenizer, loaded, metrics)
    sampling = {"max_tokens": r.max_new_tokens, "temperature": r.temperature}
    completions, client_metrics = generate_groups(
        urls,
        prompt_ids,
        r.samples_per_prompt,
        sampling,
        seed,
        weights["version"],
        s.requests_per_replica,
        s.request_timeout_s,
        model,
    )
    texts = tokenizer.decode_batch(completions.token_ids, skip_special_tokens=True)
    metrics |= client_metrics | {"samplers/ready": float(len(urls))}
    return Sampled(completions, texts, loaded, metrics)


def sample_trajectories(
    spec: RunSpec,
    urls: list[str],
    rows: list[dict],
    seed: int,
    version: int,
    model: str | None,
    tokenizer,
    loaded: float,
    metrics: dict[str, float],
) -> Sampled:
    """rollout.samples_per_prompt trajectories per row against rollout.environment
    (rlpipe.environments.run_trajectories), each turn's sequences fanned across the samplers as
    generate_groups fans prompts; request k of the n-th sequence drawn is seeded seed + n."""
    from rlpipe.engines import sampled_trajectories
    from rlpipe.engines.sampler_requests import generate_groups
    from rlpipe.environments import Codec, environment_factory, run_trajectories

    r, s = spec.rollout, spec.samplers
    environment = r.environment
    assert environment is not None  # sample_prompts rolls out trajectories only with rollout.environment
    drawn = 0
    client: dict[str, float] = {}

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        nonlocal drawn
        sampling = {"max_tokens": max_new_tokens, "temperature": r.temperature, "stop_token_ids": sorted(stop_ids)}
        completions, turn = generate_groups(
            urls, sequences, 1, sampling, seed + drawn, version, s.requests_per_replica, s.request_timeout_s, model
        )
        drawn += len(sequences)
        for key, value in turn.items():
            client[key] = client.get(key, 0.0) + value
        return completions

    codec = Codec(
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    repeated = [row for row in rows for _ in range(r.samples_per_prompt)]
    prompts = [list(row["prompt_token_ids"]) for row in repeated]
    trajectories = run_trajectories(
        sample_turn, environment_factory(environment), repeated, prompts, codec, environment, r.max_new_tokens
    )
    sampled = sampled_trajectories(trajectories, codec, loaded)
    sampled.metrics |= metrics | client | {"samplers/ready": float(len(urls))}
    return sampled
