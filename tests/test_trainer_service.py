"""The resident trainer (rlpipe.services.trainer.server) against the per-step update it replaces."""

from __future__ import annotations

import os
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
from rlpipe.evaluation.accuracy import evaluate_policy
from rlpipe.loop import sync_weights
from rlpipe.rewards import score_rollouts
from rlpipe.rollouts import read_table
from rlpipe.services.trainer.client import TrainerError, request_evaluate, request_generate, request_update
from rlpipe.services.trainer.server import LocalTrainer, make_server
from rlpipe.spec import RunSpec, parse_spec, spec_to_dict
from rlpipe.store.run_root import read_eval_samples
from rlpipe.store.weights import read_weight_ref
from rlpipe.training.session import update_policy


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
    v0 = read_weight_ref(run_root, 0)
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
    v0 = read_weight_ref(run_root, 0)
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
    monkeypatch.setattr("rlpipe.services.trainer.client.READY_TIMEOUT_S", 1.0)
    (tmp_path / "none.parquet").write_bytes(b"")
    with pytest.raises(TrainerError, match="not ready after 1 s.*trainer.endpoint.*trainer.resident: false"):
        request_update(
            parse_spec(data), run_root, read_weight_ref(run_root, 0), str(tmp_path / "none.parquet"), 1, cache
        )


def test_local_trainer_is_restarted_after_a_crash_and_reloads_from_storage(initialized_run, tmp_path: Path):
    spec, run_root, cache = initialized_run
    trainer = LocalTrainer(run_root)
    trainer.start()
    try:
        data = spec_to_dict(spec)
        data["trainer"] |= {"resident": True, "endpoint": trainer.urls[0]}
        resident = parse_spec(data)
        v0 = read_weight_ref(run_root, 0)
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
    code = "import sys, rlpipe.services.trainer.client\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resident_trainer_samples_what_the_torch_step_samples(served, tmp_path: Path):
    """rollout.engine torch + trainer.resident: the trainer samples and evaluates with the policy it
    holds; rollouts and accuracy equal the steps' own, and the next update reuses that policy."""
    spec, run_root, cache = served
    v0 = read_weight_ref(run_root, 0)
    metrics = request_generate(spec, run_root, v0, 1, str(tmp_path / "resident.parquet"), cache)
    assert metrics["trainer/reloaded"] == 1.0 and metrics["rollout/completion_tokens_mean"] > 0
    generate_rollouts(_in_step(spec), run_root, v0, 1, str(tmp_path / "step.parquet"), cache)
    resident, step = read_table(tmp_path / "resident.parquet"), read_table(tmp_path / "step.parquet")
    assert resident.to_pylist() == step.to_pylist()
    assert not list(Path(run_root, "trainer").glob("*.parquet"))

    # evaluate: the trainer's greedy accuracy of the policy it holds equals the evaluate step's own
    resident_eval = request_evaluate(spec, run_root, v0, 0, cache)
    assert resident_eval["trainer/reloaded"] == 0.0
    samples = read_eval_samples(run_root, 0)  # the trainer recorded the held-out rows' completions too
    assert len(samples) == spec.data.eval_size and {"prompt", "completion", "answer", "reward"} <= set(samples[0])
    assert sum(s["reward"] for s in samples) / len(samples) == pytest.approx(resident_eval["eval/accuracy_greedy"])
    assert evaluate_policy(_in_step(spec), run_root, v0, 0, cache)["eval/accuracy_greedy"] == pytest.approx(
        resident_eval["eval/accuracy_greedy"]
    )
    assert read_eval_samples(run_root, 0) == samples  # the step's own greedy completions are the same

    score_rollouts(spec, str(tmp_path / "resident.parquet"), str(tmp_path / "s.parquet"))
    compute_advantages(spec, str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet"))
    _, update_metrics = request_update(spec, run_root, v0, str(tmp_path / "b.parquet"), 1, cache)
    assert update_metrics["trainer/reloaded"] == 0.0


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The process of global rank `rank` among torchrun's children."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among torchrun {torchrun_pid}'s processes {children}")


def test_resident_trainer_in_two_processes_equals_one_process(initialized_run, tmp_path: Path):
    """trainer.gpus: 2 on CPU: the resident trainer under torchrun, 2 gloo processes (FSDP2), samples,
    trains and evaluates as one process does; an input error that every rank meets is answered and
    served on; a rank that dies takes the trainer down, and `rlpipe run`'s supervisor restarts it."""
    spec, run_root, cache = initialized_run
    trainer = LocalTrainer(run_root, gpus=2, device="cpu")
    trainer.start()
    try:
        data = spec_to_dict(spec)
        data["trainer"] |= {"resident": True, "endpoint": trainer.urls[0], "gpus": 2}
        two = parse_spec(data)
        v0 = read_weight_ref(run_root, 0)
        request_generate(two, run_root, v0, 1, str(tmp_path / "two.parquet"), cache)
        generate_rollouts(_in_step(spec), run_root, v0, 1, str(tmp_path / "one.parquet"), cache)
        assert read_table(tmp_path / "two.parquet").to_pylist() == read_table(tmp_path / "one.parquet").to_pylist()
        score_rollouts(spec, str(tmp_path / "two.parquet"), str(tmp_path / "s.parquet"))
        compute_advantages(spec, str(tmp_path / "s.parquet"), str(tmp_path / "b.parquet"))
        # the 5-step warm start scores 0 everywhere, so every advantage is 0: give the update a signal
        batch = read_table(tmp_path / "b.parquet")
        signal_ = [1.0 if i % 3 == 0 else -0.5 for i in range(len(batch))]
        pq.write_table(
            batch.set_column(batch.schema.get_field_index("advantage"), "advantage", [signal_]), tmp_path / "b.parquet"
        )

        resident, two_metrics = request_update(two, run_root, v0, str(tmp_path / "b.parquet"), 1, cache)
        assert two_metrics["trainer/reloaded"] == 0.0  # the policy generate sampled with, sharded
        one, one_metrics = update_policy(spec, run_root, v0, str(tmp_path / "b.parquet"), 1, cache)
        for key in ("policy/loss", "policy/grad_norm", "policy/clip_fraction", "policy/entropy", "kl/mean"):
            assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
        v0_tensors, ones, twos = _tensors(v0), _tensors(one), _tensors(resident)
        assert ones.keys() == twos.keys()
        for name, value in ones.items():
            torch.testing.assert_close(twos[name], value, rtol=1e-5, atol=1e-5, msg=name)
        moved = max(float((ones[n] - v0_tensors[n]).abs().max()) for n in ones)
        assert moved > 1e-4  # the tolerance is well below what the update moved

        v1, _ = sync_weights(spec, run_root, resident, 1, {})
        accuracy = request_evaluate(two, run_root, v1, 1, cache)["eval/accuracy_greedy"]
        assert accuracy == pytest.approx(
            evaluate_policy(_in_step(spec), run_root, v1, 1, cache)["eval/accuracy_greedy"]
        )

        # a batch every rank finds poisoned: both raise at the same check, the trainer answers and serves on
        batch = read_table(tmp_path / "b.parquet")
        nan = batch.set_column(batch.schema.get_field_index("advantage"), "advantage", [[float("nan")] * len(batch)])
        pq.write_table(nan, tmp_path / "nan.parquet")
        with pytest.raises(TrainerError, match="NonFiniteLossError: iteration 2: .* nothing was published"):
            request_update(two, run_root, v1, str(tmp_path / "nan.parquet"), 2, cache)
        assert trainer.replicas[0].restarts == 0

        # rank 1 dies: torchrun stops rank 0 too, the supervisor restarts both, the update reloads v1
        os.kill(_rank_pid(trainer.processes[0].pid, 1), signal.SIGKILL)
        again, metrics = request_update(two, run_root, v1, str(tmp_path / "b.parquet"), 2, cache)
        assert trainer.replicas[0].restarts == 1 and metrics["trainer/reloaded"] == 1.0
        pids = list(trainer.started_pids) + [_rank_pid(trainer.processes[0].pid, r) for r in (0, 1)]
    finally:
        trainer.stop()
    time.sleep(0.5)
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "trainer processes outlived stop()"


FAILING_RANK = """
import sys

import torch.distributed as dist

from rlpipe.services.trainer import server as trainer_service

update = trainer_service.ROUTES["/update"]


def update_or_fail(request, resident):
    if request.get("fail_on_rank") == dist.get_rank():
        raise RuntimeError("injected failure")
    return update(request, resident)


trainer_service.ROUTES["/update"] = update_or_fail
sys.exit(trainer_service.serve(sys.argv[1:]))
"""


def test_a_rank_failing_alone_is_answered_and_the_trainer_exits(initialized_run, tmp_path: Path):
    """Rank 1 fails an update alone while rank 0 waits for it in FSDP's all-gather: rank 0's wait
    times out (--collective-timeout-s), the client gets a 500 naming both ranks' errors, and every
    process exits non-zero (to be restarted: see the test above)."""
    from rlpipe.http_json import is_healthy, request_json
    from rlpipe.services.local_servers import free_port

    spec, run_root, cache = initialized_run
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    serve = ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--collective-timeout-s", "5"]
    with open(tmp_path / "trainer.log", "wb") as log:
        process = subprocess.Popen([*torchrun, str(script), *serve], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while not is_healthy(url):
            assert process.poll() is None and time.time() < deadline, (tmp_path / "trainer.log").read_text()
            time.sleep(0.5)
        v0 = read_weight_ref(run_root, 0)
        batch = _batch(spec, run_root, cache, v0, 1, tmp_path)
        data = spec_to_dict(spec)
        data["trainer"] |= {"gpus": 2}
        payload = {"spec": data, "run_root": run_root, "iteration": 1, "weights": v0, "cache_root": cache}
        status, body = request_json("POST", f"{url}/update", payload | {"batch_uri": batch, "fail_on_rank": 1})
        assert status == 500 and body["error"] == "RuntimeError", body
        assert "rank 1 of 2: RuntimeError: injected failure" in body["message"]
        assert "rank 0 of 2: " in body["message"]  # its all-gather timed out waiting for rank 1
        assert "processes exit and are restarted" in body["message"]
        assert process.wait(timeout=60) != 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_trainer_that_does_not_see_the_run_root_says_mount_it(tmp_path: Path):
    """A trainer container started without the run root's volume (a manifest's mount path that differs from
    the steps'): each request names the path and what to mount, and keeps no session."""
    from rlpipe.services.trainer.server import Resident, answer

    resident = Resident()
    status, body = answer("/update", {"run_root": str(tmp_path / "not-mounted"), "weights": {}}, resident)
    assert status == 422 and body["error"] == "RunRootNotMounted"
    assert str(tmp_path / "not-mounted") in body["message"] and "at the same path as the steps" in body["message"]
    assert resident.key is None and resident.session is None
