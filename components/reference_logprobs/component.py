from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def reference_logprobs(spec: str, run_root: str, metrics: dsl.Output[dsl.Metrics]) -> NamedTuple(
    "Outputs", step_metrics=dict
):
    """The frozen v0's log-probs of every pair's chosen and rejected completion, stored beside the
    pairs once (rlpipe.dpo_loop.compute_reference_logprobs)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("reference_logprobs", spec, entered)
    from rlpipe import dpo_loop as dpo

    values |= dpo.compute_reference_logprobs(run_spec, run_root, run_spec.cache_root)
    finish(metrics, values)
    return (values,)
