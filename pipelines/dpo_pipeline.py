"""Offline DPO's DAG (algorithm.name: dpo; rlpipe/dpo_loop.py has its steps' logic).

    dpo_iteration(weights v(N)):  dpo_update -> sync_weights -> evaluate, only when v(N+1) is due
    dpo_run (K unrolled):         prepare -> warm_start -> publish_warm_start -> preferences
                                  -> reference_logprobs -> plan, iterations_todo -> evaluate (if pending)
                                  -> iteration 1 -> ... -> iteration K   (iteration k under If(todo >= k))
                                  exit handler: track (MLflow)

The run pipeline's shape (pipelines/rl_pipeline.py) with the preference set made once instead of
rollouts each iteration: the same init, plan, sync_weights, evaluate and track components, and the
same driver (`rlpipe run` keeps starting runs until state.json says the loop is done).
"""

from typing import Callable

from kfp import dsl

from rlpipe.dpo_loop import check_dpo_spec, is_offline_dpo
from rlpipe.pipelines.cluster_settings import place
from rlpipe.pipelines.rl_pipeline import (
    COMPONENTS,
    build_iteration_pipeline,
    build_run_pipeline,
    initialize,
    unroll_iterations,
)
from rlpipe.spec import RunSpec
from rlpipe.steps import FUSED, iteration_steps

DPO_ITERATION = ("dpo_update", "sync_weights")


def build_dpo_iteration_pipeline(placement: RunSpec | None = None) -> Callable:
    """One DPO iteration as a pipeline: dpo_update, sync_weights (the update's metrics as its
    update_metrics; the RL steps' it does not run, empty), then evaluate when due."""
    return build_iteration_pipeline(
        placement, DPO_ITERATION, "rlpipe-dpo-iteration", "One DPO iteration: weights v(N) in, v(N+1) published."
    )


def build_dpo_pipeline(iterations_per_run: int, eval_every: int, placement: RunSpec | None = None) -> Callable:
    """The pipeline one run of which advances offline DPO by up to `iterations_per_run` iterations."""
    dpo_iteration = build_dpo_iteration_pipeline(placement)

    @dsl.pipeline(
        name="rlpipe-dpo",
        description=f"Offline DPO: initialize and build the preference set if needed, then up to "
        f"{iterations_per_run} iterations from state.json.",
    )
    def dpo_run(spec: str, run_root: str):
        flush = place(COMPONENTS["track"](spec=spec, run_root=run_root), "track", placement)
        with dsl.ExitHandler(flush, name="iterations"):
            published = initialize(spec, run_root, placement)
            pairs = place(
                COMPONENTS["preferences"](spec=spec, run_root=run_root).after(published), "preferences", placement
            )
            reference = place(
                COMPONENTS["reference_logprobs"](spec=spec, run_root=run_root).after(pairs),
                "reference_logprobs",
                placement,
            )
            unroll_iterations(spec, run_root, dpo_iteration, reference, iterations_per_run, eval_every, placement)

    return dpo_run


def build_pipeline_for(spec: RunSpec, placement: RunSpec | None = None) -> Callable:
    """The pipeline `spec` runs: offline DPO's for algorithm.name dpo, else the RL run pipeline."""
    if is_offline_dpo(spec):
        check_dpo_spec(spec)
        return build_dpo_pipeline(spec.loop.iterations_per_run, spec.loop.eval_every, placement)
    offset = spec.loop.max_staleness if spec.loop.overlap == "dag" else 0
    steps = (FUSED,) if spec.loop.fuse_steps else iteration_steps(spec)
    return build_run_pipeline(spec.loop.iterations_per_run, spec.loop.eval_every, placement, steps, offset)
