"""Where an iteration's wall time goes under `rlpipe run`: step compute vs orchestration.

    python benchmarks/iteration_breakdown.py RUN_DIR [--imports 3] [--before OLDER_RUN_DIR]
    python benchmarks/iteration_breakdown.py RUN_DIR --smoke --results-dir /tmp/out   # 1 repeat, seconds

Per step, averaged over the run's iterations: the task's wall time as the KFP local runner
logged it (RUN_DIR/logs/kfp-local.log), and inside it the imports, model load and compute
the step itself measured (RUN_DIR/metrics/iter_*.json); the rest is interpreter start/exit
and the KFP executor. Then measures,
side by side in fresh processes, what a torch step pays to import torch + transformers with
scikit-learn/scipy visible (as installed by MLflow) vs hidden (rlpipe.models.loading's guard).
Writes benchmarks/results/iteration_breakdown.{json,md}. `--smoke` measures each side-by-side
figure once and writes under runs/smoke/ unless --results-dir says (RUN_DIR: any `rlpipe run`, e.g.
a `benchmarks/demo_seeds.py --smoke` one).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rlpipe.steps import ITERATION_STEPS as STEPS

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_ROOT = Path(__file__).resolve().parents[1] / "runs" / "smoke"


def task_walls(log_path: Path) -> dict[str, list[float]]:
    """{step: [seconds from 'Executing task' to 'finished']} from the KFP local runner's log."""
    text = re.sub(r"\x1b\[\d+m", "", log_path.read_text(errors="replace"))
    pattern = r"^(\d\d):(\d\d):(\d\d\.\d+) - INFO - (?:Executing task '([\w-]+)'|Task '([\w-]+)' finished)"
    started: dict[str, float] = {}
    walls: dict[str, list[float]] = collections.defaultdict(list)
    for hours, minutes, seconds, begun, finished in re.findall(pattern, text, flags=re.MULTILINE):
        now = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        if begun:
            started[begun] = now
        elif finished in started:
            walls[re.sub(r"-\d+$", "", finished).replace("-", "_")].append(now - started.pop(finished))
    return walls


def average_breakdown(run_dir: Path, skip: int = 0) -> dict[str, dict[str, float]]:
    """Per-step means over the run's iterations, leaving out the first `skip` (cold caches, samplers
    still starting)."""
    files = sorted((run_dir / "metrics").glob("iter_*.json"))[1 + skip :]  # iter_000000 is the warm start
    if not files:
        raise SystemExit(f"{run_dir} has no iteration metrics; run `rlpipe run` first")
    rows = [json.loads(f.read_text()) for f in files]

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    logged = task_walls(run_dir / "logs" / "kfp-local.log")
    walls = {step: times[skip:] for step, times in logged.items()}
    table: dict[str, dict[str, float]] = {}
    for step in STEPS:
        row = {
            "task_wall_s": statistics.fmean(walls[step]) if walls.get(step) else 0.0,
            "import_s": mean(f"overhead/{step}_import_s"),
            "load_s": mean(f"overhead/{step}_load_s"),
            "compute_s": mean(f"time/{step}_s"),
        }
        if step == "evaluate":  # runs only when an eval is due, and once per pipeline run: amortized
            # without iteration 0's evaluation (eval_000000 and the first evaluate task, which also
            # waits for the resident trainer to start), as the iterations leave out iter_000000
            evals = [json.loads(f.read_text()) for f in sorted((run_dir / "metrics").glob("eval_*.json"))[1:]]
            per_iteration = 1 / len(rows)
            row["task_wall_s"] = sum(logged.get(step, [])[1:]) * per_iteration
            row["import_s"] = 0.0
            row["load_s"] = sum(e.get("overhead/evaluate_load_s", 0.0) for e in evals) * per_iteration
            row["compute_s"] = sum(e.get("time/evaluate_s", 0.0) for e in evals) * per_iteration
        row["interpreter_and_executor_s"] = max(
            0.0, row["task_wall_s"] - row["import_s"] - row["load_s"] - row["compute_s"]
        )
        table[step] = row
    wall = sum(table[s]["task_wall_s"] for s in STEPS)
    compute = sum(table[s]["compute_s"] for s in STEPS)
    table["iteration"] = {
        "wall_s": wall,
        "compute_s": compute,
        "orchestration_s": wall - compute,
        "iterations": float(len(rows)),
    }
    return table


def import_seconds(hide_optional: bool, repeats: int) -> float:
    """Median wall time of a fresh interpreter importing what a torch step imports."""
    code = (
        "import rlpipe.models.loading"
        if hide_optional
        else ("import torch; from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, PreTrainedTokenizerFast")
    )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


COLD_UPDATE = """
import glob, json, shutil, sys, tempfile
from pathlib import Path
from rlpipe.training.session import update_policy
from rlpipe.store.run_root import read_state
from rlpipe.spec import parse_spec
from rlpipe.store.weights import read_weight_ref
source = Path(sys.argv[1])
spec = parse_spec(json.loads((source / "spec.json").read_text()))
version = read_state(str(source))["weights_version"]
root = Path(tempfile.mkdtemp())
shutil.copytree(source / "weights" / f"v{version:06d}", root / "weights" / f"v{version:06d}")
shutil.copytree(source / "weights" / "v000000", root / "weights" / "v000000", dirs_exist_ok=True)
batch = sorted(glob.glob(str(source / "kfp" / "*" / "advantages" / "batch")))[-1]
_, metrics = update_policy(spec, str(root), read_weight_ref(str(root), version), batch, version + 1, str(root / "cache"))
print(metrics["time/update_s"])
shutil.rmtree(root)
"""


def cold_update_seconds(run_dir: Path, tuned: bool, repeats: int) -> float:
    """Median compute of one update step in a fresh process, glibc malloc default vs tuned."""
    from rlpipe.pipelines.local_runner.driver import STEP_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
    if tuned:
        env |= {k: v for k, v in STEP_ENV.items() if k.startswith("MALLOC_")}
    runs = [
        float(
            subprocess.run(
                [sys.executable, "-c", COLD_UPDATE, str(run_dir)], env=env, check=True, capture_output=True, text=True
            ).stdout.split()[-1]
        )
        for _ in range(repeats)
    ]
    return statistics.median(runs)


def before_and_now(before: dict, table: dict, before_name: str, name: str) -> list[str]:
    """Report lines comparing each step's orchestration with a run of older code."""
    lines = [
        "",
        f"Orchestration (task wall - compute) per step: {before_name} (before) vs {name}",
        "",
        "| step | before | now |",
        "|---|---|---|",
    ]
    for step in STEPS:
        was, now = (t[step]["task_wall_s"] - t[step]["compute_s"] for t in (before, table))
        lines.append(f"| {step} | {was:.2f} | {now:.2f} |")
    b = before["iteration"]
    return lines + [
        "",
        f"before: iteration wall {b['wall_s']:.1f} s = step compute {b['compute_s']:.1f} s + orchestration "
        f"{b['orchestration_s']:.1f} s ({100 * b['orchestration_s'] / b['wall_s']:.1f}%)",
    ]


def main() -> None:
    from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--imports", type=int, default=3, help="repeats of each side-by-side measurement")
    parser.add_argument("--before", type=Path, help="a run of the same spec with older code, to compare with")
    parser.add_argument("--smoke", action="store_true", help="one repeat of each measurement (--imports 1)")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    if args.smoke:
        args.imports = 1
    results = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)

    table = average_breakdown(args.run_dir)
    visible = import_seconds(False, args.imports)
    hidden = import_seconds(True, args.imports)
    # alternate the two settings so machine noise hits both alike
    default_malloc, tuned_malloc = [], []
    for _ in range(args.imports):
        default_malloc.append(cold_update_seconds(args.run_dir, False, 1))
        tuned_malloc.append(cold_update_seconds(args.run_dir, True, 1))
    default_s, tuned_s = statistics.median(default_malloc), statistics.median(tuned_malloc)
    it = table["iteration"]
    lines = [
        f"# Iteration breakdown ({int(it['iterations'])} iterations of {args.run_dir.name})",
        "",
        f"machine: {describe_machine()}, date {time.strftime('%Y-%m-%d')}",
        "",
        "Seconds per iteration (evaluate runs when an eval is due and at the start of each pipeline run: amortized).",
        "",
        "| step | task wall (KFP log) | interpreter start/exit + KFP executor | imports | model load | compute |",
        "|---|---|---|---|---|---|",
    ]
    for step in STEPS:
        r = table[step]
        lines.append(
            f"| {step} | {r['task_wall_s']:.2f} | {r['interpreter_and_executor_s']:.2f} | {r['import_s']:.2f} "
            f"| {r['load_s']:.2f} | {r['compute_s']:.2f} |"
        )
    before = average_breakdown(args.before) if args.before else None
    if before is not None:
        lines += before_and_now(before, table, args.before.name, args.run_dir.name)
    lines += [
        "",
        f"iteration wall {it['wall_s']:.1f} s = step compute {it['compute_s']:.1f} s + orchestration "
        f"{it['orchestration_s']:.1f} s ({100 * it['orchestration_s'] / it['wall_s']:.1f}%: interpreter start/exit, "
        "KFP executor, imports, model load)",
        "",
        f"torch-step imports: {visible:.2f} s with scikit-learn/scipy visible, {hidden:.2f} s hidden "
        f"(ratio {visible / hidden:.2f}x, saved {visible - hidden:.2f} s per torch step)",
        "",
        f"update step compute in a fresh process: {default_s:.2f} s with glibc malloc defaults, {tuned_s:.2f} s with "
        f"rlpipe's MALLOC_* thresholds (ratio {default_s / tuned_s:.2f}x)",
    ]
    report = "\n".join(lines)
    print(report)
    results.mkdir(parents=True, exist_ok=True)
    (results / "iteration_breakdown.md").write_text(report + "\n")
    payload = {
        "machine": describe_machine(),
        "breakdown": table,
        "before": before,
        "imports_visible_s": visible,
        "imports_hidden_s": hidden,
        "cold_update_default_malloc_s": default_s,
        "cold_update_tuned_malloc_s": tuned_s,
    }
    (results / "iteration_breakdown.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
