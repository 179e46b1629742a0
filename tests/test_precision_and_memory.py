"""Training on real hardware, checked on CPU with the same code: micro-batches with gradient
accumulation give the one-pass update, gradient checkpointing gives the same gradients, the bf16
path keeps fp32 master weights, and asking for a GPU that is not there is an error."""

import copy
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe.models.devices import resolve_device
from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
from rlpipe.spec import TinyModelSpec, parse_spec
from rlpipe.training.batching import CPU_MICRO_BATCH_TOKENS, micro_batches, token_budget
from rlpipe.training.state import Trainer
from rlpipe.training.trainer import train_on_batch

from .conftest import RLPIPE, tiny_spec_dict


def _batch(tmp_path: Path, rows: int = 24) -> str:
    """A scored batch: prompts and completions of varied lengths, advantages, sampling log-probs."""
    rng = random.Random(0)
    table = []
    for i in range(rows):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(3, 9))]
        completion = [rng.randrange(4, 19) for _ in range(rng.randrange(1, 7))]
        table.append(
            {
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "logprobs": [-rng.uniform(1.5, 4.0) for _ in completion],
                "advantage": rng.uniform(-1.5, 1.5),
                "group_id": i // 4,
            }
        )
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "batch.parquet")
    return str(tmp_path / "batch.parquet")


def _trainer(tmp_path: Path, sgd: bool = True, **trainer) -> Trainer:
    data = tiny_spec_dict(tmp_path, trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, **trainer})
    return _make(parse_spec(data), sgd)


def _make(spec, sgd: bool = True) -> Trainer:
    """A trainer on a 2-layer model. SGD by default: its update is linear in the gradient, so two
    updates agree as closely as their gradients do (Adam's first step, lr * g / |g|, turns float
    noise in near-zero gradients into full-size steps)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1),
        tokenizer,
        seed=0,
    ).to(resolve_device(spec.trainer.device))
    if spec.trainer.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=spec.trainer.lr)
    reference = None
    if spec.algorithm.kl_coef > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    return Trainer(spec, "unused", {"version": 0}, model, tokenizer, optimizer, reference)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


def test_micro_batches_fit_the_token_budget():
    rows = [{"prompt_token_ids": [0] * p, "completion_token_ids": [0] * c} for p, c in [(5, 3), (2, 1), (9, 9), (4, 4)]]
    groups = micro_batches(rows, 20)
    assert sorted(len(r["prompt_token_ids"]) for g in groups for r in g) == [2, 4, 5, 9]  # every row once
    for group in groups:
        width = max(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in group)
        assert width * len(group) <= 20 or len(group) == 1  # a row longer than the budget goes alone
    assert micro_batches(rows, None) == [rows]
    # "auto" (the default): cache-sized micro-batches on a CPU, one pass on a GPU
    assert token_budget("auto", "cpu") == CPU_MICRO_BATCH_TOKENS and token_budget("auto", "cuda") is None
    assert token_budget(64, "cuda") == 64 and token_budget(None, "cpu") is None


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_gradient_accumulation_equals_the_one_pass_update(tmp_path: Path, aggregation: str):
    batch = _batch(tmp_path)
    algorithm = {"loss_aggregation": aggregation, "kl_coef": 0.05, "track_reference_kl": True}
    one_pass = _make(
        parse_spec(
            tiny_spec_dict(
                tmp_path,
                trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "micro_batch_tokens": None},
                algorithm=algorithm,
            )
        )
    )
    accumulated = _make(
        parse_spec(
            tiny_spec_dict(
                tmp_path,
                algorithm=algorithm,
                trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "micro_batch_tokens": 40},
            )
        )
    )
    assert _params(one_pass).keys() == _params(accumulated).keys()
    full = train_on_batch(one_pass, batch, iteration=1)
    parts = train_on_batch(accumulated, batch, iteration=1)
    assert full["policy/micro_batches"] == 2 and parts["policy/micro_batches"] >= 6
    for key in (
        "policy/loss",
        "policy/grad_norm",
        "policy/clip_fraction",
        "policy/entropy",
        "kl/mean",
        "policy/ratio_mean",
    ):
        assert parts[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    before = _params(_make(one_pass.spec))
    after_full, after_parts = _params(one_pass), _params(accumulated)
    moved = max(float((after_full[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the update did something
    for name in after_full:
        torch.testing.assert_close(after_parts[name], after_full[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_tracked_kl_costs_one_reference_pass_an_iteration(tmp_path: Path):
    """kl_coef 0 with track_reference_kl: the reference runs on the iteration's first micro-batch only, and
    kl/mean is that micro-batch's token mean (its share of the step's tokens divided out): on rows all
    alike, the one-pass update's kl/mean."""
    row = {"prompt_token_ids": [1, 5, 6, 7], "completion_token_ids": [8, 9, 10], "logprobs": [-2.0] * 3}
    rows = [row | {"advantage": (-1.0) ** i, "group_id": i // 4} for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "alike.parquet")
    found = {}
    for budget in (None, 21):  # one pass a mini-batch; three rows a micro-batch
        spec = parse_spec(
            tiny_spec_dict(
                tmp_path,
                trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "micro_batch_tokens": budget},
                algorithm={"kl_coef": 0.0, "track_reference_kl": True},
            )
        )
        trainer = _make(spec)
        torch.manual_seed(0)
        reference = copy.deepcopy(trainer.policy).eval().requires_grad_(False)
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        passes: list[int] = []
        reference.get_decoder().register_forward_hook(lambda *_, calls=passes: calls.append(1))
        trainer.reference = reference
        found[budget] = train_on_batch(trainer, str(tmp_path / "alike.parquet"), iteration=1), len(passes)
    (one_pass, one_pass_calls), (parts, parts_calls) = found[None], found[21]
    assert parts["policy/micro_batches"] == 8 and one_pass_calls == parts_calls == 1
    assert parts["kl/mean"] == pytest.approx(one_pass["kl/mean"], rel=1e-5) and parts["kl/mean"] > 1e-4


def test_gradient_checkpointing_gives_the_same_update(tmp_path: Path):
    batch = _batch(tmp_path)
    plain, checkpointed = _trainer(tmp_path), _trainer(tmp_path, gradient_checkpointing=True)
    assert checkpointed.policy.is_gradient_checkpointing and not plain.policy.is_gradient_checkpointing
    a, b = train_on_batch(plain, batch, 1), train_on_batch(checkpointed, batch, 1)
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], rel=1e-6)
    for name, value in _params(plain).items():
        torch.testing.assert_close(_params(checkpointed)[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_compute_keeps_fp32_master_weights(tmp_path: Path):
    batch = _batch(tmp_path)
    fp32, bf16 = _trainer(tmp_path, sgd=False, lr=1e-3), _trainer(tmp_path, sgd=False, lr=1e-3, dtype="bfloat16")
    a, b = train_on_batch(fp32, batch, 1), train_on_batch(bf16, batch, 1)
    assert all(p.dtype == torch.float32 for p in bf16.policy.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in bf16.optimizer.state.values())
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], abs=0.05)  # bf16 rounding, not another loss
    assert b["policy/loss"] != a["policy/loss"]  # and it really computed in bf16
    drift = max(float((p - q).detach().abs().max()) for p, q in zip(fp32.policy.parameters(), bf16.policy.parameters()))
    assert 0 < drift < 0.05


def test_a_gpu_asked_for_and_missing_is_an_error(tmp_path: Path, monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine, also on a GPU one
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"trainer.device is cuda but torch sees no GPU .*set trainer.device: auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="must be one of 'auto', 'cpu', 'cuda'"):
        parse_spec(tiny_spec_dict(tmp_path, trainer={"device": "tpu"}))


QWEN2_15B = {  # Qwen2.5-1.5B's config.json fields that memory depends on
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
LLAMA = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("config", [QWEN2_15B, LLAMA], ids=["qwen2-1.5b", "llama"])
def test_parameter_count_matches_transformers(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlpipe.training.memory_estimate import shape_from_config

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert shape_from_config(hf_config.to_dict()).parameters == sum(p.numel() for p in model.parameters())


MEASURE = """
import json, random, sys
import pyarrow as pa, pyarrow.parquet as pq, torch
from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
from rlpipe.spec import TinyModelSpec, parse_spec
from rlpipe.training.memory_estimate import estimate_memory, shape_from_config
from rlpipe.training.state import Trainer
from rlpipe.training.trainer import train_on_batch

def rss(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024

torch.set_num_threads(1)
checkpointing = sys.argv[2] == "1"
rows = [{"prompt_token_ids": [1] + [5] * 59, "completion_token_ids": [6] * 64, "logprobs": [-2.0] * 64,
         "advantage": random.Random(i).uniform(-1, 1)} for i in range(64)]
pq.write_table(pa.Table.from_pylist(rows), sys.argv[1])
spec = parse_spec({"name": "m", "trainer": {"mini_batches": 1, "gradient_checkpointing": checkpointing,
                               "micro_batch_tokens": None},
                   "algorithm": {"track_reference_kl": False}, "rollout": {"prompts_per_iteration": 8}})
tokenizer = build_char_tokenizer()
before = rss("VmRSS")
shape = TinyModelSpec(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=2,
                      max_position_embeddings=256)
model = build_tiny_model(shape, tokenizer, 0).train()
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
trainer = Trainer(spec, "-", {"version": 0}, model, tokenizer, torch.optim.AdamW(model.parameters()), None)
train_on_batch(trainer, sys.argv[1], 1)
plan = estimate_memory(spec, shape_from_config(model.config.to_dict()), 124, 1, 80)
estimate = sum(b for what, b in plan.rows if not what.startswith("sampler"))
print(json.dumps({"measured": rss("VmHWM") - before, "estimate": estimate}))
"""


@pytest.mark.parametrize(
    "checkpointing", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "checkpointed"]
)
def test_memory_estimate_is_near_the_measured_peak(tmp_path: Path, checkpointing: bool):
    """One update of a 30M-parameter shape on 7,936 tokens in a fresh process: the plan's estimate
    against the growth of the process's peak RSS."""
    import json
    import subprocess
    import sys

    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "b.parquet"), str(int(checkpointing))],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.7 < result["estimate"] / result["measured"] < 1.3, result


def test_plan_says_what_to_change(tmp_path: Path):
    import subprocess

    import yaml

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(__import__("json").dumps(QWEN2_15B))
    data = tiny_spec_dict(tmp_path, model={"path": str(tmp_path / "model")})
    data["rollout"] = {"prompts_per_iteration": 128, "samples_per_prompt": 8, "max_new_tokens": 512, "batch_size": 256}
    data["data"] = {"max_prompt_tokens": 512}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))

    def estimate(*extra: str, command: str = "estimate-memory") -> subprocess.CompletedProcess:
        command = [*RLPIPE, command, str(tmp_path / "spec.yaml"), *extra]
        return subprocess.run(command, capture_output=True, text=True)

    renamed = estimate(command="plan")  # one meaning per name: `plan` is the loop's first step
    assert renamed.returncode == 2 and "`rlpipe plan` is now `rlpipe estimate-memory`" in renamed.stderr
    full = estimate()
    assert full.returncode == 1, full.stdout + full.stderr
    assert "1.544B parameters (28 layers, hidden 1536, vocab 151936), sequences of 1024 tokens" in full.stdout
    assert "policy weights (fp32)                           5.75 GiB" in full.stdout
    assert "trainer.gradient_checkpointing: true" in full.stdout and "trainer.micro_batch_tokens: " in full.stdout
    tuned = estimate(
        "--set",
        "trainer.dtype=bfloat16",
        "--set",
        "trainer.gradient_checkpointing=true",
        "--set",
        "trainer.micro_batch_tokens=8192",
    )
    assert tuned.returncode == 0 and "fits" in tuned.stdout, tuned.stdout
    small_gpu = estimate("--gpu-memory-gib", "16")
    assert "shard them over 2 or more GPUs (FSDP), or train adapters (LoRA)" in small_gpu.stdout


DATA_PARALLEL = """
import copy, json, sys
import torch
from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
from rlpipe.spec import TinyModelSpec, parse_spec
from rlpipe.training.distributed import init_from_torchrun, shard
from rlpipe.training.state import Trainer
from rlpipe.training.loading import save_version
from rlpipe.training.trainer import train_on_batch

batch, run_root, out = sys.argv[1:4]
torch.set_num_threads(1)
trainer = {"mini_batches": 2, "warmup_steps": 0, "lr": 0.01, "micro_batch_tokens": 64}
spec = parse_spec({"name": "dp", "trainer": trainer, "algorithm": {"kl_coef": 0.05}})
rank, processes = init_from_torchrun(torch.device("cpu"))
tokenizer = build_char_tokenizer()
shape = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
model = build_tiny_model(shape, tokenizer, 0).train()
reference = copy.deepcopy(model).eval().requires_grad_(False)
if processes > 1:
    shard(model, torch.device("cpu"))
    shard(reference, torch.device("cpu"))
# eps 1e-3: Adam's step is then near-linear in small gradients, so float noise stays float noise
optimizer = torch.optim.AdamW(model.parameters(), lr=spec.trainer.lr, eps=1e-3)
trainer = Trainer(spec, run_root, {"version": 0}, model, tokenizer, optimizer, reference)
metrics = train_on_batch(trainer, batch, 1)
ref = save_version(trainer, 1, run_root + "/cache")
if rank == 0:
    json.dump({"metrics": metrics, "processes": processes, "uri": ref["uri"]}, open(out, "w"))
"""


def test_two_processes_give_the_one_process_update(tmp_path: Path):
    """FSDP2 over 2 gloo processes (torchrun) against 1 process: the same metrics, the same saved
    weights, the same AdamW moments (saved by name, loadable by one process)."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from rlpipe.store.run_root import optimizer_uri
    from rlpipe.training.distributed import load_optimizer_state

    batch = _batch(tmp_path, rows=24)
    script = tmp_path / "dp.py"
    script.write_text(DATA_PARALLEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]  # what `torchrun` runs
    runs = {}
    for name, launcher in (("one", [sys.executable]), ("two", [*torchrun, "--master-port", "29581"])):
        run_root = tmp_path / name
        out = tmp_path / f"{name}.json"
        done = subprocess.run(
            [*launcher, str(script), batch, str(run_root), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        runs[name] = json.loads(out.read_text()) | {"root": run_root}
    assert (runs["one"]["processes"], runs["two"]["processes"]) == (1, 2)
    one, two = runs["one"]["metrics"], runs["two"]["metrics"]
    for key in ("policy/loss", "policy/grad_norm", "policy/clip_fraction", "policy/entropy", "kl/mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    weights = {n: load_file(Path(runs[n]["uri"]) / "model.safetensors") for n in runs}
    assert weights["one"].keys() == weights["two"].keys()
    for name, value in weights["one"].items():
        torch.testing.assert_close(weights["two"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the 2-process optimizer state (by parameter name) loads into one process and matches its own
    fresh = _trainer(tmp_path, sgd=False)
    fresh.optimizer = torch.optim.AdamW(fresh.policy.parameters(), lr=0.01, eps=1e-3)
    saved = {n: torch.load(optimizer_uri(str(runs[n]["root"]), 1), weights_only=True) for n in runs}
    assert all(isinstance(k, str) for k in saved["two"]["state"]) and all(
        isinstance(k, int) for k in saved["one"]["state"]
    )
    load_optimizer_state(fresh.policy, fresh.optimizer, saved["two"])
    by_two = [fresh.optimizer.state[p]["exp_avg"] for p in fresh.policy.parameters()]
    load_optimizer_state(fresh.policy, fresh.optimizer, saved["one"])
    by_one = [fresh.optimizer.state[p]["exp_avg"] for p in fresh.policy.parameters()]
    for a, b in zip(by_two, by_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_sampling_records_what_the_bf16_update_recomputes(tmp_path: Path):
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.training.batching import pack
    from rlpipe.training.logprobs import completion_logits, token_logprobs

    trainer = _trainer(tmp_path, dtype="bfloat16")
    model = trainer.policy.eval()
    prompts = [[1, 5, 6, 14, 7, 8, 16], [1, 9, 14, 4, 16]] * 3
    generator = torch.Generator().manual_seed(0)
    out = hf_decode(model, prompts, 6, eos_id=2, pad_id=0, generator=generator, bf16=True)
    rows = [
        {"prompt_token_ids": p, "completion_token_ids": c, "logprobs": lp, "advantage": 0.0}
        for p, c, lp in zip(prompts, out.token_ids, out.logprobs, strict=True)
    ]
    mb = pack(rows, pad_id=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = completion_logits(model, mb)
    recomputed = token_logprobs(logits, mb.targets, 1.0)
    mask = mb.completion_mask.bool()
    gap = (recomputed[mask] - mb.old_logprobs[mask]).abs().max()
    assert gap < 0.05  # bf16 rounding of a cached vs a full forward, not another distribution
    fp32 = hf_decode(model, prompts, 6, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(0))
    assert fp32.logprobs != out.logprobs  # bf16 really ran
