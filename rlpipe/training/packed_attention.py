"""Attention over rows packed end to end into one sequence: padding-free micro-batches (trainer.padding_free).

A packed micro-batch is one row of N tokens: its rows back to back, position ids restarting at 0 at each,
and cu_seq_lens_q = [0, n_1, n_1 + n_2, ..., N] (transformers' name for flash attention's cumulative
lengths). A token attends causally within its own row only, so each row computes what it computes alone:

    CUDA, bf16/fp16  torch's varlen flash attention over all rows at once (torch.nn.attention.varlen)
    otherwise        each run of k rows of n tokens as one causal SDPA call on a [k, H, n, D] view

Registered as the transformers attention implementation "rlpipe_packed". A forward without
cu_seq_lens_q (sampling, evaluation, padded micro-batches) is sdpa's, with sdpa's masks, so a model keeps
this implementation for its whole life, gradient checkpointing's recomputed forwards included.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from rlpipe.models.optional_imports import unused_hidden

with unused_hidden():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

PACKED = "rlpipe_packed"


def packable(model: PreTrainedModel | PeftModel) -> str | None:
    """None when `model`'s attention can run packed rows; else why not (for trainer.padding_free's error).
    Its attention must go through transformers' attention interface with sdpa's semantics: not eager's
    soft-capped scores (Gemma 2), not a model class that computes attention its own way."""
    config = model.config
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take transformers' attention implementations"
    if config._attn_implementation not in ("sdpa", PACKED):
        return f"its attention implementation is {config._attn_implementation!r}, not sdpa"
    if getattr(config, "attn_logit_softcapping", None):
        return "it soft-caps its attention scores (attn_logit_softcapping)"
    return None


def use_packed_attention(model: PreTrainedModel | PeftModel) -> None:
    """Give `model` the packed-or-sdpa attention (see the module's docstring)."""
    if model.config._attn_implementation != PACKED:
        model.set_attn_implementation(PACKED)


def packed_attention_kwargs(row_ends: torch.Tensor) -> dict:
    """The model forward's keyword arguments that mark a packed micro-batch, from its [B + 1] row ends."""
    longest = int((row_ends[1:] - row_ends[:-1]).max())
    return {"cu_seq_lens_q": row_ends, "cu_seq_lens_k": row_ends, "max_length_q": longest, "max_length_k": longest}


def packed_or_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, Hq, N, D], key and value [1, Hkv, N, D] -> [1, N, Hq, D]."""
    row_ends = kwargs.get("cu_seq_lens_q")
    if row_ends is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed rows come as one sequence; got a batch of {query.shape[0]}")
    window = kwargs.get("sliding_window")  # keys within the last `window` positions, the query's included
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):  # flash kernels: half precision only
        out = varlen_rows(q, k, v, row_ends, int(kwargs["max_length_q"]), scaling, window)
    else:
        out = rows_by_length(q, k, v, row_ends, scaling, dropout, window)
    return out.unsqueeze(0), None


def rows_by_length(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_ends: torch.Tensor,
    scaling: float | None,
    dropout: float,
    window: int | None,
) -> torch.Tensor:
    """[N, Hq, D]: each row's causal attention, each run of rows of one length (rlpipe.training.batching packs
    rows sorted by length) in one batched SDPA call on views of q, k and v."""
    parts = []
    for start, length, count in runs_of_equal_length(row_ends):
        q_rows, k_rows, v_rows = (
            t[start : start + count * length].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
        )
        mask = None
        if window is not None and length > window:
            i = torch.arange(length, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        attended = F.scaled_dot_product_attention(
            q_rows,
            k_rows,
            v_rows,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=True,
        )  # [count, Hq, length, D]
        parts.append(attended.transpose(1, 2).reshape(count * length, *q.shape[1:]))
    return torch.cat(parts)


_last_runs: list = [None, ()]  # every layer of a forward gets the same row_ends tensor: read it once


def runs_of_equal_length(row_ends: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """(first position, length, rows) of each run of consecutive rows of one length in a packed micro-batch."""
    if _last_runs[0] is row_ends:
        return _last_runs[1]
    ends = row_ends.tolist()
    runs: list[list[int]] = []
    for start, end in zip(ends, ends[1:]):
        if runs and runs[-1][1] == end - start:
            runs[-1][2] += 1
        else:
            runs.append([start, end - start, 1])
    _last_runs[:] = [row_ends, tuple(map(tuple, runs))]
    return _last_runs[1]


def varlen_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_ends: torch.Tensor,
    longest: int,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """[N, Hq, D]: torch's varlen flash attention, causal within each row (and within `window`)."""
    from torch.nn.attention.varlen import varlen_attn

    if k.shape[1] != q.shape[1] and "enable_gqa" not in varlen_parameters():
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    options: dict = {"scale": scaling}
    if "enable_gqa" in varlen_parameters():
        options["enable_gqa"] = k.shape[1] != q.shape[1]
    if "window_size" in varlen_parameters():  # torch >= 2.12: (left, right), (-1, 0) = causal
        options["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is None:
        options["is_causal"] = True
    else:
        raise ValueError("sliding-window attention on packed rows needs torch >= 2.12 (varlen_attn's window_size)")
    ends = row_ends.to(torch.int32)
    q, k, v = (t.contiguous() for t in (q, k, v))
    # without return_aux varlen_attn returns the output alone (its annotation has no overloads for that)
    return cast(torch.Tensor, varlen_attn(q, k, v, ends, ends, longest, longest, **options))


@cache
def varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


AttentionInterface.register(PACKED, packed_or_sdpa_attention)
AttentionMaskInterface.register(PACKED, sdpa_mask)
