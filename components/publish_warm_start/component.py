from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def publish_warm_start(spec: str, run_root: str, staged: dict, step_metrics: dict):
    """Publish v0 and commit state.json at iteration 0 (a no-op once initialized)."""
    from rlpipe import loop
    from rlpipe.spec import spec_from_json

    if staged:
        loop.sync_weights(spec_from_json(spec), run_root, staged, 0, step_metrics)
