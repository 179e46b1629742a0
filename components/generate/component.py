from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def generate(
    spec: dict,
    run_root: str,
    weights: dict,
    iteration: int,
    rollouts: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """Sample G completions per prompt with the policy `weights`; rollouts as Parquet."""
    import time

    entered = time.time()
    from rlpipe.components import exit_without_teardown, import_overhead
    from rlpipe.engines import generate_rollouts
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import cache_root_for

    run_spec = parse_spec(spec)
    values = import_overhead("generate", entered)
    cache = cache_root_for(run_spec.storage.root, run_spec.storage.cache)
    values |= generate_rollouts(run_spec, run_root, weights, iteration, rollouts.path, cache)
    for key, value in values.items():
        metrics.log_metric(key, value)
    values["started_at"] = entered  # wall clock the iteration started (for sync)
    exit_without_teardown()
    return (values,)
