"""A model's files without torch: where they are (local directory, fsspec URI, hub id) and the
tokenizer the prepare step renders and tokenizes prompts with (`tokenizers` + the chat template).

The light step image has no transformers (importing it imports torch, 4 s); `tokenizers` computes
the same ids as transformers' fast tokenizers, since they wrap it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-=* ")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
ADDED_TOKEN_FLAGS = ("add_bos_token", "add_eos_token")


def resolve_model_source(source: str, cache_dir: str | Path) -> str:
    """Turn a model reference into something `from_pretrained` accepts.

    - a GGUF file, a directory holding one or an installed package holding one: converted once into
      `cache_dir` (rlpipe.models.gguf);
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
    from rlpipe.models.gguf import converted_dir, find_gguf

    gguf = find_gguf(source)
    if gguf is not None:
        return str(converted_dir(gguf, cache_dir))
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


def char_tokenizer() -> Tokenizer:
    """The tiny demo model's character-level tokenizer (`tokenizers` WordLevel; <bos> prepended)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from tokenizers.processors import TemplateProcessing

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return tokenizer


@dataclass(frozen=True)
class PromptTokenizer:
    """What prompts are rendered and tokenized with: the model's tokenizer and its chat template."""

    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: variables of the chat template
    folder: Path | None = None  # the model's local directory (None: the tiny model's)


def load_prompt_tokenizer(model_path: str | None, cache_dir: str | Path) -> PromptTokenizer:
    """The tokenizer of model.path (a directory, URI or hub id), or the tiny model's (path None)."""
    if model_path is None:
        special = dict(zip(["pad_token", "bos_token", "eos_token", "unk_token"], SPECIAL_TOKENS, strict=True))
        return PromptTokenizer(char_tokenizer(), None, special)
    from tokenizers import Tokenizer

    source = resolve_model_source(model_path, cache_dir)
    folder = Path(source)
    if not folder.is_dir():  # a hub id: its tokenizer files only
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source, allow_patterns=TOKENIZER_FILES, cache_dir=str(Path(cache_dir) / "hub")))
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"model.path {model_path} has no tokenizer.json; rlpipe needs a fast tokenizer: load it with "
            "transformers and save_pretrained it again (that writes tokenizer.json)"
        )
    config = _read_json(folder / "tokenizer_config.json") | _read_json(folder / "special_tokens_map.json")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {
        key: value["content"] if isinstance(value, dict) else value
        for key, value in config.items()
        if key.endswith("_token") and isinstance(value, (str, dict))
    }
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    asked = authors_additions(folder)
    if asked:  # as load_tokenizer's transformers tokenizer does with the same flags
        tokenizer.post_processor = added_tokens_processor(tokenizer, asked, special)
    return PromptTokenizer(tokenizer, template, special, folder)


def authors_additions(folder: str | Path) -> dict[str, bool]:
    """What the model's authors ask a tokenizer to add around a text: tokenizer_config.json's add_bos_token /
    add_eos_token, those it sets (convert_gguf writes a GGUF's there). transformers 5 ignores them when
    tokenizer.json exists; both of rlpipe's tokenizers follow them (load_prompt_tokenizer, load_tokenizer)."""
    config = _read_json(Path(folder) / "tokenizer_config.json")
    return {flag: config[flag] for flag in ADDED_TOKEN_FLAGS if isinstance(config.get(flag), bool)}


def added_tokens_processor(tokenizer: Tokenizer, asked: dict[str, bool], special: dict[str, str]) -> Any:
    """The post-processor transformers builds from add_bos_token / add_eos_token arguments
    (TokenizersBackend.update_post_processor): bos before each text, eos after, each when asked and known."""
    from tokenizers.processors import TemplateProcessing

    ends = {}  # "bos"/"eos" -> (token, id), when asked and in the vocabulary
    for end in ("bos", "eos"):
        token = special.get(f"{end}_token")
        token_id = tokenizer.token_to_id(token) if token else None
        if asked.get(f"add_{end}_token") and token_id is not None:
            ends[end] = (token, token_id)

    def around(name: str, part: int) -> list[str]:
        before = [f"{ends['bos'][0]}:{part}"] if "bos" in ends else []
        after = [f"{ends['eos'][0]}:{part}"] if "eos" in ends else []
        return [*before, f"${name}:{part}", *after]

    single, pair = " ".join(around("A", 0)), " ".join(around("A", 0) + around("B", 1))
    return TemplateProcessing(single=single, pair=pair, special_tokens=list(ends.values()))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
