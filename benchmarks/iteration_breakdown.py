"""Where an iteration's wall time goes under `rlpipe run`: step compute vs orchestration.

    python benchmarks/iteration_breakdown.py RUN_DIR [--imports 3]

Reads RUN_DIR/metrics/iter_*.json (written by sync_weights) and averages, per step:
process start (interpreter + KFP executor), imports, model load, compute. Then measures,
side by side in fresh processes, what a torch step pays to import torch + transformers with
scikit-learn/scipy visible (as installed by MLflow) vs hidden (rlpipe.modeling's guard).
Writes benchmarks/results/iteration_breakdown.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("generate", "score", "advantages", "update", "sync_weights")
RESULTS = Path(__file__).resolve().parent / "results"


def average_breakdown(run_dir: Path) -> dict[str, dict[str, float]]:
    files = sorted((run_dir / "metrics").glob("iter_*.json"))[1:]  # iter_000000 is the warm start
    if not files:
        raise SystemExit(f"{run_dir} has no iteration metrics; run `rlpipe run` first")
    rows = [json.loads(f.read_text()) for f in files]

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    table = {
        step: {
            "process_s": mean(f"overhead/{step}_process_s"),
            "import_s": mean(f"overhead/{step}_import_s"),
            "load_s": mean(f"overhead/{step}_load_s"),
            "compute_s": mean(f"time/{step}_s"),
        }
        for step in STEPS
    }
    table["iteration"] = {
        "wall_s": mean("time/iteration_wall_s"),
        "orchestration_s": mean("overhead/iteration_s"),
        "iterations": float(len(rows)),
    }
    return table


def import_seconds(hide_optional: bool, repeats: int) -> float:
    """Median wall time of a fresh interpreter importing what a torch step imports."""
    code = "import rlpipe.modeling" if hide_optional else (
        "import torch; from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, PreTrainedTokenizerFast"
    )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--imports", type=int, default=3, help="repeats of the import measurement")
    args = parser.parse_args()

    table = average_breakdown(args.run_dir)
    visible = import_seconds(False, args.imports)
    hidden = import_seconds(True, args.imports)
    it = table["iteration"]
    lines = [
        f"# Iteration breakdown ({int(it['iterations'])} iterations of {args.run_dir.name})",
        "",
        f"machine: {platform.machine()}, {platform.python_version()}, date {time.strftime('%Y-%m-%d')}",
        "",
        "| step | process start s | imports s | model load s | compute s |",
        "|---|---|---|---|---|",
    ]
    for step in STEPS:
        r = table[step]
        lines.append(f"| {step} | {r['process_s']:.2f} | {r['import_s']:.2f} | {r['load_s']:.2f} | {r['compute_s']:.2f} |")
    compute = sum(table[s]["compute_s"] for s in STEPS)
    lines += [
        "",
        f"iteration wall {it['wall_s']:.1f} s = step compute {compute:.1f} s + orchestration {it['orchestration_s']:.1f} s "
        f"({100 * it['orchestration_s'] / it['wall_s']:.0f}%: process start, imports, model load, KFP runner)",
        "",
        f"torch-step imports: {visible:.2f} s with scikit-learn/scipy visible, {hidden:.2f} s hidden "
        f"(ratio {visible / hidden:.2f}x, saved {visible - hidden:.2f} s per torch step)",
    ]
    report = "\n".join(lines)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "iteration_breakdown.md").write_text(report + "\n")
    payload = {"breakdown": table, "imports_visible_s": visible, "imports_hidden_s": hidden}
    (RESULTS / "iteration_breakdown.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
