"""The same step functions as the pipeline, called in one process: the no-orchestration baseline.

    python benchmarks/in_process_loop.py examples/addition.yaml --run-dir /tmp/inproc [--set trainer.mini_batches=4]

Prints per-iteration step times and eval accuracy; the gap to `rlpipe run` is orchestration.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--set", action="append", default=[], help="dotted.key=value (YAML value)")
    args = parser.parse_args()

    from rlpipe.algorithms import compute_advantages
    from rlpipe.data import prepare_data
    from rlpipe.engines import generate_rollouts
    from rlpipe.evaluation import eval_due, evaluate_policy
    from rlpipe.loop import plan_run
    from rlpipe.rewards import score_rollouts
    from rlpipe.spec import load_spec
    from rlpipe.store.commit import sync_weights
    from rlpipe.store.run_root import cache_root_for
    from rlpipe.training.trainer import update_policy
    from rlpipe.training.warm_start import warm_start

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    # every step function in this process: the resident trainer is this process
    spec = load_spec(args.spec, {"trainer.resident": False} | overrides)
    run_root = str(Path(args.run_dir or tempfile.mkdtemp(prefix="rlpipe-inproc-")).resolve())
    cache = cache_root_for(spec.storage.root, spec.storage.cache)
    work = Path(run_root) / "work"
    work.mkdir(parents=True, exist_ok=True)

    started = time.time()
    prepare_data(spec, run_root)
    staged, ws_metrics = warm_start(spec, run_root, cache)
    weights, _ = sync_weights(spec, run_root, staged, 0, ws_metrics)
    print(f"warm start {time.time() - started:.1f}s", json.dumps(ws_metrics))
    accuracy = evaluate_policy(spec, run_root, weights, 0, cache)["eval/accuracy_greedy"]
    print(f"iteration 0 eval/accuracy_greedy {accuracy:.3f}")
    weights, iteration, _ = plan_run(spec, run_root)
    for iteration in range(iteration + 1, spec.loop.iterations + 1):
        t = time.time()
        metrics: dict[str, float] = {"started_at": t}
        metrics |= generate_rollouts(spec, run_root, weights, iteration, str(work / "rollouts.parquet"), cache)
        metrics |= score_rollouts(spec, str(work / "rollouts.parquet"), str(work / "scored.parquet"))
        metrics |= compute_advantages(spec, str(work / "scored.parquet"), str(work / "batch.parquet"))
        staged, update_metrics = update_policy(spec, run_root, weights, str(work / "batch.parquet"), iteration, cache)
        metrics |= update_metrics
        weights, metrics = sync_weights(spec, run_root, staged, iteration, metrics)
        line = (
            f"it {iteration:4d} {time.time() - t:5.2f}s reward {metrics['reward/mean']:.3f} "
            f"zero_var {metrics['groups/zero_variance_fraction']:.2f} kl {metrics['kl/mean']:.4f} "
            f"clip {metrics['policy/clip_fraction']:.3f} gen {metrics['time/generate_s']:.2f}s "
            f"upd {metrics['time/update_s']:.2f}s"
        )
        if eval_due(spec, iteration):
            accuracy = evaluate_policy(spec, run_root, weights, iteration, cache)["eval/accuracy_greedy"]
            line += f" eval {accuracy:.3f}"
        print(line, flush=True)
    print(f"total {time.time() - started:.1f}s, run root {run_root}")


if __name__ == "__main__":
    main()
