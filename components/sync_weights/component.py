from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def sync_weights(
    spec: dict,
    run_root: str,
    staged: dict,
    iteration: int,
    generate_metrics: dict,
    score_metrics: dict,
    advantages_metrics: dict,
    update_metrics: dict,
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
    """Publish v(N+1) atomically, record the iteration's metrics, commit state.json."""
    import time

    entered = time.time()
    from rlpipe.components import exit_without_teardown, import_overhead
    from rlpipe.spec import parse_spec
    from rlpipe.store.commit import sync_weights

    run_spec = parse_spec(spec)
    step_metrics = {**generate_metrics, **score_metrics, **advantages_metrics, **update_metrics}
    step_metrics |= import_overhead("sync_weights", entered)
    weights, values = sync_weights(run_spec, run_root, staged, iteration, step_metrics)
    for key, value in values.items():
        metrics.log_metric(key, value)
    exit_without_teardown()
    return (weights, iteration + 1)
