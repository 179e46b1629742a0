from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def prepare(spec: dict, run_root: str) -> dict:
    """Write the task's train rows and fixed held-out rows once per run (rlpipe.loop.prepare)."""
    from rlpipe import loop
    from rlpipe.spec import parse_spec

    return loop.prepare(parse_spec(spec), run_root)
