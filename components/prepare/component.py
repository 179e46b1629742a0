from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def prepare(spec: str, run_root: str) -> dict:
    """Write the task's train rows and fixed held-out rows once per run (rlpipe.loop.prepare)."""
    from rlpipe import loop
    from rlpipe.spec import spec_from_json

    return loop.prepare(spec_from_json(spec), run_root)
