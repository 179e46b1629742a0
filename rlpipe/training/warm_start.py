"""warm_start: the initial policy v0 — built or loaded, then a short SFT on task answers.

The SFT result is cached under <storage.cache>/warm_start/<key> so a second run skips it, without
importing torch or transformers (they are imported where a model is built or trained): staging a cached
v0 takes ~0.1 s where the imports alone took ~3 s of every run's first pipeline run.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
import uuid
from pathlib import Path

from rlpipe.spec import WARM_START_KEYS, EnvironmentSpec, RewardSpec, RunSpec, WarmStartSpec, pick, section_dict
from rlpipe.store.run_root import data_counts_uri, data_uri, filesystem, read_json
from rlpipe.store.weights import WeightRef, seal, staging_uri


def cache_key(spec: RunSpec) -> str:
    """Everything that determines the warm-started weights."""
    parts = pick(section_dict(spec), WARM_START_KEYS)
    parts["model"].pop("lora", None)  # v0 is the same whether adapters are trained on it or not
    if parts["rollout.environment"] is None:  # single-turn runs keep the keys they had before environments
        del parts["rollout.environment"]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def sft_completion(row: dict, template: str) -> str:
    """The row's SFT target: model.warm_start.completion formatted with its columns."""
    try:
        return template.format(**row)
    except KeyError as err:
        raise ValueError(
            f"model.warm_start.completion {template!r} names column {err} that the data lacks; columns: "
            f"{', '.join(row)}. Point it at the answer column, or set model.warm_start.max_steps: 0"
        ) from None


def transcript_turns(row: dict, column: str) -> list[tuple[str, bool]]:
    """The row's SFT transcript (model.warm_start.transcript) as (text, is a model turn) pairs."""
    if column not in row:
        raise ValueError(
            f"model.warm_start.transcript names column {column!r} that the data lacks; columns: {', '.join(row)}"
        )
    turns = json.loads(row[column]) if isinstance(row[column], str) else row[column]
    roles = {"model": True, "environment": False}
    if not turns or any(not isinstance(t, dict) or t.get("role") not in roles for t in turns):
        raise ValueError(
            f"model.warm_start.transcript: column {column!r} must hold a JSON list of "
            f"{{role: model | environment, text}} turns; row {row.get('prompt')!r} has {row[column]!r}"
        )
    return [(str(t.get("text", "")), roles[t["role"]]) for t in turns]


def sft_example(tokenizer, row: dict, ws: WarmStartSpec) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one row: prompt + target + eos, labels -100 except on the model's tokens.
    A transcript's turns are tokenized one by one, as the multi-turn rollouts append them."""
    prompt = list(row["prompt_token_ids"])
    turns = (
        [(sft_completion(row, ws.completion), True)] if ws.transcript is None else transcript_turns(row, ws.transcript)
    )
    ids, labels = list(prompt), [-100] * len(prompt)
    for text, by_model in turns:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += turn
        labels += turn if by_model else [-100] * len(turn)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def sft_batches(tokenizer, rows: list[dict], ws: WarmStartSpec, rng: random.Random):
    """Endless batches of (input_ids, labels, attention) of `sft_example`s, right-padded."""
    import torch

    encoded = [sft_example(tokenizer, row, ws) for row in rows]
    batch_size = ws.batch_size
    while True:
        chosen = rng.sample(encoded, batch_size)
        width = max(len(ids) for ids, _ in chosen)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, lab) in enumerate(chosen):  # right-pad: positions start at 0
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(lab)] = torch.tensor(lab)
            attention[row, : len(ids)] = 1
        yield input_ids, labels, attention


def supervised_warm_start(
    model,
    tokenizer,
    rows: list[dict],
    ws: WarmStartSpec,
    seed: int,
    reward: RewardSpec,
    max_new_tokens: int,
    environment: EnvironmentSpec | None = None,
) -> dict[str, float]:
    """Next-token cross-entropy on answers until greedy accuracy on the first `ws.validation_size`
    rows (held out of the SFT batches) reaches `ws.target_accuracy`, checked every `ws.check_every`
    steps, for at most `ws.max_steps` steps. Returns the warm start's metrics."""
    import torch

    from rlpipe.evaluation.accuracy import greedy_samples

    validation, train = rows[: ws.validation_size], rows[ws.validation_size :]
    if len(train) < ws.batch_size:
        raise ValueError(
            f"model.warm_start: {len(train)} SFT rows after holding out validation_size={ws.validation_size} "
            f"are fewer than batch_size={ws.batch_size}; lower them or bring more train rows (data.train_size)"
        )
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    batches = sft_batches(tokenizer, train, ws, random.Random(seed))
    recent: list[float] = []
    accuracy, step = float("nan"), 0

    def validation_accuracy() -> float:
        _, scores = greedy_samples(
            model, tokenizer, validation, reward.verifier, max_new_tokens, len(validation), reward.timeout_s,
            environment=environment,
        )  # fmt: skip
        return sum(scores) / len(scores)

    model.train()
    while step < ws.max_steps:
        input_ids, labels, attention = (t.to(model.device) for t in next(batches))
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        recent = (recent + [loss.item()])[-50:]
        step += 1
        if ws.target_accuracy is not None and (step % ws.check_every == 0 or step == ws.max_steps):
            accuracy = validation_accuracy()
            if accuracy >= ws.target_accuracy:
                break
    if ws.target_accuracy is None:  # no stop check ran: measure where max_steps landed
        accuracy = validation_accuracy()
    model.eval()
    return {
        "warm_start/final_loss": sum(recent) / max(len(recent), 1),
        "warm_start/steps": float(step),
        "warm_start/validation_accuracy": accuracy,
        "warm_start/reached_target": float(ws.target_accuracy is None or accuracy >= ws.target_accuracy),
    }


def warm_start(spec: RunSpec, run_root: str, cache_root: str) -> tuple[WeightRef, dict[str, float]]:
    """Stage v0 (to be published by sync_weights); reuse the cached warm start when present."""
    started = time.time()
    metrics: dict[str, float] = {}
    cached = Path(cache_root) / "warm_start" / cache_key(spec)
    staged = staging_uri(run_root, 0)
    fs, staged_path = filesystem(staged)
    recorded = cached.with_name(f"{cached.name}.json")  # the SFT's metrics, beside the cached weights
    if (cached / "config.json").exists():
        fs.put(str(cached) + "/", staged_path, recursive=True)
        metrics |= json.loads(recorded.read_text()) if recorded.exists() else {}
        metrics["warm_start/cached"] = 1.0
    else:
        from rlpipe.models.devices import resolve_device
        from rlpipe.models.files import resolve_model_source
        from rlpipe.models.loading import build_char_tokenizer, build_tiny_model, configure_torch, load_policy
        from rlpipe.rollouts import read_table

        configure_torch(spec.trainer.threads)
        if spec.model.path:
            model, tokenizer = load_policy(resolve_model_source(spec.model.path, cache_root))
        else:
            tokenizer = build_char_tokenizer()
            model = build_tiny_model(spec.model.tiny, tokenizer, spec.seed)
        # mypy reads transformers' functools.wraps(Module.to) as unbound: the device as `self`
        model = model.to(resolve_device(spec.trainer.device))  # type: ignore[arg-type]
        ws = spec.model.warm_start
        if ws.max_steps:
            rows = read_table(data_uri(run_root, "train")).to_pylist()
            metrics |= supervised_warm_start(
                model,
                tokenizer,
                rows,
                ws,
                spec.seed,
                spec.reward,
                spec.rollout.max_new_tokens,
                spec.rollout.environment,
            )
        tmp = cached.with_name(f"{cached.name}.tmp-{uuid.uuid4().hex[:8]}")  # runs may warm-start one key at once
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        recorded.write_text(json.dumps(metrics))
        try:
            tmp.rename(cached)
        except OSError:  # another run cached the same warm start first: the same weights, keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        fs.put(str(cached) + "/", staged_path, recursive=True)
        metrics["warm_start/cached"] = 0.0
    metrics |= read_json(data_counts_uri(run_root)) or {}
    metrics["time/warm_start_s"] = time.time() - started
    return seal(staged, version=0, iteration=0, parent=None), metrics
