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

    from rlpipe.timing import process_age_s

    process_s, entered = process_age_s(), time.time()
    from rlpipe.components.score.step import score_rollouts
    from rlpipe.spec import parse_spec
    from rlpipe.timing import component_overhead

    values = component_overhead("score", process_s, entered)
    values |= score_rollouts(parse_spec(spec), rollouts.path, scored.path)
    for key, value in values.items():
        metrics.log_metric(key, value)
    return (values,)
