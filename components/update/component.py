from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def update(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    batch: dsl.Input[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", staged=dict, step_metrics=dict):
    """Train `weights` on the batch (here, or on the resident trainer); stages v(N+1) (rlpipe.loop.update)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("update", spec, entered)
    from rlpipe import loop
    from rlpipe.store.weights import as_weight_ref  # KFP hands the version over as a float

    weights = as_weight_ref(weights)
    staged, trained = loop.update(run_spec, run_root, weights, batch.path, iteration, run_spec.cache_root)
    values |= trained
    finish(metrics, values)
    return (staged, values)
