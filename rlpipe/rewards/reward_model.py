"""A reward model as a reward: {type: reward_model, path: ..., batch_size: 32, max_length: 1024}.

An `AutoModelForSequenceClassification` (local directory, fsspec URI or hub id) scores each
prompt + completion; the reward is the logit `label` (0: the usual single-logit reward head).
Batched, on the GPU when there is one (bf16 there, fp32 on CPU). A spec with a reward model puts the
score step on the trainer image (and its GPU) on a cluster: rlpipe.steps.uses_trainer_image.
"""

from __future__ import annotations

from typing import Any

from rlpipe.rewards.registry import RewardError, RewardFunction, register_reward_type
from rlpipe.rewards.shaping import options_of

_LOADED: dict[tuple[str, str], Any] = {}  # (path, device) -> (model, tokenizer): one load per process


def load_reward_model(path: str, device: str, key: str) -> tuple[Any, Any]:
    """(model, tokenizer) for a sequence-classification model, loaded once per process."""
    if (path, device) in _LOADED:
        return _LOADED[(path, device)]
    from pathlib import Path

    import torch

    from rlpipe.models.files import resolve_model_source
    from rlpipe.models.optional_imports import unused_hidden

    with unused_hidden():
        from transformers import AutoModelForSequenceClassification

    from rlpipe.models.loading import load_tokenizer

    try:
        source = resolve_model_source(path, Path.home() / ".cache" / "rlpipe")  # a URI is copied here once
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype).to(device).eval()
        tokenizer = load_tokenizer(source)  # the saved tokenizer as saved (see load_tokenizer)
    except (OSError, ValueError) as err:
        raise RewardError(
            f"{key}: reward_model {path!r} could not be loaded ({type(err).__name__}: {err}); point `path` at a "
            "saved AutoModelForSequenceClassification directory, a URI or a hub id"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # the classifier reads the last non-pad token
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"  # keep the completion when prompt + completion is too long
    _LOADED[(path, device)] = (model, tokenizer)
    return model, tokenizer


def reward_model(options: dict[str, Any], key: str) -> RewardFunction:
    """score_i = RM(prompt_i + completion_i).logits[label], in batches of `batch_size`."""
    allowed = {"path": str, "batch_size": int, "max_length": int, "label": int, "device": str}
    options_of(options, allowed, ("path",), key, "reward_model")
    import torch

    device = options.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise RewardError(f"{key}: reward_model device {device} was asked for but no GPU is visible")
    model, tokenizer = load_reward_model(options["path"], device, key)
    batch_size, max_length, label = (
        options.get("batch_size", 32),
        options.get("max_length", 1024),
        options.get("label", 0),
    )
    if not 0 <= label < model.config.num_labels:
        raise RewardError(f"{key}: reward_model label {label} but the model has {model.config.num_labels} labels")

    @torch.inference_mode()
    def score(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            encoded = encoded_for_scoring(tokenizer, texts[start : start + batch_size], max_length).to(device)
            scores += model(**encoded).logits[:, label].float().tolist()
        return scores

    return score


def encoded_for_scoring(tokenizer: Any, texts: list[str], max_length: int) -> Any:
    """`texts` tokenized and right-padded as one batch of tensors. A text that already starts with the
    tokenizer's bos (a prompt its chat template rendered) gets no special tokens added: not a second bos."""
    bos = tokenizer.bos_token
    rows = [
        tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)), truncation=True, max_length=max_length)
        for text in texts
    ]
    return tokenizer.pad(rows, padding=True, return_tensors="pt")


register_reward_type("reward_model", reward_model)
