"""Tiny random-init models of real LLM families, built offline for tests: each family's transformers config
class with its features kept (soft-capping, sliding windows, q/k norms, fused projections, experts) at a
toy size, and a small tokenizer laid out as the family's (its special tokens and ids, BOS added where its
authors add it, its end-of-turn tokens, a shortened chat template, generation_config's eos list). Saved
as a Hugging Face directory, and written as a GGUF file (F32, Q8_0 or a k-quant) as llama.cpp would.

    hf_dir = write_hf_dir(FAMILIES["gemma2"], tmp / "gemma2")
    gguf = write_gguf(FAMILIES["gemma2"], hf_dir, tmp / "gemma2.gguf", "Q8_0")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
SHAPE |= {"num_key_value_heads": 1, "max_position_embeddings": 256}
WORDS = "Answer with a number . What is the sum ? hello the answer is You are a helpful assistant user system model"
CORPUS = [f"{a}+{b}={a + b}" for a in range(0, 100, 3) for b in range(0, 100, 7)] + [WORDS, WORDS.lower()]


@dataclass(frozen=True)
class Family:
    """One model family: its config and model classes (transformers names), toy config values, and its
    tokenizer's conventions."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    style: str  # bytelevel (Llama 3, Qwen) | spm (SentencePiece BPE, prefix space) | gemma (no prefix space)
    specials_first: list[str]  # special tokens at ids 0.. (SentencePiece families)
    specials_last: list[str]  # special tokens after the learned vocabulary (the rest)
    bos: str | None  # the BOS token; `adds_bos`: whether a text prompt gets it
    adds_bos: bool
    eos: str  # the tokenizer's eos_token (an instruct model's: Llama 3's <|eot_id|>, Qwen's <|im_end|>)
    pad: str | None
    unk: str | None
    generation_eos: list[str]  # generation_config.json's eos_token_id
    tokenizer_class: str
    chat_template: str
    gguf_arch: str  # llama.cpp's architecture name (Mistral's is llama)
    gguf_pre: str | None = None  # tokenizer.ggml.pre of byte-level vocabularies
    vocab_multiple: int = 1  # the embedding rows: the vocabulary rounded up to this (Qwen, Phi-3 pad theirs)
    added: list[str] = field(default_factory=list)  # plain (not special) added tokens: Qwen3's <think>
    end_of_turn: str | None = None  # a chat turn's end where it is not eos (Gemma, Phi-3): the GGUF's eot_token_id
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN25_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}<start_of_turn>{{ role }}\n"
    "{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    + GEMMA_TEMPLATE
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
LLAMA3_SPECIALS += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA_FIRST = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]"]
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>"] + [f"<|placeholder{i}|>" for i in range(1, 5)]
PHI3_SPECIALS += ["<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
SPM_FIRST = ["<unk>", "<s>", "</s>"]
QWEN_CONFIG = {"rope_theta": 1_000_000.0, "tie_word_embeddings": True, "max_window_layers": 28}
QWEN3_CONFIG = QWEN_CONFIG | {"head_dim": 128}  # Qwen3's, and what a qwen3 GGUF implies (no key_length read)


def _gemma_first(turns_at: int) -> list[str]:
    """Gemma's first ids: pad 0, eos 1, bos 2, unk 3, ..., <unusedN> fillers, then <start_of_turn> at `turns_at`."""
    fillers = [f"<unused{i}>" for i in range(turns_at - len(GEMMA_FIRST))]
    return GEMMA_FIRST + fillers + ["<start_of_turn>", "<end_of_turn>"]


def _qwen(name: str, config_class: str, model_class: str, config: dict, template: str, **extra: Any) -> Family:
    return Family(
        name, config_class, model_class, config, "bytelevel", [], QWEN_SPECIALS, None, False, "<|im_end|>",
        "<|endoftext|>", None, ["<|im_end|>", "<|endoftext|>"], "Qwen2Tokenizer", template, gguf_pre="qwen2",
        vocab_multiple=128, **extra,
    )  # fmt: skip


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "llama3", "LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500_000.0}, "bytelevel", [], LLAMA3_SPECIALS,
        "<|begin_of_text|>", True, "<|eot_id|>", None, None, ["<|end_of_text|>", "<|eot_id|>"],
        "PreTrainedTokenizerFast", LLAMA3_TEMPLATE, "llama", gguf_pre="llama-bpe",
    ),
    "qwen2.5": _qwen("qwen2.5", "Qwen2Config", "Qwen2ForCausalLM", QWEN_CONFIG, QWEN25_TEMPLATE, gguf_arch="qwen2"),
    "qwen3": _qwen(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM", QWEN3_CONFIG, QWEN3_TEMPLATE, gguf_arch="qwen3",
        added=["<think>", "</think>"],
    ),
    "qwen3_moe": _qwen(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        QWEN3_CONFIG | {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 768, "norm_topk_prob": True},  # 768: a qwen3moe GGUF's implied width
        QWEN3_TEMPLATE, gguf_arch="qwen3moe", added=["<think>", "</think>"],
        lora_modules=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
    ),
    "gemma2": Family(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM",
        {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
        "gemma", _gemma_first(106), [], "<bos>", True, "<eos>", "<pad>", "<unk>", ["<eos>", "<end_of_turn>"],
        "GemmaTokenizer", GEMMA2_TEMPLATE, "gemma2", end_of_turn="<end_of_turn>",
    ),
    "gemma3": Family(
        "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
         "layer_types": ["sliding_attention"] * 5 + ["full_attention"],  # Gemma 3's 5 local : 1 global
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}},
        "gemma", _gemma_first(105), [], "<bos>", True, "<eos>", "<pad>", "<unk>", ["<eos>", "<end_of_turn>"],
        "GemmaTokenizer", GEMMA_TEMPLATE, "gemma3", end_of_turn="<end_of_turn>",
    ),
    "mistral": Family(  # Mistral-7B-Instruct-v0.2: Llama 2's SentencePiece layout, no sliding window
        "mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": None, "rope_theta": 1_000_000.0},
        "spm", SPM_FIRST, [], "<s>", True, "</s>", None, "<unk>", ["</s>"], "LlamaTokenizer", MISTRAL_TEMPLATE,
        "llama",
    ),
    "phi3": Family(  # Phi-3-mini-4k-instruct's current tokenizer_config: add_bos_token false, no bos in the template
        "phi3", "Phi3Config", "Phi3ForCausalLM", {"sliding_window": 2047}, "spm", SPM_FIRST, PHI3_SPECIALS,
        "<s>", False, "<|endoftext|>", "<|endoftext|>", "<unk>", ["<|endoftext|>", "<|assistant|>", "<|end|>"],
        "LlamaTokenizer", PHI3_TEMPLATE, "phi3", vocab_multiple=64, end_of_turn="<|end|>",
        lora_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
}  # fmt: skip


def _trained_bpe(style: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a BPE trained on CORPUS: byte-level (its 256-symbol alphabet first), or SentencePiece
    pieces over "▁"-joined words (characters only: bytes go to <0xNN> fallback tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if style == "bytelevel":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 120, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    state = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return state["vocab"], merges


def family_vocab(family: Family) -> tuple[list[str], list[tuple[str, str]]]:
    """The family's tokens in id order and its BPE merges: leading specials (and <0xNN> byte fallback for
    SentencePiece families), the learned tokens, then the trailing specials and added tokens."""
    learned, merges = _trained_bpe(family.style)
    ordered = sorted(learned, key=learned.__getitem__)
    if family.style == "bytelevel":
        return ordered + family.specials_last + family.added, merges
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    return family.specials_first + bytes_ + ordered + family.specials_last + family.added, merges


def _backend(family: Family, tokens: list[str], merges: list[tuple[str, str]]):
    """The `tokenizers` Tokenizer: the family's normalizer, pre-tokenizer, decoder and post-processor."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(tokens)}
    if family.style == "bytelevel":
        model = models.BPE(vocab, merges, ignore_merges=family.name == "llama3")
        split = LLAMA3_SPLIT if family.gguf_pre == "llama-bpe" else QWEN_SPLIT
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        if family.name.startswith("qwen"):
            tokenizer.normalizer = normalizers.NFC()
    else:
        tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=family.unk, fuse_unk=True, byte_fallback=True))
        spaces = [normalizers.Replace(" ", "▁")]
        tokenizer.normalizer = normalizers.Sequence(
            spaces if family.style == "gemma" else [normalizers.Prepend("▁"), *spaces]
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence(steps if family.style == "gemma" else [*steps, decoders.Strip(" ", 1, 0)])
    specials = [t for t in family.specials_first + family.specials_last if not t.startswith("<unused")]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if family.adds_bos:
        bos = (family.bos, vocab[family.bos])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0", pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1", special_tokens=[bos]
        )
    return tokenizer


# the pre-tokenizers' splits: Llama 3 keeps up to 3 digits together, Qwen one
SPLIT_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + SPLIT_REST
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + SPLIT_REST


def build_tokenizer(family: Family):
    """The family's tokenizer (transformers PreTrainedTokenizerFast over `_backend`) and its merges."""
    from transformers import PreTrainedTokenizerFast

    tokens, merges = family_vocab(family)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(family, tokens, merges),
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=family.unk,
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer, merges


def token_id(tokens: list[str], token: str | None) -> int | None:
    return None if token is None else tokens.index(token)


def build_model(family: Family, tokens: list[str], seed: int = 0):
    """A random-init model of the family's architecture over `tokens` (embedding rows rounded up to
    family.vocab_multiple), float32."""
    import transformers

    vocab_size = -(-len(tokens) // family.vocab_multiple) * family.vocab_multiple
    bos = family.bos if family.bos is not None else family.pad  # Qwen's config names <|endoftext|>
    ids = {"bos_token_id": token_id(tokens, bos)}
    ids |= {"eos_token_id": token_id(tokens, family.eos), "pad_token_id": token_id(tokens, family.pad)}
    config_class = getattr(transformers, family.config_class)
    config = config_class(**(SHAPE | {"vocab_size": vocab_size, "dtype": "float32"} | ids | family.config))
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config).float().eval()
    generation_eos = [tokens.index(t) for t in family.generation_eos]
    model.generation_config.eos_token_id = generation_eos
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    return model


def write_hf_dir(family: Family, out: Path, seed: int = 0) -> Path:
    """The family's tiny model and tokenizer saved with save_pretrained into `out`, tokenizer_config.json
    naming the family's tokenizer class (and add_bos_token where the family's sets it)."""
    tokenizer, _ = build_tokenizer(family)
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    model = build_model(family, tokens, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | {"tokenizer_class": family.tokenizer_class}
    if family.style != "bytelevel":  # SentencePiece families state it (transformers 5 reads tokenizer.json's)
        config |= {"add_bos_token": family.adds_bos, "add_eos_token": False}
    config_path.write_text(json.dumps(config, indent=2))
    return out


def q6_k(data: np.ndarray) -> np.ndarray:
    """`data` ([rows, cols], cols a multiple of 256) as GGML Q6_K blocks (uint8 [rows, cols / 256 * 210]): per
    256 values, 16 int8 sub-block scales times an fp16 scale, 6-bit quants (gguf-py only dequantizes k-quants)."""
    rows, cols = data.shape
    x = data.astype(np.float32).reshape(-1, 16, 16)  # blocks of 16 sub-blocks of 16
    sub = np.abs(x).max(-1) / 31
    d = (sub.max(-1) / 127).astype(np.float16)
    scales = np.clip(np.rint(sub / np.maximum(d[:, None].astype(np.float32), 1e-30)), -128, 127).astype(np.int8)
    step = d[:, None].astype(np.float32) * scales  # the effective scale of each sub-block
    q = np.where(step[..., None] > 0, np.rint(x / np.where(step > 0, step, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    halves = q.reshape(-1, 2, 2, 64)  # [half, nibble, 64]: the low 4 bits, two values a byte
    ql = (halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)
    quarters = (q.reshape(-1, 2, 4, 32) >> 4) & 0x03  # [half, shift, 32]: the high 2 bits, four values a byte
    qh = sum(quarters[:, :, s] << (2 * s) for s in range(4)).astype(np.uint8)
    blocks = [ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8), d.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(blocks, axis=1).reshape(rows, cols // 256 * 210)


def _quantized(array: np.ndarray, quant: str):
    """(data, raw GGML type or None) of one tensor: 1-D tensors stay F32; Q6_K where rows are whole k-quant
    blocks of 256 (else Q8_0, as llama.cpp falls back); Q8_0."""
    import gguf

    types = gguf.GGMLQuantizationType
    if quant == "F32" or array.ndim == 1 or array.shape[-1] % 32:
        return array.astype(np.float32), None
    if quant == "Q6_K" and array.ndim == 2 and array.shape[-1] % 256 == 0:
        return q6_k(array), types.Q6_K
    return gguf.quants.quantize(array.astype(np.float32), types.Q8_0), types.Q8_0


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the `llama` architecture (transformers reverses it on load)."""
    grouped = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(family: Family, model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, transformed as its converter does: q/k rows permuted
    (llama), Gemma's norms stored as 1 + w, fused experts split into gate/up/down stacks, the tied head omitted."""
    import gguf

    config = model.config
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == family.gguf_arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    found: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:
            layer = hf_name.split(".")[2]
            if hf_name.endswith("gate_up_proj"):
                found[f"blk.{layer}.ffn_gate_exps.weight"], found[f"blk.{layer}.ffn_up_exps.weight"] = np.split(
                    array, 2, axis=1
                )
            else:
                found[f"blk.{layer}.ffn_down_exps.weight"] = array
            continue
        base, _, suffix = hf_name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise KeyError(f"{family.name}: no GGUF name for {hf_name}")
        if family.gguf_arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            array = _llama_permute(array, heads)
        if family.gguf_arch.startswith("gemma") and base.endswith("norm"):
            array = array + 1
        found[f"{target}.{suffix}"] = array
    return found


def _gguf_hparams(writer, family: Family, config) -> None:
    """The model's shape under llama.cpp's keys (what transformers rebuilds the config from)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _gguf_vocab(writer, family: Family, tokens: list[str], vocab_size: int) -> None:
    """The tokenizer as llama.cpp writes it: `gpt2` (byte-level BPE, with merges) or `llama` (SentencePiece:
    scores in merge order, byte tokens), special ids, add_bos_token, the chat template; padded with [PADn]."""
    import gguf

    kinds = gguf.TokenType
    specials = set(family.specials_first + family.specials_last)

    def kind(token: str) -> int:
        if token == family.unk:
            return kinds.UNKNOWN
        if token.startswith("<unused") or token.startswith("[PAD"):
            return kinds.UNUSED
        if token in specials:
            return kinds.CONTROL
        if token in family.added:
            return kinds.USER_DEFINED
        return kinds.BYTE if token.startswith("<0x") and len(token) == 6 else kinds.NORMAL

    padded = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    writer.add_tokenizer_model("gpt2" if family.style == "bytelevel" else "llama")
    writer.add_tokenizer_pre(family.gguf_pre or "default")
    writer.add_token_list(padded)
    writer.add_token_scores([-float(i) for i in range(len(padded))])
    writer.add_token_types([kind(t) for t in padded])
    if family.style == "bytelevel":
        writer.add_token_merges([" ".join(m) for m in build_tokenizer(family)[1]])
    if family.bos is not None:
        writer.add_bos_token_id(tokens.index(family.bos))
    writer.add_eos_token_id(tokens.index(family.eos))
    if family.unk is not None:
        writer.add_unk_token_id(tokens.index(family.unk))
    if family.pad is not None:
        writer.add_pad_token_id(tokens.index(family.pad))
    if family.end_of_turn is not None:
        writer.add_eot_token_id(tokens.index(family.end_of_turn))
    writer.add_add_bos_token(family.adds_bos)
    writer.add_add_eos_token(False)
    writer.add_chat_template(family.chat_template)


GGUF_NAMES = {"mistral": "Mistral-7B-Instruct-v0.2-tiny"}  # general.name: exactly "mistral" trips transformers


def write_gguf(family: Family, hf_dir: Path, out: Path, quant: str = "F32") -> Path:
    """`hf_dir` (write_hf_dir's) as a GGUF file at `out`: F32, Q8_0, or Q6_K (k-quant rows, the rest Q8_0)."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer = gguf.GGUFWriter(str(out), family.gguf_arch)
    writer.add_name(GGUF_NAMES.get(family.name, f"{family.name}-tiny"))
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if quant == "F32" else f"MOSTLY_{quant}"))
    _gguf_hparams(writer, family, model.config)
    _gguf_vocab(writer, family, tokens, model.config.vocab_size)
    for name, array in gguf_tensors(family, model).items():
        data, raw = _quantized(array, quant)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
