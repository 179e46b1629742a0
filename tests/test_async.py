"""Asynchronous RL (loop.max_staleness): the importance-weight math, the rollout buffer's rules, and
`rlpipe run` with s=1 killed at several moments, then resumed: every prompt used exactly once."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import yaml

from rlpipe.algorithms.policy_gradient import behaviour_weights, clipped_policy_loss
from rlpipe.spec import parse_spec

from .conftest import RLPIPE, tiny_spec_dict
from .test_local_runner import _check_consistent


def _log(*p: float) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in p]])


def test_truncated_importance_weights_per_token():
    # pi_prox / pi_behaviour = 0.5/0.1 = 5 (cut to C = 2), 0.9/0.9 = 1, 0.2/0.4 = 0.5; the 4th is padding
    proximal, behaviour = _log(0.5, 0.9, 0.2, 0.3), _log(0.1, 0.9, 0.4, 0.3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = behaviour_weights(proximal, behaviour, mask, "truncate", 2.0, "token")
    assert torch.allclose(weights, torch.tensor([[2.0, 1.0, 0.5, 0.0]]))
    assert stats["is_weight_mean"] == pytest.approx((5 + 1 + 0.5) / 3)
    assert stats["is_weight_max"] == pytest.approx(5.0)
    assert stats["truncated_fraction"] == pytest.approx(1 / 3)


def test_masked_importance_weights_per_token():
    # 5 and 1/3 fall outside [1/2, 2]: those tokens weigh 0; 1 and 0.5 (on the bound) are kept as they are
    proximal, behaviour = _log(0.5, 0.9, 0.2, 0.1), _log(0.1, 0.9, 0.4, 0.3)
    weights, stats = behaviour_weights(proximal, behaviour, torch.ones(1, 4), "mask", 2.0, "token")
    assert torch.allclose(weights, torch.tensor([[0.0, 1.0, 0.5, 0.0]]))
    assert stats["masked_fraction"] == pytest.approx(0.5)


def test_sequence_and_geometric_importance_weights():
    # two sequences: token ratios (1.5, 1.2) -> product 1.8, geometric mean sqrt(1.8); (0.5, 0.5 | pad) -> 0.25, 0.5
    proximal = torch.tensor([[math.log(0.6), math.log(0.6), 0.0], [math.log(0.2), math.log(0.1), 0.0]])
    behaviour = torch.tensor([[math.log(0.4), math.log(0.5), 0.0], [math.log(0.4), math.log(0.2), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    weights, stats = behaviour_weights(proximal, behaviour, mask, "truncate", 1.5, "sequence")
    assert torch.allclose(weights, torch.tensor([[1.5, 1.5, 0.0], [0.25, 0.25, 0.0]]))  # 1.8 cut to C = 1.5
    assert stats["truncated_fraction"] == pytest.approx(0.5) and stats["is_weight_max"] == pytest.approx(1.8)
    weights, _ = behaviour_weights(proximal, behaviour, mask, "mask", 1.5, "geometric")
    assert torch.allclose(weights, torch.tensor([[math.sqrt(1.8), math.sqrt(1.8), 0.0], [0.0, 0.0, 0.0]]))


def test_weighted_advantages_are_the_decoupled_loss():
    """-w min(r A, clip(r) A) = -min(r wA, clip(r) wA) for w >= 0: weighting the advantages is the loss."""
    logprobs = torch.tensor([[-0.2, -1.0, -0.7]], requires_grad=True)
    proximal, behaviour = torch.tensor([[-0.5, -1.1, -0.3]]), torch.tensor([[-1.5, -1.0, -0.9]])
    mask, advantages = torch.ones(1, 3), torch.tensor([-1.3])
    weights, _ = behaviour_weights(proximal, behaviour, mask, "truncate", 2.0)
    loss = clipped_policy_loss(logprobs, proximal, advantages.unsqueeze(-1) * weights, mask, 0.2).loss
    ratio = torch.exp(logprobs - proximal)
    w = torch.exp(proximal - behaviour).clamp(max=2.0)
    by_hand = (-w * torch.minimum(ratio * -1.3, ratio.clamp(0.8, 1.2) * -1.3)).mean()
    assert torch.allclose(loss, by_hand)


def test_pair_algorithms_refuse_an_off_policy_correction(tmp_path: Path):
    from rlpipe.algorithms import resolve_options

    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "online_dpo", "off_policy_correction": "mask"}))
    with pytest.raises(ValueError, match="off_policy_correction: online_dpo trains on preference pairs"):
        resolve_options(spec)


def _first_update(initialized_run, tmp_path: Path, **sections: dict) -> tuple[str, dict[str, float]]:
    """Iteration 1's generate, score, advantages and update at v0 with `sections` changed in the spec:
    (the rollouts' path, the update's metrics)."""
    from rlpipe import loop
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized_run
    data = spec_to_dict(spec)
    for section, values in sections.items():
        data[section] |= values
    spec = parse_spec(data)
    v0 = read_weight_ref(run_root, 0)
    rollouts, scored, batch = (str(tmp_path / f"{n}.parquet") for n in ("rollouts", "scored", "batch"))
    loop.generate(spec, run_root, v0, 1, rollouts, cache)
    loop.score(spec, rollouts, scored)
    loop.advantages(spec, scored, batch)
    return rollouts, loop.update(spec, run_root, v0, batch, 1, cache)[1]


def test_truncation_trains_on_stale_rollouts_and_reports_its_weights(initialized_run, tmp_path: Path):
    """The update with off_policy_correction: pi_prox from one no-grad pass; at the weights that sampled
    the batch every weight is 1 (up to the sampler's float rounding)."""
    _, metrics = _first_update(initialized_run, tmp_path, algorithm={"off_policy_correction": "truncate"})
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["off_policy/truncated_fraction"] == 0.0


def test_mismatch_metrics_by_hand():
    """d = log pi_trainer - log pi_sampler: k3 = mean(e^d - 1 - d), max and p99 of |d|."""
    from rlpipe.training.off_policy import mismatch_metrics

    d = [0.1, -0.2, 0.0] + [0.01] * 97 + [-0.5]  # 101 tokens in two micro-batches
    metrics = mismatch_metrics([torch.tensor(d[:50]), torch.tensor(d[50:])], torch.device("cpu"))
    by_hand = sum(math.exp(x) - 1 - x for x in d) / len(d)
    assert metrics["mismatch/k3_kl"] == pytest.approx(by_hand, rel=1e-5)
    assert metrics["mismatch/abs_diff_max"] == pytest.approx(0.5)
    assert metrics["mismatch/abs_diff_p99"] == pytest.approx(
        torch.quantile(torch.tensor(d).abs().double(), 0.99).item()
    )
    assert metrics["mismatch/tokens"] == 101
    assert mismatch_metrics([], torch.device("cpu")) == {}


@pytest.mark.parametrize("correction", ["none", "truncate"])
def test_the_update_measures_the_training_inference_mismatch_at_s0(initialized_run, tmp_path: Path, correction):
    """Every update reports how far the sampler's log-probs are from the trainer's of the same weights, over
    the tokens of its first optimizer step (all of them with one mini-batch); TIS works at s=0 as well.
    The torch engine samples with the trainer's own model: a KV-cache decode against a full forward."""
    from rlpipe.rollouts import read_table

    sections = {"algorithm": {"off_policy_correction": correction}, "trainer": {"mini_batches": 1}}
    rollouts, metrics = _first_update(initialized_run, tmp_path, **sections)
    tokens = sum(len(ids) for ids in read_table(rollouts).column("completion_token_ids").to_pylist())
    assert metrics["mismatch/tokens"] == tokens
    assert 0.0 <= metrics["mismatch/k3_kl"] < 1e-8
    assert 0.0 < metrics["mismatch/abs_diff_max"] < 1e-3
    assert metrics["mismatch/abs_diff_p99"] <= metrics["mismatch/abs_diff_max"]


def test_a_partial_rollout_goes_on_under_the_new_version_token_by_token(tmp_path: Path):
    """A version published after the third decode step: every row's later tokens are sampled by it, their
    log-probs exactly its own (the sequence so far prefilled again with the new weights), each token's
    version recorded; the correction weights pi_prox / pi_behaviour per token are 1 where the version
    the trainer holds sampled the token, not where the old one did."""
    from rlpipe.algorithms.policy_gradient import behaviour_weights
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
    from rlpipe.services.producer.buffer import partial_metrics
    from rlpipe.training.off_policy import sampled_by

    tokenizer = build_char_tokenizer()
    tiny = parse_spec(tiny_spec_dict(tmp_path)).model.tiny
    old, new = (build_tiny_model(tiny, tokenizer, seed).eval() for seed in (0, 1))

    class Published:  # v1 is committed while the batch is on its third token
        model, version, asked = old, 0, 0

        def newer(self):
            self.asked += 1
            if self.asked == 3:
                self.model, self.version = new, 1
                return new, 1
            return None

    prompts = [tokenizer(text)["input_ids"] for text in ("12+34=", "5+6=")]
    generator = torch.Generator().manual_seed(0)
    out = hf_decode(old, prompts, 8, -1, tokenizer.pad_token_id, generator=generator, samples=3, refresh=Published())
    assert out.token_versions == [[0, 0, 0, 1, 1, 1, 1, 1]] * 6  # eos -1: every row runs 8 tokens

    for row, (tokens, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        prompt = prompts[row // 3]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            recomputed = {
                version: torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1).gather(
                    -1, ids[0, len(prompt) :, None]
                )[:, 0]
                for version, model in ((0, old), (1, new))
            }
        by_version = torch.tensor([recomputed[v][k] for k, v in enumerate(out.token_versions[row])])
        assert torch.allclose(by_version, torch.tensor(logprobs), atol=1e-4)
        # the trainer holds v1: TIS weighs v1's tokens by 1, v0's by pi_v1 / pi_v0
        weights, _ = behaviour_weights(recomputed[1][None], torch.tensor([logprobs]), torch.ones(1, 8), "truncate", 1e9)
        assert torch.allclose(weights[0, 3:], torch.ones(5), atol=1e-3)
        assert not torch.allclose(weights[0, :3], torch.ones(3), atol=1e-3)

    rows = [{"token_versions": v, "weights_version": v[0]} for v in out.token_versions]
    assert not sampled_by(rows, 1).any() and sampled_by([{"token_versions": [1, 1], "weights_version": 1}], 1).all()
    table = pa.table({"token_versions": out.token_versions + [[1, 1]]})
    assert partial_metrics(table) == {
        "async/partial_rows_fraction": 6 / 7,
        "async/newer_version_tokens_fraction": 30 / 50,
    }


def test_the_engine_hands_over_each_group_at_the_decode_step_it_finishes(tmp_path: Path):
    """The rollout producer's torch engine publishes a group the step its last completion ends (those that
    reach max_new_tokens at the end): each group once, in the order they finish, with the completions the
    batch returns; the decoding is the same as without the callback."""
    from rlpipe.engines.torch_engine import hf_decode
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(parse_spec(tiny_spec_dict(tmp_path)).model.tiny, tokenizer, 0).eval()
    prompts = [tokenizer(text)["input_ids"] for text in ("12+34=", "5+6=", "7+8=", "91+2=", "3+3=", "40+1=")]
    calls: list = []

    def run(**kwargs):
        generator = torch.Generator().manual_seed(0)
        return hf_decode(
            model, prompts, 30, tokenizer.eos_token_id, tokenizer.pad_token_id, generator=generator, samples=3, **kwargs
        )

    out = run(on_groups=lambda groups, completions: calls.append((groups, completions)))
    assert sorted(g for groups, _ in calls for g in groups) == list(range(6))
    finished_at = []
    for groups, completions in calls:
        rows = [g * 3 + k for g in groups for k in range(3)]
        assert completions.token_ids == [out.token_ids[r] for r in rows]
        assert completions.logprobs == [out.logprobs[r] for r in rows]
        assert completions.finish_reasons == [out.finish_reasons[r] for r in rows]
        steps = {max(len(out.token_ids[g * 3 + k]) for k in range(3)) for g in groups}
        assert len(steps) == 1  # handed over together: the same step ended them
        finished_at += steps
    assert len(calls) > 1 and finished_at == sorted(finished_at)
    again = run()
    assert (again.token_ids, again.logprobs) == (out.token_ids, out.logprobs)


def test_partial_rollouts_refuse_what_they_cannot_continue(tmp_path: Path):
    with pytest.raises(ValueError, match="loop.partial_rollouts continues a completion"):
        parse_spec(tiny_spec_dict(tmp_path, loop={"partial_rollouts": True}))  # s = 0
    with pytest.raises(ValueError, match="loop.partial_rollouts continues a completion"):
        parse_spec(tiny_spec_dict(tmp_path, loop={"partial_rollouts": True, "max_staleness": 1}, **MULTI_TURN))
    assert parse_spec(
        tiny_spec_dict(tmp_path, loop={"partial_rollouts": True, "max_staleness": 1})
    ).loop.partial_rollouts


# --- the buffer -------------------------------------------------------------------------------


def _async_spec(initialized_run, s: int, **sections):
    from rlpipe.spec import spec_to_dict

    spec, run_root, cache = initialized_run
    data = spec_to_dict(spec)
    data["loop"] |= {"max_staleness": s, "iterations": 6}
    data["storage"]["keep_versions"] = 10
    return parse_spec(data | sections), run_root, cache


def _produce_until(spec, run_root, cache, done) -> dict:
    from rlpipe.services.producer.server import produce

    stop, status = threading.Event(), {}
    worker = threading.Thread(target=produce, args=(spec, run_root, cache, stop, status))
    worker.start()
    deadline = time.time() + 120
    while not done() and time.time() < deadline:
        time.sleep(0.05)
    stop.set()
    worker.join()
    assert done(), "the producer did not get there in 120 s"
    return status


def _homes(run_root: str) -> collections.Counter[int]:
    """How many finished groups of each home iteration the buffer holds."""
    from rlpipe.services.producer.buffer import buffered

    return collections.Counter(group[0] for _, group, _, _ in buffered(run_root))


def _all_of(run_root: str, *homes: int):
    return lambda: all(_homes(run_root)[home] == 8 for home in homes)  # 8 prompts an iteration


def test_the_producer_runs_at_most_s_iterations_ahead_and_picks_up_each_commit(initialized_run, tmp_path: Path):
    from rlpipe import loop
    from rlpipe.services.producer.buffer import buffered, group_bytes, iteration_uri, read_group
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = _async_spec(initialized_run, 2)
    _produce_until(spec, run_root, cache, _all_of(run_root, 1, 2, 3))  # iterations 1..1+s, with v0
    time.sleep(0.3)
    assert set(_homes(run_root)) == {1, 2, 3}  # 4 needs v1 committed
    assert {version for _, _, version, _ in buffered(run_root)} == {0}

    published, _ = loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, tmp_path, cache)
    assert not Path(iteration_uri(run_root, 1)).exists()  # retired with the commit
    used = Path(iteration_uri(run_root, 1, consumed=True))
    taken = json.loads((used / "taken.json").read_text())
    state = json.loads((Path(run_root) / "state.json").read_text())
    assert state["rollouts_taken"] == taken and len(taken["groups"]) == 8
    assert sorted(p.name for p in used.glob("*.arrow")) == sorted(g["file"] for g in taken["groups"])
    consumed = sorted([g["home"], g["position"]] for g in taken["groups"])
    expected = {"through": 1, "beyond": []} if all(g[0] == 1 for g in consumed) else {"through": 0, "beyond": consumed}
    assert state["groups_consumed"] == expected
    _produce_until(spec, run_root, cache, lambda: _homes(run_root)[4] == 8)
    fourth = [name for _, group, _, name in buffered(run_root) if group[0] == 4]
    versions = {read_group(group_bytes(run_root, n))["weights_version"][0].as_py() for n in fourth}
    assert versions == {1}
    assert published["version"] == 1


def test_the_first_finished_groups_are_taken_and_a_straggler_waits_for_a_later_iteration(
    initialized_run, tmp_path: Path
):
    """Iteration N takes the groups that finished first, whatever their home: a group of iteration 1
    that finished last is taken by iteration 2, and the consumed set tracks it exactly."""
    from rlpipe import loop
    from rlpipe.services.producer.buffer import buffered, group_file, groups_uri, iteration_uri

    spec, run_root, cache = _async_spec(initialized_run, 1)
    _produce_until(spec, run_root, cache, _all_of(run_root, 1, 2))
    listed = buffered(run_root)
    straggler = next(entry for entry in listed if entry[1] == (1, 7))
    late = group_file(listed[-1][0] + 1, straggler[1], straggler[2])
    (Path(groups_uri(run_root)) / straggler[3]).rename(Path(groups_uri(run_root)) / late)  # it finished last
    first_eight = [entry[1] for entry in buffered(run_root)[:8]]
    assert (1, 7) not in first_eight

    from rlpipe.store.weights import read_weight_ref

    (tmp_path / "1").mkdir()
    v1, metrics = loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, tmp_path / "1", cache)
    taken = json.loads((Path(iteration_uri(run_root, 1, consumed=True)) / "taken.json").read_text())
    assert [(g["home"], g["position"]) for g in taken["groups"]] == first_eight
    state = json.loads((Path(run_root) / "state.json").read_text())
    assert state["groups_consumed"] == {"through": 0, "beyond": sorted(map(list, first_eight))}
    assert metrics["async/straggler_groups"] == 0.0  # no group of an earlier iteration yet

    (tmp_path / "2").mkdir()
    _, metrics = loop.run_iteration(spec, run_root, v1, 2, tmp_path / "2", cache)
    taken = json.loads((Path(iteration_uri(run_root, 2, consumed=True)) / "taken.json").read_text())
    assert taken["groups"][0]["file"] != late and (1, 7) in [(g["home"], g["position"]) for g in taken["groups"]]
    assert metrics["async/straggler_groups"] == 1.0  # the straggler, sampled by v0, trained by iteration 2
    state = json.loads((Path(run_root) / "state.json").read_text())
    assert state["groups_consumed"] == {"through": 2, "beyond": []}


def test_a_group_older_than_s_is_dropped_counted_and_sampled_again(initialized_run, tmp_path: Path):
    """Rollouts made for s=2 are too stale once the run resumes with s=1: never used silently."""
    from rlpipe import loop
    from rlpipe.services.producer.buffer import buffered, take
    from rlpipe.store.weights import read_weight_ref

    spec2, run_root, cache = _async_spec(initialized_run, 2)
    _produce_until(spec2, run_root, cache, _all_of(run_root, 1, 2, 3))
    weights = read_weight_ref(run_root, 0)
    for iteration in (1, 2):
        (tmp_path / str(iteration)).mkdir()
        weights, _ = loop.run_iteration(spec2, run_root, weights, iteration, tmp_path / str(iteration), cache)
    spec1, _, _ = _async_spec(initialized_run, 1)
    stale = {name for _, _, _, name in buffered(run_root)}
    assert len(stale) == 8
    result: dict = {}
    taking = threading.Thread(
        target=lambda: result.update(take(spec1, run_root, weights, 3, str(tmp_path / "r3.parquet")))
    )
    taking.start()  # drops the v0 groups (iteration 3 with s=1 takes v1 or v2), then waits for new ones
    _produce_until(spec1, run_root, cache, lambda: not taking.is_alive())
    taking.join()
    assert result["async/stale_rows_dropped"] == 32  # 8 prompts x 4 samples, all from v0
    assert result["async/staleness_max"] == 0.0  # sampled again with v2, committed meanwhile
    assert not stale & {name for _, _, _, name in buffered(run_root)}


def test_a_producer_killed_mid_write_leaves_only_a_temporary_file(initialized_run):
    """A group is written to <file>.tmp-<pid> and renamed: a kill mid-write leaves the temporary file,
    which the next producer removes before it samples that group again."""
    from rlpipe.services.producer.buffer import group_file, groups_uri, read_group

    spec, run_root, cache = _async_spec(initialized_run, 1)
    partial = Path(groups_uri(run_root)) / (group_file(0, (1, 2), 0) + ".tmp-4242")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"PAR1 half a parquet file")
    _produce_until(spec, run_root, cache, _all_of(run_root, 1, 2))
    assert not partial.exists()
    rows = {read_group(p.read_bytes()).num_rows for p in Path(groups_uri(run_root)).glob("*.arrow")}
    assert rows == {4}


def test_a_producer_that_read_the_state_before_a_commit_never_samples_a_consumed_group(
    initialized_run, tmp_path: Path, monkeypatch
):
    """The producer reads state.json, then lists the buffer. If iteration N commits (and retires its
    groups to consumed/) in between, the listing finds neither them in the buffer nor them consumed in
    the state it read: a producer trusting it would sample them again, and a later iteration train on
    those prompts twice."""
    from rlpipe import loop
    from rlpipe.services.producer.buffer import buffered, iteration_uri
    from rlpipe.store import run_root as store
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = _async_spec(initialized_run, 1)
    _produce_until(spec, run_root, cache, _all_of(run_root, 1, 2))
    (tmp_path / "1").mkdir()
    v1, _ = loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, tmp_path / "1", cache)
    taken_by_1 = {(g["home"], g["position"]) for g in json.loads(
        (Path(iteration_uri(run_root, 1, consumed=True)) / "taken.json").read_text())["groups"]}  # fmt: skip

    before_the_commit = dict(store.read_state(run_root), iteration=0, weights_version=0)
    before_the_commit.pop("groups_consumed")
    reads = iter([before_the_commit])  # the producer's first read: the state just before iteration 1 committed
    monkeypatch.setattr(
        "rlpipe.services.producer.server.read_state", lambda root: next(reads, None) or store.read_state(root)
    )
    _produce_until(spec, run_root, cache, lambda: sum(_homes(run_root).values()) == 16)  # 8 left + home 3
    assert not taken_by_1 & {group for _, group, _, _ in buffered(run_root)}  # none sampled again

    (tmp_path / "2").mkdir()
    loop.run_iteration(spec, run_root, v1, 2, tmp_path / "2", cache)
    seen: set = set()
    for iteration in (1, 2):
        used = Path(iteration_uri(run_root, iteration, consumed=True))
        taken = json.loads((used / "taken.json").read_text())
        assert sorted(p.name for p in used.glob("*.arrow")) == sorted(g["file"] for g in taken["groups"])
        groups = {(g["home"], g["position"]) for g in taken["groups"]}
        assert not groups & seen
        seen |= groups


def test_retire_moves_the_taken_groups_with_their_record_and_is_idempotent(tmp_path: Path):
    """retire(N) moves the group files iteration N's taken.json names, then the record, to consumed/;
    what a kill between the two leaves is finished by the next call; the other groups stay."""
    from rlpipe.services.producer.buffer import group_file, groups_uri, iteration_uri, retire

    run_root = str(tmp_path)
    groups = Path(groups_uri(run_root))
    groups.mkdir(parents=True)
    taken_file, other = group_file(0, (1, 0), 0), group_file(1, (1, 1), 0)
    moved_file = group_file(2, (1, 2), 0)
    for name in (taken_file, other):
        (groups / name).write_bytes(name.encode())
    taking = Path(iteration_uri(run_root, 1))
    taking.mkdir()
    (taking / moved_file).write_bytes(b"moved before a kill")
    record = {"iteration": 1, "groups": [{"file": taken_file}, {"file": moved_file}]}
    (taking / "taken.json").write_text(json.dumps(record))
    empty = Path(iteration_uri(run_root, 2))
    empty.mkdir()  # no taken.json: nothing was taken

    retire(run_root, 2, keep=10)
    retire(run_root, 2, keep=10)
    used = Path(iteration_uri(run_root, 1, consumed=True))
    assert sorted(p.name for p in used.iterdir()) == sorted([taken_file, moved_file, "taken.json"])
    assert [p.name for p in groups.iterdir()] == [other]
    assert not taking.exists() and not empty.exists()


def test_generate_says_what_to_do_when_no_producer_runs(initialized_run, tmp_path: Path, monkeypatch):
    from rlpipe.services.producer.buffer import take
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = _async_spec(initialized_run, 1)
    monkeypatch.setattr("rlpipe.services.producer.buffer.HEARTBEAT_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="no rollout producer has written a heartbeat.*loop.max_staleness: 0"):
        take(spec, run_root, read_weight_ref(run_root, 0), 1, str(tmp_path / "r.parquet"))


def test_the_resident_trainer_computes_pi_prox_ahead_and_trains_the_same_weights(initialized_run, tmp_path: Path):
    """After update N the resident trainer computes v(N)'s log-probs of iteration N+1's buffered rollouts
    (while the light steps run); update N+1 then skips its no-grad pass and trains what the per-step update
    trains (to float rounding: the passes batch the rows differently)."""
    import shutil

    from safetensors.torch import load_file

    from rlpipe import loop
    from rlpipe.services.trainer.server import make_server
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref

    varied = {"functions": [{"type": "tests.toy_plugins:length", "target": 2}]}  # advantages != 0: it learns
    spec, run_root, cache = _async_spec(initialized_run, 1, reward=varied)
    _produce_until(spec, run_root, cache, _all_of(run_root, 1, 2))
    per_step_root = str(tmp_path / "per-step")
    shutil.copytree(run_root, per_step_root)  # the same v0 and the same buffered rollouts

    server = make_server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    data = spec_to_dict(spec)
    data["trainer"] |= {"resident": True, "endpoint": f"http://127.0.0.1:{server.server_address[1]}"}
    resident = parse_spec(data)
    weights = {"resident": read_weight_ref(run_root, 0), "per_step": read_weight_ref(per_step_root, 0)}
    fractions = {"resident": [], "per_step": []}
    try:
        for iteration in (1, 2):
            for name, root, run_spec in (("resident", run_root, resident), ("per_step", per_step_root, spec)):
                work = tmp_path / f"{name}-{iteration}"
                work.mkdir()
                weights[name], metrics = loop.run_iteration(run_spec, root, weights[name], iteration, work, cache)
                fractions[name].append(metrics["off_policy/proximal_prefetched_fraction"])
    finally:
        server.shutdown()
    assert fractions["per_step"] == [0.0, 0.0] and fractions["resident"][0] == 0.0
    assert fractions["resident"][1] > 0.0  # all of it, unless the update arrived first
    a, b = (load_file(Path(weights[n]["uri"]) / "model.safetensors") for n in ("resident", "per_step"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    v0 = load_file(Path(read_weight_ref(run_root, 0)["uri"]) / "model.safetensors")
    assert any(not torch.equal(a[k], v0[k]) for k in a)  # it trained


# --- rlpipe run with s=1, killed and resumed ----------------------------------------------------


def _wait_for(predicate, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_service_killed_before_its_supervisor_saw_it_serve_is_restarted_not_failed(tmp_path: Path):
    """The supervisor learns that a server served by asking /health every 0.5 s; one killed (SIGKILL)
    between two asks, as the test below kills the producer, is restarted, not taken for a server that
    cannot start (STARTUP_ATTEMPTS: those exit with an error of their own)."""
    from rlpipe.services.local_servers import STARTUP_ATTEMPTS, LocalServers

    never_answers = "import time; time.sleep(600)"
    servers = LocalServers(
        "producer",
        str(tmp_path / "run"),
        1,
        lambda port: ([sys.executable, "-c", never_answers, str(port)], {}),
        marker=never_answers,
        wait_for_weights=False,
    )
    servers.start()
    try:
        for kill in range(STARTUP_ATTEMPTS + 1):
            _wait_for(lambda: len(servers.started_pids) == kill + 1, "a start", timeout=30)
            os.kill(servers.started_pids[-1], signal.SIGKILL)
        _wait_for(lambda: servers.replicas[0].restarts == STARTUP_ATTEMPTS + 1, "the restart", timeout=30)
        assert servers.replicas[0].state != "failed" and not servers.replicas[0].served
    finally:
        servers.stop()


MULTI_TURN = {  # the calculator task: trajectories of tool calls and answers (rlpipe.environments)
    "data": {"generator": "multiplication"},
    "model": {"warm_start": {"max_steps": 5, "batch_size": 8, "validation_size": 8, "transcript": "demonstration"}},
    "rollout": {"environment": {"type": "calculator", "max_turns": 3, "max_tokens": 20}, "max_new_tokens": 6},
}


@pytest.mark.slow  # 70 s each: CI's slow step
@pytest.mark.parametrize("form", ["single-turn", "multi-turn", "partial-rollouts"])
def test_async_run_killed_anywhere_uses_every_prompt_exactly_once(tmp_path: Path, form: str):
    import pyarrow.parquet as pq

    from rlpipe.data.order import prompt_indices
    from rlpipe.services.producer.buffer import iteration_uri, read_group

    iterations, s = 16, 1
    multi_turn, partial = form == "multi-turn", form == "partial-rollouts"
    data = tiny_spec_dict(
        tmp_path,
        loop={"iterations": iterations, "iterations_per_run": 4, "eval_every": 4, "max_staleness": s}
        | ({"partial_rollouts": True} if partial else {}),
        trainer={"resident": True},
        storage={"root": str(tmp_path / "runs"), "keep_versions": iterations},  # every consumed iteration kept
        **(MULTI_TURN if multi_turn else {}),
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "kfp-local.log"
    command = [*RLPIPE, "run", str(spec_path), "--run-dir", str(run_dir)]

    def tasks() -> list[str]:
        text = log.read_text(errors="replace") if log.exists() else ""
        return re.findall(r"Executing task \x1b\[96m'([\w-]+)'", text)

    def committed() -> int:
        state = run_dir / "state.json"
        return json.loads(state.read_text()).get("iteration", 0) if state.exists() else 0

    def producer_pid() -> int:
        fleet = run_dir / "producers" / "fleet.json"
        return (json.loads(fleet.read_text())["replicas"][0]["pid"] or 0) if fleet.exists() else 0

    def heartbeat() -> dict:
        try:
            return json.loads((run_dir / "rollout_buffer" / "producer.json").read_text())
        except (OSError, ValueError):
            return {}

    # 1. the driver (and with it the step it runs, the trainer and the producer) at the second update
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for(lambda: "update-2" in tasks(), "the second update")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert committed() < iterations

    # 2. the producer twice, each time once it is up (mid-batch, or waiting for a commit), and 3. the
    # resident trainer mid-update; the rerun goes on through all of it
    killed = {producer_pid()}
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(2):
        # fleet.json says pid None (0 here) between the driver's start and the spawn: wait for a live
        # producer that has written its heartbeat
        def beating() -> bool:
            pid = producer_pid()
            return pid not in killed | {0} and heartbeat().get("pid") == pid

        _wait_for(beating, "a new producer's heartbeat")
        pid = producer_pid()
        time.sleep(0.3)  # mid-way through a batch, or waiting for a commit
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    done = len(tasks())
    _wait_for(lambda: any(t.startswith("update") for t in tasks()[done:]), "an update")
    trainer = json.loads((run_dir / "trainers" / "fleet.json").read_text())["replicas"][0]["pid"]
    os.kill(trainer, signal.SIGKILL)  # the update step waits for its restart and asks again
    output, _ = driver.communicate(timeout=600)
    if driver.returncode != 0:  # a kill may also fail the pipeline run: the next run goes on from the state
        rerun = subprocess.run(command, capture_output=True, text=True)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert committed() == iterations, output.decode(errors="replace")

    _check_consistent(run_dir, iterations)  # weights versions move forward, one MLflow point per iteration
    train_rows = pq.read_metadata(run_dir / "data" / "train.parquet").num_rows
    used_groups: collections.Counter[tuple[int, int]] = collections.Counter()
    environment_tokens, partial_rows, stragglers = 0, 0, 0
    for iteration in range(1, iterations + 1):
        used = Path(iteration_uri(str(run_dir), iteration, consumed=True))
        taken = json.loads((used / "taken.json").read_text())
        assert len(taken["groups"]) == 8
        for group in taken["groups"]:
            path = used / group["file"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == group["sha256"]  # the rows it trained on
            table = read_group(path.read_bytes())
            assert min(table.column("weights_version").to_pylist()) == group["version"]
            assert set(table.column("prompt_id").to_pylist()) == {
                prompt_indices(train_rows, 8, group["home"], 0)[group["position"]]
            }
            if partial:  # each token's version: from the row's first on, never past the iteration's v(N-1)
                for versions, first in zip(table.column("token_versions").to_pylist(), table["weights_version"]):
                    assert versions == sorted(versions) and versions[0] == first.as_py() <= versions[-1]
                    assert versions[-1] <= iteration - 1
                    partial_rows += versions[-1] != versions[0]
            if multi_turn:  # whole trajectories, their environment tokens masked
                assert min(table.column("turns").to_pylist()) >= 1
                masks, tokens = table.column("loss_mask").to_pylist(), table.column("completion_token_ids").to_pylist()
                assert [len(m) for m in masks] == [len(t) for t in tokens]
                environment_tokens += sum(m.count(0) for m in masks)
            assert iteration - 1 - s <= group["version"] <= iteration - 1
            used_groups[(group["home"], group["position"])] += 1
            stragglers += group["home"] < iteration
    state = json.loads((run_dir / "state.json").read_text())
    assert state["rollouts_taken"]["iteration"] == iterations
    assert state["groups_consumed"] == {"through": iterations, "beyond": []}
    assert sorted(used_groups) == [(h, p) for h in range(1, iterations + 1) for p in range(8)]  # none skipped
    assert set(used_groups.values()) == {1}  # none used twice
    assert environment_tokens > 0 or not multi_turn  # the calculator answered some calls
    print(f"{form}: {partial_rows} rows went on under a newer version, {stragglers} groups trained after their home")


# --- the DAG-offset form ------------------------------------------------------------------------


def _upstream(tasks: dict, name: str) -> set[str]:
    """Every task `name` waits for in its DAG, transitively."""
    seen, todo = set(), list(tasks[name].get("dependentTasks", []))
    while todo:
        task = todo.pop()
        if task not in seen:
            seen.add(task)
            todo += tasks[task].get("dependentTasks", [])
    return seen


def test_the_dag_offset_form_compiles_generate_beside_update(tmp_path: Path):
    """loop.overlap dag: the compiled YAML parses strictly into PipelineSpec, and in a run of K iterations
    generate k+1 and the update of iteration k are siblings, neither waiting for the other."""
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    from rlpipe.pipelines.compile import compile_pipeline

    loop = {"max_staleness": 1, "overlap": "dag", "iterations": 6, "iterations_per_run": 3}
    spec = parse_spec(tiny_spec_dict(tmp_path, loop=loop, storage={"root": "gs://bucket/runs"}))
    document = next(yaml.safe_load_all(compile_pipeline(spec, tmp_path / "dag.yaml").read_text()))
    json_format.ParseDict(document, pipeline_spec_pb2.PipelineSpec())  # unknown fields raise
    dags = [c["dag"]["tasks"] for c in document["components"].values() if "dag" in c]
    offset = next(tasks for tasks in dags if "generate-3" in tasks)
    updates = sorted(name for name in offset if name.startswith("rlpipe-offset-update"))
    assert len(updates) == 3
    for k, update in enumerate(updates, start=1):
        generate = f"generate-{k + 1}"
        if generate in offset:  # generate k+1 with v(k-1), update k on v(k-1): siblings
            assert update not in _upstream(offset, generate) and generate not in _upstream(offset, update)
        if k >= 2:  # update k waits for update k-1 (its weights) and its own scored rollouts
            assert {updates[k - 2], f"score-{k}" if k > 1 else "score"} <= _upstream(offset, update)
    inner = next(c["dag"]["tasks"] for name, c in document["components"].items() if name == "comp-rlpipe-offset-update")
    assert {"advantages", "update", "sync-weights"} <= set(inner) and "generate" not in inner


def test_the_dag_offset_form_runs_on_kfp_local(tmp_path: Path):
    """`rlpipe run` with loop.overlap dag on KFP's local runner: a first pipeline run of K = 2 iterations
    in the offset form (iteration 2 sampled by v0, one version stale, trained with TIS), then the loop's
    last iteration in sequence; no producer, no rollout buffer."""
    from rlpipe.store.run_root import list_metrics

    loop = {"max_staleness": 1, "overlap": "dag", "iterations": 3, "iterations_per_run": 2, "eval_every": 2}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, loop=loop)))
    run_dir = tmp_path / "run"
    cli = [*RLPIPE, "run", str(spec), "--run-dir", str(run_dir)]
    result = subprocess.run(cli, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rollout producer" not in result.stdout and not (run_dir / "rollout_buffer").exists()
    iterations = list_metrics(str(run_dir), "iter")
    assert sorted(iterations) == [0, 1, 2, 3]
    assert [iterations[i]["async/staleness_mean"] for i in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert all("off_policy/is_weight_mean" in iterations[i] for i in (1, 2, 3))
    # the mismatch is measured on rows the trainer's weights sampled: none in iteration 2 (v0's rows, v1 trains)
    assert [("mismatch/tokens" in iterations[i]) for i in (1, 2, 3)] == [True, False, True]
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == 3
    assert sorted(list_metrics(str(run_dir), "eval")) == [0, 2, 3]


def test_the_dag_offset_form_refuses_what_it_cannot_run(tmp_path: Path):
    def spec(**loop_and_more):
        sections = {"loop": {"overlap": "dag", **loop_and_more.pop("loop", {})}} | loop_and_more
        return parse_spec(tiny_spec_dict(tmp_path, **sections))

    with pytest.raises(ValueError, match="loop.overlap dag offsets iterations by loop.max_staleness"):
        spec()
    with pytest.raises(ValueError, match="use loop.overlap: producer with rollout.engine sampler"):
        spec(loop={"max_staleness": 1}, rollout={"engine": "sampler"})
    with pytest.raises(ValueError, match="storage.keep_versions must be at least max_staleness \\+ 1 = 3"):
        spec(loop={"max_staleness": 2}, storage={"keep_versions": 2, "root": str(tmp_path)})
    assert spec(loop={"max_staleness": 1}, rollout={"engine": "vllm"}).loop.overlap == "dag"
