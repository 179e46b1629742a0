"""The same step functions as the pipeline, called in one process: the no-orchestration baseline.

    python benchmarks/in_process_loop.py examples/addition.yaml --run-dir /tmp/inproc [--set trainer.mini_batches=4]
    python benchmarks/in_process_loop.py examples/addition.yaml --smoke   # tiny sizes: seconds

Prints per-iteration step times and eval accuracy; the gap to `rlpipe run` is orchestration.
`--smoke` runs the spec at benchmarks/smoke.yaml's sizes (--set still applies on top), with the
warm-start cache in the run directory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

from rlpipe.metric_keys import EVAL_ACCURACY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--set", action="append", default=[], help="dotted.key=value (YAML value)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml): runs in seconds")
    args = parser.parse_args()

    from rlpipe import loop
    from rlpipe.spec import load_spec

    run_root = str(Path(args.run_dir or tempfile.mkdtemp(prefix="rlpipe-inproc-")).resolve())
    smoke = {}
    if args.smoke:  # its warm-start cache in the run directory, not in the demo's runs/.cache
        smoke = yaml.safe_load(Path(__file__).with_name("smoke.yaml").read_text())
        smoke["storage.cache"] = f"{run_root}/cache"
    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    # every step function in this process: the resident trainer is this process
    spec = load_spec(args.spec, smoke | {"trainer.resident": False} | overrides)
    cache = spec.cache_root
    work = Path(run_root) / "work"
    work.mkdir(parents=True, exist_ok=True)

    started = time.time()
    loop.prepare(spec, run_root)
    staged, ws_metrics = loop.warm_start(spec, run_root, cache)
    if staged:
        loop.sync_weights(spec, run_root, staged, 0, ws_metrics)
    print(f"warm start {time.time() - started:.1f}s", json.dumps(ws_metrics))
    start = loop.plan(spec, run_root)
    evaluated = loop.evaluate(spec, run_root, start.weights, start.iteration, cache)
    if evaluated:
        print(f"iteration {start.iteration} eval/accuracy_greedy {evaluated['eval/accuracy_greedy']:.3f}")
    weights = start.weights
    for iteration in range(start.iteration + 1, spec.loop.iterations + 1):
        t = time.time()
        weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, work, cache)
        line = (
            f"it {iteration:4d} {time.time() - t:5.2f}s reward {metrics['reward/mean']:.3f} "
            f"zero_var {metrics['groups/zero_variance_fraction']:.2f} kl {metrics['kl/mean']:.4f} "
            f"clip {metrics['policy/clip_fraction']:.3f} gen {metrics['time/generate_s']:.2f}s "
            f"upd {metrics['time/update_s']:.2f}s"
        )
        if EVAL_ACCURACY in metrics:
            line += f" eval {metrics['eval/accuracy_greedy']:.3f}"
        print(line, flush=True)
    print(f"total {time.time() - started:.1f}s, run root {run_root}")


if __name__ == "__main__":
    main()
