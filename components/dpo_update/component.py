from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def dpo_update(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    metrics: dsl.Output[dsl.Metrics],
) -> NamedTuple("Outputs", staged=dict, step_metrics=dict, started_at=float):
    """DPO on `weights` with the iteration's pairs; stages v(N+1) (rlpipe.dpo_loop.dpo_update). started_at:
    when this process started, where the iteration's wall clock starts (sync_weights records it)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, values = start("dpo_update", spec, entered)
    from rlpipe import dpo_loop as dpo

    staged, trained = dpo.dpo_update(run_spec, run_root, weights, iteration, run_spec.cache_root)
    values |= trained
    finish(metrics, values)
    return (staged, values, entered)
