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
    python benchmarks/dpo.py --smoke                                                    # tiny sizes, 1 seed

Each run is `rlpipe run examples/addition-dpo.yaml --set seed=S --run-dir runs/dpo/<name>-seed<S>`; a
complete run is read, not re-run, and an interrupted one resumes. `--smoke` runs at
benchmarks/smoke.yaml's sizes (one seed unless --seeds says) with a verifier the barely warm-started
tiny model passes sometimes (a "1" anywhere, so there are pairs), runs and results under runs/smoke/
unless --runs/--results-dir say.
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
from demo_seeds import eval_metrics, git_commit, held_out_curve, parse_smoke_args, write_report
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

from rlpipe.spec import load_spec

SMOKE = yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text()) | {
    "reward.verifier": {"type": "regex", "pattern": "1", "mode": "search"},
    "preferences.eval_pairs": 8,
}
SPEC = Path(__file__).resolve().parents[1] / "examples" / "addition-dpo.yaml"


def run(seed: int, run_dir: Path, settings: list[str]) -> None:
    """Run (or resume) one seed's run, unless it is complete; `settings` are `--set` KEY=VALUE items."""
    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in settings)}
    iterations = load_spec(SPEC, overrides).loop.iterations
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
    iterations = [json.loads(p.read_text()) for p in sorted((run_dir / "metrics").glob("iter_*.json"))][1:]
    last = iterations[-1]
    return {
        "variant": name,
        "seed": seed,
        **held_out_curve(eval_metrics(run_dir)),
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
    parser.add_argument("--seeds", type=int, help="default 3 (--smoke: 1)")
    parser.add_argument("--only", type=int, nargs="+", metavar="SEED", help="run just these seeds (of --seeds)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses about one core)")
    parser.add_argument("--runs", type=Path, help="default runs/dpo (--smoke: runs/smoke)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a spec override for every run")
    parser.add_argument("--name", default="dpo", help="the variant's name (run directories, the results' rows)")
    parser.add_argument("--results", default="dpo", help="results file stem (in --results-dir)")
    args, runs, results, smoke = parse_smoke_args(parser, "dpo", SMOKE)
    seeds = args.only or range(args.seeds or (1 if args.smoke else 3))
    settings = [f"{key}={json.dumps(value)}" for key, value in smoke.items()] + args.set
    jobs = [(seed, (runs / f"{args.name}-seed{seed}").resolve()) for seed in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: run(*job, settings), jobs))
    rows = [result(args.name, *job) for job in jobs]
    machine = describe_machine()
    commit = git_commit()
    command = "".join(f" --set {s}" for s in args.set) + (" --smoke" if args.smoke else "")
    lines = [
        f"`python benchmarks/dpo.py --seeds {len(seeds)} --jobs {args.jobs}{command}` on {machine}, commit {commit}; "
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
    record = {"machine": machine, "commit": commit, "settings": args.set, "smoke": args.smoke, "runs": rows}
    write_report(results, args.results, lines, record)


if __name__ == "__main__":
    main()
