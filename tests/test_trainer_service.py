"""The resident trainer (rlpipe.services.trainer_service) against the per-step update it replaces."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rlpipe.algorithms import compute_advantages
from rlpipe.engines import generate_rollouts
from rlpipe.evaluation import evaluate_policy
from rlpipe.rewards import score_rollouts
from rlpipe.rollouts import read_table
from rlpipe.services.trainer_client import TrainerError, request_evaluate, request_generate, request_update
from rlpipe.services.trainer_service import LocalTrainer, make_server
from rlpipe.spec import RunSpec, parse_spec, spec_to_dict
from rlpipe.store.commit import sync_weights
from rlpipe.store.weights import read_ref
from rlpipe.training.trainer import update_policy


def _in_step(spec: RunSpec) -> RunSpec:
    return parse_spec(spec_to_dict(spec) | {"trainer": spec_to_dict(spec)["trainer"] | {"resident": False}})


def _batch(spec: RunSpec, run_root: str, cache: str, weights: dict, iteration: int, out: Path) -> str:
    """Rollouts sampled in this process (not by the trainer under test), scored, advantages."""
    generate_rollouts(_in_step(spec), run_root, weights, iteration, str(out / f"r{iteration}.parquet"), cache)
    score_rollouts(spec, str(out / f"r{iteration}.parquet"), str(out / f"s{iteration}.parquet"))
    compute_advantages(spec, str(out / f"s{iteration}.parquet"), str(out / f"b{iteration}.parquet"))
    return str(out / f"b{iteration}.parquet")


def _tensors(ref: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ref["uri"]) / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture
def served(initialized_run):
    """(resident spec, run root, cache) with a trainer served from this process."""
    spec, run_root, cache = initialized_run
    server = make_server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    data = spec_to_dict(spec)
    data["trainer"] |= {"resident": True, "endpoint": f"http://127.0.0.1:{server.server_address[1]}"}
    yield parse_spec(data), run_root, cache
    server.shutdown()


def test_resident_trainer_equals_the_per_step_update(served, tmp_path: Path):
    spec, run_root, cache = served
    v0 = read_ref(run_root, 0)
    batch1 = _batch(spec, run_root, cache, v0, 1, tmp_path)
    resident1, metrics1 = request_update(spec, run_root, v0, batch1, 1, cache)
    per_step1, _ = update_policy(spec, run_root, v0, batch1, 1, cache)
    assert metrics1["trainer/reloaded"] == 1.0 and resident1["version"] == 1
    assert _same_weights(resident1, per_step1)

    # a rerun of iteration 1 (its sync failed) asks for v0 again: the trainer reloads it from storage
    again, metrics = request_update(spec, run_root, v0, batch1, 1, cache)
    assert metrics["trainer/reloaded"] == 1.0 and _same_weights(again, per_step1)

    # iteration 2 from the published v1 reuses the held policy and optimizer, and still equals a
    # cold update that reads both back from the weight store
    v1, _ = sync_weights(spec, run_root, again, 1, {})
    batch2 = _batch(spec, run_root, cache, v1, 2, tmp_path)
    resident2, metrics2 = request_update(spec, run_root, v1, batch2, 2, cache)
    per_step2, _ = update_policy(spec, run_root, v1, batch2, 2, cache)
    assert metrics2["trainer/reloaded"] == 0.0 and metrics2["overhead/update_load_s"] < 0.05
    assert _same_weights(resident2, per_step2)
    assert not list(Path(run_root, "trainer").glob("*.parquet"))  # the copied batches are removed


def test_nan_loss_on_the_resident_trainer_says_what_to_change(served, tmp_path: Path):
    spec, run_root, cache = served
    v0 = read_ref(run_root, 0)
    batch = read_table(_batch(spec, run_root, cache, v0, 1, tmp_path))
    poisoned = batch.set_column(batch.schema.get_field_index("advantage"), "advantage", [[float("nan")] * len(batch)])
    pq.write_table(poisoned, tmp_path / "nan.parquet")
    with pytest.raises(TrainerError, match="NonFiniteLossError: iteration 1: .* nothing was published. Lower"):
        request_update(spec, run_root, v0, str(tmp_path / "nan.parquet"), 1, cache)
    # what it held may have taken some of the batch's steps: the next update reloads v0
    _, metrics = request_update(spec, run_root, v0, str(tmp_path / "b1.parquet"), 1, cache)
    assert metrics["trainer/reloaded"] == 1.0


def test_unreachable_trainer_names_what_to_check(initialized_run, tmp_path: Path, monkeypatch):
    spec, run_root, cache = initialized_run
    data = spec_to_dict(spec)
    data["trainer"] |= {"resident": True, "endpoint": "http://127.0.0.1:9"}
    monkeypatch.setattr("rlpipe.services.trainer_client.READY_TIMEOUT_S", 1.0)
    (tmp_path / "none.parquet").write_bytes(b"")
    with pytest.raises(TrainerError, match="not ready after 1 s.*trainer.endpoint.*trainer.resident: false"):
        request_update(parse_spec(data), run_root, read_ref(run_root, 0), str(tmp_path / "none.parquet"), 1, cache)


def test_local_trainer_is_restarted_after_a_crash_and_reloads_from_storage(initialized_run, tmp_path: Path):
    spec, run_root, cache = initialized_run
    trainer = LocalTrainer(run_root)
    trainer.start()
    try:
        data = spec_to_dict(spec)
        data["trainer"] |= {"resident": True, "endpoint": trainer.urls[0]}
        resident = parse_spec(data)
        v0 = read_ref(run_root, 0)
        batch = _batch(spec, run_root, cache, v0, 1, tmp_path)
        first, _ = request_update(resident, run_root, v0, batch, 1, cache)
        trainer.kill(0, signal.SIGKILL)
        again, metrics = request_update(resident, run_root, v0, batch, 1, cache)  # waits for the restart
        assert trainer.replicas[0].restarts == 1 and metrics["trainer/reloaded"] == 1.0
        assert _same_weights(first, again)
        pids = list(trainer.started_pids)
    finally:
        trainer.stop()
    time.sleep(0.2)
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "trainer processes outlived stop()"


def test_update_client_does_not_import_torch():
    code = "import sys, rlpipe.services.trainer_client\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resident_trainer_samples_what_the_torch_step_samples(served, tmp_path: Path):
    """rollout.engine torch + trainer.resident: the trainer samples and evaluates with the policy it
    holds; rollouts and accuracy equal the steps' own, and the next update reuses that policy."""
    spec, run_root, cache = served
    v0 = read_ref(run_root, 0)
    metrics = request_generate(spec, run_root, v0, 1, str(tmp_path / "resident.parquet"), cache)
    assert metrics["trainer/reloaded"] == 1.0 and metrics["rollout/completion_tokens_mean"] > 0
    generate_rollouts(_in_step(spec), run_root, v0, 1, str(tmp_path / "step.parquet"), cache)
    resident, step = read_table(tmp_path / "resident.parquet"), read_table(tmp_path / "step.parquet")
    assert resident.to_pylist() == step.to_pylist()
    assert not list(Path(run_root, "trainer").glob("*.parquet"))

    # evaluate: the trainer's greedy accuracy of the policy it holds equals the evaluate step's own
    resident_eval = request_evaluate(spec, run_root, v0, 0, cache)
    assert resident_eval["trainer/reloaded"] == 0.0
    assert evaluate_policy(_in_step(spec), run_root, v0, 0, cache)["eval/accuracy_greedy"] == pytest.approx(
        resident_eval["eval/accuracy_greedy"]
    )

    score_rollouts(spec, str(tmp_path / "resident.parquet"), str(tmp_path / "s.parquet"))
    compute_advantages(spec, str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet"))
    _, update_metrics = request_update(spec, run_root, v0, str(tmp_path / "b.parquet"), 1, cache)
    assert update_metrics["trainer/reloaded"] == 0.0
