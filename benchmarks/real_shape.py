"""A stand-in at a real model's shape, for benchmarks/iteration_at_scale.py: random-init weights of the shape
(benchmarks/gpu.py's model_config), a word-level tokenizer over its whole vocabulary (w0 ... wN, so every
sampled id decodes), prompts of random words and a coin-flip reward by the completion's hash."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_end|>", "<unk>"]  # pad, eos, unk: ids 0, 1, 2


def random_words(rng: random.Random, n: int, words: int = 64, vocab: int = 151936) -> list[dict]:
    """Data generator (data.generator 'real_shape:random_words'): prompts of random words."""
    return [
        {"prompt": " ".join(f"w{rng.randrange(len(SPECIAL), vocab)}" for _ in range(words)), "answer": ""}
        for _ in range(n)
    ]


def stand_in_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 or 0 by the completion text's hash: varied rewards, so advantages are not all zero."""
    return [float(hashlib.sha256(c.encode()).digest()[0] & 1) for c in completions]


def build_model_dir(shape: str, out: Path) -> int:
    """A random-init model of `shape` with a word-level tokenizer covering its vocabulary, saved as an
    HF model directory (what model.path points at). Returns its parameter count."""
    import torch
    from gpu import model_config
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config = model_config(shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    words = {token: i for i, token in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), config.vocab_size)}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.num_parameters()
