"""MLflow: one run per RL run, one point per iteration, even when a flush is repeated."""

from pathlib import Path

from mlflow.tracking import MlflowClient

from rlpipe.spec import parse_spec
from rlpipe.store.run_root import commit_state, eval_metrics_uri, iteration_metrics_uri, write_json
from rlpipe.tracking import flush_metrics, tracking_uri

from .conftest import tiny_spec_dict


def test_flush_is_idempotent_and_skips_uncommitted(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    commit_state(run_root, iteration=0, weights_version=0)
    write_json(eval_metrics_uri(run_root, 0), {"eval/accuracy_greedy": 0.25})
    for i in (1, 2, 3):
        write_json(iteration_metrics_uri(run_root, i), {"reward/mean": i / 10, "policy/loss": -i})
    commit_state(run_root, iteration=2)  # iteration 3's file exists but is not committed

    run_id, logged = flush_metrics(spec, run_root)
    assert logged == 3  # eval 0, iterations 1 and 2
    again_id, again = flush_metrics(spec, run_root)
    assert (again_id, again) == (run_id, 0)
    commit_state(run_root, iteration=3)
    assert flush_metrics(spec, run_root)[1] == 1

    client = MlflowClient(tracking_uri(spec, run_root))
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy_greedy")] == [0]
    run = client.get_run(run_id)
    assert run.data.params["trainer.lr"] == "0.0005"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_lost_run_id_finds_the_same_mlflow_run(tmp_path: Path):
    """A kill between creating the MLflow run and saving its id must not make a second run."""
    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    commit_state(run_root, iteration=0, weights_version=0)
    run_id, _ = flush_metrics(spec, run_root)
    commit_state(run_root, mlflow_run_id=None)
    assert flush_metrics(spec, run_root)[0] == run_id
