from typing import NamedTuple

from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def warm_start(spec: str, run_root: str) -> NamedTuple("Outputs", staged=dict, step_metrics=dict):
    """Build or load the base model, SFT it to an accuracy (cached), stage it as v0; a no-op once
    the run is initialized (rlpipe.loop.warm_start)."""
    from rlpipe import loop
    from rlpipe.spec import spec_from_json

    run_spec = spec_from_json(spec)
    return loop.warm_start(run_spec, run_root, run_spec.cache_root)
