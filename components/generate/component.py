from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def generate(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    rollouts: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
    ahead: int = 0,
) -> NamedTuple("Outputs", step_metrics=dict, started_at=float):
    """Sample G completions per prompt with the policy `weights`; rollouts as Parquet (rlpipe.loop.generate).
    `ahead`: sample iteration + ahead's prompts (the DAG-offset form: a later iteration's, beside this update).
    started_at: when this process started, where the iteration's wall clock starts (sync_weights records it)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("generate", spec, entered)
    from rlpipe import loop
    from rlpipe.store.weights import as_weight_ref  # KFP hands the version over as a float

    weights = as_weight_ref(weights)
    values |= loop.generate(run_spec, run_root, weights, iteration + ahead, rollouts.path, run_spec.cache_root)
    finish(metrics, values)
    return (values, entered)
