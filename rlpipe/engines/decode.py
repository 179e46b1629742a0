"""The torch engine's fast decode: the model's own modules over a preallocated KV cache.

Hugging Face's forward, called once per new token, rebuilds the attention mask, concatenates every
layer's cache, copies it again to repeat the grouped KV heads, and samples through two full-vocabulary
softmaxes. Per token that is Python and copies, not the model. This loop calls the same modules (so
LoRA adapters, RoPE variants and biases are theirs) and does the rest itself:

    cache      K, V: [rows, kv_heads, prompt width + max_new_tokens, head_dim] per layer, written in place
    attention  scaled_dot_product_attention(q, K[:, :, :t], V[:, :, :t], mask, enable_gqa=True): no repeat
    rows       rows that have ended leave the batch (their cache rows dropped, once an eighth has
               ended), so the long tail of a batch costs about what its unfinished rows do
    GPU        one step is a few hundred small kernels, each launched from Python: tens of ms a token for
               a model whose weights a GPU reads in well under one. There the step runs at fixed shapes
               (every row to the end, the whole cache attended under the mask, the new K, V written at a
               column tensor) and is captured once as a CUDA graph, then replayed: one launch a token
    sampling   log p = z - logsumexp(z), z = logits / T (one pass for the recorded log-prob); the token
               by inverse CDF: the first index whose cumulative probability exceeds u ~ U(0, 1) (one
               uniform draw per row, from `generator`)

For the decoder architectures whose layers are exactly norm -> attention -> residual -> norm -> MLP ->
residual (Llama, Qwen2, Qwen3, Mistral within its window; `decoder_of`); others decode with Hugging Face's
forward. The samples follow the same distribution as that path, not the same draws.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from rlpipe.rollouts import Completions

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from rlpipe.engines import Sampling

Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits -> (token, its log-prob) per row

# the decoder models whose layers this loop runs (the modeling module names apply_rotary_pos_emb)
ARCHITECTURES = {"LlamaModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3", "MistralModel": "mistral"}


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask): the prompts right-aligned, so every last token shares a column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return input_ids, attention


@dataclass(frozen=True)
class Decoder:
    """A causal LM's parts the loop calls: its decoder (embed_tokens, rotary_emb, layers, norm) and LM head."""

    model: Any
    lm_head: torch.nn.Module
    rotate: Any  # the modeling module's apply_rotary_pos_emb(q, k, cos, sin)
    kv_heads: int
    head_dim: int
    end_ids: set[int]  # a row ends at the first of these (eos, generation_config's, stop ids)
    pad_id: int


def decoder_of(model: PreTrainedModel | PeftModel, length: int, end_ids: set[int], pad_id: int) -> Decoder | None:
    """The model's Decoder, when its architecture is one this loop runs for sequences of `length`
    tokens (a sliding window shorter than that: no), else None."""
    get_base_model = getattr(model, "get_base_model", None)  # peft's LoRA
    causal_lm = get_base_model() if get_base_model is not None else model
    inner, config = getattr(causal_lm, "model", None), causal_lm.config
    family = ARCHITECTURES.get(type(inner).__name__)
    if family is None or not hasattr(causal_lm, "lm_head"):
        return None
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None and window < length:
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotate, kv_heads = modeling.apply_rotary_pos_emb, config.num_key_value_heads
    return Decoder(inner, causal_lm.lm_head, rotate, kv_heads, head_dim, set(end_ids), pad_id)


def forward(
    decoder: Decoder,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    start: int | torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The last position's logits [rows, vocab] for `ids` [rows, n] at cache columns start .. start + n;
    `mask` [rows, 1, n, start + n]: True where a query may attend a key. `start` a tensor (one column,
    n = 1: `static_step`): K, V written there and the whole cache attended, `mask` [rows, 1, 1, length]."""
    model, rows, n = decoder.model, ids.shape[0], ids.shape[1]
    hidden = model.embed_tokens(ids)
    cos, sin = model.rotary_emb(hidden, positions)
    for layer, (keys, values) in zip(model.layers, cache):
        attention = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attention.q_proj(x).view(rows, n, -1, decoder.head_dim)
        k = attention.k_proj(x).view(rows, n, -1, decoder.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = decoder.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = attention.v_proj(x).view(rows, n, -1, decoder.head_dim).transpose(1, 2)
        if isinstance(start, int):
            keys[:, :, start : start + n], values[:, :, start : start + n] = k, v
            attended = keys[:, :, : start + n], values[:, :, : start + n]
        else:
            keys.index_copy_(2, start, k.to(keys.dtype))
            values.index_copy_(2, start, v.to(values.dtype))
            attended = keys, values
        mixed = F.scaled_dot_product_attention(
            q,
            *attended,
            attn_mask=mask,
            scale=attention.scaling,
            enable_gqa=True,
        )
        hidden = hidden + attention.o_proj(mixed.transpose(1, 2).reshape(rows, n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return decoder.lm_head(model.norm(hidden[:, -1:]))[:, -1]


def next_tokens(
    logits: torch.Tensor,
    temperature: float = 1.0,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob under softmax(logits / T)) per row: the argmax, or a draw by inverse CDF
    from the distribution top-k / top-p leave (the log-prob is still the unfiltered one's)."""
    scaled = logits.float() / temperature
    normalizer = torch.logsumexp(scaled, dim=-1)
    if greedy:
        token = scaled.argmax(-1)
    else:
        allowed = filter_logits(scaled, top_k, top_p) if top_k > 0 or top_p < 1.0 else scaled
        cumulative = torch.softmax(allowed, dim=-1).cumsum_(-1)
        u = torch.rand((len(scaled), 1), generator=generator, device=scaled.device) * cumulative[:, -1:]
        token = torch.searchsorted(cumulative, u, right=True).squeeze(-1).clamp_(max=scaled.shape[-1] - 1)
    return token, scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - normalizer


Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (tokens, positions, column) -> logits


def static_step(
    decoder: Decoder, cache: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor, bf16: bool, graph: bool
) -> Step:
    """One decode step at fixed shapes: the next logits [rows, vocab] for the rows' tokens [rows] at
    `positions` [rows, 1], their K, V written at cache column `column`, every key where `valid` [rows,
    length] (the caller's, updated in place) attended. `graph` (a GPU): captured as a CUDA graph at the
    first call (after a warm-up on a side stream, as torch.cuda.graphs asks) and replayed after, the
    inputs copied into the tensors it was captured with; the logits returned are its output tensor,
    overwritten by the next call."""
    rows, device = valid.shape[0], valid.device
    ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
    positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
    column = torch.zeros(1, dtype=torch.long, device=device)
    mask = valid[:, None, None, :]
    captured: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []

    def run() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            return forward(decoder, ids, positions, cache, column, mask)

    def step(token: torch.Tensor, at: torch.Tensor, column_now: int) -> torch.Tensor:
        ids.copy_(token[:, None])
        positions.copy_(at)
        column.fill_(column_now)
        if not graph:
            return run()
        if not captured:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run()  # writes the same K, V the replay writes
            torch.cuda.current_stream(device).wait_stream(side)
            replayed = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replayed):
                logits = run()
            captured.append((replayed, logits))
        replayed, logits = captured[0]
        replayed.replay()
        return logits

    return step


@torch.no_grad()
def decode(
    decoder: Decoder,
    prompts: list[list[int]],
    sampling: Sampling,
    pick: Pick,
    static: bool | None = None,
    on_groups: Callable[[list[int], Completions], None] | None = None,
) -> Completions:
    """`sampling.samples` completions per prompt (prompt-major), each through its first end id or
    sampling.max_new_tokens: the prompts left-padded and prefilled once, their cache rows repeated per
    sample, then one forward per new token over the rows still running; `pick` chooses each token
    (next_tokens with the sampling's temperature, top-k, top-p, or greedy). `static` (default: on a
    GPU): the steps at fixed shapes, every row to the batch's end (`static_step`; a CUDA graph there).
    `on_groups` (the rollout producer's): each group (its prompt's index) and its completions, handed
    over at the step that ends its last row."""
    samples, max_new_tokens, bf16, pad_id = sampling.samples, sampling.max_new_tokens, sampling.bf16, decoder.pad_id
    device = next(decoder.model.parameters()).device
    static = device.type == "cuda" if static is None else static
    dtype = torch.bfloat16 if bf16 else next(decoder.model.parameters()).dtype
    input_ids, attention = (t.to(device) for t in left_padded(prompts, pad_id))
    width, length = input_ids.shape[1], input_ids.shape[1] + max_new_tokens
    valid = torch.zeros((len(prompts), length), dtype=torch.bool, device=device)
    valid[:, :width] = attention.bool()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    shape = (len(prompts), decoder.kv_heads, length, decoder.head_dim)
    # zeros, not empty: a static step attends unwritten columns under the mask, and 0 x NaN is NaN
    cache = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
             for _ in decoder.model.layers]  # fmt: skip
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)  # a pad query attends itself: no empty row
    prefill_mask = ((causal & valid[:, None, :width]) | diagonal)[:, None]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = forward(decoder, input_ids, positions, cache, 0, prefill_mask)
    if samples > 1:
        cache = [(k.repeat_interleave(samples, 0), v.repeat_interleave(samples, 0)) for k, v in cache]
        logits, valid, positions = (t.repeat_interleave(samples, 0) for t in (logits, valid, positions))
    rows = len(logits)
    next_position = positions[:, -1:] + 1
    ends = torch.tensor(sorted(decoder.end_ids), device=device)
    running = torch.arange(rows, device=device)  # the original row of each row still in the batch
    finished = torch.zeros(rows, dtype=torch.bool, device=device)  # of the rows in the batch: ended
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    step_logits = static_step(decoder, cache, valid, bf16, graph=device.type == "cuda") if static else None
    ended_rows = torch.zeros(rows, dtype=torch.bool, device=device)  # of every row: ended
    publish = GroupPublisher(on_groups, samples, rows) if on_groups is not None else None
    for step in range(max_new_tokens):
        token, logprob = pick(logits)
        tokens[running, step] = token.masked_fill(finished, pad_id)  # no host sync: an ended row writes pad
        logprobs[running, step] = logprob.masked_fill(finished, 0.0)
        ended = ~finished & torch.isin(token, ends)
        lengths[running] = torch.where(ended, step + 1, lengths[running])
        finished |= ended
        if publish is not None:
            ended_rows[running] |= finished
            ended_rows |= step == max_new_tokens - 1  # the rest ran to the token budget
            publish(ended_rows, lambda at: completions_of(tokens[at], logprobs[at], lengths[at], decoder.end_ids))
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        if not static and 8 * int(finished.sum()) >= len(finished):  # an eighth has ended: they leave the batch
            keep = (~finished).nonzero().squeeze(-1)
            running, token, valid, next_position = running[keep], token[keep], valid[keep], next_position[keep]
            finished = finished[keep]
            cache = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in cache]
        valid[:, width + step] = True
        if step_logits is not None:
            logits = step_logits(token, next_position, width + step)
        else:
            step_mask = valid[:, None, None, : width + step + 1]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = forward(decoder, token[:, None], next_position, cache, width + step, step_mask)
        next_position = next_position + 1
    return completions_of(tokens, logprobs, lengths, decoder.end_ids)


class GroupPublisher:
    """Hands `on_groups` the groups (`samples` consecutive rows) all of whose rows have ended, at the
    decode step that ends the last of them: their indices and completions (the rollout producer writes
    each to the buffer at once while the batch decodes on). Both decode loops use it: this module's and
    rlpipe.engines.torch_engine.hf_decode."""

    def __init__(self, on_groups: Callable[[list[int], Completions], None], samples: int, rows: int) -> None:
        self.on_groups, self.samples = on_groups, samples
        self.published = torch.zeros(rows // samples, dtype=torch.bool)

    def __call__(self, finished: torch.Tensor, completions: Callable[[torch.Tensor], Completions]) -> None:
        """`finished`: [rows] bool, every row's; `completions`: the completions of the rows indexed."""
        done = finished.view(-1, self.samples).all(-1).cpu() & ~self.published
        if bool(done.any()):
            groups = done.nonzero().flatten().tolist()
            rows = torch.tensor([g * self.samples + k for g in groups for k in range(self.samples)])
            self.on_groups(groups, completions(rows.to(finished.device)))
            self.published |= done


def completions_of(
    tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, end_ids: set[int]
) -> Completions:
    """Each row's tokens and log-probs through its length: "stop" when its last token is an end id."""
    result = Completions([], [], [], None)
    for row_tokens, row_logprobs, length in zip(tokens.tolist(), logprobs.tolist(), lengths.tolist()):
        result.token_ids.append(row_tokens[:length])
        result.logprobs.append(row_logprobs[:length])
        result.finish_reasons.append("stop" if row_tokens[length - 1] in end_ids else "length")
    return result
