"""Which MLflow server a run tracks into (the spec's, the one KFP's MLflow integration injects, or a
sqlite file in the run root), and where a person finds the run there."""

from __future__ import annotations

import os
from pathlib import Path

from rlpipe.spec import RunSpec
from rlpipe.store.run_root import is_local

KFP_MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


def kfp_mlflow() -> dict[str, str] | None:
    """What KFP 2.17's MLflow integration injects into this task (its API server's
    settings.injectUserEnvVars: true): the server, the experiment of the pipeline run's MLflow run and
    this task's run nested under it; None outside it. The MLflow client reads MLFLOW_WORKSPACE and the
    auth variables (MLFLOW_TRACKING_TOKEN, ...) itself."""
    if all(os.environ.get(name) for name in KFP_MLFLOW_VARIABLES):
        return {name: os.environ[name] for name in KFP_MLFLOW_VARIABLES}
    return None


def tracking_uri(spec: RunSpec, run_root: str) -> str:
    """The spec's URI, else the server KFP's MLflow integration names (`kfp_mlflow`), else
    sqlite:///<run root>/mlflow.db (MLflow 3 has no file store)."""
    if spec.tracking.uri:
        return spec.tracking.uri
    if kfp := kfp_mlflow():
        return kfp["MLFLOW_TRACKING_URI"]
    if not is_local(run_root):
        raise ValueError("tracking.uri must be set when storage.root is remote (sqlite needs a local file)")
    return f"sqlite:///{Path(run_root.removeprefix('file://')) / 'mlflow.db'}"


def run_url(spec: RunSpec, run_root: str, run_id: str) -> str:
    """Where a person finds the run: the UI command for sqlite, the server URL otherwise (in the
    model-training view of the MLflow 3 UI)."""
    uri = tracking_uri(spec, run_root)
    if uri.startswith("sqlite:"):
        experiment = spec.tracking.experiment
        return f"mlflow ui --backend-store-uri {uri}   (then open the '{experiment}' experiment, run {run_id})"
    return f"{uri.rstrip('/')}/#/experiments/runs/{run_id}?workflowType=machine_learning"
