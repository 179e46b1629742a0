from typing import NamedTuple

from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def plan(spec: dict, run_root: str) -> NamedTuple(
    "Outputs", weights=dict, iteration=int, next_iteration=int, eval_phase=int, iterations_left=int
):
    """Read state.json: the committed iteration and the weights it published; eval_phase and
    iterations_left say which of this run's iterations are due an eval."""
    from rlpipe.loop import plan_run
    from rlpipe.spec import parse_spec

    run_spec = parse_spec(spec)
    weights, iteration, _ = plan_run(run_spec, run_root)
    left = run_spec.loop.iterations - iteration
    return (weights, iteration, iteration + 1, iteration % run_spec.loop.eval_every, left)


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def iterations_todo(spec: dict, run_root: str) -> int:
    """How many iterations this pipeline run does (gates the unrolled iterations)."""
    from rlpipe.loop import plan_run
    from rlpipe.spec import parse_spec

    return plan_run(parse_spec(spec), run_root)[2]
