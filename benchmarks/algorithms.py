"""Every online algorithm on the demo task, side by side: the same spec (examples/addition.yaml), the
same warm start per seed (cached by seed), the same learning rate and optimizer steps, and no more
completions generated than GRPO's 4,096 per iteration. Per algorithm and seed: held-out greedy
accuracy at the warm start and after the run, wall time, completions generated, and the metric the
algorithm is known by. Writes benchmarks/results/algorithms.{json,md}.

    python benchmarks/algorithms.py --seeds 2 --jobs 2

DAPO keeps 256 prompts per iteration out of at most 512 sampled (dynamic sampling, max_oversample 2),
so it generates no more than the others. Each run is `rlpipe run examples/addition.yaml --set
algorithm.name=... --set seed=S --run-dir runs/algorithms/<name>-seed<S>`; a complete run is read,
not re-run, and an interrupted one resumes. Wall is the sum of the iterations' wall clocks
(time/iteration_wall_s: generate to commit, without the warm start and evals), so it survives both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

RESULTS = Path(__file__).with_name("results")
SPEC = Path(__file__).resolve().parents[1] / "examples" / "addition.yaml"
# algorithm -> its own settings (everything else is the demo's) and the metric it is known by
ALGORITHMS: dict[str, tuple[dict[str, object], str]] = {
    "grpo": ({}, "policy/clip_fraction"),
    "dr_grpo": ({}, "rollout/completion_tokens_mean"),
    "dapo": (
        {"rollout.prompts_per_iteration": 256, "algorithm.max_oversample": 2.0},
        "dynamic_sampling/zero_spread_dropped",
    ),
    "gspo": ({}, "policy/clip_fraction"),
    "rloo": ({}, "advantage/abs_mean"),
    "reinforce_pp": ({}, "advantage/abs_mean"),
    "ppo": ({}, "critic/explained_variance"),
    "online_dpo": ({}, "policy/preference_accuracy"),  # on the fresh pairs, each mini-batch before its step
}


def run(name: str, seed: int, run_dir: Path) -> None:
    """Run (or resume) the algorithm's run, unless it is complete."""
    iterations = yaml.safe_load(SPEC.read_text())["loop"]["iterations"]
    state = run_dir / "state.json"
    if state.exists() and json.loads(state.read_text()).get("iteration", 0) >= iterations:
        return
    settings = {"algorithm.name": name, "seed": seed} | ALGORITHMS[name][0]
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(SPEC), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        command += ["--set", f"{key}={'null' if value is None else value}"]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        subprocess.run(
            command, check=True, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def result(name: str, seed: int, run_dir: Path) -> dict:
    """What the run directory says: the eval curve, completions generated, the known-by metric's mean."""
    evals = {
        int(path.stem.split("_")[1]): json.loads(path.read_text())["eval/accuracy_greedy"]
        for path in sorted((run_dir / "metrics").glob("eval_*.json"))
    }
    iterations = [json.loads(p.read_text()) for p in sorted((run_dir / "metrics").glob("iter_*.json"))][1:]
    metric = ALGORITHMS[name][1]
    spec = yaml.safe_load(SPEC.read_text())
    group = spec["rollout"]["samples_per_prompt"]
    generated = sum(
        m.get("dynamic_sampling/groups_sampled", spec["rollout"]["prompts_per_iteration"]) * group for m in iterations
    )
    first, last = evals[min(evals)], evals[max(evals)]
    return {
        "algorithm": name,
        "seed": seed,
        "evals": evals,
        "gain_points": round(100 * (last - first), 1),
        "completions": int(generated),
        "known_by": metric,
        "known_by_mean": sum(m.get(metric, 0.0) for m in iterations) / max(len(iterations), 1),
        "wall_s": round(sum(m["time/iteration_wall_s"] for m in iterations)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses about one core)")
    parser.add_argument("--runs", type=Path, default=Path("runs/algorithms"))
    parser.add_argument("--note", default="", help="a line for the results, e.g. what else shared the machine")
    args = parser.parse_args()
    # seeds side by side first: the two runs of a seed never warm-start into the cache at once
    jobs = [
        (name, seed, (args.runs / f"{name}-seed{seed}").resolve())
        for name in args.algorithms
        for seed in range(args.seeds)
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run(*job), jobs))
    rows = [result(*job) for job in jobs]
    machine = describe_machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"`python benchmarks/algorithms.py --seeds {args.seeds} --jobs {args.jobs}` on {machine}, commit {commit}; "
        f"{args.jobs} run(s) at a time",
        *([args.note] if args.note else []),
        "",
        "| algorithm | seed | held-out accuracy: warm start -> last | gain (points) | completions "
        "| known by (mean) | wall (iterations) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (list(ALGORITHMS).index(r["algorithm"]), r["seed"])):
        evals = r["evals"]
        lines.append(
            f"| {r['algorithm']} | {r['seed']} | {evals[min(evals)]:.3f} -> {evals[max(evals)]:.3f} | "
            f"{r['gain_points']:+.1f} | {r['completions']} | {r['known_by']} {r['known_by_mean']:.3f} | "
            f"{r['wall_s']} s |"
        )
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "algorithms.md").write_text("\n".join(lines) + "\n")
    record = {"machine": machine, "commit": commit, "note": args.note, "runs": rows}
    (RESULTS / "algorithms.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
