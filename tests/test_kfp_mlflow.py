"""KFP 2.17's MLflow integration (KEP-12862) reconciled with rlpipe's tracking, against a real MLflow
server: a task that sees the variables KFP injects tracks the RL run into that server and the pipeline
run's experiment, the pipeline run's MLflow run and the RL run name each other, and no metric is logged
twice (the steps' Metrics artifacts, which KFP's launcher logs to each task's MLflow run, stay empty).

What KFP's API server and driver do for the integration (an experiment, the pipeline run's MLflow run
with its kfp.* tags, a run per task nested under it, the variables in each task's environment) is a
STUB here: no KFP API server can run on this machine. kfp.local runs the pipeline, every task with the
track task's variables."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from mlflow.tracking import MlflowClient

from .conftest import tiny_spec_dict
from .test_local_runner import _rlpipe


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite store) on a free loopback port."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if requests.get(f"{uri}/health", timeout=1).ok:
                break
        except requests.RequestException:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("the MLflow server did not answer /health in 90 s")
    yield uri
    server.terminate()
    server.wait(timeout=30)


def test_a_pipeline_run_under_kfp_mlflow_links_the_rl_run_both_ways_and_logs_each_metric_once(
    mlflow_server: str, tmp_path: Path
):
    client = MlflowClient(mlflow_server)
    # STUB of KFP's part: the experiment plugins_input named, the pipeline run's run, the track task's run
    experiment_id = client.create_experiment("rl-team")
    kfp_tags = {"kfp.pipeline_run_id": "run-7", "kfp.pipeline_run_url": "https://kfp.example/#/runs/details/run-7"}
    parent = client.create_run(experiment_id, run_name="tiny-run", tags=kfp_tags).info.run_id
    task = client.create_run(experiment_id, run_name="track", tags={"mlflow.parentRunId": parent}).info.run_id
    injected = {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_ID": experiment_id, "MLFLOW_RUN_ID": task}

    data = tiny_spec_dict(tmp_path, loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    import os

    result = _rlpipe("run", str(tmp_path / "spec.yaml"), "--run-dir", str(run_dir), env={**os.environ, **injected})
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (run_dir / "mlflow.db").exists()  # tracked into KFP's server, not the run root's sqlite

    # the RL run is in the pipeline run's experiment, and the two name each other
    rl_run_id = json.loads((run_dir / "state.json").read_text())["mlflow_run_id"]
    rl_run = client.get_run(rl_run_id)
    assert rl_run.info.experiment_id == experiment_id
    link = json.loads(rl_run.data.tags[f"rlpipe.pipeline_run.{parent}"])
    assert link == {
        "mlflow_run_id": parent,
        "kfp_run_id": "run-7",
        "kfp_run_url": kfp_tags["kfp.pipeline_run_url"],
        "iterations": "0-2",  # 0: the warm start this first pipeline run committed
    }
    assert rl_run.data.tags["rlpipe.last_pipeline_run"] == parent
    pipeline_tags = client.get_run(parent).data.tags
    assert pipeline_tags["rlpipe.rl_run_id"] == rl_run_id and pipeline_tags["rlpipe.iterations"] == "0-2"
    assert pipeline_tags["rlpipe.run_root"] == str(run_dir)

    # each metric once: in the RL run, by iteration; the Metrics artifacts KFP's launcher would log again
    # to each task's run are empty
    assert sorted(m.step for m in client.get_metric_history(rl_run_id, "reward/mean")) == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(rl_run_id, "eval/accuracy_greedy")) == [0, 2]
    outputs = list((run_dir / "kfp").rglob("executor_output.json"))
    metrics_artifacts = [
        artifact
        for path in outputs
        for name, listed in json.loads(path.read_text()).get("artifacts", {}).items()
        if name == "metrics"
        for artifact in listed["artifacts"]
    ]
    assert len(metrics_artifacts) >= 5 and all(a.get("metadata", {}) == {} for a in metrics_artifacts)
    runs = client.search_runs([experiment_id])
    assert {r.info.run_id for r in runs if r.data.metrics} == {rl_run_id}

    # the best eval's version is registered in the server's registry (which refuses local paths as sources)
    best = client.get_model_version_by_alias("tiny", "best")
    assert best.run_id == rl_run_id and best.tags["rlpipe.weights_uri"].startswith(str(run_dir / "weights"))
    assert best.source == f"rlpipe-local://{socket.gethostname()}{best.tags['rlpipe.weights_uri']}"


def test_a_version_on_the_clusters_volume_is_registered_by_its_claim(tmp_path: Path):
    from rlpipe.spec import parse_spec
    from rlpipe.tracking.registration import registry_source

    spec = parse_spec(tiny_spec_dict(tmp_path, cluster={"pvc": "rl-runs"}))
    weights = "/mnt/rlpipe/runs/tiny/weights/v000004"
    assert registry_source(spec, weights, "https://mlflow.example") == "pvc://rl-runs/runs/tiny/weights/v000004"
    assert registry_source(spec, weights, "sqlite:///runs/tiny/mlflow.db") == weights  # a local store: as it is
    assert registry_source(spec, "gs://b/runs/tiny/weights/v000004", "https://m") == "gs://b/runs/tiny/weights/v000004"
