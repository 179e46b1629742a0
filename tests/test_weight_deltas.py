"""Versions stored as deltas (storage.weights_dtype: bfloat16, storage.full_every): bit-exact round
trips over a chain, a whole version every full_every, a tampered delta refused with its file named,
pruning that keeps every version a kept delta is rebuilt from, and runs whose versions and metrics
equal those of the same run with every version whole."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.store import pruning
from rlpipe.store import weights as ws
from rlpipe.store.weight_deltas import DELTA_FILE, apply_delta, content_sha256, encode_delta

from .conftest import initialize


def _chain(steps: int = 5, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """bf16 weights moved as an AdamW step at lr 1e-6 would move their fp32 masters, step by step."""
    generator = torch.Generator().manual_seed(seed)
    masters = {"a.weight": torch.randn(64, 32, generator=generator) * 0.02, "b.bias": torch.ones(32)}
    versions = []
    for _ in range(steps):
        versions.append({k: v.to(torch.bfloat16) for k, v in masters.items()})
        masters = {k: v - 1e-6 * torch.sign(torch.randn(v.shape, generator=generator)) for k, v in masters.items()}
    return versions


def test_a_chain_of_deltas_rebuilds_every_version_bit_for_bit():
    versions = _chain()
    held = {k: v.clone() for k, v in versions[0].items()}
    for parent, child in zip(versions, versions[1:]):
        delta = encode_delta(parent, child)
        assert delta["a.weight#value"].numel() < 0.1 * child["a.weight"].numel()  # sparse in bf16
        apply_delta(held, delta)
        assert content_sha256(held) == content_sha256(child)
        assert all(torch.equal(held[k].view(torch.int16), child[k].view(torch.int16)) for k in child)
    grown = versions[-1] | {"c.new": torch.zeros(3, dtype=torch.bfloat16)}  # a tensor the parent lacks
    apply_delta(held, encode_delta(versions[-1], grown))
    assert content_sha256(held) == content_sha256(grown)


def test_a_dense_delta_is_a_bitmap_and_rebuilds_bit_for_bit():
    """Steps large against bf16's resolution change a large share of the weights: the changed positions
    go as a bitmap (an eighth of a byte per element), not as 4-byte indices; both apply exactly."""
    from rlpipe.store.weight_deltas import apply_delta_to_model

    generator = torch.Generator().manual_seed(2)
    masters = torch.randn(256, 64, generator=generator) * 0.02
    parent = {"w": masters.to(torch.bfloat16), "b": torch.ones(64, dtype=torch.bfloat16)}
    stepped = masters - 3e-4 * torch.sign(torch.randn(masters.shape, generator=generator))
    child = {"w": stepped.to(torch.bfloat16), "b": parent["b"].clone()}
    child["b"][3] = 2.0  # one change of 64: indices
    delta = encode_delta(parent, child)
    changed = int((parent["w"].view(torch.int16) != child["w"].view(torch.int16)).sum())
    assert changed > child["w"].numel() / 32 and "w#mask" in delta and "w#index" not in delta
    assert delta["w#mask"].numel() == child["w"].numel() // 8 and delta["w#value"].numel() == changed
    assert delta["b#index"].tolist() == [3]
    rebuilt = apply_delta({k: v.clone() for k, v in parent.items()}, delta)
    assert content_sha256(rebuilt) == content_sha256(child)
    model = torch.nn.Module()
    model.w, model.b = torch.nn.Parameter(parent["w"].float()), torch.nn.Parameter(parent["b"].float())
    assert apply_delta_to_model(model, delta) == changed + 1
    assert torch.equal(model.w.to(torch.bfloat16).view(torch.int16), child["w"].view(torch.int16))


def test_sealing_in_parallel_threads_gives_the_delta_and_hash_of_one_tensor_at_a_time():
    from rlpipe.training.sealing import delta_against
    from rlpipe.training.state import StoredVersion

    parent, child = _chain(steps=2, seed=1)
    policy = torch.nn.Module()
    policy.a, policy.b = torch.nn.Module(), torch.nn.Module()
    policy.a.weight = torch.nn.Parameter(child["a.weight"].float())  # bf16 values: cast back bit-exactly
    policy.b.bias = torch.nn.Parameter(child["b.bias"].float())
    expected = encode_delta(parent, child)
    threads = torch.get_num_threads()
    try:
        for each in (1, 2):
            torch.set_num_threads(each)
            served = StoredVersion({k: v.clone() for k, v in parent.items()}, version=1, chain=0)
            delta, sha, kept = delta_against(served, policy, policy.state_dict(), torch.bfloat16, keep=True)
            assert sha == content_sha256(child) == content_sha256(child, threads=1)
            assert delta.keys() == expected.keys() and all(torch.equal(delta[k], expected[k]) for k in delta)
            assert all(kept[k] is served.tensors[k] for k in kept)  # written over the parent's, no copy
            assert all(torch.equal(kept[k].view(torch.int16), child[k].view(torch.int16)) for k in child)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path: Path, full_every: int, iterations: int = 4, **storage):
    from rlpipe import loop
    from rlpipe.spec import parse_spec

    from .conftest import tiny_spec_dict

    data = tiny_spec_dict(
        tmp_path,
        trainer={"lr": 1e-5, "mini_batches": 2, "warmup_steps": 0},
        loop={"iterations": iterations, "iterations_per_run": iterations, "eval_every": 2},
        storage={"root": str(tmp_path / "runs"), "weights_dtype": "bfloat16", "full_every": full_every, **storage},
    )
    spec = parse_spec(data)
    run_root = str(tmp_path / "runs" / "tiny")
    cache = str(tmp_path / "cache")
    weights = initialize(spec, run_root, cache)
    evals = []
    for iteration in range(1, iterations + 1):
        work = Path(run_root, "work", str(iteration))
        work.mkdir(parents=True)
        weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, work, cache)
        evals.append({k: v for k, v in metrics.items() if k.startswith(("eval/", "policy/loss", "reward/"))})
    return spec, run_root, cache, evals


def _manifests(run_root: str) -> dict[int, dict]:
    return {
        int(p.name[1:]): json.loads((p / ws.MANIFEST).read_text()) for p in sorted(Path(run_root, "weights").glob("v*"))
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 iterations with every version whole (full_every 1) and with deltas (full_every 3)."""
    whole = _run(tmp_path_factory.mktemp("whole"), full_every=1, keep_versions=10)
    deltas = _run(tmp_path_factory.mktemp("deltas"), full_every=3, keep_versions=10)
    return whole, deltas


def test_deltas_store_the_same_versions_as_whole_ones(runs):
    (_, whole_root, _, whole_evals), (_, delta_root, cache, delta_evals) = runs
    whole, deltas = _manifests(whole_root), _manifests(delta_root)
    assert [deltas[v].get("delta_of") for v in range(1, 5)] == [None, 1, 2, None]  # v1 whole: v0 is fp32
    assert [deltas[v]["chain"] for v in range(1, 5)] == [0, 1, 2, 0]  # whole again after full_every - 1 deltas
    for version in range(1, 5):
        assert deltas[version]["weights_sha256"] == whole[version]["weights_sha256"], version
    assert delta_evals == whole_evals and "eval/accuracy_greedy" in delta_evals[1]
    delta_bytes = Path(delta_root, "weights", "v000002", DELTA_FILE).stat().st_size
    whole_bytes = Path(whole_root, "weights", "v000002", "model.safetensors").stat().st_size
    assert delta_bytes < 0.5 * whole_bytes
    rebuilt = ws.local_path(ws.read_weight_ref(delta_root, 4), cache)
    expected = load_file(Path(whole_root, "weights", "v000004", "model.safetensors"))
    assert content_sha256(load_file(Path(rebuilt, "model.safetensors"))) == content_sha256(expected)


def test_a_tampered_delta_is_refused_with_its_file_named(runs, tmp_path: Path):
    import shutil

    _, (_, delta_root, _, _) = runs
    copy = tmp_path / "copy"
    shutil.copytree(delta_root, copy)
    with open(copy / "weights" / "v000002" / DELTA_FILE, "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\x7f\x7f")
    with pytest.raises(ws.CorruptWeightsError, match=DELTA_FILE):
        ws.local_path(ws.read_weight_ref(str(copy), 2), tmp_path / "cache")


def test_pruning_keeps_the_versions_a_kept_delta_is_rebuilt_from(runs, tmp_path: Path):
    import shutil

    _, (_, delta_root, _, _) = runs
    copy = str(tmp_path / "copy")
    shutil.copytree(delta_root, copy)
    removed = pruning.prune(copy, keep=1, current=4)
    assert removed == [1, 2, 3]  # v4 is whole
    shutil.rmtree(copy)
    shutil.copytree(delta_root, copy)
    assert pruning.prune(copy, keep=1, current=3) == []  # v3 is a delta of v2, a delta of v1: all stay
    for path in Path(copy, "weights").glob("v00000[4]"):
        shutil.rmtree(path)
    assert ws.local_path(ws.read_weight_ref(copy, 3), tmp_path / "cache")


def test_a_sampler_holding_the_parent_applies_the_delta_in_place(runs):
    from rlpipe.models.loading import load_weights
    from rlpipe.store.weight_deltas import apply_delta_to_model

    _, (_, delta_root, cache, _) = runs
    held, _ = load_weights(ws.read_weight_ref(delta_root, 2), cache, threads=1)  # fp32, upcast from bf16 v2
    apply_delta_to_model(held, load_file(Path(delta_root, "weights", "v000003", DELTA_FILE)))
    fresh, _ = load_weights(ws.read_weight_ref(delta_root, 3), cache, threads=1)
    for (name, a), (_, b) in zip(held.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tensors_written_from_their_own_memory_read_back_as_safetensors(tmp_path: Path):
    from rlpipe.store.weight_deltas import write_safetensors

    tensors = {
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "a": torch.arange(7, dtype=torch.int32),
        "c": torch.randn(2, 2, 2),
        "empty": torch.zeros(0),
        "flag": torch.tensor([True, False]),
    }
    with open(tmp_path / "t.safetensors", "wb") as f:
        write_safetensors(tensors, f, {"format": "pt"})
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_a_fork_from_a_delta_version_gets_the_versions_it_is_rebuilt_from(runs, tmp_path: Path):
    from rlpipe.commands.fork import fork_run

    _, (_, delta_root, _, _) = runs
    child = str(tmp_path / "child")
    fork_run(delta_root, child, 3, "child", {})
    assert sorted(p.name for p in Path(child, "weights").glob("v0*")) == ["v000000", "v000001", "v000002", "v000003"]
    rebuilt = ws.local_path(ws.read_weight_ref(child, 3), tmp_path / "cache")
    parent = json.loads(Path(delta_root, "weights", "v000003", ws.MANIFEST).read_text())
    assert content_sha256(load_file(Path(rebuilt, "model.safetensors"))) == parent["weights_sha256"]
    # the store kept only v4's optimizer state and masters: the fork starts AdamW anew from v3's weights
    assert json.loads(Path(child, "state.json").read_text())["forked_from"]["optimizer_state"] == "fresh"
