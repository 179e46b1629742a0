"""One whole RL iteration at a real model size, through rlpipe's own step functions (rlpipe.loop):

    prepare -> warm_start (v0 = the model, no SFT) -> generate -> score -> advantages -> update -> sync_weights

    python benchmarks/iteration_at_scale.py                        # this CPU: Qwen2.5-0.5B shape, fp32
    python benchmarks/iteration_at_scale.py --device cuda --shapes qwen2.5-0.5b qwen2.5-1.5b --modes full lora
    python benchmarks/iteration_at_scale.py --smoke --modes full lora   # the CPU path, small shape: seconds

Each (shape, mode) runs in its own process, so its peak memory is its own: on CPU the process's peak
RSS (VmHWM, everything: model, optimizer, activations, KV cache, Python), on a GPU
torch.cuda.max_memory_allocated over the iteration. Reported per run: each step's seconds, the
iteration's wall, peak memory, and what weight sync moves: the bytes of the published version and the
seconds to swap it into a sampler already holding the previous one (full: load_state_dict of the new
safetensors; LoRA: peft load_adapter of the new adapter onto the held base). Memory is what
micro-batching (`--micro-batch-tokens`) and gradient checkpointing make fit; `--no-checkpointing`
and `--micro-batch-tokens 0` show the difference.

`--compare` runs each (shape, mode) twice, side by side: "before", the costs that grow with the model
(whole logits, every version whole in fp32), and "after", rlpipe's defaults for real sizes
(trainer.logit_chunk_tokens 512, storage.weights_dtype bfloat16 with storage.full_every 10). Each run
trains 2 iterations and reports the second: v1 is whole (v0, the model, is fp32), v2 may be a delta.
Its figures: the bytes the update wrote to the store (the version, the optimizer state, the masters),
the version's bytes against a whole copy of the same dtype, the seconds to stage the version and to
write the optimizer state, the update's working memory (its peak above what the process held when it
began: the weights, gradients and AdamW state every setting holds), and the process's peak RSS in the
update (train_on_batch) and over the whole iteration (VmHWM reset before each phase; on a GPU
torch.cuda.max_memory_allocated).

Random-init weights of the real shape and a word-level tokenizer over the shape's whole vocabulary
(w0 ... wN), so every sampled id decodes; prompts are random words. The reward is a stand-in (a coin
flip keyed by the completion's text) so that GRPO's advantages are not all zero: these figures
measure time and memory, not learning. `--smoke` runs the CPU path (any --device) with the small shape
and a tiny iteration, and writes under runs/smoke/ unless --results-dir says.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu import SHAPES, command_arguments  # benchmarks/ is on sys.path when run as a script
from real_shape import build_model_dir  # a random-init model of the shape, its tokenizer, prompts, reward

from rlpipe.spec import RunSpec, parse_spec

RESULTS = Path(__file__).with_name("results")
SMOKE_ROOT = Path(__file__).resolve().parents[1] / "runs" / "smoke"


VARIANTS = {  # --compare: the same iteration under each
    "before": {
        "trainer": {"logit_chunk_tokens": None},
        "storage": {"weights_dtype": None, "full_every": 1, "optimizer_every": 1},
    },
    "after": {
        "trainer": {"logit_chunk_tokens": 512},
        "storage": {"weights_dtype": "bfloat16", "full_every": 10, "optimizer_every": 10},
    },
}


def spec_for(args: argparse.Namespace, model_dir: Path, root: Path, lora: bool) -> dict:
    vocab = SHAPES[args.shape][5]
    variant = VARIANTS.get(args.variant, {"trainer": {}, "storage": {}})
    return {
        "name": f"scale-{args.shape}-{'lora' if lora else 'full'}",
        "seed": 0,
        "model": {
            "path": str(model_dir),
            "warm_start": {"max_steps": 0},
            "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if lora else None,
        },
        "data": {
            "generator": "real_shape:random_words",
            "options": {"words": args.prompt_tokens, "vocab": vocab},
            "train_size": args.prompts,
            "eval_size": 8,
        },
        "reward": {"functions": ["real_shape:stand_in_reward"]},
        "rollout": {
            "engine": "torch",
            "prompts_per_iteration": args.prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": args.new_tokens,
            "batch_size": args.generate_batch,
        },
        "algorithm": {"kl_coef": 0.0, "track_reference_kl": False},
        "trainer": {
            "lr": 1e-6,
            "warmup_steps": 0,
            "mini_batches": args.mini_batches,
            "threads": args.threads,
            "device": args.device,
            "dtype": args.dtype,
            "micro_batch_tokens": args.micro_batch_tokens or None,
            "gradient_checkpointing": not args.no_checkpointing,
            "resident": True,  # held in this process between iterations (iterate)
            **variant["trainer"],
        },
        "loop": {"iterations": 3, "iterations_per_run": 3, "eval_every": 1000},  # no eval, no checkpoint due at 2
        "storage": {"root": str(root), "keep_versions": 2, **variant["storage"]},
    }


def swap_seconds(v0: dict, v1: dict, cache: str, device: str) -> float:
    """Seconds to bring a sampler holding v0 to v1 in place: the delta's elements written into the held
    model (a delta version), the new safetensors into it (whole), or the new adapter onto the held base
    (LoRA)."""
    import torch
    from safetensors.torch import load_file

    from rlpipe.models.devices import resolve_device
    from rlpipe.models.loading import load_weights
    from rlpipe.store.weight_deltas import DELTA_FILE, apply_delta_to_model
    from rlpipe.store.weights import local_path, stored_path

    held, _ = load_weights(v0, cache, threads=torch.get_num_threads(), device=device)
    stored = Path(stored_path(v1, cache))
    new_dir = stored if (stored / DELTA_FILE).exists() else Path(local_path(v1, cache))
    sync = torch.cuda.synchronize if resolve_device(device).type == "cuda" else (lambda: None)
    sync()
    started = time.time()
    if (new_dir / DELTA_FILE).exists():
        apply_delta_to_model(held, load_file(new_dir / DELTA_FILE, device=str(held.device)))
    elif (new_dir / "adapter_config.json").exists():
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(held, str(new_dir), adapter_name="v1")
        adapted.set_adapter("v1")
    else:
        for file in sorted(new_dir.glob("*.safetensors")):
            held.load_state_dict(load_file(file, device=str(held.device)), strict=False)
    sync()
    return time.time() - started


def reset_peak_memory(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def stored_bytes(ref: dict) -> int:
    """Bytes of a version's stored weight files: its delta, or its whole safetensors."""
    return sum(f.stat().st_size for f in Path(ref["uri"]).iterdir() if f.suffix == ".safetensors")


def written_bytes(run_root: str, ref: dict) -> int:
    """What the update of v(N) wrote to the store: the version's files, its optimizer state and masters
    (when a checkpoint was due), the batch kept to replay it (when not)."""
    optimizer = [*Path(run_root, "optimizer").glob(f"v{ref['version']:06d}.*")]
    optimizer += Path(run_root, "optimizer", "replay").glob(f"v{ref['version']:06d}.*")
    version = sum(f.stat().st_size for f in Path(ref["uri"]).rglob("*") if f.is_file())
    return version + sum(f.stat().st_size for f in optimizer if not f.name.endswith(".tmp"))


def memory_gib(device: str, peak: bool = False) -> float:
    """What the process holds now, or at most since reset_peak_memory: RSS (CPU), or torch's allocated
    memory (GPU)."""
    import torch

    if device == "cuda":
        return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 1024**3
    field = "VmHWM:" if peak else "VmRSS:"
    return int(Path("/proc/self/status").read_text().split(field)[1].split()[0]) / 1024**2


def one_run(args: argparse.Namespace, lora: bool) -> dict:
    """One iteration of (args.shape, full or LoRA) in this process; its figures."""
    from rlpipe.models.devices import resolve_device
    from rlpipe.models.loading import configure_torch

    configure_torch(args.threads)
    args.device = resolve_device(args.device).type
    work = Path(tempfile.mkdtemp(prefix="rlpipe-scale-", dir=args.work_dir))
    try:
        return iterate(args, lora, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # GBs: model, its cached copy, v0, v1, optimizer state


def start_run(args: argparse.Namespace, lora: bool, work: Path) -> tuple[RunSpec, str, dict, dict]:
    """The model built, the run prepared and v0 published: (spec, run root, v0, the seconds it took)."""
    from rlpipe import loop

    model_dir = work / "model"
    started = time.time()
    parameters = build_model_dir(args.shape, model_dir)
    built_s = time.time() - started
    spec = parse_spec(spec_for(args, model_dir, work / "runs", lora))
    run_root = str(work / "runs" / spec.name)
    loop.prepare(spec, run_root)
    started = time.time()
    staged, warm_metrics = loop.warm_start(spec, run_root, spec.cache_root)
    weights, _ = loop.sync_weights(spec, run_root, staged, 0, warm_metrics)
    setup = {"parameters": parameters, "build_model_s": round(built_s, 1)}
    return spec, run_root, weights, setup | {"publish_v0_s": round(time.time() - started, 1)}


def iterate(args: argparse.Namespace, lora: bool, work: Path) -> dict:
    """Two iterations with the trainer held in this process between them, as the resident trainer holds
    it (trainer.resident: what real sizes run); the figures are the second iteration's."""
    from rlpipe import loop
    from rlpipe.engines import LoadedModel, generate_rollouts
    from rlpipe.training.loading import open_trainer, save_version
    from rlpipe.training.trainer import train_on_batch

    spec, run_root, weights, setup = start_run(args, lora, work)
    cache = spec.cache_root
    trainer = open_trainer(spec, run_root, weights, cache)
    for iteration in (1, 2):
        if iteration == 2:
            v1 = weights
            reset_peak_memory(args.device)  # peaks of iteration 2: before, in and after the update
        began = time.time()
        paths = {n: str(Path(run_root, "work", f"{n}-{iteration}.parquet")) for n in ("rollouts", "scored", "batch")}
        Path(run_root, "work").mkdir(parents=True, exist_ok=True)
        loaded = LoadedModel(
            trainer.policy, trainer.tokenizer
        )  # the held policy samples (rlpipe.services.trainer.server)
        generated = generate_rollouts(spec, run_root, weights, iteration, paths["rollouts"], cache, loaded=loaded)
        scored = loop.score(spec, paths["rollouts"], paths["scored"])
        advantaged = loop.advantages(spec, paths["scored"], paths["batch"])
        peaks = [memory_gib(args.device, peak=True)]
        reset_peak_memory(args.device)
        held = memory_gib(args.device)  # the update's working memory is what it adds to this
        trained_at = time.time()
        metrics = train_on_batch(trainer, paths["batch"], iteration)
        staged_at = time.time()
        peaks.append(memory_gib(args.device, peak=True))
        reset_peak_memory(args.device)
        timings: dict[str, float] = {}
        staged = save_version(trainer, iteration, cache, timings, batch_path=paths["batch"])
        synced_at = time.time()
        weights, _ = loop.sync_weights(spec, run_root, staged, iteration, generated, scored, advantaged, metrics)
        done = time.time()
    peaks.append(memory_gib(args.device, peak=True))
    if trainer.checkpoint_writer is not None:
        trainer.checkpoint_writer.join()
    v2 = weights
    swap_s = swap_seconds(v1, v2, cache, args.device)
    stage_s = synced_at - staged_at
    return {
        "shape": args.shape,
        "mode": "lora" if lora else "full",
        "variant": args.variant,
        "settings": {"trainer.logit_chunk_tokens": spec.trainer.logit_chunk_tokens}
        | {f"storage.{k}": getattr(spec.storage, k) for k in ("weights_dtype", "full_every", "optimizer_every")},
        **setup,
        "generate_s": round(generated["time/generate_s"], 2),
        "generate_tokens_per_s": round(generated["throughput/generate_tokens_per_s"], 1),
        "score_s": round(scored["time/score_s"], 2),
        "advantages_s": round(advantaged["time/advantages_s"], 2),
        "update_s": round(staged_at - trained_at + stage_s, 2),
        "update_tokens_per_s": round(metrics["throughput/update_tokens_per_s"], 1),
        "padding_share": round(metrics["policy/padding_share"], 3),
        "stage_weights_s": round(stage_s, 2),
        "stage_version_s": round(stage_s - timings["weights/stage_optimizer_s"], 2),
        "stage_optimizer_s": round(timings["weights/stage_optimizer_s"], 2),
        "load_s": round(generated.get("overhead/generate_load_s", 0.0), 2),
        "sync_weights_s": round(done - synced_at, 2),
        "iteration_s": round(done - began, 1),
        "peak_memory_gib": round(max(peaks), 2),
        "update_peak_memory_gib": round(peaks[1], 2),
        "update_working_memory_gib": round(peaks[1] - held, 2),
        "version_bytes": stored_bytes(v2),
        "whole_version_bytes": stored_bytes(v1),  # v1 is whole, in v2's dtype
        "delta_of": json.loads(Path(v2["uri"], "manifest.json").read_text()).get("delta_of"),
        "store_bytes_written": written_bytes(run_root, v2),
        "swap_in_sampler_s": round(swap_s, 3),
        "micro_batches": metrics["policy/micro_batches"],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default qwen2.5-0.5b (--smoke: small)")
    parser.add_argument("--modes", nargs="+", default=["full"], choices=["full", "lora"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per iteration")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--generate-batch", type=int, default=None, help="sequences per sampling forward")
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="0: one pass per mini-batch")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--work-dir", default=None, help="where model, run root and cache go (temp by default)")
    parser.add_argument("--tag", default=None, help="results file suffix (default: the device)")
    parser.add_argument("--smoke", action="store_true", help="the CPU path, small shape, tiny iteration: seconds")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    parser.add_argument("--compare", action="store_true", help="each run before and after, side by side")
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # set for the per-run child process
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.shape:  # the child: one iteration, its figures as the last line; its files removed
        print(json.dumps(one_run(args, args.mode == "lora")), flush=True)
        return

    import torch

    if args.smoke:
        args.device = "cpu"
        args.threads = 1
    args.shapes = args.shapes or (["small"] if args.smoke else ["qwen2.5-0.5b"])
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    defaults = {  # a GPU: an RL-sized iteration; this CPU: the smallest one that is still a real iteration
        "dtype": "bfloat16" if gpu else "float32",
        "prompts": 64 if gpu else 8,
        "samples": 8 if gpu else 4,
        "prompt_tokens": 256 if gpu else 64,
        "new_tokens": 256 if gpu else 64,
        "generate_batch": 512 if gpu else 32,
        "micro_batch_tokens": 16384 if gpu else 1024,
    }
    if args.smoke:
        defaults |= dict(prompts=2, samples=2, prompt_tokens=8, new_tokens=8, generate_batch=4, micro_batch_tokens=16)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    settings = {k: getattr(args, k) for k in [*defaults, "threads", "mini_batches", "lora_rank"]}
    settings["gradient_checkpointing"] = not args.no_checkpointing
    results = []
    variants = list(VARIANTS) if args.compare else [None]
    runs = [(shape, mode, variant) for shape in args.shapes for mode in args.modes for variant in variants]
    for shape, mode, variant in runs:
        child = [sys.executable, __file__, "--shape", shape, "--mode", mode, "--device", args.device]
        child += ["--variant", variant] if variant else []
        child += [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if k != "gradient_checkpointing"]
        child += ["--no-checkpointing"] if args.no_checkpointing else []
        child += ["--work-dir", args.work_dir] if args.work_dir else []
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(child, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-8000:], file=sys.stderr)
            raise SystemExit(f"{shape} {mode} failed (exit {done.returncode})")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(result), flush=True)
        results.append(result)

    from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

    machine = describe_machine()
    command = f"python benchmarks/iteration_at_scale.py {command_arguments()}"
    record = dict(machine=machine, torch=torch.__version__, smoke=args.smoke, settings=settings, results=results)
    headline = f"`{command}` on {machine}; torch {torch.__version__}; {settings}"
    results_dir = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    print(write_results(results_dir, args.tag or ("cuda" if gpu else "cpu"), headline, record))


def comparison(results: list[dict]) -> list[str]:
    """Before and after of each (shape, mode), side by side: what iteration 2 wrote and read, and its peak."""
    lines = [
        "| shape | mode | | version stored | of a whole copy | store bytes written | staging v2 | of which the version "
        "| and AdamW state "
        "| sampler reads, swaps | update's working memory | peak RSS of the update (of the iteration) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pairs: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results:
        pairs.setdefault((r["shape"], r["mode"]), {})[r["variant"]] = r
    for (shape, mode), by in pairs.items():
        for variant, r in by.items():
            stored = "delta" if r["delta_of"] is not None else "whole"
            cells = [
                f"{variant}: {r['settings']}",
                f"{r['version_bytes'] / 1e6:.1f} MB ({stored})",
                f"{100 * r['version_bytes'] / r['whole_version_bytes']:.1f}% of full",
                f"{r['store_bytes_written'] / 1e6:,.1f} MB",
                f"{r['stage_weights_s']:.2f} s",
                f"{r['stage_version_s']:.2f} s",
                f"{r['stage_optimizer_s']:.2f} s",
                f"{r['version_bytes'] / 1e6:.1f} MB, {r['swap_in_sampler_s']:.2f} s",
                f"{r['update_working_memory_gib']:.2f} GiB",
                f"{r['update_peak_memory_gib']:.2f} GiB ({r['peak_memory_gib']:.2f} GiB)",
            ]
            lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + " |")
        if {"before", "after"} <= by.keys():
            b, a = by["before"], by["after"]
            lines.append(
                f"| {shape} | {mode} | **after / before** | {a['version_bytes'] / b['version_bytes']:.3f}x | "
                f"| {a['store_bytes_written'] / b['store_bytes_written']:.2f}x "
                f"| **{b['stage_weights_s'] / max(a['stage_weights_s'], 1e-3):.1f}x faster** "
                f"| {b['stage_version_s'] / max(a['stage_version_s'], 1e-3):.1f}x faster "
                f"| {b['stage_optimizer_s'] / max(a['stage_optimizer_s'], 1e-3):.0f}x faster "
                f"| {b['swap_in_sampler_s'] / max(a['swap_in_sampler_s'], 1e-3):.1f}x faster "
                f"| **{100 * (1 - a['update_working_memory_gib'] / b['update_working_memory_gib']):.0f}% lower** "
                f"| {100 * (1 - a['update_peak_memory_gib'] / b['update_peak_memory_gib']):.0f}% lower "
                f"({100 * (1 - a['peak_memory_gib'] / b['peak_memory_gib']):.0f}%) |"
            )
    return lines


def write_results(results_dir: Path, tag: str, headline: str, record: dict) -> str:
    """<results_dir>/iteration_at_scale_<tag>.{md,json}; returns the markdown."""
    lines = [
        headline,
        "",
        "| shape | mode | generate | update (tokens/s) | staging | sync | iteration | peak memory "
        "| version size | swap into sampler |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        cells = [
            f"{r['shape']} ({r['parameters'] / 1e6:.0f}M)",
            r["mode"] + (f" ({r['variant']})" if r.get("variant") else ""),
            f"{r['generate_s']:.1f} s ({r['generate_tokens_per_s']:.0f} tok/s)",
            f"{r['update_s']:.1f} s ({r['update_tokens_per_s']:.0f})",
            f"{r['stage_weights_s']:.1f} s",
            f"{r['sync_weights_s']:.1f} s",
            f"{r['iteration_s']:.1f} s",
            f"{r['peak_memory_gib']:.1f} GiB",
            f"{r['version_bytes'] / 1e6:.1f} MB",
            f"{r['swap_in_sampler_s']:.2f} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    compared = [r for r in record["results"] if r.get("variant")]
    if compared:
        lines += ["", "Side by side (iteration 2):", "", *comparison(compared)]
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"iteration_at_scale_{tag}.md").write_text("\n".join(lines) + "\n")
    as_json = json.dumps(record | {"headline": headline}, indent=2)
    (results_dir / f"iteration_at_scale_{tag}.json").write_text(as_json + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
