"""The resident trainer's device memory given back between its turns on a shared device (sharing.enabled;
rlpipe.training.offload): the session's offload and onload round trip is exact, and the server's /offload and
/onload routes serve it, each request logged with its interval. On this CPU the device is the host: nothing moves,
and the bytes are those that would move on a GPU."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from rlpipe import loop
from rlpipe.http_json import request_json
from rlpipe.spec import spec_to_dict
from rlpipe.store.weights import read_weight_ref


def _batch(initialized_run, tmp_path: Path, iteration: int) -> str:
    spec, run_root, cache = initialized_run
    paths = [str(tmp_path / f"{name}-{iteration}.parquet") for name in ("rollouts", "scored", "batch")]
    loop.generate(spec, run_root, read_weight_ref(run_root, 0), iteration, paths[0], cache)
    loop.score(spec, paths[0], paths[1])
    loop.advantages(spec, paths[1], paths[2])
    return paths[2]


def _state(session) -> dict[str, torch.Tensor]:
    """The session's weights and optimizer state, copied."""
    trainer = session.trainer
    state = {f"param {name}": p.detach().clone() for name, p in trainer.policy.named_parameters()}
    for i, per_parameter in enumerate(trainer.optimizer.state.values()):
        state |= {f"optimizer {i} {key}": value.clone() for key, value in per_parameter.items()}
    return state


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_offload_and_onload_give_back_the_same_state_and_the_same_next_update(initialized_run, tmp_path: Path):
    """After an update: offload (weights too) drops the gradients and counts every byte the device would give
    back; onload brings the same tensors back, and the next update equals the one without the round trip."""
    from rlpipe.training.session import TrainerSession

    spec, run_root, cache = initialized_run
    batch = _batch(initialized_run, tmp_path, 1)
    v0 = read_weight_ref(run_root, 0)
    moved, kept = TrainerSession.open(spec, run_root, v0, cache), TrainerSession.open(spec, run_root, v0, cache)
    for session in (moved, kept):
        session.train(batch, 1)
    trainer = moved.trainer
    before = _state(moved)
    gradients = _nbytes(p.grad for p in trainer.policy.parameters() if p.grad is not None)
    optimizer = _nbytes(v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    weights = _nbytes([*trainer.policy.parameters(), *trainer.policy.buffers()])
    reference = trainer.reference
    if reference is not None and reference is not trainer.policy:
        weights += _nbytes([*reference.parameters(), *reference.buffers()])
    assert gradients > 0 and optimizer > 0

    offloaded = moved.offload(weights=True)
    assert offloaded["bytes"] == gradients + optimizer + weights
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert moved.offload(weights=True) == {"seconds": 0.0, "bytes": 0.0}  # offloaded already
    onloaded = moved.onload()
    assert onloaded["bytes"] == optimizer + weights  # the gradients were dropped, not moved
    assert moved.onload() == {"seconds": 0.0, "bytes": 0.0}
    after = _state(moved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.policy.device.type == "cpu"

    for session in (moved, kept):
        session.train(batch, 2)
    next_moved, next_kept = _state(moved), _state(kept)
    assert all(torch.equal(next_moved[k], next_kept[k]) for k in next_kept), "the round trip changed the update"


def test_the_trainer_server_offloads_onloads_and_logs_each_request(initialized_run, tmp_path: Path):
    """/offload and /onload over HTTP: nothing to do without a session; with one, its state given back and
    taken again, and an /update sent to an offloaded session onloads it first. Each POST is one line of
    <run root>/logs/trainer-requests.jsonl with its interval, one after another."""
    from rlpipe.services.trainer.server import Resident, make_server

    spec, run_root, cache = initialized_run
    batch = _batch(initialized_run, tmp_path, 1)
    resident = Resident()
    server = make_server("127.0.0.1", 0, resident)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    base = {"spec": spec_to_dict(spec), "run_root": run_root, "cache_root": cache}

    def post(route: str, iteration: int, **payload) -> dict:
        status, body = request_json("POST", f"{url}{route}", base | {"iteration": iteration} | payload)
        assert status == 200, body
        return body

    try:
        assert post("/offload", 1, weights=True) == {"seconds": 0.0, "bytes": 0.0}  # no session yet
        staged = post("/update", 1, weights=read_weight_ref(run_root, 0), batch_uri=batch)["staged"]
        assert post("/offload", 1, weights=True)["bytes"] > 0
        assert resident.session is not None and resident.session.offloaded is not None
        assert post("/onload", 1)["bytes"] > 0 and resident.session.offloaded is None
        assert post("/offload", 1, weights=False)["bytes"] > 0
        metrics = post("/update", 2, weights=staged, batch_uri=batch)["metrics"]
        assert metrics["trainer/reloaded"] == 0.0 and resident.session.offloaded is None  # onloaded, not reopened
    finally:
        server.shutdown()
    lines = [json.loads(line) for line in (Path(run_root) / "logs" / "trainer-requests.jsonl").read_text().splitlines()]
    assert [line["path"] for line in lines] == ["/offload", "/update", "/offload", "/onload", "/offload", "/update"]
    assert [line["iteration"] for line in lines] == [1, 1, 1, 1, 1, 2] and {line["status"] for line in lines} == {200}
    assert all(a["began"] <= a["ended"] <= b["began"] for a, b in zip(lines, lines[1:]))
