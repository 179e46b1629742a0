"""The tiny model and character tokenizer, and model loading by path, URI or hub id."""

from pathlib import Path

import fsspec
import pytest

from rlpipe.models.files import resolve_model_source
from rlpipe.models.loading import build_char_tokenizer, build_tiny_model, load_policy, load_tokenizer
from rlpipe.spec import TinyModelSpec


def test_char_tokenizer_round_trip():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+34=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 7
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_tiny_qwen2_saves_as_safetensors_and_reloads_with_the_char_tokenizer(tmp_path: Path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(), tokenizer, seed=0)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    reloaded = load_tokenizer(tmp_path)  # AutoTokenizer would swap in Qwen's pre-tokenizer here
    assert reloaded("7+8=")["input_ids"] == tokenizer("7+8=")["input_ids"]
    loaded, _ = load_policy(str(tmp_path))
    assert loaded.config.vocab_size == len(tokenizer)


def test_model_sources(tmp_path: Path):
    tokenizer = build_char_tokenizer()
    build_tiny_model(TinyModelSpec(), tokenizer, seed=0).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert resolve_model_source(str(tmp_path / "m"), tmp_path / "cache") == str(tmp_path / "m")
    # a URI goes through fsspec into the cache (gs:// takes this path with gcsfs installed)
    memory = fsspec.filesystem("memory")
    memory.put(str(tmp_path / "m") + "/", "/bucket/m", recursive=True)
    local = resolve_model_source("memory://bucket/m", tmp_path / "cache")
    assert Path(local, "config.json").exists()
    assert resolve_model_source("Qwen/Qwen2.5-0.5B", tmp_path / "cache") == "Qwen/Qwen2.5-0.5B"  # hub id passes through
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source("./no/such/model", tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source("memory://bucket/missing", tmp_path / "cache")


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="Offline\\? Set model.path"):
        load_policy("rlpipe-test/no-such-model")


@pytest.mark.parametrize("greedy", [False, True])
def test_a_group_sampled_from_one_prefill_equals_its_prompt_repeated(greedy: bool):
    import torch

    from rlpipe.engines.torch_engine import hf_decode, hf_decode_in_batches

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(), tokenizer, seed=0).eval()
    prompts = [tokenizer(q)["input_ids"] for q in ("12+34=", "5+6=", "123+4=")]
    pads = {"eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id, "greedy": greedy}
    shared = hf_decode(model, prompts, 8, generator=torch.Generator().manual_seed(3), samples=4, **pads)
    repeated = [ids for ids in prompts for _ in range(4)]
    alone = hf_decode(model, repeated, 8, generator=torch.Generator().manual_seed(3), **pads)
    assert shared.token_ids == alone.token_ids and shared.finish_reasons == alone.finish_reasons
    for a, b in zip(shared.logprobs, alone.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert len({tuple(t) for t in shared.token_ids[:4]}) > (0 if greedy else 1)  # sampled rows differ
    # a batch smaller than a group repeats the prompts: the same rows, one batch of 3 at a time
    small = hf_decode_in_batches(
        model, prompts, 3, samples=4, max_new_tokens=8, generator=torch.Generator().manual_seed(3), **pads
    )
    assert len(small.token_ids) == 12 and (not greedy or small.token_ids == alone.token_ids)
