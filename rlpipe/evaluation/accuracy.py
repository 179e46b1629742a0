"""evaluate: greedy accuracy (reward.verifier) of a weights version on the fixed held-out set, and
its strict companion (rlpipe.rewards.answer_checks.strict_match), which a gamed verifier cannot move.
When an iteration is evaluated and when the eval gate stops the loop: rlpipe.evaluation.cadence (torch-free,
so the evaluate step skips cheaply); what this module computes imports torch.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlpipe.metric_keys import EVAL_ACCURACY, EVAL_STRICT, EVAL_WEIGHTS_VERSION, EVALUATE_LOAD
from rlpipe.rollouts import read_table
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import (
    data_uri,
    eval_metrics_uri,
    write_eval_samples,
    write_json,
)
from rlpipe.store.weights import WeightRef, as_weight_ref

if TYPE_CHECKING:
    from rlpipe.engines import LoadedModel
    from rlpipe.environments import Trajectory
    from rlpipe.spec import EnvironmentSpec, EvalSetSpec


def greedy_texts(
    model,
    tokenizer,
    rows: list[dict],
    max_new_tokens: int,
    batch_size: int,
    bf16: bool = False,
    environment: EnvironmentSpec | None = None,
) -> tuple[list[str], list[Trajectory] | None]:
    """Greedy-decode every row's prompt: (the completions, None), or with an environment its greedy
    multi-turn trajectories (the last turns' texts, the trajectories)."""
    from rlpipe.engines import LoadedModel, Sampling
    from rlpipe.engines.torch_engine import complete, sample_trajectories

    was_training = model.training
    model.eval()
    loaded, sampling = LoadedModel(model, tokenizer), Sampling(1, max_new_tokens, batch_size=batch_size, bf16=bf16)
    try:
        if environment is not None:
            trajectories = sample_trajectories(loaded, rows, sampling, 0, environment, greedy=True)
            return [t.final_text for t in trajectories], trajectories
        prompts = [list(row["prompt_token_ids"]) for row in rows]
        completions = complete(loaded, prompts, sampling, generator=None, greedy=True)
        return tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True), None
    finally:
        model.train(was_training)


def verified(rows: list[dict], texts: list[str], verifier: str | dict, timeout_s: float | None) -> list[float]:
    """The verifier's score of each completion; it gets every other column of the rows as keyword
    lists (the reward signature)."""
    from rlpipe.rewards import call_reward

    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    return call_reward(verifier, [row["prompt"] for row in rows], texts, columns, "reward.verifier", timeout_s)


def greedy_samples(
    model,
    tokenizer,
    rows: list[dict],
    verifier: str | dict,
    max_new_tokens: int,
    batch_size: int,
    timeout_s: float | None = None,
    bf16: bool = False,
    environment: EnvironmentSpec | None = None,
) -> tuple[list[str], list[float]]:
    """Greedy completions of the rows (greedy_texts) and the verifier's score of each."""
    texts, _ = greedy_texts(model, tokenizer, rows, max_new_tokens, batch_size, bf16, environment)
    return texts, verified(rows, texts, verifier, timeout_s)


def eval_trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """eval/turns_mean, eval/tool_call_rate, ... of the greedy trajectories (trajectory_metrics)."""
    from rlpipe.environments import trajectory_metrics

    return {key.replace("rollout/", "eval/"): value for key, value in trajectory_metrics(trajectories).items()}


def answer_column(verifier: str | dict) -> str:
    """The data column holding the expected answer: a verifier type's answer_column, else `reference`
    (what the built-in verifier functions read)."""
    return verifier.get("answer_column", "reference") if isinstance(verifier, dict) else "reference"


def strict_scores(rows: list[dict], completions: list[str], answer: str) -> list[bool] | None:
    """Each completion's strict_match against the rows' `answer` column; None when the rows lack it."""
    from rlpipe.rewards.answer_checks import strict_match

    if any(row.get(answer) is None for row in rows):
        return None
    return [strict_match(completion, row[answer]) for row, completion in zip(rows, completions, strict=True)]


def eval_samples(
    rows: list[dict], completions: list[str], scores: list[float], answer: str, strict: list[bool] | None
) -> list[dict]:
    """The held-out rows as metrics/eval_N_samples.jsonl records them (rlpipe.store.run_root.read_eval_samples);
    correct: the verifier's full score (1.0); strict: strict_match (None without an answer column)."""
    return [
        {
            "index": i,
            "prompt": row["prompt"],
            "completion": completion,
            "answer": None if row.get(answer) is None else str(row[answer]),
            "reward": float(score),
            "correct": bool(score >= 1.0),
            "strict": None if strict is None else strict[i],
        }
        for i, (row, completion, score) in enumerate(zip(rows, completions, scores, strict=True))
    ]


def pass_at(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k from `samples` completions of which `correct` are (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k), the chance that k drawn without replacement hold a correct one."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def vote_key(completion: str) -> str:
    """What maj@k votes on: the completion's final answer (math_equivalence's rule), else its text."""
    from rlpipe.rewards.answer_checks import final_answer

    answer = final_answer(completion)
    return answer if answer is not None else completion.strip()


def majority_score(completions: list[str], scores: list[float]) -> float:
    """The verifier's score of the answer most completions give (ties: the one given first)."""
    keys = [vote_key(c) for c in completions]
    counts = collections.Counter(keys)
    winner = next(key for key in keys if counts[key] == max(counts.values()))
    return scores[keys.index(winner)]


def sampled_metrics(completions: list[list[str]], scores: list[list[float]], prefix: str = "eval/") -> dict[str, float]:
    """Over k sampled completions per prompt: mean_at_k, the verifier's mean (pass@1's unbiased estimate
    with partial credit); pass_at_j for j = 1, 2, 4, .., k (correct: a score of 1.0); maj_at_k."""
    k = len(scores[0])
    metrics = {
        f"{prefix}mean_at_{k}": sum(map(sum, scores)) / (k * len(scores)),
        f"{prefix}maj_at_{k}": sum(map(majority_score, completions, scores)) / len(scores),
    }
    for j in sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k}):
        passed = [pass_at(k, sum(score >= 1.0 for score in row), j) for row in scores]
        metrics[f"{prefix}pass_at_{j}"] = sum(passed) / len(passed)
    return metrics


def sampled_texts(model, tokenizer, rows: list[dict], k: int, spec: RunSpec, seed: int) -> list[list[str]]:
    """k completions of each row sampled at evaluation.temperature (multi-turn: the last turns' texts)."""
    from rlpipe.engines import LoadedModel, Sampling
    from rlpipe.engines.torch_engine import complete_groups, sample_trajectories

    sampling = Sampling(
        k,
        spec.rollout.max_new_tokens,
        spec.evaluation.temperature,
        batch_size=spec.rollout.batch_size,
        bf16=spec.trainer.dtype == "bfloat16",
    )
    was_training = model.training
    model.eval()
    try:
        environment = spec.rollout.environment
        if environment is not None:
            trajectories = sample_trajectories(LoadedModel(model, tokenizer), rows, sampling, seed, environment)
            texts = [t.final_text for t in trajectories]
        else:
            prompts = [list(row["prompt_token_ids"]) for row in rows]
            completions = complete_groups(LoadedModel(model, tokenizer), prompts, sampling, seed)
            texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return [texts[i * k : (i + 1) * k] for i in range(len(rows))]


def evaluate_set(
    spec: RunSpec, model, tokenizer, rows: list[dict], verifier: str | dict, k: int, prefix: str, seed: int
) -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples) of one held-out set: greedy accuracy and its strict companion, and with k > 0
    the sampled metrics; each row's greedy completion and, with k > 0, its samples and their scores."""
    completions, trajectories = greedy_texts(
        model,
        tokenizer,
        rows,
        spec.rollout.max_new_tokens,
        spec.rollout.batch_size,
        spec.trainer.dtype == "bfloat16",
        spec.rollout.environment,
    )
    scores = verified(rows, completions, verifier, spec.reward.timeout_s)
    answer = answer_column(verifier)
    strict = strict_scores(rows, completions, answer)
    metrics = {
        EVAL_ACCURACY.replace("eval/", prefix): sum(scores) / len(scores),
        **({} if strict is None else {EVAL_STRICT.replace("eval/", prefix): sum(strict) / len(strict)}),
    }
    if trajectories is not None:
        metrics |= {key.replace("eval/", prefix): v for key, v in eval_trajectory_metrics(trajectories).items()}
    samples = eval_samples(rows, completions, scores, answer, strict)
    for sample, trajectory in zip(samples, trajectories or [], strict=False):
        sample["transcript"] = tokenizer.decode(trajectory.completion_token_ids, skip_special_tokens=True)
        sample["tool_calls"] = trajectory.tool_calls
    if k:
        texts = sampled_texts(model, tokenizer, rows, k, spec, seed)
        repeated = [row for row in rows for _ in range(k)]
        flat = verified(repeated, [t for row in texts for t in row], verifier, spec.reward.timeout_s)
        sampled_scores = [flat[i * k : (i + 1) * k] for i in range(len(rows))]
        metrics |= sampled_metrics(texts, sampled_scores, prefix)
        for sample, row_texts, row_scores in zip(samples, texts, sampled_scores, strict=True):
            sample["samples"] = [{"completion": t, "reward": float(r)} for t, r in zip(row_texts, row_scores)]
    return metrics, samples


def held_out_sets(spec: RunSpec, sets: Sequence[EvalSetSpec]) -> list[tuple[str | None, str, str | dict, int]]:
    """(name, split, verifier, samples) of the data's held-out set (name None) and of the evaluation.sets
    entries `sets`."""
    k = spec.evaluation.samples
    return [(None, "eval", spec.reward.verifier, k)] + [
        (s.name, f"eval_{s.name}", s.verifier or spec.reward.verifier, k if s.samples is None else s.samples)
        for s in sets
    ]


def recorded_metrics(spec: RunSpec) -> list[str]:
    """The eval metrics `spec`'s evals record (evaluate_policy), as the functions that compute them name them
    (here on a placeholder row): each held-out set's greedy accuracy and its strict companion, the multi-turn
    metrics with an environment, the sampled metrics with samples. evaluation.harness's are not known before
    lm_eval runs its tasks: harness/<task>/<metric>."""
    names = [EVAL_WEIGHTS_VERSION]
    for name, _, _, k in held_out_sets(spec, spec.evaluation.sets):
        prefix = "eval/" if name is None else f"eval/{name}/"
        names += [EVAL_ACCURACY.replace("eval/", prefix), EVAL_STRICT.replace("eval/", prefix)]
        if spec.rollout.environment is not None:
            names += [key.replace("eval/", prefix) for key in eval_trajectory_metrics([])]
        if k:
            names += list(sampled_metrics([[""] * k], [[0.0] * k], prefix))
    return names


def evaluate_policy(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    cache_root: str,
    loaded: LoadedModel | None = None,
    record: bool = True,
) -> dict[str, float]:
    """Held-out metrics of `weights` (`evaluate_set`) on the data's held-out set and each evaluation.sets
    entry due at iteration N (and evaluation.harness's tasks when due: rlpipe.evaluation.harness), recorded in
    metrics/eval_N.json, and each row's completions and scores in
    metrics/eval_N_samples.jsonl (a named set's: eval_N_<name>_samples.jsonl), unless `record` is False
    (the resident trainer's other processes). `loaded`: a model already in memory at `weights`."""
    from rlpipe.evaluation.cadence import eval_sets_due
    from rlpipe.evaluation.harness import harness_due
    from rlpipe.models.loading import load_weights

    t0 = time.time()
    weights = as_weight_ref(weights)
    if loaded is None:
        model, tokenizer = load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device)
    else:
        model, tokenizer = loaded.model, loaded.tokenizer
    loaded_at = time.time()
    seed = spec.seed * 1_000_003 + 777_777 + iteration  # apart from every rollout's sampling stream
    metrics: dict[str, float] = {}
    recorded: list[tuple[str | None, list[dict]]] = []
    for name, split, verifier, k in held_out_sets(spec, eval_sets_due(spec, iteration)):
        rows = read_table(data_uri(run_root, split)).to_pylist()
        prefix = "eval/" if name is None else f"eval/{name}/"
        set_metrics, samples = evaluate_set(spec, model, tokenizer, rows, verifier, k, prefix, seed)
        metrics |= set_metrics
        recorded.append((name, samples))
    if harness_due(spec, iteration):
        from rlpipe.evaluation.harness import run_harness

        metrics |= run_harness(spec, model, tokenizer)
    metrics |= {
        EVAL_WEIGHTS_VERSION: float(weights["version"]),
        EVALUATE_LOAD: loaded_at - t0,
        "time/evaluate_s": time.time() - loaded_at,
    }
    if record:  # the samples first: an eval whose metrics file exists has its samples
        for name, samples in recorded:
            write_eval_samples(run_root, iteration, samples, name)
        write_json(eval_metrics_uri(run_root, iteration), metrics)
    return metrics
