"""The DAGs: one RL iteration, and a pipeline run that unrolls K of them.

    rl_iteration(weights v(N)):  generate -> score [-> values] -> advantages -> update -> sync_weights
                                  -> evaluate, only when v(N+1) is due an eval
                                  (values: only for an algorithm with a critic, rlpipe.steps.iteration_steps)
                                  loop.fuse_steps: one task, `iteration`, runs them all (and evaluate when due)
    rl_run (K unrolled):          prepare -> warm_start -> publish_warm_start -> plan, iterations_todo
                                  -> evaluate (if pending) -> iteration 1 -> ... -> iteration K
                                  (iteration k runs under If(iterations_todo >= k))
    DAG-offset form (loop.overlap dag, s = loop.max_staleness): iteration k's generate and score
                                  take v(k-1-s) and run beside update k-1 (`offset_iterations`)
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
from rlpipe.steps import BY_NAME, EVERY_ITERATION, FUSED, STEP_NAMES

# the KFP component of every step in the table: rlpipe.components.<step>.component:<step>
COMPONENTS = {
    step: getattr(importlib.import_module(f"rlpipe.components.{step}.component"), step) for step in STEP_NAMES
}


def add_task(step: str, available: dict[str, Any], placement: RunSpec | None) -> dsl.PipelineTask:
    """The `step` component's task, its inputs taken by name from `available` (pipeline parameters
    and earlier tasks' outputs; an optional input, when no earlier step gave it), placed for the
    cluster; its outputs join `available` (a step's `step_metrics` as `<step>_metrics`, or as the step's it is
    `merged_as`; a step that `stands_for` an artifact replaces it), except its metrics and reports, which no step
    reads."""
    component = COMPONENTS[step]
    inputs = component.component_spec.inputs
    task = component(**{name: available[name] for name in inputs if name in available or not inputs[name].optional})
    for name in component.component_spec.outputs or {}:
        if name != "metrics" and name not in BY_NAME[step].reports:
            merged_as = BY_NAME[step].merged_as or step
            available[f"{merged_as}_metrics" if name == "step_metrics" else name] = task.outputs[name]
    if BY_NAME[step].stands_for:
        available[BY_NAME[step].stands_for] = task.outputs[BY_NAME[step].outputs[0]]
    return place(task, step, placement)


def build_iteration_pipeline(
    placement: RunSpec | None = None,
    steps: tuple[str, ...] = EVERY_ITERATION,
    name: str = "rlpipe-iteration",
    description: str = "One RL iteration: weights v(N) in, v(N+1) published.",
) -> Callable:
    """One iteration as a pipeline (nested in the run pipeline, or run on its own): `steps` in order
    (rlpipe.steps.iteration_steps of the spec; offline DPO's dpo_update and sync_weights), then evaluate
    when due. `placement`: the spec whose cluster section places the tasks (None: the local runner)."""

    @dsl.pipeline(name=name, description=description)
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
        if FUSED not in steps:  # the fused iteration (loop.fuse_steps) evaluates in its own task
            add_evaluation(available, eval_phase == due_phase, iterations_left == position, placement)
        outputs = NamedTuple("Outputs", weights=dict, next_iteration=int)
        return outputs(weights=available["weights"], next_iteration=available["next_iteration"])

    return rl_iteration


def add_evaluation(available: dict[str, Any], due: Any, last: Any, placement: RunSpec | None) -> None:
    """evaluate the version sync_weights published (available["weights"]) when an eval is `due` (its
    phase) or the iteration is the loop's `last`: conditions on a nested pipeline's inputs."""
    with dsl.If(due, name="eval-due"):
        add_task("evaluate", dict(available), placement)
    with dsl.Elif(last, name="last-iteration"):
        add_task("evaluate", dict(available), placement)


AHEAD = ("generate", "score")  # the DAG-offset form's steps that run ahead, beside the update before them


def build_offset_update_pipeline(placement: RunSpec | None, steps: tuple[str, ...]) -> Callable:
    """The rest of an iteration in the DAG-offset form (loop.overlap dag), as a pipeline: the steps after
    AHEAD on rollouts scored ahead, then evaluate when due."""

    @dsl.pipeline(name="rlpipe-offset-update", description="Train v(N) into v(N+1) on rollouts scored ahead.")
    def rl_offset_update(
        spec: str,
        run_root: str,
        weights: dict,
        iteration: int,
        scored: dsl.Input[dsl.Dataset],
        generate_metrics: dict,
        score_metrics: dict,
        started_at: float,
        eval_phase: int,
        due_phase: int,
        iterations_left: int,
        position: int,
    ) -> NamedTuple("Outputs", weights=dict, next_iteration=int):
        available: dict[str, Any] = {
            "spec": spec,
            "run_root": run_root,
            "weights": weights,
            "iteration": iteration,
            "scored": scored,
            "generate_metrics": generate_metrics,
            "score_metrics": score_metrics,
            "started_at": started_at,  # generate's start, ahead: the iteration's wall clock runs from there
        }
        for step in steps:
            if step not in AHEAD:
                add_task(step, available, placement)
        add_evaluation(available, eval_phase == due_phase, iterations_left == position, placement)
        outputs = NamedTuple("Outputs", weights=dict, next_iteration=int)
        return outputs(weights=available["weights"], next_iteration=available["next_iteration"])

    return rl_offset_update


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
    offset: tuple[int, Callable] | None = None,
) -> None:
    """After `after`: plan and iterations_todo read state.json, the starting version is evaluated if an
    eval of it is pending, then `iteration_pipeline` K = iterations_per_run times, iteration k under
    If(todo >= k), each taking the weights the one before published. `offset` (s, the offset update
    pipeline): a run of K iterations takes the DAG-offset form instead (`offset_iterations`).

    The offset form is not gated per iteration: a condition group starts only once every task it takes
    an output from has finished, so iteration k+1 under If(todo >= k+1), taking update k's weights,
    could not generate beside update k. Only a run of K whole iterations takes it; the run that ends
    the loop with fewer goes in sequence."""
    start = place(COMPONENTS["plan"](spec=spec, run_root=run_root).after(after), "plan", placement)
    todo = place(COMPONENTS["iterations_todo"](spec=spec, run_root=run_root).after(after), "iterations_todo", placement)
    pending = place(
        COMPONENTS["evaluate"](
            spec=spec, run_root=run_root, weights=start.outputs["weights"], iteration=start.outputs["iteration"]
        ),
        "evaluate",
        placement,
    )
    if offset:  # a whole pipeline run of K iterations in the offset form; fewer (the loop's end) as below
        with dsl.If(todo.output >= iterations_per_run, name="offset-iterations"):
            offset_iterations(spec, run_root, start, pending, offset, iterations_per_run, eval_every, placement)
        with dsl.Else(name="last-iterations"):
            sequence_iterations(
                spec, run_root, iteration_pipeline, start, todo, pending, iterations_per_run, eval_every
            )
    else:
        sequence_iterations(spec, run_root, iteration_pipeline, start, todo, pending, iterations_per_run, eval_every)


def sequence_iterations(
    spec: str,
    run_root: str,
    iteration_pipeline: Callable,
    start: dsl.PipelineTask,
    todo: dsl.PipelineTask,
    pending: dsl.PipelineTask,
    iterations_per_run: int,
    eval_every: int,
) -> None:
    """`iteration_pipeline` K times, iteration k under If(todo >= k), each taking the weights the one
    before published."""
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


def offset_iterations(
    spec: str,
    run_root: str,
    start: dsl.PipelineTask,
    pending: dsl.PipelineTask,
    offset: tuple[int, Callable],
    iterations_per_run: int,
    eval_every: int,
    placement: RunSpec | None,
) -> None:
    """K iterations in the DAG-offset form (loop.overlap dag, s = loop.max_staleness): iteration k's
    AHEAD steps take v(k-1-s), the version published s iterations before its update (the start's for
    k <= s), so they run beside update k-1 .. k-s as sibling tasks; its update pipeline takes v(k-1):

        plan ─ generate 1 ─ score 1 ─ update 1 ─ update 2 ─ update 3 ...     (s = 1)
             └ generate 2 ─ score 2 ──────────────┘         │
                          update 1 ─ generate 3 ─ score 3 ──┘
    """
    staleness, update_pipeline = offset
    published = [(start.outputs["weights"], start.outputs["next_iteration"])]  # v(N0 + j): after j iterations
    for k in range(1, iterations_per_run + 1):
        weights, iteration = published[max(0, k - 1 - staleness)]
        ahead: dict[str, Any] = {
            "spec": spec,
            "run_root": run_root,
            "weights": weights,
            "iteration": iteration,  # the published version's next iteration: generate samples k's prompts
            "ahead": min(k - 1, staleness),
        }
        for step in AHEAD:
            task = add_task(step, ahead, placement)
            if k == 1:  # the starting version is evaluated before any iteration can prune it
                task.after(pending)
        weights, iteration = published[k - 1]
        trained = update_pipeline(
            spec=spec,
            run_root=run_root,
            weights=weights,
            iteration=iteration,
            scored=ahead["scored"],
            generate_metrics=ahead["generate_metrics"],
            score_metrics=ahead["score_metrics"],
            started_at=ahead["started_at"],
            eval_phase=start.outputs["eval_phase"],
            due_phase=-k % eval_every,  # (N0 + k) % eval_every == 0
            iterations_left=start.outputs["iterations_left"],
            position=k,
        )
        published.append((trained.outputs["weights"], trained.outputs["next_iteration"]))


def build_run_pipeline(
    iterations_per_run: int,
    eval_every: int,
    placement: RunSpec | None = None,
    steps: tuple[str, ...] = EVERY_ITERATION,
    max_staleness: int = 0,
) -> Callable:
    """The pipeline one run of which advances the loop by up to `iterations_per_run` iterations,
    evaluating every `eval_every` iterations (loop settings of the spec it is built for), each
    iteration running `steps`. `max_staleness` >= 1: the DAG-offset form (loop.overlap dag)."""
    rl_iteration = build_iteration_pipeline(placement, steps)
    offset = (max_staleness, build_offset_update_pipeline(placement, steps)) if max_staleness else None

    @dsl.pipeline(
        name="rlpipe-run",
        description=f"RL loop: initialize if needed, then up to {iterations_per_run} iterations from state.json.",
    )
    def rl_run(spec: str, run_root: str):
        flush = place(COMPONENTS["track"](spec=spec, run_root=run_root), "track", placement)
        with dsl.ExitHandler(flush, name="iterations"):
            published = initialize(spec, run_root, placement)
            unroll_iterations(
                spec, run_root, rl_iteration, published, iterations_per_run, eval_every, placement, offset
            )

    return rl_run
