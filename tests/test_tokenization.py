"""Prompts tokenized as the model's authors do (issue 45): a GGUF's tokenizer.ggml.add_bos_token and a
Hugging Face directory's tokenizer_config.json add_bos_token reach every tokenization path (prepare, the
policy's tokenizer, the warm start); generation_config's end ids stop the torch engine; a reward model
sees one bos; pre-flight shows the first prompt's pieces and refuses tokenizers that disagree."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers.processors import TemplateProcessing

from rlpipe.data import prepared_rows
from rlpipe.engines import LoadedModel, Sampling
from rlpipe.engines.torch_engine import complete_groups, hf_decode
from rlpipe.evaluation.accuracy import greedy_texts
from rlpipe.models.files import char_tokenizer, load_prompt_tokenizer, resolve_model_source
from rlpipe.models.gguf import CONVERSION
from rlpipe.models.loading import PreTrainedTokenizerFast, build_char_tokenizer, build_tiny_model, load_tokenizer
from rlpipe.preflight import CheckFailed, check_data
from rlpipe.rewards.reward_model import encoded_for_scoring
from rlpipe.spec import RunSpec, TinyModelSpec, parse_spec
from rlpipe.training.warm_start import sft_example

from .conftest import tiny_spec_dict

HIDDEN, HEADS, FFN = 64, 2, 128
PIECES = ["▁", "h", "i", "e", "l", "o", "▁h", "▁hi", "ll", "▁he", "▁hell", "▁hello"]
BOS, EOS = 1, 2  # <s>, </s>
EOT = 259 + len(PIECES)  # <|eot|>, the last token


def write_gguf(path: Path, add_bos: bool, mlp: bool = True, pieces_of: int = 0) -> Path:
    """A llama GGUF as llama.cpp's converter writes one: a SentencePiece vocabulary (<unk> <s> </s>, byte
    fallback, a few pieces, <|eot|>) with add_bos_token as given and eot_token_id set, and one random layer
    (without its MLP weights when not `mlp`); in pieces of at most `pieces_of` tensors, as gguf-split writes
    them (NAME-00001-of-0000N.gguf: the first is returned)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES, "<|eot|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=pieces_of)
    writer.add_name("tiny-test")
    for add, value in [
        (writer.add_block_count, 1),
        (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_feed_forward_length, FFN),
        (writer.add_head_count, HEADS),
        (writer.add_head_count_kv, 1),
        (writer.add_rope_dimension_count, HIDDEN // HEADS),
        (writer.add_vocab_size, len(tokens)),
        (writer.add_bos_token_id, BOS),
        (writer.add_eos_token_id, EOS),
        (writer.add_eot_token_id, EOT),
        (writer.add_add_bos_token, add_bos),
        (writer.add_add_eos_token, False),
    ]:
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    rng = np.random.default_rng(0)
    head = HIDDEN // HEADS
    shapes = {"token_embd": (len(tokens), HIDDEN), "blk.0.attn_q": (HIDDEN, HIDDEN), "blk.0.attn_k": (head, HIDDEN)}
    shapes |= {"blk.0.attn_v": (head, HIDDEN), "blk.0.attn_output": (HIDDEN, HIDDEN)}
    if mlp:
        shapes |= {"blk.0.ffn_gate": (FFN, HIDDEN), "blk.0.ffn_up": (FFN, HIDDEN), "blk.0.ffn_down": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0] if pieces_of else path


def _spec(tmp: Path, model_path: str | None, **data) -> RunSpec:
    sections = {"data": {"train_size": 24, "eval_size": 4} | data, "storage": {"root": str(tmp / "runs")}}
    return parse_spec(tiny_spec_dict(tmp, model={"path": model_path}, **sections))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[bool, RunSpec]:
    """add_bos_token -> a spec whose model.path is such a GGUF, converted once (into the specs' shared cache)."""
    tmp = tmp_path_factory.mktemp("ggufs")
    specs = {add: _spec(tmp, str(write_gguf(tmp / f"bos-{add}" / "m.gguf", add))) for add in (True, False)}
    for spec in specs.values():
        resolve_model_source(spec.model.path, spec.cache_root)
    return specs


def test_a_gguf_asking_for_bos_gets_it_in_every_tokenization_path(ggufs: dict[bool, RunSpec]):
    spec = ggufs[True]
    converted = Path(resolve_model_source(spec.model.path, spec.cache_root))
    assert converted.name.endswith(f"-{CONVERSION}")  # not a cache converted without the flags
    train, held_out, _ = prepared_rows(spec)
    assert all(row["prompt_token_ids"][0] == BOS for row in train + held_out)
    assert all(row["prompt_token_ids"].count(BOS) == 1 for row in train)
    policy = load_tokenizer(converted)
    assert policy(train[0]["prompt"]).input_ids == train[0]["prompt_token_ids"]
    assert policy("hi hello").input_ids[0] == BOS and BOS not in policy("hi", add_special_tokens=False).input_ids
    ids, _ = sft_example(policy, train[0], spec.model.warm_start)
    assert ids[0] == BOS and ids[-1] == policy.eos_token_id
    # the end of turn is an end of generation, as llama.cpp stops at it
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == [EOS, EOT]
    assert json.loads((converted / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_a_gguf_asking_for_no_bos_gets_none(ggufs: dict[bool, RunSpec]):
    spec = ggufs[False]
    train, _, _ = prepared_rows(spec)
    assert all(BOS not in row["prompt_token_ids"] for row in train)
    policy = load_tokenizer(resolve_model_source(spec.model.path, spec.cache_root))
    assert policy(train[0]["prompt"]).input_ids == train[0]["prompt_token_ids"]


def test_a_gguf_in_pieces_is_joined_and_converts_as_the_whole_file(ggufs: dict[bool, RunSpec], tmp_path: Path):
    first = write_gguf(tmp_path / "pieces" / "m.gguf", True, pieces_of=4)
    assert [p.name for p in sorted(first.parent.glob("*.gguf"))] == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    whole = Path(resolve_model_source(ggufs[True].model.path, ggufs[True].cache_root))
    for named in (first, first.with_name("m-00002-of-00003.gguf"), first.parent):  # any piece, or their folder
        spec = _spec(tmp_path, str(named))
        converted = Path(resolve_model_source(spec.model.path, spec.cache_root))
        assert (converted / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
        assert prepared_rows(spec)[0][0]["prompt_token_ids"][0] == BOS
    first.with_name("m-00003-of-00003.gguf").unlink()
    with pytest.raises(FileNotFoundError, match=r"a GGUF in 3 pieces, 1 of them missing \(m-00003-of-00003.gguf\)"):
        resolve_model_source(str(first), str(tmp_path / "other-cache"))


def test_a_gguf_transformers_reads_with_weights_missing_is_refused(tmp_path: Path):
    """Its MLP left out, as transformers reads a Mixtral GGUF (its experts' tensors mapped to nothing)."""
    spec = _spec(tmp_path, str(write_gguf(tmp_path / "moe" / "m.gguf", True, mlp=False)))
    with pytest.raises(ValueError, match=r"architecture 'llama'.*LlamaForCausalLM without 3 of its weights.*mlp"):
        resolve_model_source(spec.model.path, spec.cache_root)
    assert not list((Path(spec.cache_root) / "models").glob("gguf-*"))  # no half-random model saved


def _hf_dir(folder: Path, add_bos: bool | None, **config) -> Path:
    """The char tokenizer saved without its bos post-processor, tokenizer_config.json's add_bos_token set
    as given (None: left out), and a config.json (bos_token_id 1, or `config`)."""
    tokenizer = char_tokenizer()
    tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    if add_bos is not None:
        tokenizer_config["add_bos_token"] = add_bos
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | config.pop("tokenizer", {})))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "bos_token_id": 1} | config))
    return folder


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_a_directory_asking_for_bos_in_tokenizer_config_gets_it_in_both_tokenizers(tmp_path: Path, add_bos):
    folder = _hf_dir(tmp_path / "model", add_bos)
    prompt_ids = load_prompt_tokenizer(str(folder), tmp_path).tokenizer.encode("12+3=").ids
    assert prompt_ids == load_tokenizer(folder)("12+3=").input_ids
    assert (prompt_ids[0] == 1) is bool(add_bos) and prompt_ids.count(1) <= 1


def test_the_torch_engine_stops_at_every_end_id_of_the_generation_config():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(), tokenizer, seed=0).eval()
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id  # the demo's: nothing else ends
    options = {"max_new_tokens": 6, "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}
    prompt = [tokenizer("12+34=").input_ids]
    free = hf_decode(model, prompt, greedy=True, **options)
    first = free.token_ids[0][0]
    assert first != tokenizer.eos_token_id and free.token_ids[0] != [first]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]  # an end of turn besides eos
    stopped = complete_groups(LoadedModel(model, tokenizer), prompt, Sampling(1, 6, temperature=1e-6), seed=0)
    assert stopped.token_ids == [[first]] and stopped.finish_reasons == ["stop"]
    greedy, _ = greedy_texts(model, tokenizer, [{"prompt_token_ids": prompt[0]}], 6, batch_size=1)
    assert greedy == [tokenizer.decode([first], skip_special_tokens=True)]


def test_the_reward_model_sees_one_bos_whether_the_prompt_holds_it_or_not(tmp_path: Path):
    build_char_tokenizer().save_pretrained(tmp_path / "rm")
    tokenizer = load_tokenizer(tmp_path / "rm")  # as load_reward_model loads it
    encoded = encoded_for_scoring(tokenizer, ["<bos>12+3=" + "15", "12+3=" + "15"], max_length=32)
    bos = tokenizer.bos_token_id
    assert [row.count(bos) for row in encoded["input_ids"].tolist()] == [1, 1]
    assert encoded["input_ids"][0].tolist() == encoded["input_ids"][1].tolist()


def test_preflight_shows_the_first_prompt_as_pieces(ggufs: dict[bool, RunSpec], tmp_path: Path):
    line = check_data(ggufs[True])
    assert "first prompt " in line and " tokens: <s> | " in line
    assert " tokens: <bos> | " in check_data(_spec(tmp_path, None))  # the tiny model's
    assert " tokens: <bos> | " in check_data(_spec(tmp_path, str(_hf_dir(tmp_path / "model", True))))


def test_the_policy_tokenizers_answer_is_kept_by_the_model_folders_content(tmp_path: Path):
    """policy_problem's ids are kept under <cache>/preflight: a second check (a fresh process) refuses the
    same folder without importing transformers; a changed tokenizer_config.json is asked anew."""
    import subprocess
    import sys

    from rlpipe.spec import spec_to_json

    folder = _hf_dir(tmp_path / "llama", True, tokenizer={"tokenizer_class": "LlamaTokenizer"})
    spec = _spec(tmp_path, str(folder), prompt_template="1 + {prompt}")
    with pytest.raises(CheckFailed, match="tokenizes differently"):
        check_data(spec)
    assert len(list((Path(spec.cache_root) / "preflight").glob("tokenized-*.json"))) == 1
    code = (
        "import sys\nfrom rlpipe.preflight import CheckFailed, check_data\nfrom rlpipe.spec import spec_from_json\n"
        f"try:\n    check_data(spec_from_json({spec_to_json(spec)!r}))\nexcept CheckFailed as err:\n    print(err)\n"
        "print('transformers imported:', 'transformers' in sys.modules)"
    )
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "tokenizes differently" in again and "transformers imported: False" in again
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert "first prompt" in check_data(spec)
    assert len(list((Path(spec.cache_root) / "preflight").glob("tokenized-*.json"))) == 2


def test_preflight_refuses_tokenizers_that_disagree_and_a_missing_bos(tmp_path: Path):
    # a tokenizer class of a model family: transformers swaps in its pre-tokenizer, which drops the spaces the
    # prepare step's tokenizer.json keeps
    folder = _hf_dir(tmp_path / "llama", True, tokenizer={"tokenizer_class": "LlamaTokenizer"})
    spec = _spec(tmp_path, str(folder), prompt_template="1 + {prompt}")
    disagree = r"tokenizes differently in the prepare step .*policy's tokenizer \(\w+Tokenizer"
    with pytest.raises(CheckFailed, match=disagree) as err:
        check_data(spec)
    assert "set tokenizer_class to PreTrainedTokenizerFast" in str(err.value)
    # the authors ask for a bos, config.json names id 2 (<eos> here), the tokenizer's bos token is <bos> (1)
    spec = _spec(tmp_path, str(_hf_dir(tmp_path / "other-bos", True, bos_token_id=2)))
    with pytest.raises(
        CheckFailed, match=r"asks for a bos .*bos_token_id is 2, but the first train prompt starts with 1 "
    ):
        check_data(spec)
