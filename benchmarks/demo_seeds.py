"""A demo spec for several seeds, side by side: warm start, held-out greedy accuracy along the run,
the gain over the warm start, and wall time per seed. Writes benchmarks/results/demo_<name>.{json,md}.

    python examples/subtraction/make_data.py
    python benchmarks/demo_seeds.py examples/subtraction.yaml --seeds 3

Each seed is `rlpipe run SPEC --set seed=S --run-dir runs/demo-seeds/<name>-seed<S>` (a run already
complete there is read, not re-run; its wall is then unknown).
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

RESULTS = Path(__file__).with_name("results")


def run_seed(spec: Path, seed: int, run_dir: Path) -> float | None:
    """Wall seconds of `rlpipe run` for one seed; None when the run was already complete."""
    state = run_dir / "state.json"
    iterations = yaml.safe_load(spec.read_text())["loop"]["iterations"]
    if state.exists() and json.loads(state.read_text()).get("iteration", 0) >= iterations:
        return None
    started = time.time()
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(spec), "--set", f"seed={seed}"]
    subprocess.run([*command, "--run-dir", str(run_dir)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--runs", type=Path, default=Path("runs/demo-seeds"))
    args = parser.parse_args()
    name = yaml.safe_load(args.spec.read_text())["name"]
    rows = []
    for seed in range(args.seeds):
        run_dir = (args.runs / f"{name}-seed{seed}").resolve()
        rows.append(seed_result(seed, run_dir, run_seed(args.spec, seed, run_dir)))
    machine = describe_machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    iterations = sorted(rows[0]["evals"])
    lines = [
        f"`python benchmarks/demo_seeds.py {args.spec} --seeds {args.seeds}` on {machine}, commit {commit}",
        "",
        f"| seed | warm start (SFT steps) | held-out greedy accuracy, iterations {', '.join(map(str, iterations))} "
        "| gain (points) | wall |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        curve = ", ".join(f"{row['evals'][i]:.3f}" for i in iterations)
        wall = "already run" if row["wall_s"] is None else f"{row['wall_s']} s"
        lines.append(f"| {row['seed']} | {row['warm_start_steps']} | {curve} | +{row['gain_points']} | {wall} |")
    gains = [row["gain_points"] for row in rows]
    lines += ["", f"gain over the warm start: min {min(gains)}, mean {sum(gains) / len(gains):.1f} points"]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"demo_{name}.md").write_text("\n".join(lines) + "\n")
    record = {"spec": str(args.spec), "machine": machine, "commit": commit, "seeds": rows}
    (RESULTS / f"demo_{name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
