"""A demo spec for several seeds, side by side: warm start, held-out greedy accuracy along the run,
the gain over the warm start, and wall time per seed. Writes benchmarks/results/demo_<name>.{json,md}.

    python examples/subtraction/make_data.py
    python benchmarks/demo_seeds.py examples/subtraction.yaml --seeds 3
    python benchmarks/demo_seeds.py examples/addition-lora.yaml --smoke   # tiny sizes, 1 seed: seconds

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
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

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


def seed_result(seed: int, run_dir: Path, wall_s: float | None) -> dict:
    """What one seed's run directory says: held-out accuracy per eval, the warm start's SFT steps."""
    evals = {
        int(path.stem.split("_")[1]): json.loads(path.read_text())["eval/accuracy_greedy"]
        for path in sorted((run_dir / "metrics").glob("eval_*.json"))
    }
    start = json.loads((run_dir / "metrics" / "iter_000000.json").read_text())
    first, last = evals[min(evals)], evals[max(evals)]
    return {
        "seed": seed,
        "warm_start_steps": int(start.get("warm_start/steps", 0)),
        "evals": evals,
        "gain_points": round(100 * (last - first), 1),
        "wall_s": None if wall_s is None else round(wall_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--seeds", type=int, help="default 3 (--smoke: 1)")
    parser.add_argument("--runs", type=Path, help="default runs/demo-seeds (--smoke: runs/smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml): runs in seconds")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.smoke else 3)
    runs = args.runs or (SMOKE_ROOT / "demo-seeds" if args.smoke else Path("runs/demo-seeds"))
    results = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    # the smoke runs keep their warm-start cache beside them, not in the demo's runs/.cache
    overrides = SMOKE | {"storage.cache": str(runs.resolve() / "cache")} if args.smoke else {}
    name = yaml.safe_load(args.spec.read_text())["name"]
    rows = []
    for seed in range(seeds):
        run_dir = (runs / f"{name}-seed{seed}").resolve()
        rows.append(seed_result(seed, run_dir, run_seed(args.spec, seed, run_dir, overrides)))
    machine = describe_machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
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
    print("\n".join(lines))
    results.mkdir(parents=True, exist_ok=True)
    (results / f"demo_{name}.md").write_text("\n".join(lines) + "\n")
    record = {"spec": str(args.spec), "smoke": args.smoke, "machine": machine, "commit": commit, "seeds": rows}
    (results / f"demo_{name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
