"""A demo spec for several seeds, side by side: warm start, held-out greedy accuracy along the run,
the gain over the warm start, and wall time per seed. Writes benchmarks/results/demo_<name>.{json,md}.

    python examples/subtraction/make_data.py
    python benchmarks/demo_seeds.py examples/subtraction.yaml --seeds 3
    python benchmarks/demo_seeds.py examples/addition-lora.yaml --smoke   # tiny sizes, 1 seed: seconds
    python benchmarks/demo_seeds.py examples/calculator.yaml --seeds 3   # multi-turn: + tool calls, turns

Each seed is `rlpipe run SPEC --set seed=S --run-dir runs/demo-seeds/<name>-seed<S>` (a run already
complete there is read, not re-run; its wall is then unknown). `--smoke` runs the spec at
benchmarks/smoke.yaml's sizes (one seed unless --seeds says), with runs and results under runs/smoke/
unless --runs/--results-dir say.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from machine import describe_machine, how_steps_ran  # benchmarks/ is on sys.path when run as a script

from rlpipe.spec import load_spec

RESULTS = Path(__file__).with_name("results")
SMOKE = yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text())
SMOKE_ROOT = Path(__file__).resolve().parents[1] / "runs" / "smoke"


def run_seed(spec: Path, seed: int, run_dir: Path, overrides: dict) -> float | None:
    """Wall seconds of `rlpipe run` for one seed; None when the run was already complete."""
    state = run_dir / "state.json"
    iterations = load_spec(spec, overrides).loop.iterations
    if state.exists() and json.loads(state.read_text()).get("iteration", 0) >= iterations:
        return None
    started = time.time()
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)]
    for key, value in (overrides | {"seed": seed}).items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.time() - started


def eval_metrics(run_dir: Path) -> dict[int, dict]:
    """Each held-out evaluation's metrics in a run directory, by iteration."""
    return {
        int(path.stem.split("_")[1]): json.loads(path.read_text())
        for path in sorted((run_dir / "metrics").glob("eval_*.json"))
    }


def held_out_curve(recorded: dict[int, dict]) -> dict:
    """{"evals": held-out greedy accuracy by iteration, "gain_points": the last one's gain over the first
    one's, in points} of a run's eval metrics (`eval_metrics`); benchmarks/algorithms.py and dpo.py too."""
    evals = {iteration: metrics["eval/accuracy_greedy"] for iteration, metrics in recorded.items()}
    first, last = evals[min(evals)], evals[max(evals)]
    return {"evals": evals, "gain_points": round(100 * (last - first), 1)}


def seed_result(seed: int, run_dir: Path, wall_s: float | None) -> dict:
    """What one seed's run directory says: held-out accuracy per eval, the warm start's SFT steps."""
    recorded = eval_metrics(run_dir)
    start = json.loads((run_dir / "metrics" / "iter_000000.json").read_text())
    result = {
        "seed": seed,
        "warm_start_steps": int(start.get("warm_start/steps", 0)),
        **held_out_curve(recorded),
        "wall_s": None if wall_s is None else round(wall_s),
        "steps": how_steps_ran(run_dir),
    }
    if "eval/tool_call_rate" in recorded[min(recorded)]:  # a multi-turn run: how it used the tool
        iterations = sorted(int(p.stem.split("_")[1]) for p in (run_dir / "metrics").glob("iter_*.json"))
        final = json.loads((run_dir / "metrics" / f"iter_{iterations[-1]:06d}.json").read_text())
        result |= {
            "eval_tool_call_rate": {i: m["eval/tool_call_rate"] for i, m in recorded.items()},
            "eval_turns_mean": {i: m["eval/turns_mean"] for i, m in recorded.items()},
            "rollout_tool_call_rate_first": json.loads(
                (run_dir / "metrics" / f"iter_{iterations[1]:06d}.json").read_text()
            )["rollout/tool_call_rate"],
            "rollout_tool_call_rate_last": final["rollout/tool_call_rate"],
            "rollout_turns_mean_last": final["rollout/turns_mean"],
        }
    return result


def parse_smoke_args(
    parser: argparse.ArgumentParser, runs: str, smoke: dict = SMOKE
) -> tuple[argparse.Namespace, Path, Path, dict]:
    """`parser` (with its --runs) given --smoke and --results-dir, parsed: (the arguments, the runs folder
    (--runs, else runs/<runs>, under runs/smoke/ with --smoke), the results folder, the spec overrides of
    --smoke: `smoke`); the seeds benchmarks' options (this one, benchmarks/algorithms.py and dpo.py)."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml): runs in seconds")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    folder = args.runs or (SMOKE_ROOT / runs if args.smoke else Path("runs") / runs)
    results = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    # the smoke runs keep their warm-start cache beside them, not in the demo's runs/.cache
    overrides = smoke | {"storage.cache": str(folder.resolve() / "cache")} if args.smoke else {}
    return args, folder, results, overrides


def git_commit() -> str:
    """The checkout's commit, short."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def write_report(results: Path, stem: str, lines: list[str], record: dict) -> None:
    """Print the report's `lines` and write them to <results>/<stem>.md, `record` to <stem>.json."""
    print("\n".join(lines))
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (results / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--seeds", type=int, help="default 3 (--smoke: 1)")
    parser.add_argument("--runs", type=Path, help="default runs/demo-seeds (--smoke: runs/smoke)")
    args, runs, results, overrides = parse_smoke_args(parser, "demo-seeds")
    seeds = args.seeds or (1 if args.smoke else 3)
    name = yaml.safe_load(args.spec.read_text())["name"]
    rows = []
    for seed in range(seeds):
        run_dir = (runs / f"{name}-seed{seed}").resolve()
        rows.append(seed_result(seed, run_dir, run_seed(args.spec, seed, run_dir, overrides)))
    machine = describe_machine()
    commit = git_commit()
    iterations = sorted(rows[0]["evals"])
    smoke = " --smoke" if args.smoke else ""
    lines = [
        f"`python benchmarks/demo_seeds.py {args.spec} --seeds {seeds}{smoke}` on {machine}, commit {commit}",
        "",
        f"| seed | warm start (SFT steps) | held-out greedy accuracy, iterations {', '.join(map(str, iterations))} "
        "| gain (points) | wall |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        curve = ", ".join(f"{row['evals'][i]:.3f}" for i in iterations)
        wall = "already run" if row["wall_s"] is None else f"{row['wall_s']} s"
        lines.append(f"| {row['seed']} | {row['warm_start_steps']} | {curve} | {row['gain_points']:+.1f} | {wall} |")
    gains = [row["gain_points"] for row in rows]
    lines += ["", f"gain over the warm start: min {min(gains)}, mean {sum(gains) / len(gains):.1f} points"]
    lines += ["", f"KFP tasks: {'; '.join(dict.fromkeys(row['steps'] for row in rows))}, run by {sys.executable}"]
    if "eval_tool_call_rate" in rows[0]:
        lines += [
            "",
            "Tool use: the share of trajectories that call the tool and the model turns per trajectory, held-out "
            "(greedy) at the warm start and at the end, and in the rollouts (sampled) of the first and last iteration.",
            "",
            "| seed | held-out tool-call rate, start -> end | held-out turns, start -> end "
            "| rollout tool-call rate, first -> last | rollout turns, last |",
            "|---|---|---|---|---|",
        ]
        for row in rows:
            calls, turns = row["eval_tool_call_rate"], row["eval_turns_mean"]
            lines.append(
                f"| {row['seed']} | {calls[iterations[0]]:.3f} -> {calls[iterations[-1]]:.3f} "
                f"| {turns[iterations[0]]:.2f} -> {turns[iterations[-1]]:.2f} "
                f"| {row['rollout_tool_call_rate_first']:.3f} -> {row['rollout_tool_call_rate_last']:.3f} "
                f"| {row['rollout_turns_mean_last']:.2f} |"
            )
    record = {"spec": str(args.spec), "smoke": args.smoke, "machine": machine, "commit": commit, "seeds": rows}
    write_report(results, f"demo_{name}", lines, record)


if __name__ == "__main__":
    main()
