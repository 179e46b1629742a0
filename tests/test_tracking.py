"""MLflow: one run per RL run, one point per iteration, even when a flush is repeated."""

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rlpipe.spec import parse_spec
from rlpipe.store.run_root import eval_metrics_uri, iteration_metrics_uri, tracked_uri, write_json
from rlpipe.tracking.mlflow_runs import flush_metrics
from rlpipe.tracking.uri import tracking_uri

from .conftest import set_state, tiny_spec_dict


def test_flush_is_idempotent_and_skips_uncommitted(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    set_state(run_root, iteration=0, weights_version=0)
    write_json(eval_metrics_uri(run_root, 0), {"eval/accuracy_greedy": 0.25})
    for i in (1, 2, 3):
        write_json(iteration_metrics_uri(run_root, i), {"reward/mean": i / 10, "policy/loss": -i})
    set_state(run_root, iteration=2)  # iteration 3's file exists but is not committed

    run_id, logged, _ = flush_metrics(spec, run_root)
    assert logged == 3  # eval 0, iterations 1 and 2
    again_id, again, _ = flush_metrics(spec, run_root)
    assert (again_id, again) == (run_id, 0)
    set_state(run_root, iteration=3)
    assert flush_metrics(spec, run_root)[1] == 1

    client = MlflowClient(tracking_uri(spec, run_root))
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy_greedy")] == [0]
    run = client.get_run(run_id)
    assert run.data.params["trainer.lr"] == "0.0005"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_flush_with_nothing_new_returns_without_mlflow_and_the_next_commit_logs(tmp_path: Path):
    """tracked.json: a flush that finds what the last complete one logged from returns at once (in a fresh
    process MLflow is not even imported); an iteration committed, or the tracking settings changed, and
    the next flush logs again."""
    import json
    import subprocess
    import sys

    from rlpipe.spec import spec_to_json
    from rlpipe.tracking.mlflow_runs import flush

    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    set_state(run_root, iteration=0, weights_version=0)
    write_json(iteration_metrics_uri(run_root, 1), {"reward/mean": 0.5})
    first = flush(spec, run_root)
    assert first["points"] == 0 and Path(tracked_uri(run_root)).exists()
    code = (
        "import json, sys\nfrom rlpipe.tracking.mlflow_runs import flush\nfrom rlpipe.spec import spec_from_json\n"
        f"done = flush(spec_from_json({spec_to_json(spec)!r}), {run_root!r})\n"
        "print(json.dumps([done, 'mlflow' in sys.modules]))"
    )
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    done, imported = json.loads(again.stdout.strip().splitlines()[-1])
    assert done["up_to_date"] and done["run_id"] == first["run_id"] and not imported
    set_state(run_root, iteration=1)
    assert flush(spec, run_root)["points"] == 1
    assert flush(spec, run_root)["up_to_date"]
    moved = parse_spec(tiny_spec_dict(tmp_path, tracking={"register": "every_eval"}))
    assert "up_to_date" not in flush(moved, run_root)


def test_rlpipe_run_flushes_as_each_iteration_commits(tmp_path: Path):
    """The driver's live tracking (a thread of `rlpipe run`): a commit reaches MLflow within seconds, before
    any track step; a track step under the driver (driver_s) waits for it and finds all done; stopping it
    ends the thread."""
    import threading
    import time

    from rlpipe.tracking.mlflow_runs import flush, flush_as_it_commits

    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    set_state(run_root, iteration=0, weights_version=0)
    stop = threading.Event()
    tracker = threading.Thread(target=flush_as_it_commits, args=(spec, run_root, stop, 0.1))
    tracker.start()
    try:
        write_json(iteration_metrics_uri(run_root, 1), {"reward/mean": 0.1})
        set_state(run_root, iteration=1)
        deadline = time.time() + 30
        while not (run_id := json.loads((Path(run_root) / "state.json").read_text()).get("mlflow_run_id")) or not (
            MlflowClient(tracking_uri(spec, run_root)).get_metric_history(run_id, "reward/mean")
        ):
            assert time.time() < deadline, "iteration 1 did not reach MLflow in 30 s"
            time.sleep(0.2)
        write_json(iteration_metrics_uri(run_root, 2), {"reward/mean": 0.2})
        set_state(run_root, iteration=2)
        assert flush(spec, run_root, driver_s=30.0)["up_to_date"]  # the track step: the driver logged it
    finally:
        stop.set()
        tracker.join(timeout=30)
    assert not tracker.is_alive()
    history = MlflowClient(tracking_uri(spec, run_root)).get_metric_history(run_id, "reward/mean")
    assert [m.value for m in history] == [0.1, 0.2]


def test_lost_run_id_finds_the_same_mlflow_run(tmp_path: Path):
    """A kill between creating the MLflow run and saving its id must not make a second run."""
    spec = parse_spec(tiny_spec_dict(tmp_path))
    run_root = str(tmp_path / "run")
    set_state(run_root, iteration=0, weights_version=0)
    run_id, *_ = flush_metrics(spec, run_root)
    set_state(run_root, mlflow_run_id=None)
    assert flush_metrics(spec, run_root)[0] == run_id


def test_registry_alias_follows_the_best_eval_and_the_store_keeps_its_weights(initialized_run, tmp_path: Path):
    """tracking.register best: each new best held-out eval becomes a model version whose source is the
    sealed version in the weight store (no copy), tagged with iteration, accuracy and sha256; the alias
    'best' moves with it, and pruning keeps the versions the registry points at."""
    from rlpipe import loop
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.tracking.mlflow_runs import flush
    from rlpipe.tracking.registration import versions_to_register

    spec, run_root, cache = initialized_run
    data = spec_to_dict(spec)
    data["loop"] |= {"iterations": 10, "eval_every": 100}  # no eval on its own: this test sets the accuracies
    data["storage"]["keep_versions"] = 1
    spec = parse_spec(data)
    client = MlflowClient(tracking_uri(spec, run_root))

    def evaluated(iteration: int, accuracy: float) -> None:
        write_json(
            eval_metrics_uri(run_root, iteration), {"eval/accuracy_greedy": accuracy, "eval/weights_version": iteration}
        )

    def best() -> str:
        return client.get_model_version_by_alias("tiny", "best").tags["rlpipe.iteration"]

    evaluated(0, 0.30)
    done = flush(spec, run_root)
    assert done["registered"] == [0] and best() == "0" and "spec.yaml" in done["artifacts"]
    weights = read_weight_ref(run_root, 0)
    for iteration, accuracy in ((1, 0.50), (2, 0.40), (3, 0.50), (4, 0.45)):
        work = tmp_path / str(iteration)
        work.mkdir()
        weights, _ = loop.run_iteration(spec, run_root, weights, iteration, work, cache)
        evaluated(iteration, accuracy)
        flush(spec, run_root)
    # 0.50 at iteration 1 was the first best; 0.50 again at 3 is no better
    assert best() == "1"
    versions = {v.tags["rlpipe.iteration"]: v for v in client.search_model_versions("name = 'tiny'")}
    assert sorted(versions) == ["0", "1"]
    one = versions["1"]
    assert (
        one.source == read_weight_ref(run_root, 1)["uri"]
        and one.tags["rlpipe.sha256"] == read_weight_ref(run_root, 1)["sha256"]
    )
    assert one.tags["eval/accuracy_greedy"] == "0.5000" and one.run_id == flush(spec, run_root)["run_id"]
    # keep_versions 1 pruned v2 and v3; v1 stays while the registry points at it
    kept = sorted(p.name for p in (Path(run_root) / "weights").glob("v0*"))
    assert kept == ["v000000", "v000001", "v000004"]
    again = flush(spec, run_root)
    assert again["up_to_date"] and again["registered"] == []  # nothing new: MLflow is not asked
    Path(tracked_uri(run_root)).unlink()  # as after a flush killed before its record: MLflow is asked
    assert flush(spec, run_root)["registered"] == []  # and registers nothing twice

    # every_eval from here on: each eval the store still has; the gate's version gets its alias
    data["tracking"] = {"register": "every_eval"}
    spec = parse_spec(data)
    set_state(run_root, stopped={"iteration": 4, "weights_version": 4, "reason": "test", "when": "x"})
    assert sorted(versions_to_register(spec, run_root)) == [0, 1, 2, 3, 4]
    assert flush(spec, run_root)["registered"] == [4]  # v2 and v3 were pruned before every_eval was asked for
    assert client.get_model_version_by_alias("tiny", "gate_passed").tags["rlpipe.iteration"] == "4"
    assert best() == "1"


def test_each_eval_logs_its_held_out_samples_as_an_mlflow_table(initialized_run):
    import json

    from rlpipe.evaluation.accuracy import evaluate_policy
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.tracking.mlflow_runs import flush

    spec, run_root, cache = initialized_run
    accuracy = evaluate_policy(spec, run_root, read_weight_ref(run_root, 0), 0, cache)["eval/accuracy_greedy"]
    done = flush(spec, run_root)
    assert done["artifacts"] == ["spec.yaml", "eval_samples/eval_000000.json"]
    client = MlflowClient(tracking_uri(spec, run_root))
    table = json.loads(Path(client.download_artifacts(done["run_id"], "eval_samples/eval_000000.json")).read_text())
    assert table["columns"] == ["index", "prompt", "completion", "answer", "reward", "correct", "strict"]
    assert len(table["data"]) == spec.data.eval_size
    assert sum(row[4] for row in table["data"]) / len(table["data"]) == pytest.approx(accuracy)
    strict = json.loads((Path(run_root) / "metrics" / "eval_000000.json").read_text())["eval/accuracy_strict"]
    assert sum(row[6] for row in table["data"]) / len(table["data"]) == pytest.approx(strict)
    tag = json.loads(client.get_run(done["run_id"]).data.tags["mlflow.loggedArtifacts"])
    assert tag == [{"path": "eval_samples/eval_000000.json", "type": "table"}]
    spec_logged = client.download_artifacts(done["run_id"], "spec.yaml")
    assert yaml.safe_load(Path(spec_logged).read_text())["name"] == spec.name
    Path(tracked_uri(run_root)).unlink()  # MLflow is asked, not tracked.json
    assert flush(spec, run_root)["artifacts"] == []  # logged once


def test_a_new_sqlite_store_appears_whole_or_not_at_all(tmp_path: Path):
    """MLflow migrates a new sqlite database for seconds; a kill in them left one every later open failed
    on (`duplicate column name`). It is made under another name and linked into place."""
    from rlpipe.store.run_root import created_whole

    db = tmp_path / "mlflow.db"

    def killed(at: Path) -> None:
        at.write_text("half a schema")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        created_whole(db, killed)
    assert not db.exists() and list(tmp_path.iterdir()) == []
    created_whole(db, lambda at: at.write_text("whole"))
    created_whole(db, killed)  # there already: not made again
    assert db.read_text() == "whole" and list(tmp_path.iterdir()) == [db]
