"""What the run reads: the model (a directory, GGUF file, URI or hub id) and the data's prompts, which
must fit the model's context with the completion budget and tokenize as the model's authors ask (its
bos first) and alike in the prepare step and the policy's tokenizer."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpipe.preflight.probe import PROBE_S, CheckFailed, within
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, join

if TYPE_CHECKING:
    from rlpipe.models.files import PromptTokenizer


def check_model(spec: RunSpec) -> str:
    """model.path names a saved model: a directory, GGUF file or URI holding one, or a hub id, which the HF
    cache holds when the hub cannot be reached (check_hub_id)."""
    source = spec.model.path
    if not source:
        return "model: a tiny model built from model.tiny"
    if "://" in source:

        def has_config() -> bool:
            fs, remote = filesystem(source)
            return fs.exists(join(remote, "config.json"))

        try:
            found = within(PROBE_S, has_config)
        except TimeoutError:
            raise CheckFailed(
                f"model.path {source} did not answer in {PROBE_S:g} s; check the name, the network and the "
                "credentials, or point model.path at a local directory"
            ) from None
        except Exception as err:  # noqa: BLE001 (credentials, unknown protocol, ...)
            raise CheckFailed(f"model.path {source}: cannot read it ({type(err).__name__}: {err})") from None
        if not found:
            raise CheckFailed(f"model.path {source} has no config.json; point it at a save_pretrained directory")
        return f"model: {source}"
    from rlpipe.models.gguf import checked_gguf

    try:
        gguf = checked_gguf(source)
    except (ValueError, FileNotFoundError) as err:
        raise CheckFailed(str(err)) from None
    if gguf is not None:
        if importlib.util.find_spec("gguf") is None:
            raise CheckFailed(
                f"model.path {source} is a GGUF file ({gguf}); converting it needs pip install 'rlpipe[gguf]'"
            )
        return f"model: GGUF file {gguf}, dequantized once into {spec.cache_root}/models/"
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckFailed(f"model.path {source} has no config.json; save the model with save_pretrained")
        return f"model: local directory {path}"
    if source.startswith(("/", "./", "../", "~")) or path.exists():
        raise CheckFailed(f"model.path {source} does not exist; set it to a model directory, a URI or a hub id")
    return check_hub_id(source, spec.cache_root)


HUB_PROBE_S = 3.0


def check_hub_id(repo: str, cache_root: str) -> str:
    """A hub id can be read: the hub answers, or (HF_HUB_OFFLINE=1, or no answer in HUB_PROBE_S) the HF caches
    the steps read hold it: the default one (from_pretrained: config and weights), and <cache>/hub (the
    prepare step's tokenizer, rlpipe.models.files)."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        offline = "HF_HUB_OFFLINE=1"
    else:
        try:
            within(HUB_PROBE_S, lambda: get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S))
            return f"model: hub id {repo} (downloaded by warm_start)"
        except Exception as err:  # noqa: BLE001 (no network, DNS, proxy, TimeoutError, ...)
            offline = f"{constants.ENDPOINT} does not answer: {type(err).__name__}"
    caches = {
        "config.json": constants.HF_HUB_CACHE,
        "model weights": constants.HF_HUB_CACHE,
        "tokenizer.json": str(Path(cache_root) / "hub"),
    }
    missing = [f"{name} in {cache}" for name, cache in caches.items() if not _cached(repo, name, cache)]
    if missing:
        raise CheckFailed(
            f"model.path {repo} is a hub id and the hub cannot be reached ({offline}); the HF caches do not hold it "
            f"(missing: {', '.join(missing)}). Download it where there is network (hf download {repo} "
            "--local-dir DIR) and set model.path: DIR, or run where the hub answers"
        )
    return f"model: hub id {repo} from the HF cache ({offline})"


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _cached(repo: str, name: str, cache: str) -> bool:
    """`name` (a file, or "model weights": any of WEIGHT_FILES) of hub repo `repo` is in the HF cache `cache`."""
    from huggingface_hub import try_to_load_from_cache

    files = WEIGHT_FILES if name == "model weights" else (name,)
    try:
        return any(isinstance(try_to_load_from_cache(repo, file, cache_dir=cache), str) for file in files)
    except ValueError:  # not a hub id's shape
        return False


PROMPTS_CHECKED = 512  # rows of each split the check renders and tokenizes


def check_data(spec: RunSpec) -> str:
    """The data section gives train and held-out rows, enough for the warm start, and their prompts
    render and tokenize within data.max_prompt_tokens (the first PROMPTS_CHECKED of each split, as the
    prepare step encodes them). Every problem found is listed, not only the first."""
    from rlpipe.data import task_rows
    from rlpipe.data.prompts import encode_prompts

    data = spec.data
    try:
        train, held_out = task_rows(spec)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    except Exception as err:  # noqa: BLE001 (a generator's options it cannot meet, a file it cannot read, ...)
        source = f"data.generator {data.generator} with data.options" if data.generator else f"data.path {data.path}"
        raise CheckFailed(f"{source}: reading the rows failed ({type(err).__name__}: {err})") from None
    problems = []
    if not train or not held_out:
        problems.append(f"data: {len(train)} train rows and {len(held_out)} held-out rows; both need some")
    ws = spec.model.warm_start
    if ws.max_steps and len(train) < ws.validation_size + ws.batch_size:
        problems.append(
            f"model.warm_start: {len(train)} train rows cannot hold validation_size={ws.validation_size} plus a "
            f"batch of {ws.batch_size}; bring more train rows (data.train_size) or lower them"
        )
    tokenized = ""
    tokenizer = None
    if tokenizer_is_local(spec) and (train or held_out):
        from rlpipe.models.files import load_prompt_tokenizer

        try:
            tokenizer = load_prompt_tokenizer(spec.model.path, spec.cache_root)
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
        except Exception as err:  # noqa: BLE001 (credentials, network, ... reading a URI)
            problems.append(f"model.path {spec.model.path}: cannot read its tokenizer ({type(err).__name__}: {err})")
    if tokenizer is not None:
        split = "train"
        longest: list[tuple[int, str, str]] = []  # (tokens, split, text) of each split's longest prompt kept
        try:
            for split, rows in (("train", train), ("held-out", held_out)):
                sample = rows[:PROMPTS_CHECKED]
                encoded, dropped = encode_prompts(sample, data, tokenizer)
                if encoded:
                    longest.append(max((len(row["prompt_token_ids"]), split, row["prompt"]) for row in encoded))
                if sample and not encoded:
                    problems.append(
                        f"data.max_prompt_tokens {data.max_prompt_tokens} drops every {split} prompt (all "
                        f"{len(sample)} checked are longer); raise it, or set it to null to keep every prompt"
                    )
                elif split == "train" and encoded:
                    kept = f"; {dropped} of {len(sample)} checked longer than max_prompt_tokens" if dropped else ""
                    first, found = first_prompt(spec, tokenizer, sample[0])
                    tokenized, problems = f"{kept}; {first}", problems + found
        except ValueError as err:
            problems.append(str(err))
        except Exception as err:  # noqa: BLE001 (a template that fails on a row: '{0}', '{a.b}', raise_exception)
            problems.append(
                f"data: a {split} prompt does not render ({type(err).__name__}: {err}); fix data.prompt_template "
                "(its fields name the rows' columns: {column}) or the chat template (data.chat_template)"
            )
        if longest and (problem := context_problem(spec, max(longest))):
            problems.append(problem)
    if problems:
        raise CheckFailed("\n    ".join(problems))
    source = f"generator {data.generator}" if data.generator else f"{data.path}"
    return f"data {source}: {len(train)} train rows, {len(held_out)} held-out rows{tokenized}"


PIECES_SHOWN = 24  # of the first prompt: its head and its tail (where a chat template's generation prompt is)


def first_prompt(spec: RunSpec, tokenizer: PromptTokenizer, row: dict[str, Any]) -> tuple[str, list[str]]:
    """("first prompt N tokens: <s> | ▁What | ...", what is wrong with its ids): not starting with the model's
    bos when its authors ask for one (bos_problem), or other ids from the policy's tokenizer (policy_problem)."""
    from rlpipe.data.prompts import prompt_text

    text, rendered = prompt_text(row, spec.data, tokenizer)
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=not rendered).ids  # as encode_prompts does
    pieces = [tokenizer.tokenizer.id_to_token(i) or f"#{i}" for i in ids]
    pieces = [piece if piece.strip() else repr(piece) for piece in pieces]  # a space shown as ' '
    if len(pieces) > PIECES_SHOWN:
        pieces = [*pieces[: PIECES_SHOWN - 6], "...", *pieces[-5:]]
    problems = []
    if tokenizer.folder is not None:
        found = (
            bos_problem(spec, tokenizer, ids, rendered),
            policy_problem(spec, tokenizer.folder, text, rendered, ids),
        )
        problems = [problem for problem in found if problem]
    return f"first prompt {len(ids)} tokens: {' | '.join(pieces)}", problems


def bos_problem(spec: RunSpec, tokenizer: PromptTokenizer, ids: list[int], rendered: bool) -> str | None:
    """What to change when a text prompt does not start with config.json's bos_token_id although the
    tokenizer's authors ask for a bos (rlpipe.models.files.authors_additions), or None."""
    from rlpipe.models.files import authors_additions

    folder = tokenizer.folder
    assert folder is not None  # first_prompt asks only of a model's own tokenizer (the tiny model's has none)
    config = folder / "config.json"
    bos = json.loads(config.read_text()).get("bos_token_id") if config.is_file() else None
    if rendered or not isinstance(bos, int) or not authors_additions(folder).get("add_bos_token"):
        return None
    if ids and ids[0] == bos:
        return None
    first = f"{ids[0]} ({tokenizer.tokenizer.id_to_token(ids[0])})" if ids else "nothing"
    return (
        f"model.path {spec.model.path}: {folder / 'tokenizer_config.json'} asks for a bos "
        f"(add_bos_token: true) and config.json's bos_token_id is {bos}, but the first train prompt starts with "
        f"{first}; set tokenizer_config.json's bos_token to the token of id {bos} "
        f"({tokenizer.tokenizer.id_to_token(bos)}), or add_bos_token: false if the model takes no bos"
    )


def policy_problem(spec: RunSpec, folder: Path, text: str, rendered: bool, ids: list[int]) -> str | None:
    """What to change when the policy's tokenizer (transformers, rlpipe.models.loading.load_tokenizer) gives
    `text` other ids than the prepare step's (`ids`), or None; not compared where torch and transformers are
    not installed (the light image) or do not load in PROBE_S."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return None
    try:
        name, theirs = within(PROBE_S, lambda: policy_ids(spec, folder, text, rendered))
    except TimeoutError:
        return None
    except Exception as err:  # noqa: BLE001 (a tokenizer class or file transformers cannot load)
        return f"model.path {spec.model.path}: the policy's tokenizer does not load ({type(err).__name__}: {err})"
    if theirs == ids:
        return None
    at = next((k for k, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b), min(len(ids), len(theirs)))
    return (
        f"model.path {spec.model.path}: the first train prompt tokenizes differently in the prepare step "
        f"(tokenizer.json: {ids[at : at + 8]} from position {at}) and in the policy's tokenizer ({name}: "
        f"{theirs[at : at + 8]}), so the trainer would read other tokens than those sampled; in "
        f"{folder / 'tokenizer_config.json'} set tokenizer_class to PreTrainedTokenizerFast (transformers then uses "
        "tokenizer.json as it is) and add_bos_token / add_eos_token to what the model expects"
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".h5", ".msgpack")


def policy_ids(spec: RunSpec, folder: Path, text: str, rendered: bool) -> tuple[str, list[int]]:
    """The policy's tokenizer's class and ids for `text`, kept under <cache>/preflight/ by the model folder's
    files (all but weights), the text, transformers' version and rlpipe's loader (rlpipe.models.loading, read,
    not imported): importing transformers is two seconds of every `rlpipe run`'s start, and the answer changes
    only with those."""
    import hashlib
    import os

    module = importlib.util.find_spec("rlpipe.models.loading")
    assert module is not None and module.origin is not None  # a module of this package, from its file
    loader = Path(module.origin).read_bytes()
    digest = hashlib.sha256(json.dumps([text, rendered, importlib.metadata.version("transformers")]).encode() + loader)
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    kept = Path(spec.cache_root) / "preflight" / f"tokenized-{digest.hexdigest()[:32]}.json"
    if kept.is_file():
        name, ids = json.loads(kept.read_text())
        return name, ids
    from rlpipe.models.loading import load_tokenizer

    policy = load_tokenizer(folder)
    found = type(policy).__name__, policy(text, add_special_tokens=not rendered)["input_ids"]
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f".{kept.name}.{os.getpid()}")
    partial.write_text(json.dumps(found))
    partial.replace(kept)  # whole or absent: runs may share the cache
    return found


def context_problem(spec: RunSpec, longest: tuple[int, str, str]) -> str | None:
    """What to change when the longest prompt checked (tokens, split, text) and the completion budget (the
    environment's max_tokens, else rollout.max_new_tokens) exceed the model's context, or None (also when the
    context is not known here). The torch engine would run past it silently; vLLM refuses such a prompt."""
    context = model_context(spec)
    if context is None:
        return None
    limit, where = context
    tokens, split, text = longest
    environment = spec.rollout.environment
    budget, budget_key = (
        (environment.max_tokens, "rollout.environment.max_tokens")
        if environment is not None
        else (spec.rollout.max_new_tokens, "rollout.max_new_tokens")
    )
    if tokens + budget <= limit:
        return None
    shown = text if len(text) <= 80 else text[:77] + "..."
    advice = []
    if limit > budget:
        advice.append(f"set data.max_prompt_tokens: {limit - budget} to drop longer prompts")
    if limit > tokens:
        advice.append(f"lower {budget_key} to {limit - tokens}")
    if spec.model.path is None:  # RoPE: more positions, the same weights
        advice.append(f"raise model.tiny.max_position_embeddings to {tokens + budget}")
    return (
        f"data: the longest {split} prompt checked (data.max_prompt_tokens: {spec.data.max_prompt_tokens}), "
        f"{shown!r}, is {tokens} tokens; with {budget_key} {budget} that is {tokens + budget}, over the model's "
        f"context of {limit} ({where}); {', or '.join(advice)}"
    )


def model_context(spec: RunSpec) -> tuple[int, str] | None:
    """(max_position_embeddings, where it was read) of the model, when it is known without network: the tiny
    model's, a local directory's or GGUF file's config.json, a hub id's in the HF cache."""
    if spec.model.path is None:
        return spec.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    if "://" in spec.model.path:
        return None
    from huggingface_hub import try_to_load_from_cache

    from rlpipe.models.files import resolve_model_source

    try:
        source = resolve_model_source(spec.model.path, spec.cache_root)  # a local directory, or a hub id
    except (ValueError, FileNotFoundError):
        return None  # check_model says why
    config = Path(source) / "config.json" if Path(source).is_dir() else try_to_load_from_cache(source, "config.json")
    if not isinstance(config, (str, Path)) or not Path(config).is_file():
        return None
    limit = json.loads(Path(config).read_text()).get("max_position_embeddings")
    return (limit, f"max_position_embeddings in {config}") if isinstance(limit, int) else None


def tokenizer_is_local(spec: RunSpec) -> bool:
    """The model's tokenizer can be read without network: the tiny model's, a directory, a URI or a
    GGUF file (converted into the cache here, once, if no step has yet)."""
    from rlpipe.models.gguf import checked_gguf

    path = spec.model.path
    if path is None or "://" in path:
        return True
    try:
        return checked_gguf(path) is not None or Path(path).expanduser().is_dir()
    except (ValueError, FileNotFoundError):
        return False  # check_model says why (a file named .gguf that is not one, ...)
