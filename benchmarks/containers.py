"""An iteration's wall time with every step in its image (`rlpipe run --containers`) against every step a
process (KFP's SubprocessRunner), side by side in one invocation, on the demo spec.

    CONTAINERS_CONF=$PWD/images/containers.conf python benchmarks/containers.py [--iterations 6]
    python benchmarks/containers.py --smoke      # benchmarks/smoke.yaml's sizes: the same code in a minute

Both runs share the spec and seed; each has its own run root and warm-start cache, so each pays its own
warm start. The figure is the median of `time/iteration_wall_s` over the iterations after the first of
each pipeline run (the first pays the pipeline run's start: prepare, plan, the services' first load).
Images: built beforehand (bash images/build.sh). Results: benchmarks/results/containers.{md,json}
(--smoke: under runs/smoke/ unless --results-dir says).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
LOOP = ("loop.iterations", "loop.iterations_per_run", "loop.eval_every")  # this benchmark's own (`run`)
SMOKE = [f"{key}={json.dumps(value)}" for key, value in yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text()).items()
         if key not in LOOP]  # fmt: skip
RLPIPE = str(Path(sys.executable).with_name("rlpipe"))
# the demo at sizes where one iteration takes seconds: what containers add is per step, not per sample
SIZES = ["model.warm_start.max_steps=150", "data.train_size=2000", "data.eval_size=100", "evaluation.samples=0",
         "evaluation.sets=[]", "rollout.prompts_per_iteration=64", "trainer.mini_batches=2"]  # fmt: skip


def run(runner: str, root: Path, iterations: int, per_run: int, sizes: list[str]) -> dict:
    """One `rlpipe run` of the demo; its iterations' wall times and the committed weights."""
    run_root = root / runner
    sets = [*sizes, f"loop.iterations={iterations}", f"loop.iterations_per_run={per_run}",
            f"loop.eval_every={iterations}", f"storage.cache={root / (runner + '-cache')}"]  # fmt: skip
    command = [RLPIPE, "run", str(REPO / "examples" / "addition.yaml"), "--run-dir", str(run_root)]
    command += [f"--set={each}" for each in sets] + (["--containers"] if runner == "containers" else [])
    started = time.time()
    subprocess.run(command, check=True, capture_output=True, text=True)
    walls = {}
    for path in sorted((run_root / "metrics").glob("iter_*.json")):
        iteration = int(path.stem.split("_")[1])
        if iteration == 0:  # the warm start's record
            continue
        walls[iteration] = json.loads(path.read_text())["time/iteration_wall_s"]
    steady = [wall for i, wall in walls.items() if (i - 1) % per_run != 0]
    state = json.loads((run_root / "state.json").read_text())
    return {"run_s": time.time() - started, "iteration_walls_s": walls, "steady_median_s": statistics.median(steady),
            "weights_sha256": state["weights_sha256"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--per-run", type=int, default=3, help="loop.iterations_per_run")
    parser.add_argument("--runs", type=Path, help="default runs/bench-containers (--smoke: runs/smoke/containers)")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    parser.add_argument("--smoke", action="store_true", help="benchmarks/smoke.yaml's sizes, 2 iterations")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else SIZES
    if args.smoke:
        args.iterations, args.per_run = 2, 2
    args.runs = args.runs or REPO / "runs" / ("smoke/containers" if args.smoke else "bench-containers")
    args.results_dir = args.results_dir or (REPO / "runs" / "smoke" if args.smoke else REPO / "benchmarks" / "results")
    shutil.rmtree(args.runs, ignore_errors=True)
    args.runs.mkdir(parents=True)
    results = {runner: run(runner, args.runs, args.iterations, args.per_run, sizes) for runner in ("processes", "containers")}
    ratio = results["containers"]["steady_median_s"] / results["processes"]["steady_median_s"]
    same = results["containers"]["weights_sha256"] == results["processes"]["weights_sha256"]
    machine = describe_machine()
    lines = [
        f"# An iteration in containers vs processes ({machine})",
        "",
        f"`python benchmarks/containers.py --iterations {args.iterations} --per-run {args.per_run}`: the demo spec "
        f"(resident trainer) at {', '.join(sizes)}; median iteration wall after each pipeline run's first.",
        "",
        "| runner | iteration wall (median) | whole run | final weights sha256 |",
        "|---|---|---|---|",
    ]
    for runner, result in results.items():
        lines.append(f"| {runner} | {result['steady_median_s']:.2f} s | {result['run_s']:.0f} s | "
                     f"{result['weights_sha256'][:12]} |")  # fmt: skip
    lines += ["", f"containers / processes: **{ratio:.2f}x** the iteration wall; same weights: {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "containers.md").write_text(text)
    summary = {"machine": machine, "smoke": args.smoke, "ratio": ratio, "same_weights": same, **results}
    (args.results_dir / "containers.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
