"""Offline DPO (algorithm.name: dpo): its pipeline's own steps, in plain Python.

    prepare -> warm_start -> publish_warm_start                  (the RL pipeline's, unchanged)
    -> preferences          the preference set, once: preferences/{train,eval}.parquet
    -> reference_logprobs   the frozen v0's per-token log-probs of every chosen and rejected
                            completion, once, as columns beside the pairs
    -> per iteration: dpo_update (v(N) on the next rollout.prompts_per_iteration pairs; stage v(N+1))
                      -> sync_weights -> evaluate when due        (the RL pipeline's)
    -> track (MLflow)

A pair row: prompt_id, prompt, prompt_token_ids, chosen, rejected (texts), chosen_token_ids,
rejected_token_ids (each through eos), then ref_chosen_logprobs and ref_rejected_logprobs.
Each step is a no-op once its output exists, so a rerun after a kill continues. The DAG is
pipelines/dpo_pipeline.py; the loss rlpipe.algorithms.dpo; the torch work rlpipe.training.dpo.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from rlpipe.rollouts import read_table
from rlpipe.store.run_root import data_uri, filesystem, join, move, read_json, write_json

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef

SPLITS = ("train", "eval")
REFERENCE_COLUMNS = ("ref_chosen_logprobs", "ref_rejected_logprobs")


def is_offline_dpo(spec: RunSpec) -> bool:
    """The spec's algorithm trains on a fixed preference set in the DPO pipeline."""
    from rlpipe.algorithms import get_algorithm

    algorithm = get_algorithm(spec.algorithm.name)
    return "pairs" in algorithm.needs and "groups" not in algorithm.needs


def check_dpo_spec(spec: RunSpec) -> None:
    """Settings the DPO pipeline cannot honour, with what to write instead."""
    if spec.trainer.resident:
        raise ValueError("algorithm.name dpo trains in its own update steps; set trainer.resident: false")
    if spec.rollout.engine != "torch":
        raise ValueError(
            "algorithm.name dpo samples its preference set with the torch engine; set rollout.engine: torch"
        )
    if spec.trainer.gpus * spec.trainer.nodes > 1:
        raise ValueError("algorithm.name dpo trains in one process for now; set trainer.gpus: 1")


def pairs_uri(run_root: str, split: str) -> str:
    return join(run_root, "preferences", f"{split}.parquet")


def summary_uri(run_root: str) -> str:
    """What the preferences and reference_logprobs steps measured; every dpo_update records it."""
    return join(run_root, "preferences", "summary.json")


def add_to_summary(run_root: str, metrics: dict[str, float]) -> None:
    write_json(summary_uri(run_root), (read_json(summary_uri(run_root)) or {}) | metrics)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def write_pairs(pairs: list[dict] | object, uri: str) -> None:
    """Write pair rows (or a table) atomically: a reader never sees half a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    table = pairs if isinstance(pairs, pa.Table) else pa.Table.from_pylist(pairs)
    with fs.open(path + ".tmp", "wb") as f:
        pq.write_table(table, f)
    move(uri + ".tmp", uri)


def pairs_from_samples(
    rows: list[dict], token_ids: list[list[int]], texts: list[str], scores: list[float], group: int, per_prompt: int
) -> list[dict]:
    """Pairs from `group` scored samples of each row (prompt-major): chosen = a sample the verifier
    accepts more than the rejected one (with 0/1 scores: correct vs wrong), paired best-with-worst in
    each group as online DPO pairs them (rlpipe.algorithms.dpo.preference_roles), at most `per_prompt`
    per prompt. A prompt whose samples all score the same gives none."""
    from rlpipe.algorithms.dpo import preference_roles

    group_ids = np.repeat(np.arange(len(rows)), group)
    roles = preference_roles(np.asarray(scores, dtype=np.float64), group_ids)
    pairs = []
    for g, row in enumerate(rows):
        members = range(g * group, (g + 1) * group)
        chosen = [i for i in members if roles[i] > 0]
        rejected = [i for i in members if roles[i] < 0]
        for c, r in list(zip(chosen, rejected))[:per_prompt]:
            pairs.append(pair_row(row, texts[c], texts[r], token_ids[c], token_ids[r]))
    return pairs


def pair_row(row: dict, chosen: str, rejected: str, chosen_ids: list[int], rejected_ids: list[int]) -> dict:
    return {
        "prompt_id": int(row.get("prompt_id", row.get("_row", 0))),
        "prompt": row["prompt"],
        "prompt_token_ids": list(row["prompt_token_ids"]),
        "chosen": chosen,
        "rejected": rejected,
        "chosen_token_ids": list(chosen_ids),
        "rejected_token_ids": list(rejected_ids),
    }


def pairs_from_columns(spec: RunSpec, rows: list[dict], tokenizer) -> list[dict]:
    """Pairs given by the data (preferences.chosen / preferences.rejected columns): each completion
    tokenized without special tokens, eos appended (as a sampled completion ends)."""
    p = spec.preferences
    pairs = []
    for row in rows:
        ids = [tokenizer(str(row[key]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for key in (p.chosen, p.rejected)]  # fmt: skip
        pairs.append(pair_row(row, str(row[p.chosen]), str(row[p.rejected]), *ids))
    return pairs


def build_preferences(spec: RunSpec, run_root: str, cache_root: str) -> dict[str, float]:
    """The preferences step: preferences/{train,eval}.parquet from the prepared data (data/*.parquet),
    once. From the data's chosen/rejected columns when it has them; else sampled from v0 and ranked
    by reward.verifier (PreferencesSpec). Returns counts."""
    if all(exists(pairs_uri(run_root, split)) for split in SPLITS):
        return {}
    started = time.time()
    from rlpipe.rewards import call_reward
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.dpo import load_reference, sample_and_decode

    model, tokenizer = load_reference(spec, read_weight_ref(run_root, 0), cache_root)
    metrics: dict[str, float] = {}
    for index, split in enumerate(SPLITS):
        table = read_table(data_uri(run_root, split))
        rows = [row | {"prompt_id": i} for i, row in enumerate(table.to_pylist())]
        if {spec.preferences.chosen, spec.preferences.rejected} <= set(table.column_names):
            pairs = pairs_from_columns(spec, rows, tokenizer)
        else:
            group = spec.rollout.samples_per_prompt
            token_ids, texts = sample_and_decode(spec, model, tokenizer, [r["prompt_token_ids"] for r in rows], index)
            extra = [k for k in table.column_names if k != "prompt"]
            columns = {k: [r[k] for r in rows for _ in range(group)] for k in extra}
            prompts = [r["prompt"] for r in rows for _ in range(group)]
            scores = call_reward(
                spec.reward.verifier, prompts, texts, columns, "reward.verifier", spec.reward.timeout_s
            )
            pairs = pairs_from_samples(rows, token_ids, texts, scores, group, spec.preferences.pairs_per_prompt)
            metrics[f"preferences/{split}_sampled_accuracy"] = float(np.mean(scores))
        if not pairs:
            raise ValueError(
                f"no preference pairs from the {split} prompts: every prompt's samples scored the same. Raise "
                "rollout.samples_per_prompt or rollout.temperature, or warm-start to a middling accuracy "
                "(model.warm_start.target_accuracy)"
            )
        write_pairs(pairs, pairs_uri(run_root, split))
        metrics[f"preferences/{split}_pairs"] = float(len(pairs))
        metrics[f"preferences/{split}_prompts"] = float(len(rows))
    add_to_summary(run_root, metrics)
    return metrics | {"time/preferences_s": time.time() - started}


def compute_reference_logprobs(spec: RunSpec, run_root: str, cache_root: str) -> dict[str, float]:
    """The reference_logprobs step: the frozen v0's log-probs of every pair's chosen and rejected
    completion, added as columns beside the pairs, once (the update then needs no reference model)."""
    uris = [pairs_uri(run_root, split) for split in SPLITS]
    tables = [read_table(uri) for uri in uris]
    if all(set(REFERENCE_COLUMNS) <= set(t.column_names) for t in tables):
        return {}
    started = time.time()
    import pyarrow as pa

    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.dpo import load_reference, reference_columns

    model, tokenizer = load_reference(spec, read_weight_ref(run_root, 0), cache_root)
    metrics = {}
    for split, uri, table in zip(SPLITS, uris, tables):
        table = table.drop_columns([c for c in REFERENCE_COLUMNS if c in table.column_names])
        columns = reference_columns(spec, model, tokenizer, table.to_pylist())
        for name, values in columns.items():
            table = table.append_column(name, pa.array(values, type=pa.list_(pa.float32())))
        write_pairs(table, uri)
        chosen, rejected = (np.array([sum(v) for v in columns[c]]) for c in REFERENCE_COLUMNS)
        metrics[f"dpo/{split}_logprob_accuracy_v0"] = float(np.mean(chosen > rejected))
    add_to_summary(run_root, metrics)
    return metrics | {"time/reference_logprobs_s": time.time() - started}


def iteration_pairs(spec: RunSpec, pairs: list[dict], iteration: int) -> list[dict]:
    """Iteration N's pairs: the next rollout.prompts_per_iteration of a per-epoch shuffle (as the RL
    loop takes prompts, rlpipe.data.order.prompt_indices)."""
    from rlpipe.data.order import prompt_indices

    per_iteration = min(spec.rollout.prompts_per_iteration, len(pairs))
    return [pairs[i] for i in prompt_indices(len(pairs), per_iteration, iteration, spec.seed)]


def dpo_update(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """The dpo_update step: v(N) trained on iteration N's pairs, v(N+1) staged and sealed; the
    preference accuracy of v(N+1) on preferences.eval_pairs held-out pairs and as many train pairs."""
    from rlpipe.training.dpo import dpo_iteration

    train = read_table(pairs_uri(run_root, "train"))
    if not set(REFERENCE_COLUMNS) <= set(train.column_names):
        raise RuntimeError(f"{pairs_uri(run_root, 'train')} has no reference log-probs: run reference_logprobs first")
    train_rows = train.to_pylist()
    held_out = read_table(pairs_uri(run_root, "eval")).to_pylist()
    n = spec.preferences.eval_pairs
    check = {"eval": held_out[:n], "train": train_rows[:n]}
    staged, metrics = dpo_iteration(
        spec, run_root, weights, iteration, cache_root, iteration_pairs(spec, train_rows, iteration), check
    )
    return staged, (read_json(summary_uri(run_root)) or {}) | metrics
