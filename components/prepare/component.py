from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def prepare(spec: dict, run_root: str) -> dict:
    """Generate the task data once per run (a no-op when data/ exists)."""
    from rlpipe.data import prepare_data
    from rlpipe.spec import parse_spec

    return prepare_data(parse_spec(spec), run_root)
