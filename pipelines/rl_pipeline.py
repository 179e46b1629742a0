"""The DAGs: one RL iteration, and a pipeline run that unrolls K of them.

    rl_iteration(weights v(N)):  generate -> score -> advantages -> update -> sync_weights
                                  -> evaluate, only when v(N+1) is due an eval
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

from contextlib import ExitStack
from typing import Callable, NamedTuple

from kfp import dsl

from rlpipe.components.advantages.component import advantages
from rlpipe.components.evaluate.component import evaluate
from rlpipe.components.generate.component import generate
from rlpipe.components.plan.component import iterations_todo, plan
from rlpipe.components.prepare.component import prepare
from rlpipe.components.score.component import score
from rlpipe.components.sync_weights.component import sync_weights
from rlpipe.components.track.component import track
from rlpipe.components.update.component import update
from rlpipe.components.warm_start.component import publish_warm_start, warm_start
from rlpipe.pipelines.cluster_settings import place
from rlpipe.spec import ClusterSpec


def build_iteration_pipeline(cluster: ClusterSpec | None = None, thin: frozenset[str] = frozenset()) -> Callable:
    """One GRPO iteration as a pipeline (nested in the run pipeline, or run on its own).
    `thin` (spec.thin_client_steps) puts generate / update on the light image on the cluster."""

    @dsl.pipeline(name="rlpipe-iteration", description="One GRPO iteration: weights v(N) in, v(N+1) published.")
    def rl_iteration(
        spec: dict,
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
        rollouts = place(
            generate(spec=spec, run_root=run_root, weights=weights, iteration=iteration), "generate", cluster, thin
        )
        scored = place(score(spec=spec, rollouts=rollouts.outputs["rollouts"]), "score", cluster)
        batch = place(advantages(spec=spec, scored=scored.outputs["scored"]), "advantages", cluster)
        updated = place(
            update(spec=spec, run_root=run_root, weights=weights, iteration=iteration, batch=batch.outputs["batch"]),
            "update",
            cluster,
            thin,
        )
        synced = place(
            sync_weights(
                spec=spec,
                run_root=run_root,
                staged=updated.outputs["staged"],
                iteration=iteration,
                generate_metrics=rollouts.outputs["step_metrics"],
                score_metrics=scored.outputs["step_metrics"],
                advantages_metrics=batch.outputs["step_metrics"],
                update_metrics=updated.outputs["step_metrics"],
            ),
            "sync_weights",
            cluster,
        )

        def evaluate_new_version() -> None:
            place(
                evaluate(spec=spec, run_root=run_root, weights=synced.outputs["weights"], iteration=iteration),
                "evaluate",
                cluster,
                thin,
            )

        with dsl.If(eval_phase == due_phase, name="eval-due"):
            evaluate_new_version()
        with dsl.Elif(iterations_left == position, name="last-iteration"):
            evaluate_new_version()
        outputs = NamedTuple("Outputs", weights=dict, next_iteration=int)
        return outputs(weights=synced.outputs["weights"], next_iteration=synced.outputs["next_iteration"])

    return rl_iteration


def build_run_pipeline(
    iterations_per_run: int, eval_every: int, cluster: ClusterSpec | None = None, thin: frozenset[str] = frozenset()
) -> Callable:
    """The pipeline one run of which advances the loop by up to `iterations_per_run` iterations,
    evaluating every `eval_every` iterations (loop settings of the spec it is built for)."""
    rl_iteration = build_iteration_pipeline(cluster, thin)

    @dsl.pipeline(
        name="rlpipe-run",
        description=f"GRPO loop: initialize if needed, then up to {iterations_per_run} iterations from state.json.",
    )
    def rl_run(spec: dict, run_root: str):
        flush = place(track(spec=spec, run_root=run_root), "track", cluster)
        with dsl.ExitHandler(flush, name="iterations"):
            data = place(prepare(spec=spec, run_root=run_root), "prepare", cluster)
            initial = place(warm_start(spec=spec, run_root=run_root).after(data), "warm_start", cluster)
            published = place(
                publish_warm_start(
                    spec=spec,
                    run_root=run_root,
                    staged=initial.outputs["staged"],
                    step_metrics=initial.outputs["step_metrics"],
                ),
                "publish_warm_start",
                cluster,
            )
            start = place(plan(spec=spec, run_root=run_root).after(published), "plan", cluster)
            todo = place(iterations_todo(spec=spec, run_root=run_root).after(published), "iterations_todo", cluster)
            pending = place(
                evaluate(
                    spec=spec, run_root=run_root, weights=start.outputs["weights"], iteration=start.outputs["iteration"]
                ),
                "evaluate",
                cluster,
                thin,
            )
            weights, iteration = start.outputs["weights"], start.outputs["next_iteration"]
            with ExitStack() as nested:
                for k in range(1, iterations_per_run + 1):
                    nested.enter_context(dsl.If(todo.output >= k, name=f"iteration-{k}"))
                    step = rl_iteration(
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

    return rl_run
