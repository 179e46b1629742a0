"""Offline DPO's torch work: sample the preference set from v0, the reference's log-probs of each pair
(once), and one iteration of DPO updates on the next slice of pairs. The step functions that call
these are in rlpipe/dpo_loop.py; the loss is rlpipe.algorithms.dpo."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from rlpipe.algorithms.dpo import DpoOptions
from rlpipe.metric_keys import UPDATE_LOAD, UPDATE_TIME
from rlpipe.models.loading import load_weights
from rlpipe.rollouts import write_table
from rlpipe.training.logprobs import completion_logprobs
from rlpipe.training.trainer import train_on_batch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def sample_and_decode(spec: RunSpec, model, tokenizer, prompt_ids: list[list[int]], seed: int) -> tuple[list, list]:
    """rollout.samples_per_prompt completions per prompt (prompt-major): (token ids, decoded texts)."""
    from rlpipe.engines import LoadedModel, Sampling
    from rlpipe.engines.torch_engine import complete_groups as sample_completions

    model.eval()
    completions = sample_completions(LoadedModel(model, tokenizer), prompt_ids, Sampling.of(spec), seed)
    return completions.token_ids, tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)


def batched_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    temperature: float,
    chunk_tokens: int | None,
    batch_size: int = 256,
) -> list[list[float]]:
    """completion_logprobs of each (prompt, completion), `batch_size` sequences per forward pass, the head
    in chunks of chunk_tokens."""
    model.eval()
    rows = [{"prompt_token_ids": list(p), "completion_token_ids": list(c)} for p, c in zip(prompts, completions)]
    return [
        logprobs
        for start in range(0, len(rows), batch_size)
        for logprobs in completion_logprobs(
            model, rows[start : start + batch_size], pad_id, temperature, chunk_tokens=chunk_tokens
        )
    ]


def reference_columns(spec: RunSpec, model, tokenizer, pairs: list[dict]) -> dict[str, list[list[float]]]:
    """ref_chosen_logprobs and ref_rejected_logprobs of every pair under `model` (the frozen v0)."""
    prompts = [p["prompt_token_ids"] for p in pairs]
    return {
        f"ref_{role}_logprobs": batched_logprobs(
            model,
            prompts,
            [p[f"{role}_token_ids"] for p in pairs],
            tokenizer.pad_token_id,
            spec.rollout.temperature,
            spec.trainer.logit_chunk_tokens,
        )
        for role in ("chosen", "rejected")
    }


def preference_accuracy(spec: RunSpec, model, tokenizer, pairs: list[dict]) -> dict[str, float]:
    """On `pairs`: the fraction with h_w > h_l (h = log pi - log pi_ref, summed over the completion:
    DPO's implicit reward ranks them right), the mean margin beta (h_w - h_l), and the fraction with
    log pi(y_w|x) > log pi(y_l|x) (the policy itself prefers the chosen one)."""
    if not pairs:
        return {}
    policy = {
        role: batched_logprobs(
            model,
            [p["prompt_token_ids"] for p in pairs],
            [p[f"{role}_token_ids"] for p in pairs],
            tokenizer.pad_token_id,
            spec.rollout.temperature,
            spec.trainer.logit_chunk_tokens,
        )
        for role in ("chosen", "rejected")
    }
    assert isinstance(spec.algorithm, DpoOptions)  # offline DPO's (dpo_iteration): the spec's algorithm is dpo
    beta = spec.algorithm.beta or 0.1
    right = margin = prefers = 0.0
    for i, pair in enumerate(pairs):
        chosen, rejected = sum(policy["chosen"][i]), sum(policy["rejected"][i])
        h_w = chosen - sum(pair["ref_chosen_logprobs"])
        h_l = rejected - sum(pair["ref_rejected_logprobs"])
        right += h_w > h_l
        margin += beta * (h_w - h_l)
        prefers += chosen > rejected
    n = len(pairs)
    return {"preference_accuracy": right / n, "reward_margin": margin / n, "logprob_accuracy": prefers / n}


def batch_rows(pairs: list[dict]) -> list[dict]:
    """The pairs as update rows (rlpipe.training.batching.pack): chosen (advantage +1) and rejected
    (-1) of pair k in group k, with the reference's log-probs computed once; the sampler log-probs
    (pi_old, only in the ratio statistic) are the reference's too."""
    rows = []
    for k, pair in enumerate(pairs):
        for index, (role, sign) in enumerate((("chosen", 1.0), ("rejected", -1.0))):
            reference = pair[f"ref_{role}_logprobs"]
            rows.append(
                {
                    "group_id": k,
                    "sample_index": index,
                    "prompt_token_ids": pair["prompt_token_ids"],
                    "completion_token_ids": pair[f"{role}_token_ids"],
                    "logprobs": reference,
                    "ref_logprobs": reference,
                    "advantage": sign,
                }
            )
    return rows


def dpo_iteration(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    cache_root: str,
    pairs: list[dict],
    check: dict[str, list[dict]],
) -> tuple[WeightRef, dict[str, float]]:
    """Train v(N) on `pairs` (the iteration's slice), stage and seal v(N+1); then the preference
    accuracy of v(N+1) on each of `check`'s pair sets (dpo/<name>_preference_accuracy, ...)."""
    t0 = time.time()
    # the reference's log-probs come with the pairs: no reference model in memory
    from rlpipe.store.weights import as_weight_ref
    from rlpipe.training.session import TrainerSession

    algorithm = dataclasses.replace(spec.algorithm, track_reference_kl=False)
    without_kl = dataclasses.replace(spec, algorithm=algorithm)
    session = TrainerSession.open(without_kl, run_root, as_weight_ref(weights), cache_root)
    loaded = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        batch = str(Path(scratch) / "batch.parquet")
        write_table(pa.Table.from_pylist(batch_rows(pairs)), batch)
        metrics = train_on_batch(session.trainer, batch, iteration)
    trained = time.time()
    policy = session.trainer.policy
    for name, rows in check.items():
        for key, value in preference_accuracy(spec, policy, session.trainer.tokenizer, rows).items():
            metrics[f"dpo/{name}_{key}"] = value
    policy.train()
    checked = time.time()
    sealed = session.save(iteration)
    return sealed, metrics | {
        UPDATE_LOAD: loaded - t0,
        UPDATE_TIME: trained - loaded + time.time() - checked,
        "time/preference_check_s": checked - trained,
    }


def load_reference(spec: RunSpec, weights: WeightRef, cache_root: str):
    """The frozen v0 (model, tokenizer) for sampling pairs and their reference log-probs."""
    model, tokenizer = load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device)
    return model.eval().requires_grad_(False), tokenizer
