"""Log-probabilities of completion tokens, as the update computes them: right-padded rows,
softmax(logits / T) in fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlpipe.training.batching import MicroBatch, pack, window_column

if TYPE_CHECKING:  # transformers is imported through rlpipe.modeling (rlpipe.optional_imports)
    from transformers import PreTrainedModel


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(target_t | prefix) under softmax(logits / T), for each position."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs, and the entropy H_t = -sum_v p_v log p_v of each position (with a gradient
    only for an entropy bonus), from one log-softmax over the vocabulary."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def completion_logits(model: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """[B, T, V]: the logits of `mb`'s window (positions start .. L - 2). transformers'
    logits_to_keep applies the LM head (hidden x vocabulary) to the last L - start positions only."""
    keep = mb.input_ids.shape[1] - mb.start
    return model(input_ids=mb.input_ids, attention_mask=mb.attention, logits_to_keep=keep).logits[:, :-1]


def sequence_key(row: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a completion's log-probs depend on: its prompt and completion token ids."""
    return tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"])


@torch.no_grad()
def completion_logprobs(
    model: PreTrainedModel, rows: list[dict], pad_id: int, temperature: float, bf16: bool = False
) -> list[list[float]]:
    """log pi(token | prefix) of each row's completion tokens after its prompt (rows with prompt_token_ids
    and completion_token_ids); one no-grad forward pass over `rows`."""
    mb = pack(rows, pad_id).to(model.device)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = completion_logits(model, mb)
    logprobs = token_logprobs(logits, mb.targets, temperature).cpu()
    found = []
    for i, row in enumerate(rows):
        start = window_column(row, mb)
        found.append(logprobs[i, start : start + len(row["completion_token_ids"])].tolist())
    return found
