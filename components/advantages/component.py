from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def advantages(
    spec: dict,
    scored: dsl.Input[dsl.Dataset],
    batch: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """GRPO group-normalized advantages per completion."""
    import time

    entered = time.time()
    from rlpipe.algorithms import compute_advantages
    from rlpipe.components import exit_without_teardown, import_overhead
    from rlpipe.spec import parse_spec

    values = import_overhead("advantages", entered)
    values |= compute_advantages(parse_spec(spec), scored.path, batch.path)
    for key, value in values.items():
        metrics.log_metric(key, value)
    exit_without_teardown()
    return (values,)
