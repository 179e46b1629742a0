from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def plan(spec: str, run_root: str) -> NamedTuple(
    "Outputs", weights=dict, iteration=int, next_iteration=int, eval_phase=int, iterations_left=int
):
    """Read state.json: the committed iteration and the weights it published; eval_phase and
    iterations_left say which of this run's iterations are due an eval (rlpipe.loop.plan)."""
    from rlpipe import loop
    from rlpipe.spec import spec_from_json

    start = loop.plan(spec_from_json(spec), run_root)
    return (start.weights, start.iteration, start.iteration + 1, start.eval_phase, start.iterations_left)
