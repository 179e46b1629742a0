"""Step entrypoints for plain Argo Workflows (no KFP): `python3 -m rlpipe.pipelines.argo_steps STEP`.

The same plain step functions as the KFP components. Without KFP's artifact passing, each
step finds its iteration in state.json (i = committed iteration + 1) and its inputs under
<run root>/work/iter_<i>/ on the shared filesystem. A step whose iteration is past
loop.iterations exits 0 without work, so a scheduled workflow is a no-op once the loop is done.

    argo_steps STEP --spec-json JSON --run-root ROOT
"""

import argparse
import json
import sys

from rlpipe.spec import RunSpec, parse_spec
from rlpipe.store.run_root import cache_root_for, filesystem, join, read_json, read_state, write_json

ITERATION_STEPS = ("generate", "score", "advantages", "update", "sync_weights")
STEPS = ("init", *ITERATION_STEPS, "evaluate", "track")


def _work(run_root: str, iteration: int, name: str) -> str:
    uri = join(run_root, "work", f"iter_{iteration:06d}", name)
    fs, path = filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    return uri


def run_step(step: str, spec: RunSpec, run_root: str) -> str:
    """Run one step against the run root's state; returns what it did (for the pod log)."""
    cache = cache_root_for(spec.storage.root, spec.storage.cache)
    if step == "init":
        if read_state(run_root) is not None:
            return "initialized already"
        from rlpipe.data import prepare_data
        from rlpipe.store.commit import sync_weights
        from rlpipe.training.warm_start import warm_start

        prepare_data(spec, run_root)
        staged, metrics = warm_start(spec, run_root, cache)
        sync_weights(spec, run_root, staged, 0, metrics)
        return "published v0"
    if step == "track":
        from rlpipe.tracking import flush_metrics

        run_id, logged = flush_metrics(spec, run_root)
        return f"MLflow run {run_id}: {logged} new points"

    state = read_state(run_root) or {}
    if "iteration" not in state:
        raise RuntimeError(f"{run_root} has no state.json: the init step must run first")
    from rlpipe.store.weights import read_ref

    weights = read_ref(run_root, state["weights_version"])
    if step == "evaluate":
        from rlpipe.evaluation import evaluate_policy, evaluation_pending

        if not evaluation_pending(spec, run_root, state["iteration"]):
            return "no eval due"
        accuracy = evaluate_policy(spec, run_root, weights, state["iteration"], cache)["eval/accuracy_greedy"]
        return f"eval/accuracy_greedy {accuracy:.3f}"

    iteration = state["iteration"] + 1
    if iteration > spec.loop.iterations:
        return f"loop done at iteration {state['iteration']}"
    rollouts, scored, batch = (_work(run_root, iteration, f"{n}.parquet") for n in ("rollouts", "scored", "batch"))
    metrics_uri = _work(run_root, iteration, f"{step}_metrics.json")
    local = {name: filesystem(uri)[1] for name, uri in (("rollouts", rollouts), ("scored", scored), ("batch", batch))}
    if step == "generate":
        from rlpipe.engines import generate_rollouts

        write_json(metrics_uri, generate_rollouts(spec, run_root, weights, iteration, local["rollouts"], cache))
    elif step == "score":
        from rlpipe.rewards import score_rollouts

        write_json(metrics_uri, score_rollouts(spec, local["rollouts"], local["scored"]))
    elif step == "advantages":
        from rlpipe.algorithms import compute_advantages

        write_json(metrics_uri, compute_advantages(spec, local["scored"], local["batch"]))
    elif step == "update":
        from rlpipe.services.trainer_client import train_iteration

        staged, metrics = train_iteration(spec, run_root, weights, local["batch"], iteration, cache)
        write_json(metrics_uri, {"staged": staged, "metrics": metrics})
    elif step == "sync_weights":
        from rlpipe.store.commit import sync_weights

        updated = read_json(_work(run_root, iteration, "update_metrics.json"))
        merged = {}
        for name in ("generate", "score", "advantages"):
            merged |= read_json(_work(run_root, iteration, f"{name}_metrics.json")) or {}
        merged |= updated["metrics"]
        sync_weights(spec, run_root, updated["staged"], iteration, merged)
    return f"{step} iteration {iteration}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe.pipelines.argo_steps", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--spec-json", required=True)
    parser.add_argument("--run-root", required=True)
    args = parser.parse_args(argv)
    print(run_step(args.step, parse_spec(json.loads(args.spec_json)), args.run_root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
