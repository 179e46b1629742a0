from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def advantages(
    spec: str,
    scored: dsl.Input[dsl.Dataset],
    batch: dsl.Output[dsl.Dataset],
    rollout_samples: dsl.Output[dsl.Markdown],
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", step_metrics=dict):
    """The algorithm's advantage for every completion (rlpipe.loop.advantages); rollout_samples: the
    reward distribution and the best and worst groups' completions (rlpipe.reports.step_reports)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("advantages", spec, entered)
    from rlpipe import loop

    values |= loop.advantages(run_spec, scored.path, batch.path)
    from rlpipe.reports import step_reports

    with open(rollout_samples.path, "w", encoding="utf-8") as f:
        f.write(step_reports("advantages", scored_path=scored.path, batch_path=batch.path)["rollout_samples"])
    finish(metrics, values)
    return (values,)
