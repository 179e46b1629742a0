"""DPO, offline and online: the loss on hand-computed values and the direction of its gradient, the
preference set built from the task (chosen correct, rejected wrong, prompts without both dropped),
online DPO's pairs ranked by reward, pairs kept together in micro-batches, the DPO pipeline's steps,
a whole DPO run on KFP's local runner, and its compiled YAML."""

import copy
import dataclasses
import json
import math
import random
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from rlpipe.algorithms import PolicyInputs, compute_advantages, get_algorithm, resolve_options
from rlpipe.algorithms.dpo import PreferenceLoss, paired_rows, preference_roles
from rlpipe.dpo_loop import pairs_from_samples
from rlpipe.spec import SpecError, parse_spec
from rlpipe.training.batching import micro_batches
from rlpipe.training.trainer import train_on_batch

from .conftest import REPO, RLPIPE, compile_example, tiny_spec_dict
from .test_precision_and_memory import _make, _params

# two pairs, rows (chosen, rejected) x 2, two completion tokens each (the rejected of pair 1 has one)
LOGP = torch.tensor([[-1.0, -2.0], [-3.0, 0.0], [-1.0, -1.0], [-0.5, -0.5]])
REF = torch.tensor([[-1.5, -2.5], [-2.0, 0.0], [-0.75, -0.75], [-0.75, -0.75]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
ROLES = torch.tensor([1.0, -1.0, 1.0, -1.0])
# h = sum (logp - ref): pair 1: h_w = 1.0, h_l = -1.0; pair 2: h_w = -0.5, h_l = 0.5


def _options(tmp_path: Path, **algorithm):
    return resolve_options(parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo"} | algorithm)))


def dpo_loss(logprobs, old_logprobs, roles, mask, ref_logprobs, options):
    """(loss, statistics) of the DPO loss `options` configure, the roles one per row ([B])."""
    inputs = PolicyInputs(logprobs, old_logprobs, roles.unsqueeze(-1).expand_as(logprobs), mask, ref_logprobs)
    terms = PreferenceLoss.from_options(options)(inputs)
    return terms.loss, dict(terms.extra) | {"kl": terms.kl, "ratio": terms.ratio}


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def test_dpo_loss_by_hand(tmp_path: Path):
    options = _options(tmp_path)
    assert (options.beta, options.label_smoothing, options.dpo_loss, options.rpo_alpha) == (0.1, 0.0, "sigmoid", 0.0)
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = dpo_loss(logp, LOGP, ROLES, MASK, REF, options)
    # -log sigmoid(0.1 * 2) and -log sigmoid(0.1 * -1), averaged over the pairs
    assert loss.item() == pytest.approx((_softplus(-0.2) + _softplus(0.1)) / 2, abs=1e-6)
    assert stats["preference_accuracy"].item() == pytest.approx(0.5)
    assert stats["reward_margin"].item() == pytest.approx((0.2 - 0.1) / 2)
    assert stats["chosen_reward"].item() == pytest.approx(0.1 * (1.0 - 0.5) / 2)
    loss.backward()
    # descending the loss raises the chosen tokens' log-probs and lowers the rejected ones', each by
    # beta sigmoid(-z) / pairs; padding gets none
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert logp.grad[0].tolist() == pytest.approx([-0.1 * sig(-0.2) / 2] * 2)
    assert logp.grad[1].tolist() == pytest.approx([0.1 * sig(-0.2) / 2, 0.0])
    assert logp.grad[2].tolist() == pytest.approx([-0.1 * sig(0.1) / 2] * 2)
    assert (logp.grad[3] > 0).all()


def test_ipo_label_smoothing_and_rpo_by_hand(tmp_path: Path):
    ipo = _options(tmp_path, dpo_loss="ipo", beta=0.5)
    loss, _ = dpo_loss(LOGP, LOGP, ROLES, MASK, REF, ipo)
    assert loss.item() == pytest.approx(((2.0 - 1.0) ** 2 + (-1.0 - 1.0) ** 2) / 2)  # (h_w - h_l - 1/(2 beta))^2
    smoothed = _options(tmp_path, label_smoothing=0.2)
    loss, _ = dpo_loss(LOGP, LOGP, ROLES, MASK, REF, smoothed)
    expected = [0.8 * _softplus(-z) + 0.2 * _softplus(z) for z in (0.2, -0.1)]
    assert loss.item() == pytest.approx(sum(expected) / 2, abs=1e-6)
    rpo = _options(tmp_path, rpo_alpha=0.5)
    loss, stats = dpo_loss(LOGP, LOGP, ROLES, MASK, REF, rpo)
    nll = (1.5 + 1.0) / 2  # the chosen rows' NLL per token: 3/2 and 2/2
    assert stats["chosen_nll"].item() == pytest.approx(nll)
    assert loss.item() == pytest.approx((_softplus(-0.2) + _softplus(0.1)) / 2 + 0.5 * nll, abs=1e-6)


def test_a_micro_batch_must_hold_whole_pairs(tmp_path: Path):
    options = _options(tmp_path)
    with pytest.raises(ValueError, match="whole pairs"):
        dpo_loss(LOGP[1:], LOGP[1:], ROLES[1:], MASK[1:], REF[1:], options)
    with pytest.raises(ValueError, match="reference"):
        dpo_loss(LOGP, LOGP, ROLES, MASK, None, options)


def test_online_pairs_are_ranked_by_reward():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.5, 0.2])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    roles = preference_roles(rewards, groups)
    # group 0: two correct, two wrong -> two pairs; group 1: all equal -> none; group 2: 0.9 > 0.2 and
    # 0.5 > 0.2 (the tie of 0.2s: the first is the worst)
    assert roles.tolist() == [1, -1, -1, 1, 0, 0, 0, 0, -1, 1, 1, -1]


def test_online_dpo_advantages_step_writes_roles(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "online_dpo"}))
    assert get_algorithm("online_dpo").needs >= {"pairs", "reference"}
    assert resolve_options(spec).rpo_alpha == 1.0  # online DPO keeps the chosen answers' likelihood (README)
    scored = tmp_path / "scored.parquet"
    pq.write_table(pa.table({"group_id": [0, 0, 0, 1, 1, 1], "reward": [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]}), scored)
    metrics = compute_advantages(spec, str(scored), str(tmp_path / "batch.parquet"))
    assert pq.read_table(tmp_path / "batch.parquet").column("advantage").to_pylist() == [-1, 1, 0, 0, 0, 0]
    assert metrics["groups/zero_variance_fraction"] == 0.5
    offline = parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo"}))
    with pytest.raises(ValueError, match="own pipeline"):
        compute_advantages(offline, str(scored), str(tmp_path / "batch.parquet"))


def test_preference_set_from_samples():
    rows = [{"prompt": f"p{i}", "prompt_token_ids": [1, i], "prompt_id": i} for i in range(3)]
    texts = ["7", "8", "7", "9", "1", "1", "1", "1", "5", "4", "5", "6"]  # 4 samples per prompt
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # prompt 1 all right, 2 all wrong
    ids = [[int(t), 2] for t in texts]
    pairs = pairs_from_samples(rows, ids, texts, scores, group=4, per_prompt=1)
    assert [(p["prompt_id"], p["chosen"], p["rejected"]) for p in pairs] == [(0, "7", "8")]  # others dropped
    assert pairs[0]["chosen_token_ids"] == [7, 2] and pairs[0]["prompt_token_ids"] == [1, 0]
    two = pairs_from_samples(rows, ids, texts, scores, group=4, per_prompt=2)
    assert [(p["chosen"], p["rejected"]) for p in two] == [("7", "8"), ("7", "9")]


def _pair_batch(tmp_path: Path, pairs: int = 10) -> str:
    rng = random.Random(0)
    table = []
    for g in range(pairs):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(3, 9))]
        for index, role in enumerate((1.0, -1.0, 0.0)):  # chosen, rejected, unpaired
            completion = [rng.randrange(4, 19) for _ in range(rng.randrange(1, 7))]
            table.append(
                {
                    "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "logprobs": [-rng.uniform(1.5, 4.0) for _ in completion],
                    "advantage": role,
                    "group_id": g,
                    "sample_index": index,
                }
            )
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "pairs.parquet")
    return str(tmp_path / "pairs.parquet")


def test_pairs_stay_together_in_micro_batches(tmp_path: Path):
    rows = pq.read_table(_pair_batch(tmp_path)).to_pylist()
    ordered = paired_rows(rows, seed=3)
    assert len(ordered) == 20  # unpaired rows dropped
    for chosen, rejected in zip(ordered[0::2], ordered[1::2]):
        assert chosen["group_id"] == rejected["group_id"] and chosen["advantage"] > 0 > rejected["advantage"]
    groups = micro_batches(ordered, 40, unit=2)
    assert len(groups) > 1 and sum(len(g) for g in groups) == 20
    for group in groups:
        assert len(group) % 2 == 0
        assert all(c["group_id"] == r["group_id"] and c["advantage"] > 0 for c, r in zip(group[0::2], group[1::2]))


def test_online_dpo_update_in_micro_batches_equals_one_pass(tmp_path: Path):
    """online_dpo trains on the pairs only, each pair in one micro-batch: split into micro-batches
    of a few tokens, the update equals the one-pass update."""
    batch = _pair_batch(tmp_path)
    algorithm = {"name": "online_dpo", "beta": 0.5, "rpo_alpha": 0.0}
    trainers = []
    for budget in (None, 40):
        spec = parse_spec(
            tiny_spec_dict(
                tmp_path, algorithm=algorithm, trainer={"mini_batches": 2, "lr": 0.5, "micro_batch_tokens": budget}
            )
        )
        trainer = _make(spec)
        trainer.reference = copy.deepcopy(trainer.policy).eval().requires_grad_(False)
        before = _params(trainer)
        metrics = train_on_batch(trainer, batch, iteration=1)
        trainers.append((trainer, metrics))
    (one, m_one), (micro, m_micro) = trainers
    assert m_one["policy/pairs"] == 10 and m_micro["policy/micro_batches"] > m_one["policy/micro_batches"]
    assert m_one["policy/preference_accuracy"] == pytest.approx(m_micro["policy/preference_accuracy"])
    # each mini-batch's statistic counts: after the first step the pairs it trained on rank right
    assert m_one["policy/preference_accuracy"] > 0.25
    moved = False
    for name, value in _params(one).items():
        assert torch.allclose(value, _params(micro)[name], atol=1e-5), name
        moved |= not torch.equal(value, before[name])
    assert moved


def test_dpo_settings_are_checked(tmp_path: Path):
    from rlpipe.pipelines.dpo_pipeline import build_pipeline_for

    with pytest.raises(ValueError, match="trainer.resident: false"):
        build_pipeline_for(parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo"}, trainer={"resident": True})))
    from rlpipe.preflight import CheckFailed, check_algorithm

    with pytest.raises(CheckFailed, match="set trainer.gpus: 1"):  # rlpipe check says so before anything runs
        check_algorithm(parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo"}, trainer={"gpus": 2})))
    with pytest.raises(ValueError, match="not an option of algorithm grpo"):
        resolve_options(parse_spec(tiny_spec_dict(tmp_path, algorithm={"beta": 0.2})))
    with pytest.raises(SpecError, match="algorithm.dpo_loss"):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo", "dpo_loss": "hinge"}))
    with pytest.raises(SpecError, match="preferences.pairs_per_prompt"):
        parse_spec(tiny_spec_dict(tmp_path, preferences={"pairs_per_prompt": 0}))


def _dpo_spec(tmp_path: Path, **sections):
    return tiny_spec_dict(
        tmp_path,
        algorithm={"name": "dpo", "beta": 0.5},
        reward={"verifier": {"type": "regex", "pattern": "1", "mode": "search"}},  # the tiny model's "correct"
        preferences={"eval_pairs": 8},
        loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2},
        **sections,
    )


def test_offline_dpo_steps_in_process(tmp_path: Path, initialized_run):
    """preferences -> reference_logprobs -> dpo_update, each a no-op when rerun: pairs from v0's
    samples, the reference's log-probs stored once, the iteration's pairs trained on."""
    from rlpipe import dpo_loop as dpo
    from rlpipe.loop import sync_weights
    from rlpipe.store.weights import read_weight_ref

    base, run_root, cache = initialized_run
    spec = parse_spec(_dpo_spec(tmp_path))
    spec = dataclasses.replace(spec, model=base.model, data=base.data)  # the fixture's v0 and data
    built = dpo.build_preferences(spec, run_root, cache)
    assert built["preferences/train_pairs"] > 0 and dpo.build_preferences(spec, run_root, cache) == {}
    train = pq.read_table(dpo.pairs_uri(run_root, "train")).to_pylist()
    assert all("1" in p["chosen"] and "1" not in p["rejected"] for p in train)  # accepted vs rejected
    assert len({p["prompt_id"] for p in train}) == len(train)  # pairs_per_prompt 1
    reference = dpo.compute_reference_logprobs(spec, run_root, cache)
    assert "dpo/eval_logprob_accuracy_v0" in reference and dpo.compute_reference_logprobs(spec, run_root, cache) == {}
    train = pq.read_table(dpo.pairs_uri(run_root, "train")).to_pylist()
    assert all(len(p["ref_chosen_logprobs"]) == len(p["chosen_token_ids"]) for p in train)
    staged, metrics = dpo.dpo_update(spec, run_root, read_weight_ref(run_root, 0), 1, cache)
    assert staged["version"] == 1 and metrics["policy/pairs"] == min(len(train), spec.rollout.prompts_per_iteration)
    assert metrics["dpo/train_preference_accuracy"] > 0.5  # v1 ranks the pairs it trained on by the implicit reward
    assert metrics["preferences/train_pairs"] == len(train)
    sync_weights(spec, run_root, staged, 1, metrics)


@pytest.mark.slow
def test_whole_dpo_run_on_the_kfp_local_runner(tmp_path: Path):
    """prepare -> warm_start -> publish -> preferences -> reference_logprobs -> 2 x (dpo_update ->
    sync_weights) -> evaluate -> track, every step its own process (~40 s on a quiet 2-core machine)."""
    from rlpipe.pipelines.local_runner.driver import run_locally

    spec = parse_spec(_dpo_spec(tmp_path))
    run_root = tmp_path / "run"
    state = run_locally(spec, str(run_root))
    assert state["iteration"] == 2 and state["weights_version"] == 2
    metrics = yaml.safe_load((run_root / "metrics" / "iter_000002.json").read_text())
    assert 0 <= metrics["dpo/eval_preference_accuracy"] <= 1 and metrics["preferences/train_pairs"] > 0
    assert (run_root / "metrics" / "eval_000002.json").exists() and "time/iteration_wall_s" in metrics


def test_compiled_dpo_yaml_parses_strictly(tmp_path: Path):
    out = tmp_path / "dpo.yaml"
    compile_example("addition-dpo.yaml", "-o", str(out), "--run-root", "gs://bucket/runs/addition-dpo", check=True)
    docs = list(yaml.safe_load_all(out.read_text()))
    spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())  # unknown fields raise
    assert spec.pipeline_info.name == "rlpipe-dpo"
    executors = set(spec.deployment_spec["executors"].keys())
    for step in ("preferences", "reference-logprobs", "dpo-update", "sync-weights", "evaluate", "track"):
        assert f"exec-{step}" in executors
    assert not {"exec-generate", "exec-score", "exec-advantages", "exec-update"} & executors
    assert len([name for name in spec.components if name.startswith("comp-rlpipe-dpo-iteration")]) == 5
    update = spec.components["comp-dpo-update"]
    assert not list(update.input_definitions.artifacts)  # weights and pairs stay in the run root
    embedded = json.loads(spec.root.input_definitions.parameters["spec"].default_value.string_value)
    assert embedded["algorithm"]["name"] == "dpo"
    argo = subprocess.run(
        [*RLPIPE, "compile", str(REPO / "examples" / "addition-dpo.yaml"),
         "-o", str(tmp_path / "argo.yaml"), "--target", "argo", "--run-root", "gs://bucket/runs/x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert argo.returncode == 1 and "KFP only" in argo.stderr
