"""The DAGs: one RL iteration, and a pipeline run that unrolls K of them.

    rl_iteration(weights v(N)):  generate -> score [-> values] -> advantages -> update -> sync_weights
                                  -> evaluate, only when v(N+1) is due an eval
                                  (values: only for an algorithm with a critic, rlpipe.steps.iteration_steps)
    rl_run (K unrolled):          prepare -> warm_start -> publish_warm_start -> plan, iterations_todo
                                  -> evaluate (if pending) -> iteration 1 -> ... -> iteration K
                                  (iteration k runs under If(iterations_todo >= k))
                                  exit handler: track (MLflow), runs even if an iteration fails

KFP v2 has no while loop: `plan` reads state.json, so every run of this pipeline (local
driver, or a recurring run on a cluster) continues where storage says the loop is, and a
run with nothing left to do is a no-op. Initialization steps are no-ops once state.json
exists; evaluate is a no-op unless an eval is due and not yet recorded. Weights travel as
{uri, version, sha256} dicts.

Conditions test single-output tasks (`iterations_todo.output`) or a nested pipeline's inputs:
kfp 2.17.0's local runner cannot resolve a condition on one named output of a multi-output task.
Which iterations evaluate is known when the run starts (plan's eval_phase = N0 % eval_every and
iterations_left), so an iteration that is not due starts no evaluate task at all.
"""

import importlib
from contextlib import ExitStack
from typing import Any, Callable, NamedTuple

from kfp import dsl

from rlpipe.pipelines.cluster_settings import place
from rlpipe.spec import RunSpec
from rlpipe.steps import BY_NAME, EVERY_ITERATION, STEP_NAMES

# the KFP component of every step in the table: rlpipe.components.<step>.component:<step>
COMPONENTS = {
    step: getattr(importlib.import_module(f"rlpipe.components.{step}.component"), step) for step in STEP_NAMES
}


def add_task(step: str, available: dict[str, Any], placement: RunSpec | None) -> dsl.PipelineTask:
    """The `step` component's task, its inputs taken by name from `available` (pipeline parameters
    and earlier tasks' outputs; an optional input, when no earlier step gave it), placed for the
    cluster; its outputs join `available` (a step's `step_metrics` as `<step>_metrics`; a step that
    `stands_for` an artifact replaces it), except its metrics and reports, which no step reads."""
    component = COMPONENTS[step]
    inputs = component.component_spec.inputs
    task = component(**{name: available[name] for name in inputs if name in available or not inputs[name].optional})
    for name in component.component_spec.outputs or {}:
        if name != "metrics" and name not in BY_NAME[step].reports:
            available[f"{step}_metrics" if name == "step_metrics" else name] = task.outputs[name]
    if BY_NAME[step].stands_for:
        available[BY_NAME[step].stands_for] = task.outputs[BY_NAME[step].outputs[0]]
    return place(task, step, placement)


def build_iteration_pipeline(placement: RunSpec | None = None, steps: tuple[str, ...] = EVERY_ITERATION) -> Callable:
    """One iteration as a pipeline (nested in the run pipeline, or run on its own): `steps` in order
    (rlpipe.steps.iteration_steps of the spec), then evaluate when due. `placement`: the spec whose
    cluster section places the tasks (None: the local runner)."""

    @dsl.pipeline(name="rlpipe-iteration", description="One RL iteration: weights v(N) in, v(N+1) published.")
    def rl_iteration(
        spec: str,
        run_root: str,
        weights: dict,
        iteration: int,
        eval_phase: int,
        due_phase: int,
        iterations_left: int,
        position: int,
    ) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
        """The run's `position`-th iteration; it evaluates v(N+1) when eval_phase == due_phase (N+1 is a
        multiple of loop.eval_every) or iterations_left == position (the loop's last iteration)."""
        available: dict[str, Any] = {"spec": spec, "run_root": run_root, "weights": weights, "iteration": iteration}
        for step in steps:
            add_task(step, available, placement)
        # sync_weights put the published v(N+1) in available["weights"]
        with dsl.If(eval_phase == due_phase, name="eval-due"):
            add_task("evaluate", dict(available), placement)
        with dsl.Elif(iterations_left == position, name="last-iteration"):
            add_task("evaluate", dict(available), placement)
        outputs = NamedTuple("Outputs", weights=dict, next_iteration=int)
        return outputs(weights=available["weights"], next_iteration=available["next_iteration"])

    return rl_iteration


def initialize(spec: str, run_root: str, placement: RunSpec | None) -> dsl.PipelineTask:
    """prepare -> warm_start -> publish_warm_start: each a no-op once the run is initialized."""
    data = place(COMPONENTS["prepare"](spec=spec, run_root=run_root), "prepare", placement)
    initial = place(COMPONENTS["warm_start"](spec=spec, run_root=run_root).after(data), "warm_start", placement)
    return place(
        COMPONENTS["publish_warm_start"](
            spec=spec, run_root=run_root, staged=initial.outputs["staged"], step_metrics=initial.outputs["step_metrics"]
        ),
        "publish_warm_start",
        placement,
    )


def unroll_iterations(
    spec: str,
    run_root: str,
    iteration_pipeline: Callable,
    after: dsl.PipelineTask,
    iterations_per_run: int,
    eval_every: int,
    placement: RunSpec | None,
) -> None:
    """After `after`: plan and iterations_todo read state.json, the starting version is evaluated if an
    eval of it is pending, then `iteration_pipeline` K = iterations_per_run times, iteration k under
    If(todo >= k), each taking the weights the one before published."""
    start = place(COMPONENTS["plan"](spec=spec, run_root=run_root).after(after), "plan", placement)
    todo = place(COMPONENTS["iterations_todo"](spec=spec, run_root=run_root).after(after), "iterations_todo", placement)
    pending = place(
        COMPONENTS["evaluate"](
            spec=spec, run_root=run_root, weights=start.outputs["weights"], iteration=start.outputs["iteration"]
        ),
        "evaluate",
        placement,
    )
    weights, iteration = start.outputs["weights"], start.outputs["next_iteration"]
    with ExitStack() as nested:
        for k in range(1, iterations_per_run + 1):
            nested.enter_context(dsl.If(todo.output >= k, name=f"iteration-{k}"))
            step = iteration_pipeline(
                spec=spec,
                run_root=run_root,
                weights=weights,
                iteration=iteration,
                eval_phase=start.outputs["eval_phase"],
                due_phase=-k % eval_every,  # (N0 + k) % eval_every == 0
                iterations_left=start.outputs["iterations_left"],
                position=k,
            )
            if k == 1:  # evaluate the starting version before iterations can prune it
                step.after(pending)
            weights, iteration = step.outputs["weights"], step.outputs["next_iteration"]


def build_run_pipeline(
    iterations_per_run: int,
    eval_every: int,
    placement: RunSpec | None = None,
    steps: tuple[str, ...] = EVERY_ITERATION,
) -> Callable:
    """The pipeline one run of which advances the loop by up to `iterations_per_run` iterations,
    evaluating every `eval_every` iterations (loop settings of the spec it is built for), each
    iteration running `steps`."""
    rl_iteration = build_iteration_pipeline(placement, steps)

    @dsl.pipeline(
        name="rlpipe-run",
        description=f"RL loop: initialize if needed, then up to {iterations_per_run} iterations from state.json.",
    )
    def rl_run(spec: str, run_root: str):
        flush = place(COMPONENTS["track"](spec=spec, run_root=run_root), "track", placement)
        with dsl.ExitHandler(flush, name="iterations"):
            published = initialize(spec, run_root, placement)
            unroll_iterations(spec, run_root, rl_iteration, published, iterations_per_run, eval_every, placement)

    return rl_run
