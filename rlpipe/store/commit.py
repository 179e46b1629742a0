"""The commit: the one writer of state.json, the run's commit point (its path and reader are
rlpipe.store.run_root.state_uri / read_state).

state.json holds the committed iteration with the weights version it published and its sha256, the
run's uid, its MLflow run id, the eval gate that stopped the loop, what an asynchronous iteration took
from the rollout buffer, and a fork's parent. Every change replaces the whole file atomically; the
callers say what changed through the functions here:
    commit_iteration     iteration N+1 with v(N+1) (rlpipe.loop.sync_weights: after publishing the
                         weights and writing the iteration's metrics, before pruning)   <- the commit point
    record_tracking_run  the MLflow run this RL run logs to (rlpipe.tracking.mlflow_runs)
    record_stopped       the loop stopped by loop.stop_when (rlpipe.loop.evaluate)
    commit_fork          a forked run's first state (rlpipe.commands.fork)
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from rlpipe.store.run_root import read_state, state_uri, write_json
from rlpipe.store.weights import WeightRef, read_weight_ref


def _write_state(run_root: str, **changes: Any) -> dict[str, Any]:
    """Merge `changes` into state.json atomically; returns the new state."""
    state = read_state(run_root) or {"run_uid": uuid.uuid4().hex, "created_at": time.time()}
    state.update(changes, updated_at=time.time())
    write_json(state_uri(run_root), state)
    return state


def already_committed(run_root: str, iteration: int) -> WeightRef | None:
    """The published weights when `iteration` is committed already (a sync retried after its own
    commit), None when it is the next to commit; RuntimeError when the state is anywhere else."""
    state = read_state(run_root) or {}
    committed = state.get("iteration", -1)
    if committed >= iteration:
        return read_weight_ref(run_root, state["weights_version"])
    if committed != iteration - 1:
        raise RuntimeError(
            f"state.json is at iteration {committed}, cannot commit iteration {iteration}; "
            "another run is writing to this run root? Rerun `rlpipe run` to continue from the state."
        )
    return None


def commit_iteration(
    run_root: str,
    iteration: int,
    published: WeightRef,
    rollouts_taken: dict[str, Any] | None = None,
    groups_consumed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Commit `iteration`: it published `published` (and, asynchronous, trained on `rollouts_taken`, after
    which the buffer's `groups_consumed` are consumed: rlpipe.services.producer.buffer). A kill before this redoes
    the iteration from v(N); after it, the iteration is done."""
    if already_committed(run_root, iteration) is not None:
        raise RuntimeError(f"iteration {iteration} is committed already: a second writer on {run_root}?")
    return _write_state(
        run_root,
        iteration=iteration,
        weights_version=published["version"],
        weights_sha256=published["sha256"],
        **({"rollouts_taken": rollouts_taken} if rollouts_taken else {}),
        **({"groups_consumed": groups_consumed} if groups_consumed else {}),
    )


def record_tracking_run(run_root: str, mlflow_run_id: str) -> dict[str, Any]:
    """The MLflow run that this RL run's metrics go to, across all its pipeline runs."""
    return _write_state(run_root, mlflow_run_id=mlflow_run_id)


def record_stopped(run_root: str, stopped: dict[str, Any]) -> dict[str, Any]:
    """The eval gate (loop.stop_when) stopped the loop at `stopped["iteration"]`."""
    return _write_state(run_root, stopped=stopped)


def commit_fork(run_root: str, iteration: int, weights_sha256: str, forked_from: dict[str, Any]) -> dict[str, Any]:
    """A fork's first state: at its parent's iteration N, with v(N) (rlpipe.commands.fork)."""
    return _write_state(
        run_root, iteration=iteration, weights_version=iteration, weights_sha256=weights_sha256, forked_from=forked_from
    )
