"""The data section: rows from generators, files, saved datasets and hub loaders; prompts from a
column, a template or chat messages; held-out splits; the token limit; old `task:` specs."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
import yaml

from rlpipe.data import prepare_data, prepared_rows, task_rows
from rlpipe.data.files import read_rows
from rlpipe.data.prompts import encode_prompts
from rlpipe.models.files import load_prompt_tokenizer
from rlpipe.spec import DataSpec, SpecError, load_spec, parse_spec

from .conftest import tiny_spec_dict

ROWS = [{"question": f"{a}-{b}", "answer": str(a - b), "id": a * 100 + b} for a in range(10) for b in range(4)]


def _spec(tmp_path: Path, **data):
    return parse_spec(tiny_spec_dict(tmp_path, data=data))


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    """A Qwen2-shaped chat model directory: a byte-level BPE tokenizer trained here, carrying ChatML."""
    from rlpipe.models.loading import build_bpe_tokenizer, build_tiny_model
    from rlpipe.spec import TinyModelSpec

    folder = tmp_path_factory.mktemp("bpe") / "model"
    texts = [f"What is {a} minus {b}? The answer is {a - b}." for a in range(40) for b in range(40)]
    tokenizer = build_bpe_tokenizer(texts, vocab_size=400)
    shape = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1)
    build_tiny_model(shape, tokenizer, 0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_every_file_form_reads_the_same_rows(tmp_path: Path):
    table = pa.Table.from_pylist(ROWS)
    _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "rows.json").write_text(json.dumps({"data": ROWS}))
    pq.write_table(table, tmp_path / "rows.parquet")
    pyarrow.csv.write_csv(table, tmp_path / "rows.csv")
    (tmp_path / "shards").mkdir()
    _write_jsonl(tmp_path / "shards" / "part-0.jsonl", ROWS[:15])
    _write_jsonl(tmp_path / "shards" / "part-1.jsonl", ROWS[15:])
    for path in ["rows.jsonl", "rows.json", "rows.parquet", "shards", "shards/part-*.jsonl"]:
        assert read_rows(str(tmp_path / path), "auto", None, "train", "data.path") == ROWS, path
    csv_rows = read_rows(str(tmp_path / "rows.csv"), "auto", None, "train", "data.path")
    assert [{k: str(v) for k, v in r.items()} for r in csv_rows] == [{k: str(v) for k, v in r.items()} for r in ROWS]
    with pytest.raises(ValueError, match=r"data.path .*missing.jsonl does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"), "auto", None, "train", "data.path")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"cannot read .*bad.jsonl as jsonl"):
        read_rows(str(tmp_path / "bad.jsonl"), "auto", None, "train", "data.path")


def test_saved_dataset_and_hub_loader_with_splits(tmp_path: Path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS[:30]), "test": Dataset.from_list(ROWS[30:])}).save_to_disk(
        tmp_path / "saved"
    )
    assert read_rows(str(tmp_path / "saved"), "auto", None, "test", "data.path") == ROWS[30:]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not 'validation'"):
        read_rows(str(tmp_path / "saved"), "auto", None, "validation", "data.path")
    # the hub loader (datasets.load_dataset) on a local dataset repository layout: data/<split>.jsonl
    (tmp_path / "hub" / "data").mkdir(parents=True)
    _write_jsonl(tmp_path / "hub" / "data" / "train.jsonl", ROWS[:30])
    _write_jsonl(tmp_path / "hub" / "data" / "test.jsonl", ROWS[30:])
    spec = _spec(tmp_path, path=str(tmp_path / "hub"), format="hub", split="train", eval_split="test")
    train, held_out = task_rows(spec)
    assert train == ROWS[:30] and held_out == ROWS[30:]
    with pytest.raises(ValueError, match=r"could not load it as a hub dataset .*Offline\?"):
        read_rows("no-such-owner/no-such-dataset", "auto", None, "train", "data.path")


def test_held_out_splits_are_disjoint(tmp_path: Path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS[:30])
    _write_jsonl(tmp_path / "eval.jsonl", ROWS[30:])
    train, held_out = task_rows(
        _spec(tmp_path, path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"))
    )
    assert train == ROWS[:30] and held_out == ROWS[30:]
    fraction = _spec(tmp_path, path=str(tmp_path / "train.jsonl"), eval_fraction=0.2, train_size=None, eval_size=None)
    train, held_out = task_rows(fraction)
    assert len(held_out) == 6 and len(train) == 24
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in held_out)
    assert task_rows(fraction) == (train, held_out)  # seeded: the same split every time
    other_seed = parse_spec(tiny_spec_dict(tmp_path, data={"path": str(tmp_path / "train.jsonl"), "seed": 7}))
    assert task_rows(other_seed)[1] != held_out
    # files hold out 5% by default; a generator makes its own
    assert DataSpec(path="x.jsonl").eval_fraction == 0.05
    with pytest.raises(ValueError, match="data.eval_fraction is for data files"):
        DataSpec(eval_fraction=0.1)
    with pytest.raises(ValueError, match="choose one held-out source, not eval_path and eval_fraction"):
        DataSpec(path="x.jsonl", eval_path="y.jsonl", eval_fraction=0.1)


def test_prompt_from_a_template_with_columns_reaching_the_rewards(tmp_path: Path):
    _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    spec = _spec(tmp_path, path=str(tmp_path / "rows.jsonl"), prompt_template="{question}=", train_size=None)
    train, held_out, counts = prepared_rows(spec)
    assert counts == {"data/train_rows": 38, "data/eval_rows": 2, "data/dropped_too_long": 0}
    row = next(r for r in train + held_out if r["id"] == 703)
    assert row["prompt"] == "7-3=" and row["answer"] == "4"
    assert row["prompt_token_ids"] == load_prompt_tokenizer(None, tmp_path).tokenizer.encode("7-3=").ids
    prepare_data(spec, str(tmp_path / "run"))
    written = pq.read_table(tmp_path / "run" / "data" / "train.parquet")
    assert {"prompt", "prompt_token_ids", "question", "answer", "id"} <= set(written.column_names)
    assert json.loads((tmp_path / "run" / "data" / "counts.json").read_text()) == counts
    with pytest.raises(ValueError, match=r"names column 'query' that the rows lack; columns: question, answer, id"):
        prepared_rows(_spec(tmp_path, path=str(tmp_path / "rows.jsonl"), prompt_template="{query}"))
    with pytest.raises(ValueError, match=r"no column 'prompt'; columns: question, answer, id"):
        prepared_rows(_spec(tmp_path, path=str(tmp_path / "rows.jsonl")))
    _write_jsonl(tmp_path / "clash.jsonl", [r | {"reward": 1} for r in ROWS])
    with pytest.raises(ValueError, match=r"columns \['reward'\] clash with rollout columns"):
        prepared_rows(_spec(tmp_path, path=str(tmp_path / "clash.jsonl"), prompt_template="{question}="))


def test_chat_prompts_render_like_transformers_and_long_ones_are_counted(tmp_path: Path, bpe_model: Path):
    from rlpipe.models.loading import load_tokenizer

    hf = load_tokenizer(bpe_model)  # what the trainer loads (AutoTokenizer would swap in Qwen2's pre-tokenizer)
    tokenizer = load_prompt_tokenizer(str(bpe_model), tmp_path)
    assert tokenizer.chat_template == hf.chat_template and tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    rows = [
        {"messages": [{"role": "user", "content": "What is 12 minus 5?"}], "answer": "7"},
        {"messages": [{"role": "user", "content": "What is 30 minus 8? " + "Think. " * 40}], "answer": "22"},
    ]
    data = DataSpec(path="x.jsonl", prompt="messages", system_prompt="Answer with a number.", max_prompt_tokens=48)
    kept, dropped = encode_prompts(rows, data, tokenizer)
    assert dropped == 1 and len(kept) == 1
    messages = [{"role": "system", "content": "Answer with a number."}] + rows[0]["messages"]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert kept[0]["prompt"] == expected and expected.endswith("<|im_start|>assistant\n")
    assert kept[0]["prompt_token_ids"] == hf(expected, add_special_tokens=False)["input_ids"]
    # a text column as one user message, through the template (chat_template: true)
    (text,), _ = encode_prompts([{"prompt": "What is 3 minus 1?"}], DataSpec(path="x", chat_template=True), tokenizer)
    assert text["prompt"] == hf.apply_chat_template(
        [{"role": "user", "content": "What is 3 minus 1?"}], tokenize=False, add_generation_prompt=True
    )
    # the tiny character model has no chat template: chat prompts say so
    with pytest.raises(ValueError, match="the model's tokenizer has none"):
        encode_prompts(rows, DataSpec(path="x", prompt="messages"), load_prompt_tokenizer(None, tmp_path))


def test_a_user_generator_as_module_function(tmp_path: Path):
    spec = _spec(tmp_path, generator="tests.toy_plugins:doubling_rows", train_size=30, eval_size=5)
    train, held_out = task_rows(spec)
    assert len(train) == 30 and len(held_out) == 5
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held_out)
    with pytest.raises(ValueError, match=r"data.generator 'no_such_module:rows': cannot import 'no_such_module'"):
        task_rows(_spec(tmp_path, generator="no_such_module:rows"))


def test_old_task_section_shows_the_new_form(tmp_path: Path):
    data = tiny_spec_dict(tmp_path)
    data.pop("data")
    data["task"] = {"name": "addition", "train_size": 200, "eval_size": 20}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_spec(tmp_path / "old.yaml")
    assert str(err.value).endswith(
        "the `task` section is now `data` (which also reads data files, hub datasets and chat prompts); "
        'write instead:\n  data:\n    generator: "addition"\n    eval_size: 20\n    train_size: 200'
    )
