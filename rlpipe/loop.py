"""plan: read state.json and say where this pipeline run starts (no torch)."""

from __future__ import annotations

from rlpipe.spec import RunSpec
from rlpipe.store.run_root import read_state
from rlpipe.store.weights import WeightRef, read_ref


def plan_run(spec: RunSpec, run_root: str) -> tuple[WeightRef, int, int]:
    """(current weights, committed iteration, iterations this pipeline run does).
    The run's k-th iteration is due an eval when (iteration + k) % loop.eval_every == 0, or
    iteration + k == loop.iterations (components/evaluate/step.py: eval_due)."""
    state = read_state(run_root)
    if state is None or "iteration" not in state:
        raise RuntimeError(f"{run_root} has no state.json: the warm_start and publish_warm_start steps must run first")
    iteration = state["iteration"]
    todo = max(0, min(spec.loop.iterations_per_run, spec.loop.iterations - iteration))
    return read_ref(run_root, state["weights_version"]), iteration, todo
