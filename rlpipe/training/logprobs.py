"""Log-probabilities of completion tokens, as the update computes them: right-padded rows,
softmax(logits / T) in fp32.

The logits of a micro-batch are its largest tensor: N tokens x V vocabulary in fp32, and the
log-softmax and its gradient as large again (16,384 tokens x 151,936 = 10 GB each). `completion_logprobs_and_entropy`
never holds them whole: from the decoder's final hidden states it takes only the completion tokens'
positions, and runs head -> log-softmax -> gather (-> entropy) over chunks of trainer.logit_chunk_tokens
of them, each chunk checkpointed (its logits recomputed in the backward pass, one chunk at a time).
Peak: chunk x V instead of N x V; values and gradients are the full computation's.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from rlpipe.training.batching import MicroBatch, pack, window_column

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from peft import PeftModel
    from transformers import PreTrainedModel

# config fields of heads that do more than hidden @ W^T (Gemma 2's soft-capping, Cohere's and Granite's
# scales): those models go through their own forward, whole logits
HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


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


def model_inputs(mb: MicroBatch) -> dict:
    """A forward pass's inputs for `mb`: ids and attention mask, or packed ids, their positions and row ends."""
    if not mb.packed:
        return {"input_ids": mb.input_ids, "attention_mask": mb.attention}
    from rlpipe.training.packed_attention import packed_attention_kwargs

    assert mb.row_ends is not None  # packed: packed_layout sets the row ends
    return {"input_ids": mb.input_ids, "position_ids": mb.positions, **packed_attention_kwargs(mb.row_ends)}


def window_of(outputs: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[B, T, ...]: a forward pass's per-position outputs ([B, L, ...] padded, [1, N, ...] packed) at `mb`'s
    window: column j of row i holds the output at the row's position start + j."""
    return outputs[0, mb.window_index] if mb.packed else outputs[:, mb.start : -1]


def completion_logits(model: PreTrainedModel | PeftModel, mb: MicroBatch) -> torch.Tensor:
    """[B, T, V]: the logits of `mb`'s window (positions start .. L - 2). transformers'
    logits_to_keep applies the LM head (hidden x vocabulary) to the last L - start positions only
    (packed: every position's, then the window's)."""
    if mb.packed:
        return window_of(model(**model_inputs(mb)).logits, mb)
    keep = mb.input_ids.shape[1] - mb.start
    return model(**model_inputs(mb), logits_to_keep=keep).logits[:, :-1]


def chunks_head_on_hidden(model: PreTrainedModel | PeftModel) -> bool:
    """Whether the logits are the output embedding applied to the decoder's last hidden state, so that
    they can be computed in chunks from it. Not for heads with a transform (HEAD_TRANSFORMS), nor for
    an FSDP-sharded model, whose root unit gathers the head only inside its own forward."""
    from rlpipe.training.distributed import is_sharded

    config = model.config
    if is_sharded(model) or any(getattr(config, name, None) for name in HEAD_TRANSFORMS):
        return False
    return callable(getattr(model, "get_decoder", None)) and model.get_output_embeddings() is not None


def chunk_logprobs_and_entropy(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] log-probs of `targets` and entropies from [n, H] hidden states: one chunk's logits, made and freed here."""
    return token_logprobs_and_entropy(head(hidden), targets, temperature, entropy_grad)


def completion_logprobs_and_entropy(
    model: PreTrainedModel | PeftModel,
    mb: MicroBatch,
    temperature: float,
    chunk_tokens: int | None,
    entropy_grad: bool = False,
    precision: contextlib.AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log pi(target | prefix) and entropy of `mb`'s window (chunked: 0 off its completion tokens,
    which every loss masks).

    chunk_tokens None (or a model whose head cannot be chunked): the whole logits at once. Else the
    decoder's hidden states at the completion positions, in chunks of chunk_tokens through the head,
    each chunk checkpointed when gradients are on. `precision` (autocast) wraps the forward passes."""
    precision = precision or contextlib.nullcontext()
    if chunk_tokens is None or not chunks_head_on_hidden(model):
        with precision:
            logits = completion_logits(model, mb)
        return token_logprobs_and_entropy(logits, mb.targets, temperature, entropy_grad)
    with precision:
        hidden = model.get_decoder()(**model_inputs(mb)).last_hidden_state
    on_completion = mb.completion_mask.bool()
    if mb.packed:  # [n, H], n = completion tokens
        assert mb.window_index is not None  # packed: packed_layout sets the window index
        hidden = hidden[0, mb.window_index[on_completion]]
    else:
        hidden = hidden[:, mb.start : -1][on_completion]
    targets = mb.targets[on_completion]
    head = model.get_output_embeddings()
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for begin in range(0, len(targets), chunk_tokens):
        args = (head, hidden[begin : begin + chunk_tokens], targets[begin : begin + chunk_tokens], temperature)
        with precision:
            if torch.is_grad_enabled():
                parts.append(checkpoint(chunk_logprobs_and_entropy, *args, entropy_grad, use_reentrant=False))
            else:
                parts.append(chunk_logprobs_and_entropy(*args, False))
    logprobs = torch.zeros(mb.completion_mask.shape, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logprobs)
    if parts:
        logprobs = logprobs.masked_scatter(on_completion, torch.cat([p[0] for p in parts]))
        entropy = entropy.masked_scatter(on_completion, torch.cat([p[1] for p in parts]))
    return logprobs, entropy


def sequence_key(row: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a completion's log-probs depend on: its prompt and completion token ids."""
    return tuple(row["prompt_token_ids"]), tuple(row["completion_token_ids"])


@torch.no_grad()
def completion_logprobs(
    model: PreTrainedModel | PeftModel,
    rows: list[dict],
    pad_id: int,
    temperature: float,
    bf16: bool = False,
    chunk_tokens: int | None = None,
    packed: bool = False,
) -> list[list[float]]:
    """log pi(token | prefix) of each row's completion tokens after its prompt (rows with prompt_token_ids
    and completion_token_ids); one no-grad forward pass over `rows` (padded, or `packed`: the model must
    have rlpipe.training.packed_attention's attention), the head in chunks of chunk_tokens."""
    mb = pack(rows, pad_id, packed).to(model.device)
    precision = torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16)
    logprobs = completion_logprobs_and_entropy(model, mb, temperature, chunk_tokens, precision=precision)[0].cpu()
    found = []
    for i, row in enumerate(rows):
        start = window_column(row, mb)
        found.append(logprobs[i, start : start + len(row["completion_token_ids"])].tolist())
    return found
