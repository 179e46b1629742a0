from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def iterations_todo(spec: str, run_root: str) -> int:
    """How many iterations this pipeline run does (gates the unrolled iterations)."""
    from rlpipe import loop
    from rlpipe.spec import spec_from_json

    return loop.plan(spec_from_json(spec), run_root).todo
