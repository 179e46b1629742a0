from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE, TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def warm_start(spec: dict, run_root: str) -> NamedTuple("Outputs", staged=dict, step_metrics=dict):
    """Build or load the base model, SFT it briefly (cached), stage it as v0. No-op once initialized."""
    from rlpipe.store.run_root import read_state

    if read_state(run_root) is not None:  # checked before importing torch: ~4 s saved per run
        return ({}, {})
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import cache_root_for
    from rlpipe.training.warm_start import warm_start as warm_start_policy

    run_spec = parse_spec(spec)
    return warm_start_policy(run_spec, run_root, cache_root_for(run_spec.storage.root, run_spec.storage.cache))


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def publish_warm_start(spec: dict, run_root: str, staged: dict, step_metrics: dict):
    """Publish v0 and commit state.json at iteration 0 (a no-op once initialized)."""
    from rlpipe.spec import parse_spec
    from rlpipe.store.commit import sync_weights

    if staged:
        sync_weights(parse_spec(spec), run_root, staged, 0, step_metrics)
