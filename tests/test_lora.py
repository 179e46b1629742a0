"""LoRA (model.lora): the reference is the base with adapters off, versions after v0 hold only
adapters over the sealed base, they load back (trainable, or merged for sampling), and export
merges them into a plain model."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from rlpipe.models.loading import is_adapted, load_weights
from rlpipe.spec import parse_spec
from rlpipe.store.weights import BASE_FILE, publish, read_weight_ref
from rlpipe.training.loading import open_trainer, save_version
from rlpipe.training.trainer import train_on_batch

from .conftest import RLPIPE, tiny_spec_dict
from .test_precision_and_memory import _batch

LORA = {"rank": 4, "alpha": 8.0}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_reference_is_the_base_and_versions_hold_only_adapters(initialized_run, tmp_path: Path):
    _, run_root, cache = initialized_run
    lora_spec = parse_spec(tiny_spec_dict(tmp_path, model={"lora": LORA}, algorithm={"kl_coef": 0.1}))
    base_ref = read_weight_ref(run_root, 0)
    trainer = open_trainer(lora_spec, run_root, base_ref, cache)
    assert is_adapted(trainer.policy) and trainer.reference is trainer.policy  # no second copy
    trained = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 16, 9]])
    base, _ = load_weights(base_ref, cache, threads=1)
    before = _logits(trainer.policy, ids)
    torch.testing.assert_close(before, _logits(base, ids))  # B = 0: the adapted model starts as the base
    metrics = train_on_batch(trainer, _batch(tmp_path), iteration=1)
    assert metrics["kl/mean"] >= 0  # the KL to the adapters-off base (0 before the first step moves them)
    trainer.policy.eval()
    adapted = _logits(trainer.policy, ids)
    assert (adapted - before).abs().max() > 1e-4  # training moved the adapters
    with trainer.policy.disable_adapter():
        torch.testing.assert_close(_logits(trainer.policy, ids), _logits(base, ids))  # the reference = v0
    # v1 holds adapters (and the base's ref), not a model
    ref = save_version(trainer, 1, cache)
    folder = Path(ref["uri"])
    names = {p.name for p in folder.iterdir()}
    assert names == {
        "adapter_model.safetensors",
        "adapter_config.json",
        BASE_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "manifest.json",
    }
    assert json.loads((folder / BASE_FILE).read_text())["sha256"] == base_ref["sha256"]
    adapter_bytes = (folder / "adapter_model.safetensors").stat().st_size
    base_bytes = (Path(base_ref["uri"]) / "model.safetensors").stat().st_size
    assert adapter_bytes < base_bytes / 5
    publish(run_root, ref)
    # loaded back: merged for sampling, trainable for the next update, both computing the same
    merged, _ = load_weights(read_weight_ref(run_root, 1), cache, threads=1)
    assert not is_adapted(merged)
    torch.testing.assert_close(_logits(merged, ids), adapted, rtol=1e-5, atol=1e-5)
    resumed = open_trainer(lora_spec, run_root, read_weight_ref(run_root, 1), cache)
    assert is_adapted(resumed.policy) and resumed.optimizer.state_dict()["state"]
    resumed.policy.eval()
    torch.testing.assert_close(_logits(resumed.policy, ids), adapted, rtol=1e-6, atol=1e-6)
    # export: a plain model directory that computes the adapted policy
    out = tmp_path / "exported"
    done = subprocess.run(
        [*RLPIPE, "export", run_root, "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote v1" in done.stdout and (out / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(exported, ids), adapted, rtol=1e-5, atol=1e-5)


def test_lora_ranks_vllm_cannot_serve_or_several_processes_are_refused(tmp_path: Path):
    parse_spec(tiny_spec_dict(tmp_path, model={"lora": LORA}, rollout={"engine": "sampler"}))
    with pytest.raises(ValueError, match="vLLM serves LoRA ranks up to 512"):
        parse_spec(tiny_spec_dict(tmp_path, model={"lora": {"rank": 1024}}, rollout={"engine": "vllm"}))
    with pytest.raises(ValueError, match="model.lora trains in one process for now"):
        parse_spec(tiny_spec_dict(tmp_path, model={"lora": LORA}, trainer={"gpus": 2}))


@pytest.mark.parametrize("resident", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_lora_runs_the_loop_on_kfp_local(tmp_path: Path, resident: bool):
    import yaml

    data = tiny_spec_dict(tmp_path, model={"lora": LORA}, trainer={"resident": resident, "lr": 5e-3})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [*RLPIPE, "run", str(tmp_path / "spec.yaml"), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((run_dir / "state.json").read_text())
    assert state["iteration"] == 3 and state["weights_version"] == 3
    for version in (1, 2, 3):
        folder = run_dir / "weights" / f"v{version:06d}"
        if folder.exists():  # keep_versions may have pruned the oldest
            assert (folder / "adapter_model.safetensors").exists() and not (folder / "model.safetensors").exists()
    assert (run_dir / "weights" / "v000000" / "model.safetensors").exists()  # the base stays whole
    evals = sorted((run_dir / "metrics").glob("eval_*.json"))
    assert [p.name for p in evals][-1] == "eval_000003.json"


@pytest.mark.parametrize("rslora", [False, True])
def test_the_sampler_merges_an_adapter_as_peft_does(tmp_path: Path, rslora: bool):
    """rlpipe.engines.vllm_worker.merged_lora_weights (what a CPU sampler loads for a LoRA
    version) equals peft's merge_and_unload, module for module."""
    from peft import LoraConfig, get_peft_model

    from rlpipe.engines.vllm_worker import merged_lora_weights
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
    from rlpipe.spec import TinyModelSpec

    model = build_tiny_model(TinyModelSpec(), build_char_tokenizer(), seed=0)
    model.save_pretrained(tmp_path / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=rslora))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    merged = merged_lora_weights(str(tmp_path / "base"), str(tmp_path / "adapter"))
    expected = adapted.merge_and_unload().state_dict()
    assert len(merged) == 7 * TinyModelSpec().num_layers
    for name, weight in merged.items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("disable", [True, False])
def test_the_update_compares_the_policy_with_itself_not_two_dropout_samples(
    initialized_run, tmp_path: Path, disable: bool
):
    """trainer.disable_dropout (default on, TRL's): LoRA's dropout and the attention's are off in the
    trainer's log-prob passes, so pi_theta / pi_old is 1 before the first step; off, two passes differ."""
    _, run_root, cache = initialized_run
    lora = LORA | {"dropout": 0.5}
    spec = parse_spec(tiny_spec_dict(tmp_path, model={"lora": lora}, trainer={"disable_dropout": disable}))
    trainer = open_trainer(spec, run_root, read_weight_ref(run_root, 0), cache)
    assert trainer.policy.training
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:  # B = 0 at the start hides the adapters' dropout
                parameter.normal_()
        for module in trainer.policy.modules():
            if hasattr(module, "attention_dropout") and not disable:
                module.attention_dropout = 0.5
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 16, 9]])
    torch.manual_seed(0)
    first, second = _logits(trainer.policy, ids), _logits(trainer.policy, ids)
    assert torch.equal(first, second) == disable


def test_disable_dropout_turns_off_the_attentions_dropout_too():
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model, disable_dropout
    from rlpipe.spec.schema import TinyModelSpec

    tiny = TinyModelSpec(hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_tiny_model(tiny, build_char_tokenizer(), 0)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5  # HF attention applies it while training, outside any nn.Dropout
    model.train()
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 16, 9]])
    assert not torch.equal(_logits(model, ids), _logits(model, ids))
    disable_dropout(model)
    assert torch.equal(_logits(model, ids), _logits(model, ids))
