from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def iteration(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    rollouts: dsl.Output[dsl.Dataset],
    scored: dsl.Output[dsl.Dataset],
    batch: dsl.Output[dsl.Dataset],
    rollout_samples: dsl.Output[dsl.Markdown],
    time_breakdown: dsl.Output[dsl.Markdown],
    eval_samples: dsl.Output[dsl.Markdown],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
    """loop.fuse_steps: the whole iteration in this one task (rlpipe.loop.run_iteration): generate -> score
    [-> values] -> advantages -> update -> sync_weights, then evaluate when due; the same artifacts, reports
    and metrics as the steps' own tasks write."""
    import time

    entered = time.time()
    import shutil
    import tempfile
    from pathlib import Path

    from rlpipe.components import finish, start

    run_spec, overhead = start("iteration", spec, entered)
    from rlpipe import loop
    from rlpipe.store.weights import as_weight_ref  # KFP hands the version over as a float

    weights = as_weight_ref(weights)
    with tempfile.TemporaryDirectory() as work:
        published, values = loop.run_iteration(
            run_spec, run_root, weights, iteration, work, run_spec.cache_root, started_at=entered
        )
        for output, name in ((rollouts, "rollouts.parquet"), (scored, "scored.parquet"), (batch, "batch.parquet")):
            shutil.move(Path(work) / name, output.path)
        for output, name in ((rollout_samples, "rollout_samples.md"), (time_breakdown, "time_breakdown.md")):
            shutil.move(Path(work) / name, output.path)
        report = Path(work) / "eval_samples.md"  # when an eval was due
        if report.exists():
            shutil.move(report, eval_samples.path)
    finish(metrics, values | overhead)
    return (published, iteration + 1)
