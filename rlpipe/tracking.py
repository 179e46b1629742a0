"""MLflow tracking: one MLflow run per RL run, metrics at step = iteration, no duplicates.

Metrics are first written to the run root (metrics/*.json, by sync_weights and evaluate);
`flush_metrics` copies every committed point MLflow does not yet have. MLflow is the
record of what was logged, so a flush killed halfway is simply repeated.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlpipe.metric_keys import EVAL_ACCURACY, REWARD_MEAN
from rlpipe.spec import RunSpec, flatten, spec_to_dict
from rlpipe.store.run_root import commit_state, is_local, list_metrics, read_state

RUN_TAG = "rlpipe.run_uid"


def tracking_uri(spec: RunSpec, run_root: str) -> str:
    """The spec's URI, else sqlite:///<run root>/mlflow.db (MLflow 3 has no file store)."""
    if spec.tracking.uri:
        return spec.tracking.uri
    if not is_local(run_root):
        raise ValueError("tracking.uri must be set when storage.root is remote (sqlite needs a local file)")
    return f"sqlite:///{Path(run_root.removeprefix('file://')) / 'mlflow.db'}"


def ensure_run(spec: RunSpec, run_root: str) -> str:
    """The MLflow run id for this RL run: from state.json, by tag, or newly created."""
    import mlflow
    from mlflow.tracking import MlflowClient

    state = read_state(run_root) or {}
    if state.get("mlflow_run_id"):
        return state["mlflow_run_id"]
    mlflow.set_tracking_uri(tracking_uri(spec, run_root))
    client = MlflowClient()
    experiment = client.get_experiment_by_name(spec.tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(spec.tracking.experiment)
    # a kill between create_run and commit_state must not make a second MLflow run
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{state['run_uid']}'")
    if found:
        run_id = found[0].info.run_id
    else:
        run = client.create_run(
            experiment_id, run_name=spec.name, tags={RUN_TAG: state["run_uid"], "rlpipe.run_root": run_root}
        )
        run_id = run.info.run_id
        params = {k: str(v)[:6000] for k, v in flatten(spec_to_dict(spec)).items()}
        items = list(params.items())
        for start in range(0, len(items), 100):
            client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in items[start : start + 100]])
    commit_state(run_root, mlflow_run_id=run_id)
    return run_id


def flush_metrics(spec: RunSpec, run_root: str) -> tuple[str, int]:
    """Log committed iteration and eval metrics MLflow lacks; returns (run id, points logged)."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    state = read_state(run_root)
    if state is None:  # initialization failed before state.json: nothing to log yet
        return "", 0
    mlflow.set_tracking_uri(tracking_uri(spec, run_root))
    run_id = ensure_run(spec, run_root)
    client = MlflowClient()
    committed = state.get("iteration", -1)
    logged = 0
    for kind, marker in (("iter", REWARD_MEAN), ("eval", EVAL_ACCURACY)):
        have = {m.step for m in client.get_metric_history(run_id, marker)}
        for iteration, values in sorted(list_metrics(run_root, kind).items()):
            if iteration > committed or iteration in have:
                continue
            now = int(time.time() * 1000)
            batch = [Metric(key, float(value), now, iteration) for key, value in sorted(values.items())]
            # the marker goes last: its presence means the whole point was logged
            batch.sort(key=lambda m: m.key == marker)
            for start in range(0, len(batch), 1000):
                client.log_batch(run_id, metrics=batch[start : start + 1000])
            logged += 1
    return run_id, logged


def run_url(spec: RunSpec, run_root: str, run_id: str) -> str:
    """Where a person finds the run: the UI command for sqlite, the server URL otherwise."""
    uri = tracking_uri(spec, run_root)
    if uri.startswith("sqlite:"):
        experiment = spec.tracking.experiment
        return f"mlflow ui --backend-store-uri {uri}   (then open the '{experiment}' experiment, run {run_id})"
    return f"{uri.rstrip('/')}/#/experiments/runs/{run_id}"
