"""One RL iteration in plain Python: start reading rlpipe here.

    weights v(N) --generate--> rollouts --score--> scored (--values--> scored + V_t, PPO)
                 --advantages--> batch
                 --update--> staged v(N+1) --sync_weights--> v(N+1) published, state.json committed
                 (--evaluate--> held-out accuracy, when due)

`run_iteration` calls the steps in that order in one process (the tests and
benchmarks/in_process_loop.py). On KFP each step is its own task (pipelines/rl_pipeline.py,
built from the step table in rlpipe/steps.py) whose component calls the same function; on plain
Argo, pipelines/argo_steps.py does. Between steps only Parquet files and small dicts travel;
weights stay in the weight store and travel as {uri, version, sha256} references.

Each step imports what it computes with inside its function: a light step's process (score,
advantages, sync_weights) never imports torch, and a thin client (rlpipe.steps.service_for)
never imports what its service computes with.

With sharing.enabled the resident trainer and the samplers take turns on one device
(rlpipe.sharing.handover): update, values and evaluate run in the trainer's turn, generate in the samplers'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.metric_keys import (
    ITERATION_OVERHEAD,
    ITERATION_WALL,
    STALENESS_MAX,
    STALENESS_MEAN,
    UPDATE_TIME,
)
from rlpipe.steps import BY_NAME, iteration_steps, merged_steps, service_for

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def prepare(spec: RunSpec, run_root: str) -> dict[str, int]:
    """data/train.parquet and data/eval.parquet, made by the task once per run; spec.json, the spec this
    pipeline run was given (what a rollout producer on a cluster reads)."""
    from rlpipe.data import prepare_data
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.run_root import join, write_json

    write_json(join(run_root, "spec.json"), spec_to_dict(spec))
    return prepare_data(spec, run_root)


@dataclass(frozen=True)
class Start:
    """Where a pipeline run starts: the committed iteration and the weights it published."""

    weights: WeightRef
    iteration: int
    todo: int  # iterations this pipeline run does
    eval_phase: int  # iteration % loop.eval_every: which of the run's iterations are due an eval
    iterations_left: int  # in the whole loop: the run's last iteration is evaluated too


def plan(spec: RunSpec, run_root: str) -> Start:
    """Read state.json. The run's k-th iteration is due an eval when (iteration + k) %
    loop.eval_every == 0, or iteration + k == loop.iterations (rlpipe.evaluation.cadence.eval_due). Nothing is
    left once a stop holds (rlpipe.evaluation.stopping: the eval gate, a degenerate start, no reward); with a
    gate, a pipeline run ends at the next eval."""
    from rlpipe.evaluation.cadence import iterations_to_next_eval
    from rlpipe.evaluation.stopping import stopped
    from rlpipe.store.run_root import read_state
    from rlpipe.store.weights import read_weight_ref

    state = read_state(run_root)
    if state is None or "iteration" not in state:
        raise RuntimeError(f"{run_root} has no state.json: the warm_start and publish_warm_start steps must run first")
    iteration = state["iteration"]
    left = 0 if stopped(spec, state) else spec.loop.iterations - iteration
    todo = max(0, min(spec.loop.iterations_per_run, left))
    if spec.loop.stop_when:  # a pipeline run ends at the next eval: the next one starts only if the gate is shut
        todo = min(todo, iterations_to_next_eval(spec, iteration))
    return Start(
        weights=read_weight_ref(run_root, state["weights_version"]),
        iteration=iteration,
        todo=todo,
        eval_phase=iteration % spec.loop.eval_every,
        iterations_left=left,
    )


def warm_start(spec: RunSpec, run_root: str, cache_root: str) -> tuple[WeightRef | dict, dict[str, float]]:
    """Stage v0: the base model, SFT-warm-started (cached). ({}, {}) once the run is initialized,
    decided before importing torch."""
    from rlpipe.store.run_root import read_state

    if read_state(run_root) is not None:
        return {}, {}
    from rlpipe.training.warm_start import warm_start as stage_warm_started

    return stage_warm_started(spec, run_root, cache_root)


def generate(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, rollouts_path: str, cache_root: str
) -> dict[str, float]:
    """Sample rollout.samples_per_prompt completions for each of the iteration's prompts with
    v(N); rollout rows (rlpipe.rollouts.ROLLOUT_SCHEMA) at `rollouts_path`. Asynchronous runs
    (loop.max_staleness s >= 1) take them from the rollout buffer instead, sampled ahead by the producer
    with v(N-s) .. v(N) (rlpipe.services.producer.buffer), or, in the DAG-offset form (loop.overlap dag), sample
    them here with the version the pipeline hands over, s iterations old at most. Refused (StoppedBySign) once a
    sign stopped the loop: a pipeline run plans its iterations before the stop."""
    from rlpipe.evaluation.stopping import refuse_if_stopped

    refuse_if_stopped(run_root)
    if service_for("generate", spec) == "producer":
        from rlpipe.services.producer.buffer import take

        return take(spec, run_root, weights, iteration, rollouts_path)
    if service_for("generate", spec) == "trainer":
        from rlpipe.services.trainer.client import request_generate

        return request_generate(spec, run_root, weights, iteration, rollouts_path, cache_root)
    from rlpipe.engines import generate_rollouts

    if spec.rollout.engine != "sampler":
        metrics = generate_rollouts(spec, run_root, weights, iteration, rollouts_path, cache_root)
    else:
        from rlpipe.sharing.handover import sample_turn

        # the samplers serve v(N) (a replica that restarted since sync_weights catches up); sharing: awake, then asleep
        with sample_turn(spec, run_root, weights, iteration) as turn:
            metrics = generate_rollouts(spec, run_root, weights, iteration, rollouts_path, cache_root)
        metrics = turn | metrics
    if spec.loop.max_staleness:  # the DAG-offset form: v(N-1-s) .. v(N-1) sample iteration N
        metrics[STALENESS_MEAN] = metrics[STALENESS_MAX] = float(iteration - 1 - weights["version"])
    return metrics


def score(spec: RunSpec, rollouts_path: str, scored_path: str) -> dict[str, float]:
    """reward = sum_i w_i * reward_function_i(prompts, completions, **columns)."""
    from rlpipe.rewards import score_rollouts

    return score_rollouts(spec, rollouts_path, scored_path)


def values(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    scored_path: str,
    valued_path: str,
    cache_root: str,
) -> dict[str, float]:
    """The critic's value V_t of every completion token under critic v(N), beside the scored rollouts
    (algorithms with a critic: PPO)."""
    if service_for("values", spec) == "trainer":
        from rlpipe.services.trainer.client import request_values
        from rlpipe.sharing.handover import train_turn

        with train_turn(spec, run_root, iteration) as turn:  # sharing: the samplers asleep, the trainer onloaded
            metrics = request_values(spec, run_root, weights, iteration, scored_path, valued_path, cache_root)
        return metrics | turn
    from rlpipe.training.critic import compute_values

    return compute_values(spec, run_root, weights, scored_path, valued_path, cache_root)


def advantages(spec: RunSpec, scored_path: str, batch_path: str) -> dict[str, float]:
    """The algorithm's advantage for every completion (GRPO: normalized within its group)."""
    from rlpipe.algorithms import compute_advantages

    return compute_advantages(spec, scored_path, batch_path)


def update(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """Train v(N) on the batch (mini-batch policy-gradient steps); stage and seal v(N+1)."""
    if service_for("update", spec) == "trainer":
        from rlpipe.services.trainer.client import request_update
        from rlpipe.sharing.handover import train_turn

        with train_turn(spec, run_root, iteration) as turn:  # sharing: the samplers asleep, the trainer onloaded
            staged, metrics = request_update(spec, run_root, weights, batch_path, iteration, cache_root)
        return staged, metrics | turn
    from rlpipe.training.session import update_policy

    return update_policy(spec, run_root, weights, batch_path, iteration, cache_root)


def sync_weights(
    spec: RunSpec,
    run_root: str,
    staged: WeightRef,
    iteration: int,
    *step_metrics: dict[str, float],
    started_at: float | None = None,
) -> tuple[WeightRef, dict[str, float]]:
    """Publish v(N+1), record the iteration's metrics (every step's, merged, and its wall clock from
    `started_at`, when the generate step's process started), commit state.json, then prune what the store no
    longer needs. A kill before the commit redoes the iteration from v(N); a sync retried after its own commit
    only checks the stop (rlpipe.store.commit). After the commit the loop stops when the iteration's records
    show a stop (rlpipe.evaluation.stopping: a stretch of 64 rollouts without reward)."""
    from rlpipe.evaluation.stopping import record_stop, should_stop
    from rlpipe.store.commit import already_committed

    retried = already_committed(run_root, iteration)  # a kill may have come between the commit and the stop
    if retried is None:
        published, metrics = publish_and_commit(spec, run_root, staged, iteration, step_metrics, started_at)
    else:
        published, metrics = retried, {}
    record_stop(run_root, should_stop(spec, run_root, iteration, published["version"]))  # <- the commit's boundary
    if retried is None:
        prune_store(spec, run_root, published["version"])
    return published, metrics


def publish_and_commit(
    spec: RunSpec,
    run_root: str,
    staged: WeightRef,
    iteration: int,
    step_metrics: tuple[dict[str, float], ...],
    started_at: float | None,
) -> tuple[WeightRef, dict[str, float]]:
    """v(N+1) published, metrics/iter_N.json written, state.json committed at iteration N."""
    from rlpipe.store.commit import commit_iteration
    from rlpipe.store.run_root import iteration_metrics_uri, write_json
    from rlpipe.store.weights import publish

    started = time.time()
    published, weight_bytes = publish(run_root, staged)  # verified, moved to weights/v(N+1), then LATEST
    metrics: dict[str, float] = {}
    for each in step_metrics:
        metrics |= each
    metrics["sync/bytes"] = float(weight_bytes)  # an adapter's, or all weights
    # asynchronous: the producer pulls it; sharing: the samplers sleep, and load it as they wake (generate)
    if spec.rollout.engine == "sampler" and not spec.loop.max_staleness and not spec.sharing.enabled:
        from rlpipe.services.samplers.client import reload_samplers

        metrics |= reload_samplers(spec, published)  # in place; a rerun after a kill finds them labelled
    metrics["time/sync_weights_s"] = time.time() - started
    metrics |= iteration_wall(spec, started_at, metrics)
    write_json(iteration_metrics_uri(run_root, iteration), metrics)
    taken = consumed = None
    if service_for("generate", spec) == "producer" and iteration:
        from rlpipe.services.producer.buffer import taken_for_commit

        taken, consumed = taken_for_commit(spec, run_root, iteration)
    commit_iteration(run_root, iteration, published, taken, consumed)  # <- the commit point
    return published, metrics


def iteration_wall(spec: RunSpec, started_at: float | None, metrics: dict[str, float]) -> dict[str, float]:
    """The iteration's wall clock, from the generate step's process start (`started_at`) to now, and the
    part of it no step's `time/*_s` accounts for (orchestration: process starts, imports, artifacts)."""
    if started_at is None:
        return {}
    wall = time.time() - started_at
    compute = sum(v for k, v in metrics.items() if k.startswith("time/") and k.endswith("_s"))
    timing = {ITERATION_WALL: wall, ITERATION_OVERHEAD: max(0.0, wall - compute)}
    if spec.loop.max_staleness:
        timing["async/training_busy_share"] = metrics.get(UPDATE_TIME, 0.0) / max(wall, 1e-9)
    return timing


def prune_store(spec: RunSpec, run_root: str, version: int) -> None:
    """After the commit of v(version): move the iteration's buffered rollouts to consumed/ (asynchronous
    runs), delete weight versions past storage.keep_versions (never v0 nor a version the MLflow Model
    Registry points at) and optimizer states older than v(version)'s, the policy's and a critic's."""
    from rlpipe.store.pruning import prune, prune_optimizer_states
    from rlpipe.tracking.registration import registered_versions

    if service_for("generate", spec) == "producer":
        from rlpipe.services.producer.buffer import retire

        retire(run_root, version, spec.storage.keep_versions)
    registered = registered_versions(spec, run_root)
    for lineage in ("policy", "critic"):
        kept = registered if lineage == "policy" else frozenset()
        prune(run_root, spec.storage.keep_versions, version, lineage, kept)
        prune_optimizer_states(run_root, version, lineage)


def evaluate(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, cache_root: str
) -> dict[str, float] | None:
    """Greedy held-out accuracy (reward.verifier) of `weights`, recorded in metrics/eval_N.json, when
    iteration N is due an eval and not yet recorded; None otherwise (decided before importing torch).
    Then the loop stops when the eval shows a stop (rlpipe.evaluation.stopping: its metrics pass
    loop.stop_when, or v0's held-out answers are all one string, right for none)."""
    from rlpipe.evaluation.cadence import evaluation_pending
    from rlpipe.evaluation.stopping import record_stop, should_stop

    if not evaluation_pending(spec, run_root, iteration):
        return None
    if service_for("evaluate", spec) == "trainer":
        from rlpipe.services.trainer.client import request_evaluate
        from rlpipe.sharing.handover import train_turn

        with train_turn(spec, run_root, iteration) as turn:  # sharing: the samplers asleep, the trainer onloaded
            metrics = request_evaluate(spec, run_root, weights, iteration, cache_root)
        metrics |= turn
    else:
        from rlpipe.evaluation.accuracy import evaluate_policy

        metrics = evaluate_policy(spec, run_root, weights, iteration, cache_root)
    record_stop(run_root, should_stop(spec, run_root, iteration, weights["version"], metrics))  # the eval's boundary
    return metrics


def run_iteration(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    work_dir: str | Path,
    cache_root: str,
    started_at: float | None = None,
) -> tuple[WeightRef, dict[str, float]]:
    """Iteration `iteration`: v(N) = `weights` in, v(N+1) published and committed; its metrics (and
    the held-out evaluation's, when one was due). The artifacts (rollouts, scored, batch) are Parquet
    files in `work_dir`, beside the step table's Markdown reports (rlpipe.reports). The in-process loop,
    and the fused iteration's one task (loop.fuse_steps), whose process started at `started_at`."""
    from rlpipe.reports import write_reports

    paths = {name: str(Path(work_dir) / f"{name}.parquet") for name in ("rollouts", "scored", "valued", "batch")}
    done: dict[str, dict[str, float]] = {}  # each step's metrics, which sync_weights merges
    started_at = started_at or time.time()  # the iteration's wall clock runs from here (sync_weights records it)
    done["generate"] = generate(spec, run_root, weights, iteration, paths["rollouts"], cache_root)
    done["score"] = score(spec, paths["rollouts"], paths["scored"])
    if "values" in iteration_steps(spec):
        done["values"] = values(spec, run_root, weights, iteration, paths["scored"], paths["valued"], cache_root)
        stands_for = BY_NAME["values"].stands_for
        assert stands_for is not None  # the step table says: scored
        paths[stands_for] = paths["valued"]  # valued (scored + V_t) stands for scored from here on
    done["advantages"] = advantages(spec, paths["scored"], paths["batch"])
    write_reports("advantages", work_dir, scored_path=paths["scored"], batch_path=paths["batch"])
    staged, done["update"] = update(spec, run_root, weights, paths["batch"], iteration, cache_root)
    merged = [done[name] for name in merged_steps(spec)]
    published, metrics = sync_weights(spec, run_root, staged, iteration, *merged, started_at=started_at)
    write_reports("sync_weights", work_dir, iteration=iteration, metrics=metrics)
    evaluated = evaluate(spec, run_root, published, iteration, cache_root)
    write_reports("evaluate", work_dir, iteration=iteration, run_root=run_root)
    return published, metrics | (evaluated or {})
