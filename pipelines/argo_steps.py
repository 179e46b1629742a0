"""Step entrypoints for plain Argo Workflows (no KFP): `python3 -m rlpipe.pipelines.argo_steps STEP`.

The same plain step functions as the KFP components. Without KFP's artifact passing, each
step finds its iteration in state.json (i = committed iteration + 1) and its inputs under
<run root>/work/iter_<i>/ on the shared filesystem. A step whose iteration is past
loop.iterations exits 0 without work, so a scheduled workflow is a no-op once the loop is done.

    argo_steps STEP --spec-json JSON --run-root ROOT
"""

import argparse
import sys

from rlpipe import loop
from rlpipe.metric_keys import EVAL_ACCURACY
from rlpipe.reports import write_reports
from rlpipe.spec import RunSpec, spec_from_json
from rlpipe.steps import BY_NAME, EVERY_ITERATION, FUSED, iteration_steps, merged_steps
from rlpipe.store.run_root import filesystem, join, read_json, read_state, write_json

# init: prepare, warm_start, publish_warm_start; iteration: all of an iteration's steps (loop.fuse_steps)
STEPS = ("init", *EVERY_ITERATION, FUSED, "evaluate", "track")


def _work(run_root: str, iteration: int, name: str) -> str:
    """A local path for the iteration's file `name` under <run root>/work/ (the shared filesystem)."""
    uri = join(run_root, "work", f"iter_{iteration:06d}", name)
    fs, path = filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    return path


def run_step(step: str, spec: RunSpec, run_root: str) -> str:
    """Run one step against the run root's state; returns what it did (for the pod log)."""
    if step == "init":
        if read_state(run_root) is not None:
            return "initialized already"
        loop.prepare(spec, run_root)
        staged, metrics = loop.warm_start(spec, run_root, spec.cache_root)
        loop.sync_weights(spec, run_root, staged, 0, metrics)
        return "published v0"
    if step == "track":
        from rlpipe.tracking.mlflow_runs import flush

        done = flush(spec, run_root)
        return (
            f"MLflow run {done['run_id']}: {done['points']} new points; registered iterations {done.get('registered')}"
        )

    start = loop.plan(spec, run_root)
    if step == "evaluate":
        values = loop.evaluate(spec, run_root, start.weights, start.iteration, spec.cache_root)
        reports = _work(run_root, start.iteration, "reports")
        write_reports("evaluate", reports, iteration=start.iteration, run_root=run_root)
        return f"{EVAL_ACCURACY} {values[EVAL_ACCURACY]:.3f}" if values else "no eval due"
    iteration = start.iteration + 1
    if iteration > spec.loop.iterations:
        return f"loop done at iteration {start.iteration}"
    paths = {name: _work(run_root, iteration, f"{name}.parquet") for name in ("rollouts", "scored", "valued", "batch")}
    if step == FUSED:  # loop.fuse_steps: every step of it, and its eval when due, in this pod
        work = paths["rollouts"].rsplit("/", 1)[0]
        _, metrics = loop.run_iteration(spec, run_root, start.weights, iteration, work, spec.cache_root)
        return f"iteration {iteration}: reward/mean {metrics['reward/mean']:.3f}"
    steps = iteration_steps(spec)
    for earlier in steps[: steps.index(step)] if step in steps else ():
        if stands_for := BY_NAME[earlier].stands_for:  # its output replaces that artifact for the steps after it
            paths[stands_for] = paths[BY_NAME[earlier].outputs[0]]
    rollouts, scored, valued, batch = (paths[name] for name in ("rollouts", "scored", "valued", "batch"))
    reports = _work(run_root, iteration, "reports")

    def step_metrics(name: str) -> str:
        return join(run_root, "work", f"iter_{iteration:06d}", f"{name}_metrics.json")

    if step == "generate":
        values = loop.generate(spec, run_root, start.weights, iteration, rollouts, spec.cache_root)
    elif step == "score":
        values = loop.score(spec, rollouts, scored)
    elif step == "values":
        values = loop.values(spec, run_root, start.weights, iteration, scored, valued, spec.cache_root)
    elif step == "advantages":
        values = loop.advantages(spec, scored, batch)
        write_reports(step, reports, scored_path=scored, batch_path=batch)
    elif step == "update":
        staged, metrics = loop.update(spec, run_root, start.weights, batch, iteration, spec.cache_root)
        values = {"staged": staged, "metrics": metrics}
    else:  # sync_weights
        updated = read_json(step_metrics("update"))
        merged = [read_json(step_metrics(name)) or {} for name in merged_steps(spec) if name != "update"]
        _, metrics = loop.sync_weights(spec, run_root, updated["staged"], iteration, *merged, updated["metrics"])
        write_reports(step, reports, iteration=iteration, metrics=metrics)
        return f"{step} iteration {iteration}"
    write_json(step_metrics(step), values)
    return f"{step} iteration {iteration}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe.pipelines.argo_steps", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--spec-json", required=True)
    parser.add_argument("--run-root", required=True)
    args = parser.parse_args(argv)
    print(run_step(args.step, spec_from_json(args.spec_json, "--spec-json"), args.run_root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
