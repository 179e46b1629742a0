"""Models and tokenizers: build the tiny offline model, load any policy by local path, URI or hub id.

Only the torch steps (warm_start, generate, update, evaluate) import this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch  # noqa: E402

from rlpipe.optional_imports import unused_hidden  # noqa: E402

with unused_hidden():
    from transformers import (  # noqa: E402
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

from rlpipe.spec import TinyModelSpec  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-=* ")


def configure_torch(threads: int) -> None:
    """One thread per step on a shared CPU: more threads ran 5x slower under contention."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer for arithmetic tasks, built locally with `tokenizers`."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from tokenizers.processors import TemplateProcessing

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_model(tiny: TinyModelSpec, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen2ForCausalLM:
    """Random-init Qwen2-architecture causal LM (head size >= 32 so vLLM can serve it)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_tokenizer(local_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer; a PreTrainedTokenizerFast is loaded as such, since AutoTokenizer in
    transformers 5.x swaps in the model family's pre-tokenizer (breaks character tokenizers)."""
    config_path = Path(local_dir) / "tokenizer_config.json"
    if config_path.exists() and json.loads(config_path.read_text()).get("tokenizer_class") in (
        "PreTrainedTokenizerFast",
        "TokenizersBackend",
    ):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(local_dir))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(local_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def resolve_model_source(source: str, cache_dir: str | Path) -> str:
    """Turn a model reference into something `from_pretrained` accepts.

    - an existing local directory: used as is;
    - `scheme://...` (gs://, s3://, file://, ...): copied once into `cache_dir` with fsspec;
    - a path-looking string that does not exist: a clear error;
    - anything else: a hub id, handed to transformers (needs network unless cached).
    """
    if "://" in source:
        import fsspec

        fs, remote = fsspec.core.url_to_fs(source)
        if not fs.exists(remote):
            raise FileNotFoundError(f"model.path {source} does not exist; point model.path at a saved model directory")
        local = Path(cache_dir) / "models" / remote.strip("/").replace("/", "__")
        if not (local / "config.json").exists():
            local.mkdir(parents=True, exist_ok=True)
            fs.get(remote.rstrip("/") + "/", str(local), recursive=True)
        return str(local)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {source} has no config.json; save the model with save_pretrained")
        return str(path)
    if source.startswith(("/", "./", "../", "~")) or path.exists():
        raise FileNotFoundError(
            f"model.path {source} does not exist; set model.path to a model directory, a URI or a hub id"
        )
    return source


def load_weights(
    weights: dict, cache_root: str | Path, threads: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a published weights version (a WeightRef) for a torch step, on `threads` CPU threads."""
    from rlpipe.store.weights import local_path

    configure_torch(threads)
    return load_policy(local_path(weights, cache_root))


def load_policy(source: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or hub id."""
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as err:
        raise FileNotFoundError(
            f"could not load model {source!r}: {err}. Offline? Set model.path to a local directory or URI."
        ) from None
    return model, load_tokenizer(source) if Path(source).is_dir() else AutoTokenizer.from_pretrained(source)
