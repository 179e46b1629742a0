"""Where a run goes besides on: an eval gate that stops it, `rlpipe status`, and `rlpipe fork` from
iteration N (the fork's v(N) is the parent's; the two diverge only after N)."""

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from rlpipe.spec import SpecError, parse_spec

from .conftest import tiny_spec_dict
from .test_local_runner import _check_consistent, _rlpipe


def test_stop_when_reads_a_metric_comparison():
    from rlpipe.evaluation.stopping import gate_passed

    spec = parse_spec({"name": "g", "loop": {"stop_when": "eval/accuracy_greedy >= 0.7"}})
    assert gate_passed(spec, {"eval/accuracy_greedy": 0.69}) is None
    assert gate_passed(spec, {"eval/accuracy_greedy": 0.7}) == "eval/accuracy_greedy 0.7 >= 0.7"
    assert gate_passed(spec, {"reward/mean": 1.0}) is None  # not this eval's metric
    assert gate_passed(parse_spec({"name": "g", "loop": {"stop_when": "eval/loss<1e-3"}}), {"eval/loss": 5e-4})
    with pytest.raises(SpecError, match="loop.stop_when"):
        parse_spec({"name": "g", "loop": {"stop_when": "accuracy is high"}})


def _sha(run_root: Path, version: int) -> str:
    return json.loads((run_root / "weights" / f"v{version:06d}" / "manifest.json").read_text())["sha256"]


def _metrics(run_root: Path, iteration: int) -> dict:
    return json.loads((run_root / "metrics" / f"iter_{iteration:06d}.json").read_text())


@pytest.mark.slow  # 4 runs on kfp.local, ~2 min: CI's slow step
def test_a_gated_run_stops_and_a_fork_from_iteration_n_diverges_only_after_n(tmp_path: Path):
    # the parent: 6 iterations, evals every 2, a gate that passes at the eval of v2
    data = tiny_spec_dict(
        tmp_path,
        loop={"iterations": 6, "iterations_per_run": 4, "eval_every": 2, "stop_when": "eval/weights_version >= 2"},
        storage={"root": str(tmp_path / "runs"), "keep_versions": 4},
        reward={"functions": [{"type": "tests.toy_plugins:length", "target": 2}]},  # advantages != 0: it learns
    )
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    parent = tmp_path / "parent"
    result = _rlpipe("run", str(tmp_path / "spec.yaml"), "--run-dir", str(parent))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loop.stop_when passed at iteration 2 (eval/weights_version 2 >= 2): the loop ends there" in result.stdout
    _check_consistent(parent, 2)  # the pipeline run ended at the eval that passed: nothing after it
    state = json.loads((parent / "state.json").read_text())
    assert state["stopped"]["iteration"] == 2 and state["stopped"]["weights_version"] == 2

    # the registry has the version that passed (and the best eval's)
    client = MlflowClient(f"sqlite:///{parent / 'mlflow.db'}")
    gate = client.get_model_version_by_alias("tiny", "gate_passed")
    assert gate.tags["rlpipe.iteration"] == "2" and gate.source == str(parent / "weights" / "v000002")
    assert gate.tags["rlpipe.sha256"] == _sha(parent, 2) and gate.run_id == state["mlflow_run_id"]
    best = client.get_model_version_by_alias("tiny", "best")
    accuracies = {n: json.loads((parent / "metrics" / f"eval_{n:06d}.json").read_text()) for n in (0, 2)}
    top = max(a["eval/accuracy_greedy"] for a in accuracies.values())
    assert best.tags["rlpipe.iteration"] == str(
        min(n for n, a in accuracies.items() if a["eval/accuracy_greedy"] == top)
    )

    status = _rlpipe("status", str(parent))
    assert status.returncode == 0, status.stderr
    assert "iteration   2 of 6 committed" in status.stdout
    assert "stopped     at iteration 2: eval/weights_version 2 >= 2" in status.stdout
    assert json.loads(_rlpipe("status", str(parent), "--json").stdout)["versions_kept"] == [0, 1, 2]

    # what a fork cannot do, it says
    for args, says in (
        (["--from-iteration", "3", "--name", "x"], "the parent has committed iterations 0..2"),
        (["--from-iteration", "1", "--name", "x", "--set", "model.tiny.num_layers=2"], "keeps the parent's model"),
        (["--from-iteration", "1", "--name", "parent"], "exists and is not empty"),
    ):
        refused = _rlpipe("fork", str(parent), *args)
        assert refused.returncode == 1 and says in refused.stderr, refused.stderr
    assert not (tmp_path / "x").exists()

    # a fork from iteration 1 with another KL coefficient, without the gate, for 3 iterations (the parent kept
    # only v2's optimizer state: this fork's AdamW starts anew)
    result = _rlpipe(
        "fork", str(parent), "--from-iteration", "1", "--name", "kl",
        "--set", "algorithm.kl_coef=0.5", "--set", "loop.stop_when=null", "--set", "loop.iterations=3",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    child = tmp_path / "kl"
    assert f"rlpipe run {child / 'spec.yaml'} --run-dir {child}" in result.stdout
    assert "AdamW starts anew" in result.stdout
    # v1 is the parent's: the same bytes, shared by a hard link
    assert _sha(child, 1) == _sha(parent, 1)
    weights_file = Path("weights", "v000001", "model.safetensors")
    assert (child / weights_file).stat().st_ino == (parent / weights_file).stat().st_ino
    result = _rlpipe("run", str(child / "spec.yaml"), "--run-dir", str(child))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(child, 3, store=parent)  # tracked in the parent's MLflow store

    # iteration 1 is the parent's; iteration 2 samples the same rollouts from v1, and its update (another
    # KL coefficient, and v1 is not v0) makes another v2
    assert _metrics(child, 1) == _metrics(parent, 1)
    assert _metrics(child, 2)["reward/mean"] == _metrics(parent, 2)["reward/mean"]
    assert _metrics(child, 2)["kl/mean"] > 0  # v1 differs from the reference v0
    assert _sha(child, 2) != _sha(parent, 2)
    child_state = json.loads((child / "state.json").read_text())
    assert child_state["forked_from"]["iteration"] == 1 and child_state["forked_from"]["run_root"] == str(parent)
    assert yaml.safe_load((child / "spec.yaml").read_text())["algorithm"]["kl_coef"] == 0.5

    # MLflow: the fork's run sits in the parent's store, nested under it, its curve from 1 to 3
    fork_run = client.get_run(child_state["mlflow_run_id"])
    assert fork_run.data.tags["mlflow.parentRunId"] == state["mlflow_run_id"]
    assert fork_run.data.tags["rlpipe.forked_at_iteration"] == "1"
    assert [m.step for m in client.get_metric_history(fork_run.info.run_id, "reward/mean")] == [1, 2, 3]
    assert "forked from" in _rlpipe("status", str(child)).stdout

    # a fork from the latest iteration that changes nothing (but the gate) goes on exactly as the parent
    # does, which goes on once its gate is gone; the fork's optimizer state is the parent's
    from rlpipe import loop
    from rlpipe.commands.fork import fork_run as fork
    from rlpipe.store.weights import read_weight_ref

    same = tmp_path / "same"
    spec = fork(str(parent), str(same), 2, "same", {"loop.stop_when": None})
    assert json.loads((same / "state.json").read_text())["forked_from"]["optimizer_state"] == "parent's"
    (tmp_path / "work").mkdir()
    loop.run_iteration(spec, str(same), read_weight_ref(str(same), 2), 3, tmp_path / "work", spec.cache_root)
    result = _rlpipe("run", str(tmp_path / "spec.yaml"), "--run-dir", str(parent), "--iterations", "3",
                     "--set", "loop.stop_when=null")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(parent, 3)
    assert _sha(same, 3) == _sha(parent, 3)
    a, b = (load_file(root / "weights" / "v000003" / "model.safetensors") for root in (same, parent))
    assert all((a[k] == b[k]).all() for k in a)


def test_a_fork_starts_its_own_local_services():
    """The parent's spec.json records the loopback addresses of the trainer and samplers its `rlpipe run`
    started; a fork drops them (its run starts its own), and keeps a cluster's."""
    from rlpipe.commands.fork import local_services

    local = {"trainer": {"endpoint": "http://127.0.0.1:40525"}, "samplers": {"endpoints": ["http://127.0.0.1:8001"]}}
    assert local_services(local) == {"trainer.endpoint": None, "samplers.endpoints": []}
    cluster = {"trainer": {"endpoint": "http://rlpipe-trainer:8000"}, "samplers": {"endpoints": []}}
    assert local_services(cluster) == {}
