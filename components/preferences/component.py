from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def preferences(spec: str, run_root: str, metrics: dsl.Output[dsl.Metrics]) -> NamedTuple("Outputs", step_metrics=dict):
    """Offline DPO's preference pairs, once: v0's samples ranked by the verifier, or the data's
    chosen/rejected columns (rlpipe.dpo_loop.build_preferences)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("preferences", spec, entered)
    from rlpipe import dpo_loop as dpo

    values |= dpo.build_preferences(run_spec, run_root, run_spec.cache_root)
    finish(metrics, values)
    return (values,)
