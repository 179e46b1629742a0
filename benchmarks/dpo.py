"""Offline DPO on the demo task (examples/addition-dpo.yaml), a few seeds: the preference set built
from the task once (8 samples of each prompt from the warm start; chosen = one the verifier accepts,
rejected = one it rejects), then 25 iterations of DPO on 512 pairs each. Per seed: held-out greedy
accuracy at the warm start and after DPO; on held-out pairs (from the held-out prompts) the
preference accuracy (the implicit reward ranks the pair right: h_w > h_l, h = log pi - log pi_ref
summed over the completion; 0 at v0, where every h is 0) and the fraction the policy itself prefers
the chosen answer (log pi(y_w|x) > log pi(y_l|x)) at v0 and after. Writes
benchmarks/results/dpo.{json,md}.

    python benchmarks/dpo.py --seeds 3 --jobs 2
    python benchmarks/dpo.py --seeds 3 --set algorithm.rpo_alpha=1.0 --name dpo_rpo   # a variant

Each run is `rlpipe run examples/addition-dpo.yaml --set seed=S --run-dir runs/dpo/<name>-seed<S>`; a
complete run is read, not re-run, and an interrupted one resumes.
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
SPEC = Path(__file__).resolve().parents[1] / "examples" / "addition-dpo.yaml"


def run(seed: int, run_dir: Path, settings: list[str]) -> None:
    """Run (or resume) one seed's run, unless it is complete."""
    iterations = yaml.safe_load(SPEC.read_text())["loop"]["iterations"]
    state = run_dir / "state.json"
    if state.exists() and json.loads(state.read_text()).get("iteration", 0) >= iterations:
        return
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(SPEC), "--run-dir", str(run_dir)]
    for setting in [f"seed={seed}", *settings]:
        command += ["--set", setting]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with run_dir.with_suffix(".log").open("a") as out:
        subprocess.run(
            command, check=True, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def result(name: str, seed: int, run_dir: Path) -> dict:
    """What the run directory says: the eval curve, the last iteration's DPO metrics, the pairs."""
    metrics = run_dir / "metrics"
    evals = {
        int(p.stem.split("_")[1]): json.loads(p.read_text())["eval/accuracy_greedy"]
        for p in sorted(metrics.glob("eval_*.json"))
    }
    iterations = [json.loads(p.read_text()) for p in sorted(metrics.glob("iter_*.json"))][1:]
    last = iterations[-1]
    first, final = evals[min(evals)], evals[max(evals)]
    return {
        "variant": name,
        "seed": seed,
        "evals": evals,
        "gain_points": round(100 * (final - first), 1),
        "train_pairs": int(last["preferences/train_pairs"]),
        "eval_pairs": int(last["preferences/eval_pairs"]),
        "sampled_accuracy_v0": last.get("preferences/train_sampled_accuracy"),
        "eval_preference_accuracy": last["dpo/eval_preference_accuracy"],
        "train_preference_accuracy": last["dpo/train_preference_accuracy"],
        "eval_reward_margin": last["dpo/eval_reward_margin"],
        "eval_logprob_accuracy_v0": last["dpo/eval_logprob_accuracy_v0"],
        "eval_logprob_accuracy": last["dpo/eval_logprob_accuracy"],
        "wall_s": round(sum(m["time/iteration_wall_s"] for m in iterations)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", type=int, nargs="+", metavar="SEED", help="run just these seeds (of --seeds)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses about one core)")
    parser.add_argument("--runs", type=Path, default=Path("runs/dpo"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a spec override for every run")
    parser.add_argument("--name", default="dpo", help="the variant's name (run directories, the results' rows)")
    parser.add_argument("--results", default="dpo", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    seeds = args.only if args.only else range(args.seeds)
    jobs = [(seed, (args.runs / f"{args.name}-seed{seed}").resolve()) for seed in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run(*job, args.set), jobs))
    rows = [result(args.name, *job) for job in jobs]
    machine = describe_machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    settings = "".join(f" --set {s}" for s in args.set)
    lines = [
        f"`python benchmarks/dpo.py --seeds {args.seeds} --jobs {args.jobs}{settings}` on {machine}, commit {commit}; "
        f"examples/addition-dpo.yaml, {args.jobs} run(s) at a time",
        "",
        "| variant | seed | pairs (train / held-out) | held-out greedy accuracy: warm start -> DPO | gain (points) "
        "| held-out preference accuracy (train pairs) | policy prefers chosen: v0 -> DPO | wall (iterations) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        evals = r["evals"]
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['train_pairs']} / {r['eval_pairs']} | "
            f"{evals[min(evals)]:.3f} -> {evals[max(evals)]:.3f} | {r['gain_points']:+.1f} | "
            f"{r['eval_preference_accuracy']:.3f} ({r['train_preference_accuracy']:.3f}) | "
            f"{r['eval_logprob_accuracy_v0']:.3f} -> {r['eval_logprob_accuracy']:.3f} | {r['wall_s']} s |"
        )
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.results}.md").write_text("\n".join(lines) + "\n")
    record = {"machine": machine, "commit": commit, "settings": args.set, "runs": rows}
    (RESULTS / f"{args.results}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
