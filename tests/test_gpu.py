"""The same training code on a CUDA GPU (marker `gpu`): CI has no GPU, so these skip there with that
reason; they run wherever torch sees one (`pytest -m gpu`). The update on the GPU equals the CPU's,
micro-batches still give the one-pass update, packed rows (varlen flash attention) the padded update,
bf16 keeps fp32 masters on the device, a whole iteration of the step functions runs there, and LoRA's
reference is the base there too."""

from pathlib import Path

import pytest
import torch

from rlpipe.spec import parse_spec
from rlpipe.training.trainer import packs_rows, train_on_batch

from .conftest import initialize, tiny_spec_dict
from .test_precision_and_memory import _batch, _make, _params, _trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 would round fp32 matmuls to 10-bit mantissas: compare fp32 with fp32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_the_update_on_the_gpu_equals_the_cpu_update(tmp_path: Path):
    batch = _batch(tmp_path)
    on_cpu, on_gpu = _trainer(tmp_path, device="cpu"), _trainer(tmp_path, device="cuda")
    assert all(p.device.type == "cuda" for p in on_gpu.policy.parameters())
    a, b = train_on_batch(on_cpu, batch, 1), train_on_batch(on_gpu, batch, 1)
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], rel=1e-4, abs=1e-6)
    assert all(p.device.type == "cuda" for p in on_gpu.policy.parameters())  # nothing fell back to CPU
    for name, value in _params(on_cpu).items():
        torch.testing.assert_close(_params(on_gpu)[name].cpu(), value, rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_accumulation_on_the_gpu_equals_the_one_pass_update(tmp_path: Path):
    batch = _batch(tmp_path)
    settings = {"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "device": "cuda"}
    one_pass = _make(parse_spec(tiny_spec_dict(tmp_path, trainer=settings)))
    accumulated = _make(parse_spec(tiny_spec_dict(tmp_path, trainer=settings | {"micro_batch_tokens": 40})))
    full, parts = train_on_batch(one_pass, batch, 1), train_on_batch(accumulated, batch, 1)
    assert parts["policy/micro_batches"] >= 6
    assert parts["policy/loss"] == pytest.approx(full["policy/loss"], rel=1e-5, abs=1e-7)
    for name, value in _params(one_pass).items():
        torch.testing.assert_close(_params(accumulated)[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_update_on_the_gpu_is_the_padded_update(tmp_path: Path, dtype: str):
    """trainer.padding_free on CUDA: bf16 autocast attends through torch's varlen flash attention, fp32 through
    SDPA over the rows of each length; either way the padded update, within the precision's rounding."""
    batch = _batch(tmp_path)
    found = {}
    for padding_free in (False, True):
        trainer = _trainer(tmp_path, device="cuda", dtype=dtype, padding_free=padding_free, micro_batch_tokens=None)
        trainer.packed = packs_rows(trainer)
        found[padding_free] = train_on_batch(trainer, batch, 1), _params(trainer)
    (padded, padded_weights), (packed, packed_weights) = found[False], found[True]
    assert packed["policy/padding_share"] == 0 < padded["policy/padding_share"]
    rel, atol = (1e-4, 1e-5) if dtype == "float32" else (2e-2, 2e-3)
    assert packed["policy/loss"] == pytest.approx(padded["policy/loss"], rel=rel, abs=atol)
    for name, weight in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], weight, rtol=rel, atol=atol, msg=name)


def test_bf16_on_the_gpu_keeps_fp32_masters_and_samples_what_it_trains_on(tmp_path: Path):
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.training.batching import pack
    from rlpipe.training.logprobs import completion_logits, token_logprobs

    batch = _batch(tmp_path)
    fp32 = _trainer(tmp_path, sgd=False, lr=1e-3, device="cuda")
    bf16 = _trainer(tmp_path, sgd=False, lr=1e-3, device="cuda", dtype="bfloat16")
    a, b = train_on_batch(fp32, batch, 1), train_on_batch(bf16, batch, 1)
    assert all(p.dtype == torch.float32 and p.is_cuda for p in bf16.policy.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 and s["exp_avg"].is_cuda for s in bf16.optimizer.state.values())
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], abs=0.05) and b["policy/loss"] != a["policy/loss"]

    model = bf16.policy.eval()
    prompts = [[1, 5, 6, 14, 7, 8, 16], [1, 9, 14, 4, 16]] * 3
    out = hf_decode(model, prompts, 6, eos_id=2, pad_id=0, generator=torch.Generator("cuda").manual_seed(0), bf16=True)
    rows = [
        {"prompt_token_ids": p, "completion_token_ids": c, "logprobs": lp, "advantage": 0.0}
        for p, c, lp in zip(prompts, out.token_ids, out.logprobs, strict=True)
    ]
    mb = pack(rows, pad_id=0).to(torch.device("cuda"))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = completion_logits(model, mb)
    recomputed = token_logprobs(logits, mb.targets, 1.0)
    mask = mb.completion_mask.bool()
    assert (recomputed[mask] - mb.old_logprobs[mask]).abs().max() < 0.05


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_whole_iteration_runs_on_the_gpu(tmp_path: Path, lora: bool):
    from rlpipe import loop
    from rlpipe.models.loading import load_weights
    from rlpipe.store.weights import read_weight_ref

    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            trainer={"device": "cuda", "dtype": "bfloat16", "micro_batch_tokens": 64, "gradient_checkpointing": True},
            model={"lora": {"rank": 4, "alpha": 8.0} if lora else None},
            reward={"functions": [{"type": "tests.toy_plugins:length", "target": 2}]},  # varied: advantages != 0
        )
    )
    run_root, cache = str(tmp_path / "runs" / spec.name), spec.cache_root
    v0 = initialize(spec, run_root, cache)
    torch.cuda.reset_peak_memory_stats()
    v1, metrics = loop.run_iteration(spec, run_root, v0, 1, tmp_path, cache)
    assert torch.cuda.max_memory_allocated() > 0 and metrics["policy/micro_batches"] > 2
    assert v1["version"] == 1 and read_weight_ref(run_root, 1)["sha256"] == v1["sha256"]
    before, _ = load_weights(v0, cache, threads=1, device="cuda")
    after, _ = load_weights(v1, cache, threads=1, device="cuda")
    assert after.device.type == "cuda"
    ids = torch.tensor([[1, 5, 6, 14, 7]], device="cuda")
    with torch.no_grad():
        assert not torch.equal(before(ids).logits, after(ids).logits)  # v1 is a trained step away
    if lora:  # the reference is the base: the adapted v1 with its adapters off computes v0
        trained, _ = load_weights(v1, cache, threads=1, device="cuda", trainable=True)
        with torch.no_grad(), trained.disable_adapter():
            torch.testing.assert_close(trained(ids).logits, before(ids).logits)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_decode_replays_one_cuda_graph_a_step_and_decodes_what_eager_steps_do(monkeypatch, lora: bool):
    """rlpipe.engines.decode on a GPU: the step captured once and replayed (not launched op by op), the
    same greedy tokens, ends and log-probs as eager steps with rows leaving the batch; sampled in bf16,
    each recorded log-prob is a full forward's."""
    from rlpipe.engines import Sampling
    from rlpipe.engines.decode import decode, decoder_of, next_tokens

    from .test_decode import PROMPTS, tiny

    model = tiny("llama").cuda()
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
        model = get_peft_model(model, config).eval()
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    decoder = decoder_of(model, 32, {0, 1}, 23)
    greedy = lambda z: next_tokens(z, greedy=True)  # noqa: E731
    graphed = decode(decoder, PROMPTS, Sampling(2, 10), greedy)
    assert len(replays) >= 3  # a replay per step after the first
    eager = decode(decoder, PROMPTS, Sampling(2, 10), greedy, static=False)
    assert graphed.token_ids == eager.token_ids and graphed.finish_reasons == eager.finish_reasons
    assert lora or "stop" in graphed.finish_reasons  # (this LoRA's greedy rows never end: all "length")
    for a, b in zip(graphed.logprobs, eager.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    generator = torch.Generator("cuda").manual_seed(0)
    sampled = decode(decoder, PROMPTS, Sampling(4, 10, bf16=True), lambda z: next_tokens(z, 0.8, generator=generator))
    for row, (tokens, logprobs) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        ids = torch.tensor([PROMPTS[row // 4] + tokens], device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits[0, len(PROMPTS[row // 4]) - 1 : -1].float()
        full = torch.log_softmax(logits / 0.8, -1).gather(-1, ids[0, -len(tokens) :, None]).squeeze(-1)
        assert (full.cpu() - torch.tensor(logprobs)).abs().max() < 0.05  # bf16 on both sides
