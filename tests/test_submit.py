"""`rlpipe submit` / `rlpipe schedule` against a STUB of the KFP v2beta1 REST API (tests/kfp_api_stub.py)."""

import subprocess

import pytest

from rlpipe.pipelines.submit import cron_for_kfp, interval_seconds

from .conftest import REPO, RLPIPE
from .kfp_api_stub import KfpApiStub

GKE_SPEC = str(REPO / "examples" / "addition-gke.yaml")


def _rlpipe(*args: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([*RLPIPE, *args], capture_output=True, text=True, env={**os.environ, **env})


def _posts(stub: KfpApiStub, path: str) -> list[dict]:
    return [r["body"] for r in stub.requests if r["method"] == "POST" and r["path"] == f"/apis/v2beta1/{path}"]


def test_submit_creates_a_run_with_the_compiled_pipeline_and_waits():
    with KfpApiStub() as stub:
        result = _rlpipe(
            "submit",
            GKE_SPEC,
            "--host",
            stub.host,
            "--experiment",
            "rl-team",
            "--wait",
            "60",
            KFP_BEARER_TOKEN="token-abc",
        )
    assert result.returncode == 0, result.stderr
    assert f"run run-1: {stub.host}/#/runs/details/run-1" in result.stdout
    assert "finished: SUCCEEDED" in result.stdout
    assert [e["display_name"] for e in _posts(stub, "experiments")] == ["rl-team"]
    (run,) = _posts(stub, "runs")
    assert run["experiment_id"] == "exp-1" and run["display_name"] == "addition-demo-run"
    # KFP 2.17's MLflow integration files the pipeline run's MLflow run beside rlpipe's RL run
    assert run["plugins_input"] == {"mlflow": {"experiment_name": "rlpipe"}}  # the spec's tracking.experiment
    # the full compiled pipeline travels in the body: PipelineSpec plus the kfp-kubernetes PlatformSpec
    assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "rlpipe-run"
    executors = run["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors["exec-update"]["pvcMount"][0]["mountPath"] == "/mnt/rlpipe"
    assert all(r["authorization"] == "Bearer token-abc" for r in stub.requests)
    assert [r["path"] for r in stub.requests][-1] == "/apis/v2beta1/runs/run-1"  # polled for completion


def test_schedule_creates_a_recurring_run_that_never_overlaps():
    with KfpApiStub() as stub:
        result = _rlpipe("schedule", GKE_SPEC, "--host", stub.host, "--cron", "0 */2 * * *")
        assert result.returncode == 0, result.stderr
        every = _rlpipe("schedule", GKE_SPEC, "--host", stub.host, "--every", "45m")
        assert every.returncode == 0, every.stderr
    assert f"recurring run rr-1: {stub.host}/#/recurringrun/details/rr-1" in result.stdout
    cron_run, interval_run = _posts(stub, "recurringruns")
    assert cron_run["plugins_input"] == {"mlflow": {"experiment_name": "rlpipe"}}
    assert cron_run["max_concurrency"] == "1" or cron_run["max_concurrency"] == 1
    assert cron_run["no_catchup"] is True and cron_run["mode"] == "ENABLE"
    assert cron_run["trigger"] == {"cron_schedule": {"cron": "0 0 */2 * * *"}}
    assert interval_run["trigger"] == {"periodic_schedule": {"interval_second": "2700"}} or interval_run["trigger"] == {
        "periodic_schedule": {"interval_second": 2700}
    }
    assert (
        cron_run["pipeline_spec"]["pipeline_spec"]["root"]["inputDefinitions"]["parameters"]["run_root"]["defaultValue"]
        == "/mnt/rlpipe/runs/addition-demo"
    )


def test_submit_can_leave_plugins_input_out_for_a_kfp_before_2_17():
    with KfpApiStub() as stub:
        result = _rlpipe("submit", GKE_SPEC, "--host", stub.host, "--no-mlflow-experiment")
    assert result.returncode == 0, result.stderr
    (run,) = _posts(stub, "runs")
    assert "plugins_input" not in run


def test_schedule_arguments_are_checked():
    assert cron_for_kfp("*/5 * * * *") == "0 */5 * * * *"
    assert interval_seconds("2h") == 7200
    with pytest.raises(ValueError, match="5 fields"):
        cron_for_kfp("daily")
    with pytest.raises(ValueError, match="30m, 2h, 1d"):
        interval_seconds("0m")
    result = _rlpipe("schedule", GKE_SPEC, "--host", "http://127.0.0.1:9", "--every", "soon")
    assert result.returncode == 1 and "--every 'soon'" in result.stderr
