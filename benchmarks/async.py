"""Asynchronous RL: loop.max_staleness s = 0 (synchronous) vs 1 vs 2, side by side, one run at a time
on this machine, with the same spec, warm start, sample budget and hyperparameters. s >= 1 trains with
truncated importance sampling (TIS, the asynchronous default); s=1 also without any correction (the
clipped ratio to the stale behaviour policy), which shows why; s=0 also with trainer.threads 2 (both
cores on the synchronous loop), which shows what the overlap gains over using both cores for each step;
s=1 also with partial rollouts (loop.partial_rollouts: a completion goes on under a version committed
while it is sampled).

Two workloads:
  examples/sorting.yaml   generation-heavy (the default): long-tailed completions, 3-40 tokens, which
                          a batch decodes through to its longest; generation is over half of an
                          iteration. Writes benchmarks/results/async_sorting.{json,md}.
  examples/addition.yaml  the demo: 5-token answers, the update is 3/5 of an iteration, generation a
                          fifth; the case where async cannot pay. Writes benchmarks/results/async.{json,md}.

    python benchmarks/async.py --seeds 3 --iterations 20
    python benchmarks/async.py --spec examples/addition.yaml --seeds 3 --iterations 20
    python benchmarks/async.py --smoke   # tiny sizes (benchmarks/smoke.yaml), 1 seed, 2 iterations

Per run: wall per iteration (from the first iteration's commit to the last's, evals and pipeline-run
boundaries included, so the first iteration's model loads are left out), samples/s, held-out greedy
accuracy at each eval (equal samples across s), each engine's busy share of the wall (the trainer's
update time; generation: the resident trainer's sampling time at s=0, the producer's busy time at
s >= 1) and the staleness the iterations trained on. A complete run is read, not re-run. `--smoke`
puts runs and results under runs/smoke/ unless --runs/--results-dir say.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

from rlpipe.spec import load_spec

RESULTS = Path(__file__).with_name("results")
SMOKE = yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text())
SMOKE_ROOT = Path(__file__).resolve().parents[1] / "runs" / "smoke"
SPEC = Path(__file__).resolve().parents[1] / "examples" / "sorting.yaml"
CONFIGS: dict[str, dict[str, object]] = {
    "s=0": {"loop.max_staleness": 0},
    "s=0 2 threads": {"loop.max_staleness": 0, "trainer.threads": 2},
    "s=1": {"loop.max_staleness": 1},  # off_policy_correction: truncate (TIS), the asynchronous default
    "s=2": {"loop.max_staleness": 2},
    "s=1 no correction": {"loop.max_staleness": 1, "algorithm.off_policy_correction": "none"},
    "s=1 partial rollouts": {"loop.max_staleness": 1, "loop.partial_rollouts": True},
}


def run_dir_for(root: Path, config: str, seed: int) -> Path:
    return root / f"{config.replace('=', '').replace(' ', '-').lower()}-seed{seed}"


def run(spec: Path, config: str, seed: int, iterations: int, run_dir: Path, base: dict) -> None:
    """Run (or resume) the config's run with `base` (the smoke sizes, or none) under it, unless complete."""
    state = run_dir / "state.json"
    if state.exists() and json.loads(state.read_text()).get("iteration", 0) >= iterations:
        return
    settings = base | CONFIGS[config] | {"seed": seed, "loop.iterations": iterations}
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with run_dir.with_suffix(".log").open("a") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)


def result(config: str, seed: int, iterations: int, run_dir: Path, samples: int) -> dict:
    """The run's figures; `samples`: completions per iteration."""
    metrics_dir = run_dir / "metrics"
    per_iteration = [json.loads((metrics_dir / f"iter_{i:06d}.json").read_text()) for i in range(1, iterations + 1)]
    committed = [(metrics_dir / f"iter_{i:06d}.json").stat().st_mtime for i in range(1, iterations + 1)]
    wall = (committed[-1] - committed[0]) / (iterations - 1)
    later = per_iteration[1:]
    update = statistics.mean(m["time/update_s"] for m in later)
    if CONFIGS[config]["loop.max_staleness"]:
        generation = statistics.mean(m.get("async/generation_busy_share", 0.0) for m in later)
        staleness = statistics.mean(m["async/staleness_mean"] for m in later)
    else:
        generation = statistics.mean(m["time/generate_s"] for m in later) / wall
        staleness = 0.0
    lengths = {
        q: statistics.mean(m.get(f"rollout/completion_tokens_{q}", float("nan")) for m in later)
        for q in ("mean", "p50", "p99", "max")
    }
    evals = {
        int(p.stem.split("_")[1]): json.loads(p.read_text())["eval/accuracy_greedy"]
        for p in sorted(metrics_dir.glob("eval_*.json"))
    }
    return {
        "config": config,
        "seed": seed,
        "wall_per_iteration_s": round(wall, 2),
        "samples_per_s": round(samples / wall, 1),
        "training_busy_share": round(update / wall, 3),
        "generation_busy_share": round(generation, 3),
        "staleness_mean": round(staleness, 2),
        "completion_tokens": {q: round(v, 1) for q, v in lengths.items()},
        "evals": evals,
        "is_weight_max": max((m.get("off_policy/is_weight_max", 0.0) for m in later), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, help="default 3 (--smoke: 1)")
    parser.add_argument("--iterations", type=int, help="default 20 (--smoke: 2)")
    parser.add_argument("--spec", type=Path, default=SPEC, help="the workload (default examples/sorting.yaml)")
    parser.add_argument("--uncorrected-seeds", type=int, default=1, help="seeds of the s=1 run without a correction")
    parser.add_argument("--two-thread-seeds", type=int, default=1, help="seeds of the s=0 run on 2 threads")
    parser.add_argument("--partial-seeds", type=int, default=1, help="seeds of the s=1 run with partial rollouts")
    parser.add_argument("--runs", type=Path, help="default runs/async (--smoke: runs/smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml): runs in seconds")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.smoke else 3)
    iterations = args.iterations or (2 if args.smoke else 20)
    workload = args.spec.stem
    suffix = "" if workload == "addition" else f"_{workload}"
    root = (args.runs or (SMOKE_ROOT / f"async{suffix}" if args.smoke else Path(f"runs/async{suffix}"))).resolve()
    results_dir = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    # the smoke runs keep their warm-start cache beside them, not in the demo's runs/.cache
    base = SMOKE | {"storage.cache": str(root / "cache")} if args.smoke else {}
    spec = load_spec(args.spec, base)
    samples = spec.rollout.prompts_per_iteration * spec.rollout.samples_per_prompt
    plan = [(c, s) for s in range(seeds) for c in ("s=0", "s=1", "s=2")]
    plan += [("s=1 no correction", s) for s in range(args.uncorrected_seeds)]
    plan += [("s=0 2 threads", s) for s in range(args.two_thread_seeds)]
    plan += [("s=1 partial rollouts", s) for s in range(args.partial_seeds)]
    results = []
    for config, seed in plan:
        run_dir = run_dir_for(root, config, seed)
        print(f"{config} seed {seed}: {run_dir}", flush=True)
        run(args.spec, config, seed, iterations, run_dir, base)
        results.append(result(config, seed, iterations, run_dir, samples))
        print(json.dumps(results[-1]), flush=True)

    machine = describe_machine()
    by_config: dict[str, list[dict]] = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    base = {r["seed"]: r for r in by_config["s=0"]}
    smoke = " --smoke" if args.smoke else ""
    lines = [
        f"# Asynchronous RL on {args.spec.name} ({iterations} iterations x {samples:,} completions, one run at a time)",
        "",
        f"machine: {machine}",
        "",
        f"Command: `python benchmarks/async.py --spec examples/{args.spec.name} --seeds {seeds} "
        f"--iterations {iterations}{smoke}`. Samples/s ratio: "
        f"against s=0 of the same seed. Accuracy: held-out greedy, at the warm start and after every "
        f"{spec.loop.eval_every} iterations (equal samples).",
        "",
        "| s | seed | wall/iteration | samples/s | vs s=0 | trainer busy | generation busy | staleness | "
        f"completion tokens p50 / p99 / max | held-out accuracy (0, {spec.loop.eval_every}, "
        f"{2 * spec.loop.eval_every}, ...) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["samples_per_s"] / base[r["seed"]]["samples_per_s"] if r["seed"] in base else float("nan")
        accuracies = ", ".join(f"{r['evals'][i]:.3f}" for i in sorted(r["evals"]))
        tokens = r["completion_tokens"]
        lines.append(
            f"| {r['config']} | {r['seed']} | {r['wall_per_iteration_s']} s | {r['samples_per_s']} | {ratio:.2f}x | "
            f"{r['training_busy_share']:.2f} | {r['generation_busy_share']:.2f} | {r['staleness_mean']} | "
            f"{tokens['p50']:.0f} / {tokens['p99']:.0f} / {tokens['max']:.0f} | {accuracies} |"
        )
    lines += ["", "Means over seeds:", "", "| s | samples/s vs s=0 | final accuracy | final minus s=0 (points) |"]
    lines.append("|---|---|---|---|")
    for config, rows in by_config.items():
        ratios = [r["samples_per_s"] / base[r["seed"]]["samples_per_s"] for r in rows if r["seed"] in base]
        finals = [r["evals"][max(r["evals"])] for r in rows]
        deltas = [100 * (r["evals"][max(r["evals"])] - base[r["seed"]]["evals"][max(r["evals"])]) for r in rows]
        lines.append(
            f"| {config} | {statistics.mean(ratios):.2f}x | {statistics.mean(finals):.3f} | "
            f"{statistics.mean(deltas):+.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"async{suffix}.md").write_text(text)
    record = {"machine": machine, "smoke": args.smoke, "spec": args.spec.name, "results": results}
    (results_dir / f"async{suffix}.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
