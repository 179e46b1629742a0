"""An iteration's wall time with every step in its image (`rlpipe run --containers`) against every step a
process (KFP's SubprocessRunner), side by side in one invocation, on the demo spec.

    CONTAINERS_CONF=$PWD/images/containers.conf python benchmarks/containers.py [--iterations 6]
    python benchmarks/containers.py --fused --fresh --demo-size   # + fuse_steps, --fresh-steps; the demo's batch
    python benchmarks/containers.py --smoke      # benchmarks/smoke.yaml's sizes: the same code in a minute

Both runs share the spec and seed; each has its own run root and warm-start cache, so each pays its own
warm start. Two figures per run, medians over the iterations after the first of each pipeline run (the first
pays the pipeline run's start: prepare, plan, the services' first load):
  iteration wall   `time/iteration_wall_s`: from the generate step's entry to the commit (the iteration's own
                   clock; it cannot see the first task's process or container start)
  period           commit to commit (the mtimes of metrics/iter_N.json): everything an iteration costs
  orchestration    1 - the steps' compute (their `time/*_s`) / the period
A task a step is a fork of a warm step server (one a step image in containers:
rlpipe.pipelines.local_runner.step_forks);
--fresh also runs each runner with `rlpipe run --fresh-steps` (a fresh process or container a step, as KFP's
runners start them), --fused with loop.fuse_steps (one task an iteration). Images: built beforehand (bash
images/build.sh). Results: benchmarks/results/containers.{md,json} (--smoke: under runs/smoke/ unless
--results-dir says).
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
from machine import describe_machine, how_steps_ran

REPO = Path(__file__).resolve().parents[1]
LOOP = ("loop.iterations", "loop.iterations_per_run", "loop.eval_every")  # this benchmark's own (`run`)
SMOKE_SPEC = yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text())
SMOKE = [f"{key}={json.dumps(value)}" for key, value in SMOKE_SPEC.items() if key not in LOOP]
RLPIPE = str(Path(sys.executable).with_name("rlpipe"))
# the demo at sizes where one iteration takes seconds: what containers add is per step, not per sample
SIZES = ["model.warm_start.max_steps=150", "data.train_size=2000", "data.eval_size=100", "evaluation.samples=0",
         "evaluation.sets=[]", "rollout.prompts_per_iteration=64", "trainer.mini_batches=2"]  # fmt: skip
STEPS = {"forks": "a task a step (forks)", "fresh": "a task a step (fresh)", "fused": "one task an iteration"}
DEMO = ["data.eval_size=100", "evaluation.samples=0", "evaluation.sets=[]"]  # the demo's batch; a short final eval


def run(name: str, root: Path, iterations: int, per_run: int, sizes: list[str]) -> dict:
    """One `rlpipe run` of the demo (`name`: runner, and "-fused" for loop.fuse_steps, "-fresh" for
    --fresh-steps); its iterations' walls, periods and compute, and the committed weights."""
    run_root = root / name
    sets = [*sizes, f"loop.iterations={iterations}", f"loop.iterations_per_run={per_run}",
            f"loop.eval_every={iterations}", f"storage.cache={root / (name + '-cache')}",
            f"loop.fuse_steps={json.dumps(name.endswith('-fused'))}"]  # fmt: skip
    command = [RLPIPE, "run", str(REPO / "examples" / "addition.yaml"), "--run-dir", str(run_root)]
    command += [f"--set={each}" for each in sets] + (["--containers"] if name.startswith("containers") else [])
    command += ["--fresh-steps"] if name.endswith("-fresh") else []
    started = time.time()
    subprocess.run(command, check=True, capture_output=True, text=True)
    walls, compute, committed = {}, {}, {}
    for path in sorted((run_root / "metrics").glob("iter_*.json")):
        iteration = int(path.stem.split("_")[1])
        if iteration == 0:  # the warm start's record
            continue
        metrics = json.loads(path.read_text())
        walls[iteration] = metrics["time/iteration_wall_s"]
        compute[iteration] = sum(v for k, v in metrics.items() if k.startswith("time/") and k.endswith("_s")
                                 and k != "time/iteration_wall_s")  # fmt: skip
        committed[iteration] = path.stat().st_mtime
    steady = [i for i in walls if (i - 1) % per_run != 0]  # i - 1 and i in one pipeline run
    periods = [committed[i] - committed[i - 1] for i in steady]
    state = json.loads((run_root / "state.json").read_text())
    return {"run_s": time.time() - started, "iteration_walls_s": walls,
            "steady_median_s": statistics.median(walls[i] for i in steady),
            "period_median_s": statistics.median(periods),
            "compute_median_s": statistics.median(compute[i] for i in steady),
            "orchestration_share": statistics.median(1 - compute[i] / p for i, p in zip(steady, periods)),
            "weights_sha256": state["weights_sha256"], "tasks": how_steps_ran(run_root)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--per-run", type=int, default=3, help="loop.iterations_per_run")
    parser.add_argument("--runs", type=Path, help="default runs/bench-containers (--smoke: runs/smoke/containers)")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    parser.add_argument("--smoke", action="store_true", help="benchmarks/smoke.yaml's sizes, 2 iterations")
    parser.add_argument("--fused", action="store_true", help="also each runner with loop.fuse_steps")
    parser.add_argument("--fresh", action="store_true", help="also each runner with --fresh-steps")
    parser.add_argument("--demo-size", action="store_true", help="the demo's own batch (512 prompts x 8)")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else DEMO if args.demo_size else SIZES
    if args.smoke:
        args.iterations, args.per_run = 2, 2
    args.runs = args.runs or REPO / "runs" / ("smoke/containers" if args.smoke else "bench-containers")
    args.results_dir = args.results_dir or (REPO / "runs" / "smoke" if args.smoke else REPO / "benchmarks" / "results")
    shutil.rmtree(args.runs, ignore_errors=True)
    args.runs.mkdir(parents=True)
    names = ["processes", "containers"] + (["processes-fresh", "containers-fresh"] if args.fresh else [])
    names += ["processes-fused", "containers-fused"] if args.fused else []
    results = {name: run(name, args.runs, args.iterations, args.per_run, sizes) for name in names}
    ratio = results["containers"]["period_median_s"] / results["processes"]["period_median_s"]
    same = len({result["weights_sha256"] for result in results.values()}) == 1
    machine = describe_machine()
    lines = [
        f"# An iteration in containers vs processes ({machine})",
        "",
        f"`python benchmarks/containers.py {' '.join(sys.argv[1:])}`: the demo spec (resident trainer) at "
        f"{', '.join(sizes)}; medians over the iterations after each pipeline run's first. Iteration wall: the "
        "iteration's own clock (generate's entry to the commit); period: commit to commit; orchestration: "
        "1 - the steps' compute / the period.",
        "",
        "| runner | steps | how the tasks started | iteration wall | period | steps' compute | orchestration "
        "| whole run | final weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        runner, mode = (name.split("-") + ["forks"])[:2]
        steps = STEPS[mode]
        lines.append(f"| {runner} | {steps} | {result['tasks']} | {result['steady_median_s']:.2f} s | "
                     f"{result['period_median_s']:.2f} s | {result['compute_median_s']:.2f} s | "
                     f"{result['orchestration_share']:.1%} | "
                     f"{result['run_s']:.0f} s | {result['weights_sha256'][:12]} |")  # fmt: skip
    lines += ["", f"containers / processes: **{ratio:.2f}x** the period (a task a step); same weights: {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "containers.md").write_text(text)
    summary = {"machine": machine, "smoke": args.smoke, "ratio": ratio, "same_weights": same, **results}
    (args.results_dir / "containers.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
