from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def sync_weights(
    spec: str,
    run_root: str,
    staged: dict,
    iteration: int,
    started_at: float,  # when the iteration's first step (generate, dpo_update) started: its wall clock
    metrics: dsl.Output[dsl.Metrics],
    time_breakdown: dsl.Output[dsl.Markdown],
    # {}: KFP's default for an optional input, for the steps an iteration does not run (values without a
    # critic; offline DPO's iteration runs only its update)
    generate_metrics: dict = {},  # noqa: B006
    score_metrics: dict = {},  # noqa: B006
    values_metrics: dict = {},  # noqa: B006
    advantages_metrics: dict = {},  # noqa: B006
    update_metrics: dict = {},  # noqa: B006
) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
    """Publish v(N+1) atomically, record the iteration's metrics, commit state.json (rlpipe.loop.sync_weights);
    time_breakdown: where the iteration's wall time went (rlpipe.reports.step_reports)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, overhead = start("sync_weights", spec, entered)
    from rlpipe import loop

    step_metrics = (generate_metrics, score_metrics, values_metrics, advantages_metrics, update_metrics, overhead)
    weights, values = loop.sync_weights(run_spec, run_root, staged, iteration, *step_metrics, started_at=started_at)
    from rlpipe.reports import step_reports

    with open(time_breakdown.path, "w", encoding="utf-8") as f:
        f.write(step_reports("sync_weights", iteration=iteration, metrics=values)["time_breakdown"])
    finish(metrics, values)
    return (weights, iteration + 1)
