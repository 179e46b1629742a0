"""Log-probabilities of completion tokens, as the update computes them: right-padded rows,
softmax(logits / T) in fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlpipe.training.batching import pack

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


def sequence_key(row: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a completion's log-probs depend on: its prompt and completion token ids."""
    return tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"])


@torch.no_grad()
def completion_logprobs(
    model: PreTrainedModel, rows: list[dict], pad_id: int, temperature: float, bf16: bool = False
) -> list[list[float]]:
    """log pi(token | prefix) of each row's completion tokens after its prompt (rows with prompt_token_ids
    and completion_token_ids); one no-grad forward pass over `rows`."""
    mb = pack(rows, pad_id)
    input_ids = mb.input_ids.to(model.device)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, attention_mask=mb.attention.to(model.device)).logits[:, :-1]
    logprobs = token_logprobs(logits, input_ids[:, 1:], temperature).cpu()
    found = []
    for i, row in enumerate(rows):
        start = len(row["prompt_token_ids"]) - 1
        found.append(logprobs[i, start : start + len(row["completion_token_ids"])].tolist())
    return found
