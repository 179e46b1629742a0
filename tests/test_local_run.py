"""`rlpipe run` on KFP's local runner: the whole loop, then a kill -9 mid-iteration and a resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from .conftest import tiny_spec_dict


def _write_spec(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, **sections)))
    return path


def _rlpipe(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlpipe.pipelines.cli", *args], capture_output=True, text=True, **kwargs
    )


def _mlflow_steps(run_root: Path, key: str) -> list[int]:
    state = json.loads((run_root / "state.json").read_text())
    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(state["mlflow_run_id"], key))


def _check_consistent(run_root: Path, iterations: int) -> None:
    """No iteration lost or duplicated, versions monotone, one MLflow point per iteration."""
    state = json.loads((run_root / "state.json").read_text())
    assert state["iteration"] == iterations and state["weights_version"] == iterations
    assert (run_root / "weights" / "LATEST").read_text() == f"v{iterations:06d}"
    metrics = sorted(p.name for p in (run_root / "metrics").glob("iter_*.json"))
    assert metrics == [f"iter_{i:06d}.json" for i in range(iterations + 1)]
    manifests = [json.loads(p.read_text()) for p in sorted((run_root / "weights").glob("v*/manifest.json"))]
    for manifest in manifests[1:]:
        assert manifest["parent_version"] == manifest["version"] - 1 and manifest["iteration"] == manifest["version"]
    assert not list((run_root / "weights" / ".staging").glob("*"))
    assert _mlflow_steps(run_root, "reward/mean") == list(range(1, iterations + 1))
    eval_steps = _mlflow_steps(run_root, "eval/accuracy_greedy")
    assert eval_steps == sorted(set(eval_steps)) and eval_steps[0] == 0 and eval_steps[-1] == iterations


def test_run_the_loop_and_continue_it(tmp_path: Path):
    spec = _write_spec(tmp_path)
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MLflow run: mlflow ui --backend-store-uri sqlite:///" in result.stdout
    _check_consistent(run_dir, 3)
    # running again with more iterations continues from state.json
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 4)
    # a pipeline run once the loop is done (what a recurring run does) changes nothing
    before = (run_dir / "state.json").read_text()
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == json.loads(before)["iteration"]
    _check_consistent(run_dir, 4)
    # each step's KFP Metrics artifact (what the KFP UI shows) carries its metrics; kfp.local keeps
    # one output directory per task name, so unrolled iterations of one pipeline run share it
    outputs = [json.loads(p.read_text()) for p in (run_dir / "kfp").glob("*/update/executor_output.json")]
    assert len(outputs) == 3  # three pipeline runs that iterated (the fourth had nothing to do)
    assert all("policy/loss" in o["artifacts"]["metrics"]["artifacts"][0]["metadata"] for o in outputs)


def test_bad_spec_fails_before_anything_runs(tmp_path: Path):
    data = tiny_spec_dict(tmp_path)
    data["rollout"]["engine"] = "jax"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    result = _rlpipe("run", str(tmp_path / "bad.yaml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "rollout.engine: must be one of 'torch'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_missing_model_path_says_what_to_change(tmp_path: Path):
    spec = _write_spec(tmp_path, model={"path": str(tmp_path / "missing-model")})
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert "pre-flight check failed" in result.stderr  # before any step runs
    assert f"model.path {tmp_path / 'missing-model'} does not exist" in result.stderr
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize(
    ("kill_in", "resident"),
    [
        ("update", False),
        ("update", True),  # the driver, the update step and (by PDEATHSIG) the resident trainer
        pytest.param("generate", False, marks=pytest.mark.slow),
        pytest.param("sync-weights", False, marks=pytest.mark.slow),
    ],
)
def test_kill_mid_iteration_then_resume(tmp_path: Path, kill_in: str, resident: bool):
    spec = _write_spec(
        tmp_path, loop={"iterations": 4, "iterations_per_run": 4, "eval_every": 2}, trainer={"resident": resident}
    )
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "kfp-local.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(spec), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    marker = f"Executing task \x1b[96m'{kill_in}-2'"  # the second iteration's step
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and marker in log.read_text(errors="replace"):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the running step, like a preempted node
    proc.wait()
    killed_at = json.loads((run_dir / "state.json").read_text())["iteration"]
    assert 1 <= killed_at < 4  # the kill landed mid-loop
    if resident:
        orphan = json.loads((run_dir / "trainers" / "fleet.json").read_text())["replicas"][0]["pid"]

    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 4)
    if resident:  # the killed driver's trainer is gone, and so is the resumed run's
        trainer = json.loads((run_dir / "trainers" / "fleet.json").read_text())["replicas"][0]
        assert trainer["state"] == "stopped"
        for pid in (orphan, trainer["pid"]):
            cmdline = Path(f"/proc/{pid}/cmdline")
            assert not cmdline.exists() or b"trainer_service" not in cmdline.read_bytes(), f"trainer {pid} lives"
