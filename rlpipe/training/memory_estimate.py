"""`rlpipe estimate-memory SPEC`: the memory one training GPU needs for the spec, and what to change when it
does not fit. Torch-free: the shape comes from the model's config.json (or model.tiny).

Per GPU, with P parameters, sharded over `gpus` by FSDP (weights, gradients and AdamW state):
    policy weights     4 P / gpus              fp32 master weights
    gradients          4 P / gpus              fp32 (LoRA: 4 A for A adapter parameters)
    AdamW state        8 P / gpus              two fp32 moments (LoRA: 8 A)
    reference          b P / gpus              frozen v0 for the KL (b = 2 in bf16, 4 in fp32)
    critic             16 P / gpus             PPO's value model: weights, gradients, AdamW (its
                                               activations come after the policy's are freed)
    activations        N (c L + s) b           one micro-batch of N tokens, L layers (below)
    logits             C V 4 x 3               fp32 logits, log-softmax and its gradient of one chunk of
                                               C = min(N, trainer.logit_chunk_tokens) tokens (N unchunked)
    sampler KV cache   R T L 2 kv d b          colocated torch sampling: R rows of T tokens
    sampler weights    4 P                     gpus > 1: the policy's whole weights, gathered for sampling
Saved activations per token and layer, for a Llama/Qwen2 block with SDPA attention (no T^2 term):
    c = 12 h + 4 i values (norms, q/k/v/o inputs and outputs, residuals, gate/up/act/down);
    with gradient checkpointing only each layer's input is kept (c = h) and one layer at a time
    is recomputed and back-propagated, holding its activations and their gradients
    (s = 2 (12 h + 4 i)); without it s = 0.
Estimates of the peak of one step, not allocator-exact: for a 30M-parameter Qwen2 shape (8 layers,
hidden 512) and 7,936 tokens on CPU, the process's peak RSS grew by 3.89 GiB against 3.85
estimated, and by 1.6-1.8 GiB against 1.42 with checkpointing (tests/test_precision_and_memory.py
holds the estimate to within 30% of that measurement).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.algorithms import needs_critic
from rlpipe.training.batching import token_budget

if TYPE_CHECKING:
    from rlpipe.spec import LoraSpec, RunSpec

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def shape_from_config(config: dict) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (Llama, Qwen2, Mistral, ... field names)."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    intermediate = config.get("intermediate_size", 4 * hidden)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    if config.get("attention_bias", config.get("model_type") == "qwen2"):
        attention += head_dim * (heads + 2 * kv_heads)
    block = attention + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return ModelShape(layers * block + embeddings + hidden, layers, hidden, intermediate, heads, kv_heads, vocab)


def model_shape(spec: RunSpec, cache_dir: str | Path) -> ModelShape:
    """The shape of model.path (its config.json; a URI or hub id is fetched) or of model.tiny."""
    if spec.model.path is None:
        tiny = spec.model.tiny
        config = {
            "hidden_size": tiny.hidden_size,
            "num_hidden_layers": tiny.num_layers,
            "intermediate_size": tiny.intermediate_size,
            "num_attention_heads": tiny.num_heads,
            "num_key_value_heads": tiny.num_kv_heads,
            "vocab_size": 19,  # rlpipe.models.files: 4 special tokens + 15 characters
            "tie_word_embeddings": True,
            "model_type": "qwen2",
        }
        return shape_from_config(config)
    from rlpipe.models.files import resolve_model_source

    source = resolve_model_source(spec.model.path, cache_dir)
    if not Path(source).is_dir():
        from huggingface_hub import hf_hub_download

        source = str(Path(hf_hub_download(source, "config.json", cache_dir=str(Path(cache_dir) / "hub"))).parent)
    return shape_from_config(json.loads((Path(source) / "config.json").read_text()))


@dataclass(frozen=True)
class MemoryEstimate:
    rows: list[tuple[str, float]]  # (what, bytes per GPU)
    gpu_bytes: float
    advice: list[str]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.rows)

    def table(self) -> str:
        lines = [f"{'':2}{what:<42}{b / GIB:>10.2f} GiB" for what, b in self.rows]
        lines.append(f"{'':2}{'total per GPU':<42}{self.total / GIB:>10.2f} GiB of {self.gpu_bytes / GIB:.0f} GiB")
        return "\n".join(lines)


def micro_batch_tokens(spec: RunSpec, seq_len: int) -> int:
    """Tokens in one forward/backward on a GPU: trainer.micro_batch_tokens, else ("auto", null) the whole
    mini-batch."""
    rows = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    mini_batch = math.ceil(rows / spec.trainer.mini_batches) * seq_len
    budget = token_budget(spec.trainer.micro_batch_tokens, "cuda")
    return min(budget or mini_batch, mini_batch)


def activation_bytes(shape: ModelShape, tokens: int, checkpointing: bool, act_bytes: int) -> float:
    full = 12 * shape.hidden + 4 * shape.intermediate
    per_layer = shape.hidden if checkpointing else full
    return tokens * (per_layer * shape.layers + (2 * full if checkpointing else 0)) * act_bytes


def adapter_parameters(shape: ModelShape, lora: LoraSpec) -> int:
    """A = layers x sum over the targeted projections of rank (in + out)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = {
        "q_proj": (shape.hidden, q),
        "k_proj": (shape.hidden, kv),
        "v_proj": (shape.hidden, kv),
        "o_proj": (q, shape.hidden),
        "gate_proj": (shape.hidden, shape.intermediate),
        "up_proj": (shape.hidden, shape.intermediate),
        "down_proj": (shape.intermediate, shape.hidden),
    }
    return shape.layers * sum(lora.rank * sum(sizes[t]) for t in lora.targets if t in sizes)


def logit_tokens(spec: RunSpec, tokens: int) -> int:
    """Tokens whose vocabulary-wide logits exist at once: one chunk (rlpipe.training.logprobs), else all."""
    return min(tokens, spec.trainer.logit_chunk_tokens or tokens)


def logits_row(spec: RunSpec, tokens: int) -> str:
    chunk = logit_tokens(spec, tokens)
    return f"logits (fp32, x3, {chunk} tokens at a time)" if chunk < tokens else "logits (fp32, x3)"


def estimate_memory(spec: RunSpec, shape: ModelShape, seq_len: int, gpus: int, gpu_memory_gib: float) -> MemoryEstimate:
    """Bytes per GPU for the spec's training and colocated torch sampling (module docstring)."""
    p, bf16 = shape.parameters, spec.trainer.dtype == "bfloat16"
    act_bytes = 2 if bf16 else 4
    tokens = micro_batch_tokens(spec, seq_len)
    trained = adapter_parameters(shape, spec.model.lora) if spec.model.lora else p
    what = "LoRA adapters' " if spec.model.lora else ""
    rows = [
        ("policy weights (fp32)", 4 * p / gpus),
        (f"{what}gradients (fp32)", 4 * trained / gpus),
        (f"{what}AdamW state (fp32)", 8 * trained / gpus),
    ]
    if (spec.algorithm.kl_coef > 0 or spec.algorithm.track_reference_kl) and not spec.model.lora:  # LoRA: adapters off
        rows.append((f"reference ({'bf16' if bf16 else 'fp32'})", act_bytes * p / gpus))
    if needs_critic(spec):
        rows.append(("critic: weights, gradients, AdamW", 16 * p / gpus))
    rows.append(
        (
            f"activations ({tokens} tokens{', checkpointed' if spec.trainer.gradient_checkpointing else ''})",
            activation_bytes(shape, tokens, spec.trainer.gradient_checkpointing, act_bytes),
        )
    )
    rows.append((logits_row(spec, tokens), logit_tokens(spec, tokens) * shape.vocab * 4 * 3))
    if spec.rollout.engine == "torch":
        sample_rows = min(spec.rollout.batch_size, spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt)
        kv = sample_rows * seq_len * shape.layers * 2 * shape.kv_heads * shape.head_dim * act_bytes
        rows.append((f"sampler KV cache ({sample_rows} rows)", kv))
        if gpus > 1:  # FSDP units gathered whole while sampling (rlpipe.training.distributed.gathered)
            rows.append(("sampler: whole policy gathered (fp32)", 4 * p))
    gpu_bytes = gpu_memory_gib * GIB
    estimate = MemoryEstimate(rows, gpu_bytes, [])
    return MemoryEstimate(
        rows, gpu_bytes, advise(spec, shape, estimate, seq_len, gpus) if estimate.total > 0.9 * gpu_bytes else []
    )


def advise(spec: RunSpec, shape: ModelShape, estimate: MemoryEstimate, seq_len: int, gpus: int) -> list[str]:
    """What to change, cheapest first, until the estimate fits in 90% of the GPU."""
    budget = 0.9 * estimate.gpu_bytes
    fixed = sum(b for what, b in estimate.rows if not what.startswith(("activations", "logits", "sampler")))
    act_bytes = 2 if spec.trainer.dtype == "bfloat16" else 4
    advice = []
    if spec.rollout.engine == "torch":
        kv = next(b for what, b in estimate.rows if what.startswith("sampler"))
        if kv > 0.25 * budget:
            advice.append("rollout.batch_size: lower it (the sampler's KV cache grows with it), or sample with vLLM")
    per_token = activation_bytes(shape, 1, True, act_bytes)
    if not spec.trainer.logit_chunk_tokens:  # chunked, the logits stay one chunk's
        per_token += shape.vocab * 4 * 3
    if not spec.trainer.gradient_checkpointing:
        advice.append("trainer.gradient_checkpointing: true (activations from 12h+4i to h values per token and layer)")
    if spec.trainer.dtype == "float32":
        advice.append("trainer.dtype: bfloat16 (halves activations and the reference)")
    room = budget - fixed
    if room > 0:
        fits = int(room / per_token)
        if fits < micro_batch_tokens(spec, seq_len):
            advice.append(
                f"trainer.micro_batch_tokens: {max(fits // 256 * 256, seq_len)} (what fits beside the weights)"
            )
    else:
        need = math.ceil(gpus * fixed / budget)
        advice.append(
            f"weights, gradients and optimizer alone need {fixed / 1024**3:.1f} GiB per GPU: shard them over "
            f"{need} or more GPUs (FSDP), or train adapters (LoRA)"
        )
    return advice
