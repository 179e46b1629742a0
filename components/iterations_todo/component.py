from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def iterations_todo(spec: dict, run_root: str) -> int:
    """How many iterations this pipeline run does (gates the unrolled iterations)."""
    from rlpipe import loop
    from rlpipe.spec import parse_spec

    return loop.plan(parse_spec(spec), run_root).todo
