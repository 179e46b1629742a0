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

from typing import Any, Callable, NamedTuple

from kfp import dsl

from rlpipe.dpo_loop import check_dpo_spec, is_offline_dpo
from rlpipe.pipelines.cluster_settings import place
from rlpipe.pipelines.rl_pipeline import COMPONENTS, add_task, build_run_pipeline, initialize, unroll_iterations
from rlpipe.spec import RunSpec
from rlpipe.steps import iteration_steps


def build_dpo_iteration_pipeline(placement: RunSpec | None = None) -> Callable:
    """One DPO iteration as a pipeline: dpo_update, sync_weights (the update's metrics in its
    update_metrics; its other step metrics empty), then evaluate when due."""

    @dsl.pipeline(name="rlpipe-dpo-iteration", description="One DPO iteration: weights v(N) in, v(N+1) published.")
    def dpo_iteration(
        spec: str,
        run_root: str,
        weights: dict,
        iteration: int,
        eval_phase: int,
        due_phase: int,
        iterations_left: int,
        position: int,
    ) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
        available: dict[str, Any] = {"spec": spec, "run_root": run_root, "weights": weights, "iteration": iteration}
        add_task("dpo_update", available, placement)
        available["update_metrics"] = available.pop("dpo_update_metrics")
        for name in COMPONENTS["sync_weights"].component_spec.inputs:
            if name.endswith("_metrics"):  # the RL steps DPO does not run
                available.setdefault(name, {})
        add_task("sync_weights", available, placement)
        with dsl.If(eval_phase == due_phase, name="eval-due"):
            add_task("evaluate", dict(available), placement)
        with dsl.Elif(iterations_left == position, name="last-iteration"):
            add_task("evaluate", dict(available), placement)
        outputs = NamedTuple("Outputs", weights=dict, next_iteration=int)
        return outputs(weights=available["weights"], next_iteration=available["next_iteration"])

    return dpo_iteration


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
    return build_run_pipeline(
        spec.loop.iterations_per_run, spec.loop.eval_every, placement, iteration_steps(spec), offset
    )
