from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def score(
    spec: str,
    rollouts: dsl.Input[dsl.Dataset],
    scored: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """Reward every completion with the spec's reward functions (rlpipe.loop.score)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("score", spec, entered)
    from rlpipe import loop

    values |= loop.score(run_spec, rollouts.path, scored.path)
    finish(metrics, values)
    return (values,)
