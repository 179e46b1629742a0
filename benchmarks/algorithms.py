"""Every online algorithm on the demo task, side by side: the same spec (examples/addition.yaml), the
same warm start per seed (cached by seed), the same learning rate and optimizer steps, and no more
completions generated than GRPO's 4,096 per iteration. Per algorithm and seed: held-out greedy
accuracy at the warm start and after the run, wall time, completions generated, and the metric the
algorithm is known by. Writes benchmarks/results/algorithms.{json,md}.

    python benchmarks/algorithms.py --seeds 2 --jobs 2
    python benchmarks/algorithms.py --jobs 2 --smoke   # tiny sizes, 1 seed: every algorithm in ~a minute

DAPO keeps half the spec's prompts per iteration (256) out of at most all of them sampled (dynamic
sampling, max_oversample 2), so it generates no more than the others. Each run is `rlpipe run
examples/addition.yaml --set algorithm.name=... --set seed=S --run-dir runs/algorithms/<name>-seed<S>`;
a complete run is read, not re-run, and an interrupted one resumes. Wall is the sum of the iterations'
wall clocks (time/iteration_wall_s: generate to commit, without the warm start and evals), so it
survives both. `--smoke` runs at benchmarks/smoke.yaml's sizes (one seed unless --seeds says),
with runs and results under runs/smoke/ unless --runs/--results-dir say.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from demo_seeds import eval_metrics, git_commit, held_out_curve, parse_smoke_args, write_report
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

from rlpipe.spec import load_spec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "addition.yaml"
# algorithm -> its own settings (everything else is the demo's) and the metric it is known by
ALGORITHMS: dict[str, tuple[dict[str, object], str]] = {
    "grpo": ({}, "policy/clip_fraction"),
    "dr_grpo": ({}, "rollout/completion_tokens_mean"),
    "dapo": ({"algorithm.max_oversample": 2.0}, "dynamic_sampling/zero_spread_dropped"),  # + half the prompts
    "gspo": ({}, "policy/clip_fraction"),
    "rloo": ({}, "advantage/abs_mean"),
    "reinforce_pp": ({}, "advantage/abs_mean"),
    "ppo": ({}, "critic/explained_variance"),
    "online_dpo": ({}, "policy/preference_accuracy"),  # on the fresh pairs, each mini-batch before its step
}


def settings_for(name: str, seed: int, base: dict) -> dict:
    """The run's spec overrides: `base` (the smoke sizes, or none), the algorithm, the seed and the
    algorithm's own settings; DAPO keeps half the spec's prompts per iteration."""
    own = dict(ALGORITHMS[name][0])
    if name == "dapo":
        own["rollout.prompts_per_iteration"] = load_spec(SPEC, base).rollout.prompts_per_iteration // 2
    return base | {"algorithm.name": name, "seed": seed} | own


def run(name: str, seed: int, run_dir: Path, base: dict) -> None:
    """Run (or resume) the algorithm's run, unless it is complete."""
    settings = settings_for(name, seed, base)
    state = run_dir / "state.json"
    done = json.loads(state.read_text()).get("iteration", 0) if state.exists() else 0
    if done >= load_spec(SPEC, settings).loop.iterations:
        return
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(SPEC), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        subprocess.run(
            command, check=True, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def result(name: str, seed: int, run_dir: Path, base: dict) -> dict:
    """What the run directory says: the eval curve, completions generated, the known-by metric's mean
    over the iterations that logged it (None if none did)."""
    iterations = [json.loads(p.read_text()) for p in sorted((run_dir / "metrics").glob("iter_*.json"))][1:]
    metric = ALGORITHMS[name][1]
    rollout = load_spec(SPEC, settings_for(name, seed, base)).rollout
    generated = sum(
        m.get("dynamic_sampling/groups_sampled", rollout.prompts_per_iteration) * rollout.samples_per_prompt
        for m in iterations
    )
    logged = [m[metric] for m in iterations if metric in m]
    return {
        "algorithm": name,
        "seed": seed,
        **held_out_curve(eval_metrics(run_dir)),
        "completions": int(generated),
        "known_by": metric,
        "known_by_mean": sum(logged) / len(logged) if logged else None,
        "wall_s": round(sum(m["time/iteration_wall_s"] for m in iterations)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, help="default 2 (--smoke: 1)")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses about one core)")
    parser.add_argument("--runs", type=Path, help="default runs/algorithms (--smoke: runs/smoke)")
    parser.add_argument("--note", default="", help="a line for the results, e.g. what else shared the machine")
    args, runs, results, base = parse_smoke_args(parser, "algorithms")
    seeds = args.seeds or (1 if args.smoke else 2)
    jobs = [(name, seed, (runs / f"{name}-seed{seed}").resolve()) for name in args.algorithms for seed in range(seeds)]
    # one run per seed first, then the rest: two runs never warm-start one seed into the cache at once
    # (they would race on the same cache entry)
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run(*job, base), jobs[:seeds]))
        list(pool.map(lambda job: run(*job, base), jobs[seeds:]))
    rows = [result(*job, base) for job in jobs]
    machine = describe_machine()
    commit = git_commit()
    smoke = " --smoke" if args.smoke else ""
    lines = [
        f"`python benchmarks/algorithms.py --seeds {seeds} --jobs {args.jobs}{smoke}` on {machine}, "
        f"commit {commit}; {args.jobs} run(s) at a time",
        *([args.note] if args.note else []),
        "",
        "| algorithm | seed | held-out accuracy: warm start -> last | gain (points) | completions "
        "| known by (mean) | wall (iterations) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (list(ALGORITHMS).index(r["algorithm"]), r["seed"])):
        evals = r["evals"]
        known_by = "not logged" if r["known_by_mean"] is None else f"{r['known_by_mean']:.3f}"
        lines.append(
            f"| {r['algorithm']} | {r['seed']} | {evals[min(evals)]:.3f} -> {evals[max(evals)]:.3f} | "
            f"{r['gain_points']:+.1f} | {r['completions']} | {r['known_by']} {known_by} | "
            f"{r['wall_s']} s |"
        )
    record = {"machine": machine, "commit": commit, "note": args.note, "smoke": args.smoke, "runs": rows}
    write_report(results, "algorithms", lines, record)


if __name__ == "__main__":
    main()
