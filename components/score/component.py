from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def score(
    spec: dict,
    rollouts: dsl.Input[dsl.Dataset],
    scored: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """Apply the spec's reward functions to each completion."""
    import time

    entered = time.time()
    from rlpipe.components import exit_without_teardown, import_overhead
    from rlpipe.rewards import score_rollouts
    from rlpipe.spec import parse_spec

    values = import_overhead("score", entered)
    values |= score_rollouts(parse_spec(spec), rollouts.path, scored.path)
    for key, value in values.items():
        metrics.log_metric(key, value)
    exit_without_teardown()
    return (values,)
