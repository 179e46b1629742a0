from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def plan(spec: dict, run_root: str) -> NamedTuple("Outputs", weights=dict, iteration=int, next_iteration=int):
    """Read state.json: the committed iteration and the weights it published."""
    from rlpipe.components.plan.step import plan_run
    from rlpipe.spec import parse_spec

    weights, iteration, _ = plan_run(parse_spec(spec), run_root)
    return (weights, iteration, iteration + 1)


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def iterations_todo(spec: dict, run_root: str) -> int:
    """How many iterations this pipeline run does (gates the unrolled iterations)."""
    from rlpipe.components.plan.step import plan_run
    from rlpipe.spec import parse_spec

    return plan_run(parse_spec(spec), run_root)[2]
