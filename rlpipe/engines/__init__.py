"""generate: sample G completions for each of this iteration's prompts with the current policy.

Engines (rollout.engine), each returning the same Completions:
  torch    the HF model in this process, batched KV-cache sampling; with trainer.resident, the
           resident trainer samples with the policy it holds (colocated, like TRL)
  vllm     vllm.LLM in this process
  sampler  long-lived vLLM servers; this step is an HTTP client and imports no torch
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from rlpipe.spec import RunSpec
from rlpipe.store.run_root import data_uri, filesystem
from rlpipe.store.weights import WeightRef, as_ref, local_path


def prompt_indices(num_rows: int, per_iteration: int, iteration: int, seed: int) -> list[int]:
    """Rows for `iteration` (1-based): consecutive slices of a per-epoch shuffle of the train set.

    data cursor = (iteration - 1) * per_iteration; epoch e uses permutation Random((seed, e)).
    """
    cursor = (iteration - 1) * per_iteration
    indices: list[int] = []
    while len(indices) < per_iteration:
        epoch, offset = divmod(cursor, num_rows)
        order = list(range(num_rows))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        take = order[offset : offset + per_iteration - len(indices)]
        indices += take
        cursor += len(take)
    return indices


def sample_seed(seed: int, iteration: int) -> int:
    """Seed of this iteration's sampling; vLLM engines seed sample j of prompt i with
    sample_seed + i * G + j."""
    return (seed * 1_000_003 + iteration * 65_537) % (2**31 - 4096)


def sample_torch(
    spec: RunSpec, weights: WeightRef, cache_root: str, prompts: list[str], iteration: int, policy: tuple | None
):
    import torch

    from rlpipe.engines.torch_engine import sample_in_batches
    from rlpipe.modeling import load_weights

    model, tokenizer = policy or load_weights(weights, cache_root, spec.trainer.threads)
    was_training = model.training
    model.eval()
    loaded = time.time()
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + iteration)
    completions = sample_in_batches(
        model,
        [ids for ids in prompt_ids for _ in range(spec.rollout.samples_per_prompt)],
        batch_size=spec.rollout.batch_size,
        max_new_tokens=spec.rollout.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=spec.rollout.temperature,
        top_k=spec.rollout.top_k,
        top_p=spec.rollout.top_p,
        generator=generator,
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    return prompt_ids, completions, texts, loaded, {}


def sample_vllm(spec: RunSpec, weights: WeightRef, cache_root: str, prompts: list[str], iteration: int):
    from rlpipe.engines.vllm_engine import load_engine, sample_groups

    llm = load_engine(local_path(weights, cache_root), spec.seed, gpu=False)
    tokenizer = llm.get_tokenizer()
    loaded = time.time()
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    r = spec.rollout
    seed = sample_seed(spec.seed, iteration)
    completions = sample_groups(llm, prompt_ids, r.samples_per_prompt, r.max_new_tokens, r.temperature, seed)
    texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    return prompt_ids, completions, texts, loaded, {}


def sample_service(
    spec: RunSpec, run_root: str, weights: WeightRef, cache_root: str, prompts: list[str], iteration: int
):
    from tokenizers import Tokenizer

    from rlpipe.services.sampler_client import ensure_version, generate_groups, ready_replicas, sampler_weights_dir

    s = spec.samplers
    urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    metrics = ensure_version(urls, sampler_weights_dir(weights["uri"]), weights["version"], s.request_timeout_s)
    tokenizer = Tokenizer.from_file(str(Path(local_path(weights, cache_root)) / "tokenizer.json"))
    loaded = time.time()
    prompt_ids = [tokenizer.encode(p).ids for p in prompts]
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
    )
    texts = tokenizer.decode_batch(completions.token_ids, skip_special_tokens=True)
    return prompt_ids, completions, texts, loaded, metrics | client_metrics | {"samplers/ready": float(len(urls))}


def generate_rollouts(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    out_path: str,
    cache_root: str,
    policy: tuple | None = None,
) -> dict[str, float]:
    """Write one rollout row per completion to `out_path` (Parquet); return step metrics.
    `policy` (model, tokenizer): sample with a model already in memory at `weights` (torch engine;
    the resident trainer's). With the torch engine and trainer.resident, the step asks the resident
    trainer to sample with the policy it holds: no model load and no weight sync."""
    t0 = time.time()
    weights = as_ref(weights)
    import pyarrow.parquet as pq  # not at the top: the thin client above needs no pyarrow

    from rlpipe.rollouts import ROLLOUT_SCHEMA, write_table

    table = pq.read_table(filesystem(data_uri(run_root, "train"))[1])
    order = prompt_indices(table.num_rows, spec.rollout.prompts_per_iteration, iteration, spec.seed)
    rows = table.take(order).to_pylist()
    group = spec.rollout.samples_per_prompt
    prompts = [row["prompt"] for row in rows]
    engine = spec.rollout.engine
    if engine == "torch":
        result = sample_torch(spec, weights, cache_root, prompts, iteration, policy)
    elif engine == "vllm":
        result = sample_vllm(spec, weights, cache_root, prompts, iteration)
    else:
        result = sample_service(spec, run_root, weights, cache_root, prompts, iteration)
    prompt_ids, completions, texts, loaded, engine_metrics = result
    sampled = time.time()

    n = len(completions.token_ids)
    write_table(
        {
            "prompt_id": [order[i // group] for i in range(n)],
            "group_id": [i // group for i in range(n)],
            "sample_index": [i % group for i in range(n)],
            "prompt": [rows[i // group]["prompt"] for i in range(n)],
            "reference": [rows[i // group]["reference"] for i in range(n)],
            "prompt_token_ids": [prompt_ids[i // group] for i in range(n)],
            "completion_token_ids": completions.token_ids,
            "logprobs": completions.logprobs,
            "finish_reason": completions.finish_reasons,
            "completion": texts,
            "weights_version": [weights["version"]] * n,
            "iteration": [iteration] * n,
        },
        out_path,
        ROLLOUT_SCHEMA,
    )
    new_tokens = sum(len(t) for t in completions.token_ids)
    return engine_metrics | {
        "overhead/generate_load_s": loaded - t0,
        "time/generate_s": time.time() - loaded,
        "throughput/generate_tokens_per_s": new_tokens / max(sampled - loaded, 1e-9),
        "rollout/completion_tokens_mean": new_tokens / n,
        "rollout/stop_fraction": sum(r == "stop" for r in completions.finish_reasons) / n,
    }
