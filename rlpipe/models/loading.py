"""Models and tokenizers: build the tiny offline model, load any policy by local path, URI or hub id.

Only the torch steps (warm_start, generate, update, evaluate) import this module.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch  # noqa: E402

from rlpipe.models.optional_imports import unused_hidden  # noqa: E402

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

from rlpipe.models.devices import resolve_device  # noqa: E402
from rlpipe.models.files import authors_additions, char_tokenizer  # noqa: E402
from rlpipe.spec import LoraSpec, TinyModelSpec  # noqa: E402

if TYPE_CHECKING:
    from peft import PeftModel
    from typing_extensions import TypeIs

    from rlpipe.store.weights import WeightRef

# ChatML, as Qwen2's tokenizers carry it: what build_bpe_tokenizer's chat models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def configure_torch(threads: int) -> None:
    """One thread per step on a shared CPU: more threads ran 5x slower under contention. Tensors of
    MMAP_THRESHOLD bytes or more get memory of their own (release_freed_tensors)."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    release_freed_tensors()


MMAP_THRESHOLD = 4 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def release_freed_tensors() -> None:
    """Make glibc's malloc give tensors of MMAP_THRESHOLD bytes or more their own mapping, returned to the
    system when freed. By default the threshold rises to the largest block freed (up to 32 MB), and
    later tensors come from the heap, whose freed holes stay in the process: a 0.5B model's update held
    6.1 GiB above its weights instead of 2.5 GiB in one micro-step, for +3% time (docs/costs-at-scale.md).
    glibc only (Linux): elsewhere nothing changes."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer for arithmetic tasks (rlpipe.models.files.char_tokenizer)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=char_tokenizer(),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_bpe_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` with `tokenizers`, carrying the ChatML chat
    template and its special tokens (<|im_start|>, <|im_end|> = eos), as Qwen2's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
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
        dtype="float32",  # transformers 5's name (torch_dtype, its old one, makes the same config)
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_tokenizer(local_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer; a PreTrainedTokenizerFast is loaded as such, since AutoTokenizer in
    transformers 5.x swaps in the model family's pre-tokenizer (breaks character tokenizers). It adds
    bos/eos as tokenizer_config.json's add_bos_token/add_eos_token ask (authors_additions), which
    transformers 5 ignores unless they are passed as arguments."""
    config_path = Path(local_dir) / "tokenizer_config.json"
    asked: dict[str, Any] = authors_additions(local_dir)  # keyword arguments of from_pretrained
    if config_path.exists() and json.loads(config_path.read_text()).get("tokenizer_class") in (
        "PreTrainedTokenizerFast",
        "TokenizersBackend",
    ):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(local_dir), **asked)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(local_dir), **asked)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def release_memory(device: torch.device, phase: str) -> dict[str, float]:
    """Between colocated phases (sample, train, evaluate in one process): hand the phase's cached
    GPU blocks (KV cache, activations) back so the next phase can use them, and report the phase's
    peak (memory/<phase>_peak_gib). Nothing to do on CPU, where freed tensors go back to the allocator."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 1024**3
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return {f"memory/{phase}_peak_gib": peak}


@overload
def load_weights(
    weights: WeightRef, cache_root: str | Path, threads: int, device: str = "cpu", trainable: Literal[False] = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]: ...


@overload
def load_weights(
    weights: WeightRef, cache_root: str | Path, threads: int, device: str = "cpu", *, trainable: bool
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]: ...


def load_weights(
    weights: WeightRef, cache_root: str | Path, threads: int, device: str = "cpu", trainable: bool = False
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """Load a published weights version (a WeightRef) for a torch step onto trainer.device, with
    `threads` CPU threads. An adapter version (model.lora) is loaded onto its base (BASE_FILE):
    as a PeftModel to train (`trainable`), else merged into the base (plain weights, faster sampling)."""
    from rlpipe.store.weights import BASE_FILE, local_path

    configure_torch(threads)
    path = Path(local_path(weights, cache_root))
    if not (path / "adapter_config.json").exists():
        model, tokenizer = load_policy(str(path))
        # mypy reads transformers' functools.wraps(Module.to) as unbound: the device as `self`
        return model.to(resolve_device(device)), tokenizer  # type: ignore[arg-type]
    from peft import PeftModel

    base, tokenizer = load_policy(local_path(json.loads((path / BASE_FILE).read_text()), cache_root))
    on_device = base.to(resolve_device(device))  # type: ignore[arg-type]  # (as above)
    adapted = PeftModel.from_pretrained(on_device, str(path), is_trainable=trainable)
    return (adapted if trainable else adapted.merge_and_unload()), tokenizer


def export_model(run_root: str, version: int | None, out: str | Path, cache_root: str | Path) -> tuple[int, str]:
    """Write weights version `version` (default: the latest) as a plain Hugging Face model directory:
    an adapter version merged into its base. Returns (version, out)."""
    from rlpipe.store.weights import latest_version, read_weight_ref

    version = latest_version(run_root) if version is None else version
    if version is None:
        raise FileNotFoundError(f"{run_root} has no published weights; run the loop first")
    model, tokenizer = load_weights(read_weight_ref(run_root, version), cache_root, threads=1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return version, str(out)


def add_lora(model: PreTrainedModel, lora: LoraSpec) -> PeftModel:
    """`model` with fresh LoRA adapters (B = 0, so it computes what the base does) on lora.targets;
    only the adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int, but scales by alpha / r: a float works
        target_modules=list(lora.targets),
        lora_dropout=lora.dropout,
    )
    return get_peft_model(model, config)


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off, LoRA's and attention's included (TRL's disable_dropout): the update's
    ratio pi_theta / pi_old must compare the policy with itself, not two dropout samples of it. HF attention
    modules apply `attention_dropout` while training, outside any nn.Dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            # torch annotates Module.__setattr__ for tensors and modules; a float attribute is set as is
            module.attention_dropout = 0.0  # type: ignore[assignment]


def is_adapted(model: torch.nn.Module) -> TypeIs[PeftModel]:
    """Whether `model` carries LoRA adapters (a peft PeftModel)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def load_policy(source: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or hub id."""
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as err:
        raise FileNotFoundError(
            f"could not load model {source!r}: {err}. Offline? Set model.path to a local directory or URI."
        ) from None
    if Path(source).is_dir():
        return model, load_tokenizer(source)
    from transformers.utils import cached_file

    config = cached_file(source, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False)
    asked = authors_additions(Path(config).parent) if config else {}  # a hub id: as for a directory
    return model, AutoTokenizer.from_pretrained(source, **asked)
