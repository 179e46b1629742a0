from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE, TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def warm_start(spec: dict, run_root: str) -> NamedTuple("Outputs", staged=dict, step_metrics=dict):
    """Build or load the base model, SFT it to an accuracy (cached), stage it as v0; a no-op once
    the run is initialized (rlpipe.loop.warm_start)."""
    from rlpipe import loop
    from rlpipe.spec import parse_spec

    run_spec = parse_spec(spec)
    return loop.warm_start(run_spec, run_root, run_spec.cache_root)


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def publish_warm_start(spec: dict, run_root: str, staged: dict, step_metrics: dict):
    """Publish v0 and commit state.json at iteration 0 (a no-op once initialized)."""
    from rlpipe import loop
    from rlpipe.spec import parse_spec

    if staged:
        loop.sync_weights(parse_spec(spec), run_root, staged, 0, step_metrics)
