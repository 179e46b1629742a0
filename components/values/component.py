from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def values(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    scored: dsl.Input[dsl.Dataset],
    valued: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """The critic's value of every completion token under critic v(N) (PPO; rlpipe.loop.values)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, step_metrics = start("values", spec, entered)
    from rlpipe import loop
    from rlpipe.store.weights import as_weight_ref  # KFP hands the version over as a float

    weights = as_weight_ref(weights)
    step_metrics |= loop.values(run_spec, run_root, weights, iteration, scored.path, valued.path, run_spec.cache_root)
    finish(metrics, step_metrics)
    return (step_metrics,)
