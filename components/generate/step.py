"""generate: sample G completions for each of this iteration's prompts with the current policy."""

from __future__ import annotations

import random
import time

import pyarrow.parquet as pq
import torch

from rlpipe.components.generate.torch_engine import sample_in_batches
from rlpipe.modeling import load_weights
from rlpipe.rollouts import ROLLOUT_SCHEMA, write_table
from rlpipe.run_store import filesystem, join
from rlpipe.spec import RunSpec
from rlpipe.weight_store import WeightRef, as_ref


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


def generate_rollouts(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, out_path: str, cache_root: str
) -> dict[str, float]:
    """Write one rollout row per completion to `out_path` (Parquet); return step metrics."""
    t0 = time.time()
    weights = as_ref(weights)
    model, tokenizer = load_weights(weights, cache_root, spec.trainer.threads)
    model.eval()
    loaded = time.time()

    table = pq.read_table(filesystem(join(run_root, "data", "train.parquet"))[1])
    order = prompt_indices(table.num_rows, spec.rollout.prompts_per_iteration, iteration, spec.seed)
    rows = table.take(order).to_pylist()
    group = spec.rollout.samples_per_prompt
    prompt_ids = [tokenizer(row["prompt"])["input_ids"] for row in rows]

    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + iteration)
    completions = sample_in_batches(
        model,
        [ids for ids in prompt_ids for _ in range(group)],
        batch_size=spec.rollout.batch_size,
        max_new_tokens=spec.rollout.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=spec.rollout.temperature,
        top_k=spec.rollout.top_k,
        top_p=spec.rollout.top_p,
        generator=generator,
    )
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
            "completion": tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True),
            "weights_version": [weights["version"]] * n,
            "iteration": [iteration] * n,
        },
        out_path,
        ROLLOUT_SCHEMA,
    )
    new_tokens = sum(len(t) for t in completions.token_ids)
    return {
        "overhead/generate_load_s": loaded - t0,
        "time/generate_s": time.time() - loaded,
        "throughput/generate_tokens_per_s": new_tokens / max(sampled - loaded, 1e-9),
        "rollout/completion_tokens_mean": new_tokens / n,
        "rollout/stop_fraction": sum(r == "stop" for r in completions.finish_reasons) / n,
    }
