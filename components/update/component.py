from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def update(
    spec: dict,
    run_root: str,
    weights: dict,
    iteration: int,
    batch: dsl.Input[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", staged=dict, step_metrics=dict):
    """Clipped policy-gradient update from `weights` (here, or on the resident trainer); stages v(N+1)."""
    import time

    entered = time.time()
    from rlpipe.components import exit_without_teardown, import_overhead
    from rlpipe.services.trainer_client import train_iteration
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import cache_root_for

    run_spec = parse_spec(spec)
    if not run_spec.trainer.resident:
        import rlpipe.training.trainer  # noqa: F401 (torch + transformers: timed as this step's import)
    values = import_overhead("update", entered)
    cache = cache_root_for(run_spec.storage.root, run_spec.storage.cache)
    staged, step_values = train_iteration(run_spec, run_root, weights, batch.path, iteration, cache)
    values |= step_values
    for key, value in values.items():
        metrics.log_metric(key, value)
    exit_without_teardown()
    return (staged, values)
