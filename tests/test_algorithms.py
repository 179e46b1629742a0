"""The algorithm family on hand-computed values: KL estimators, loss aggregations, DAPO's
clip-higher, Dr. GRPO, GSPO's sequence ratio, RLOO's leave-one-out baseline, REINFORCE++'s
batch whitening and KL-to-go, the entropy bonus, and per-algorithm options."""

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe.algorithms import ALGORITHMS, PolicyInputs, Scored, get_algorithm, resolve_options
from rlpipe.algorithms.policy_gradient import aggregate, kl_estimate
from rlpipe.spec import SpecError, parse_spec
from rlpipe.training.batching import pack
from rlpipe.training.logprobs import completion_logits, token_logprobs_and_entropy
from rlpipe.training.trainer import train_on_batch

from .conftest import initialize, tiny_spec_dict
from .test_precision_and_memory import _batch, _make, _params

BUILT_IN = ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"]


def _options(tmp_path: Path, **algorithm):
    return resolve_options(parse_spec(tiny_spec_dict(tmp_path, algorithm=algorithm)))


def _terms(options, logprobs, old, advantages, mask, ref=None):
    """The loss terms of `options.name`'s configured loss; `advantages` one per sequence ([B])."""
    loss = get_algorithm(options.name).loss(options)
    return loss(PolicyInputs(logprobs, old, advantages.unsqueeze(-1).expand_as(logprobs), mask, ref))


def _advantages(name: str, options, rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    return get_algorithm(name).advantages(Scored(rewards, group_ids), options).per_sequence


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = log ref - log pi = -ln 2
    ln2 = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(ln2**2 / 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(logp, ref, "k4")


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "sequence_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "sequence_sum", length_norm=4).item() == pytest.approx((6 + 4) / 2 / 4)


def test_dapo_clips_higher_than_grpo(tmp_path: Path):
    logp = torch.log(torch.tensor([[1.25, 0.7]]))  # ratios 1.25 and 0.7 against old log-probs of 0
    old, mask = torch.zeros((1, 2)), torch.tensor([[1.0, 0.0]])
    grpo, dapo = _options(tmp_path, name="grpo"), _options(tmp_path, name="dapo")
    assert (dapo.clip_eps, dapo.clip_eps_high, dapo.loss_aggregation) == (0.2, 0.28, "token_mean")
    up = torch.tensor([1.0])
    assert _terms(grpo, logp, old, up, mask).loss.item() == pytest.approx(-1.2)  # clipped
    assert _terms(dapo, logp, old, up, mask).loss.item() == pytest.approx(-1.25)  # not
    down, second = torch.tensor([-1.0]), torch.tensor([[0.0, 1.0]])  # ratio 0.7, A < 0: the low bound, 0.8, for both
    for options in (grpo, dapo):
        assert _terms(options, logp, old, down, second).loss.item() == pytest.approx(0.8)


def test_dr_grpo_neither_scales_by_std_nor_by_length(tmp_path: Path):
    options = _options(tmp_path, name="dr_grpo")
    assert (options.scale_rewards, options.loss_aggregation, options.length_norm) == ("none", "sequence_sum", 4)
    advantages = _advantages("dr_grpo", options, np.array([1.0, 0.0, 0.0, 0.0]), np.zeros(4))
    np.testing.assert_allclose(advantages, [0.75, -0.25, -0.25, -0.25])
    # one completion of 1 token and one of 3, ratio 1: -(0.75 * 1 + (-0.25) * 3) / 2 / 4 = 0
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss = _terms(options, torch.zeros((2, 3)), torch.zeros((2, 3)), torch.tensor([0.75, -0.25]), mask).loss
    assert loss.item() == pytest.approx(-(0.75 * 1 - 0.25 * 3) / 2 / 4)


def test_gspo_uses_one_ratio_per_sequence(tmp_path: Path):
    options = _options(tmp_path, name="gspo")
    assert (options.clip_eps, options.clip_eps_high) == (3e-4, 4e-4)
    mask, old = torch.ones((1, 2)), torch.zeros((1, 2))
    far = torch.tensor([[0.1, 0.3]], requires_grad=True)  # s = exp(mean(0.1, 0.3)) = e^0.2, clipped at 1 + 4e-4
    terms = _terms(options, far, old, torch.tensor([1.0]), mask)
    assert terms.loss.item() == pytest.approx(-(1 + 4e-4)) and terms.ratio.item() == pytest.approx(math.exp(0.2))
    terms.loss.backward()
    assert torch.equal(far.grad, torch.zeros_like(far))  # clipped: no gradient
    near = torch.tensor([[1e-4, -1e-4]], requires_grad=True)  # s = exp(0) = 1: inside the range
    loss = _terms(options, near, old, torch.tensor([2.0]), mask).loss
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    torch.testing.assert_close(far.new_tensor([[-1.0, -1.0]]), near.grad)  # d/dlogp_t of -A s = -A s / |o| each


def test_rloo_leave_one_out_baseline(tmp_path: Path):
    rewards, groups = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), np.array([0, 0, 0, 0, 1, 1])
    advantages = _advantages("rloo", _options(tmp_path, name="rloo"), rewards, groups)
    # A_0 = 1 - (0 + 0 + 1) / 3, A_1 = 0 - (1 + 0 + 1) / 3; the second group has no spread
    np.testing.assert_allclose(advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])


def test_reinforce_pp_whitens_the_batch_and_folds_the_kl_into_the_reward(tmp_path: Path):
    options = _options(tmp_path, name="reinforce_pp", kl_coef=0.1)
    assert (options.kl_estimator, options.loss_aggregation) == ("k1", "token_mean")
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    advantages = _advantages("reinforce_pp", options, rewards, np.array([0, 0, 0, 0, 1, 1]))
    np.testing.assert_allclose(advantages, (rewards - 0.5) / (np.std(rewards, ddof=1) + 1e-4))
    old, ref = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.5, -1.0, -2.0]])  # k1 = old - ref = .5, 0, 1
    terms = _terms(options, old.clone(), old, torch.tensor([1.0]), torch.ones((1, 3)), ref)
    # A_t = 1 - 0.1 x KL-to-go (1.5, 1.0, 1.0); ratio 1; token mean
    assert terms.loss.item() == pytest.approx(-((1 - 0.15) + (1 - 0.1) + (1 - 0.1)) / 3)
    assert terms.kl.item() == pytest.approx(0.5)  # tracked with k1: mean(0.5, 0, 1)


def test_options_an_algorithm_does_not_read_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"algorithm.beta is not an option of algorithm grpo .*scale_rewards"):
        _options(tmp_path, name="grpo", beta=0.5)
    with pytest.raises(ValueError, match="algorithm.length_norm divides the sequence_sum aggregation only"):
        _options(tmp_path, name="grpo", length_norm=100)  # grpo aggregates by sequence_mean: it would do nothing
    with pytest.raises(ValueError, match="algorithm.scale_rewards is not an option of algorithm reinforce_pp"):
        _options(tmp_path, name="reinforce_pp", scale_rewards="group")
    assert _options(tmp_path, name="dapo", clip_eps_high=0.3).clip_eps_high == 0.3  # set: kept
    assert _options(tmp_path).scale_rewards == "group"  # the default algorithm is GRPO as before


def test_the_entropy_bonus_raises_entropy(tmp_path: Path):
    batch = _batch(tmp_path)
    table = pq.read_table(batch)
    pq.write_table(table.set_column(table.column_names.index("advantage"), "advantage", [[0.0] * len(table)]), batch)

    def mean_entropy(trainer) -> float:
        mb = pack(table.to_pylist(), pad_id=0)
        with torch.no_grad():
            logits = completion_logits(trainer.policy, mb)
        _, entropy = token_logprobs_and_entropy(logits, mb.targets, 1.0)
        mask = mb.completion_mask
        return float((entropy * mask).sum() / mask.sum())

    settings = {"mini_batches": 2, "warmup_steps": 0, "lr": 0.05}
    trainer = _make(parse_spec(tiny_spec_dict(tmp_path, trainer=settings, algorithm={"entropy_coef": 1.0})))
    before = mean_entropy(trainer)
    metrics = train_on_batch(trainer, batch, 1)
    assert metrics["policy/loss"] < 0  # zero advantages: the loss is -H alone
    assert mean_entropy(trainer) > before


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_algorithm_trains(tmp_path: Path, name: str):
    assert set(BUILT_IN) <= set(ALGORITHMS)
    spec = tiny_spec_dict(
        tmp_path,
        trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "micro_batch_tokens": 40},
        algorithm={"name": name, "kl_coef": 0.05},
    )
    trainer = _make(parse_spec(spec))
    before = _params(trainer)
    metrics = train_on_batch(trainer, _batch(tmp_path), 1)
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["kl/mean"] != 0  # the reference was used
    assert max(float((p - before[k]).abs().max()) for k, p in _params(trainer).items()) > 1e-4


def test_rlpipe_check_names_an_option_the_algorithm_does_not_read(tmp_path: Path):
    from rlpipe.preflight import CheckFailed, check_algorithm

    with pytest.raises(SpecError, match="algorithm.loss_aggregation is not an option of algorithm gspo .*ppo"):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "gspo", "loss_aggregation": "token_mean"}))
    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "grpo", "length_norm": 8}))
    with pytest.raises(CheckFailed, match="algorithm.length_norm divides the sequence_sum aggregation only"):
        check_algorithm(spec)
    assert check_algorithm(parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dapo"}))) == "algorithm dapo"


def _scored(tmp_path: Path, rewards_by_group: list[list[float]]) -> str:
    import pyarrow as pa

    rows = [
        {"group_id": g, "reward": r, "prompt_id": g, "completion_token_ids": [5], "logprobs": [-1.0]}
        for g, rewards in enumerate(rewards_by_group)
        for r in rewards
    ]
    path = tmp_path / "scored.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path: Path):
    from rlpipe.algorithms import compute_advantages

    spec = parse_spec(
        tiny_spec_dict(
            tmp_path, algorithm={"name": "dapo"}, rollout={"prompts_per_iteration": 4, "samples_per_prompt": 2}
        )
    )
    assert resolve_options(spec).dynamic_sampling
    # 8 groups sampled for 4 wanted; every other one has no spread
    scored = _scored(tmp_path, [[1, 1], [1, 0], [0, 0], [0, 1], [1, 1], [1, 0], [0, 0], [1, 0]])
    metrics = compute_advantages(spec, scored, str(tmp_path / "batch.parquet"))
    batch = pq.read_table(tmp_path / "batch.parquet").to_pylist()
    assert sorted({row["group_id"] for row in batch}) == [1, 3, 5, 7] and len(batch) == 4 * 2  # the requested size
    assert all(abs(row["advantage"]) > 0.5 for row in batch)  # every kept completion carries a gradient
    assert metrics["groups/zero_variance_fraction"] == 0.5
    assert (metrics["dynamic_sampling/zero_spread_dropped"], metrics["dynamic_sampling/short"]) == (4.0, 0.0)

    # too few informative groups: all of them, and the shortfall counted
    scored = _scored(tmp_path, [[1, 1], [1, 0], [0, 0], [0, 1], [1, 1], [0, 0]])
    metrics = compute_advantages(spec, scored, str(tmp_path / "batch.parquet"))
    assert len(pq.read_table(tmp_path / "batch.parquet")) == 2 * 2 and metrics["dynamic_sampling/short"] == 2.0
    off = parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dapo", "dynamic_sampling": False}))
    compute_advantages(off, scored, str(tmp_path / "batch.parquet"))
    assert len(pq.read_table(tmp_path / "batch.parquet")) == 6 * 2  # off: every group stays, as in GRPO


def test_dynamic_sampling_samples_within_the_cap(tmp_path: Path):
    from rlpipe.data.order import iteration_prompts, prompt_indices
    from rlpipe.store.run_root import iteration_metrics_uri, write_json

    algorithm = {"name": "dapo", "max_oversample": 2.0}
    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm=algorithm, rollout={"prompts_per_iteration": 10}))
    run_root = str(tmp_path / "run")
    first = iteration_prompts(spec, run_root, 200, 1)  # nothing known yet: the cap
    assert len(first) == 20 and len(set(first)) == 20 and first[:10] == prompt_indices(200, 10, 1, 0)
    assert iteration_prompts(spec, run_root, 200, 1) == first  # deterministic
    for zero_fraction, sampled in ((0.5, 20), (0.2, 14), (0.0, 11), (1.0, 20)):  # ceil(1.1 x 10 / f), capped
        write_json(iteration_metrics_uri(run_root, 1), {"groups/zero_variance_fraction": zero_fraction})
        assert len(iteration_prompts(spec, run_root, 200, 2)) == sampled, zero_fraction
    grpo = parse_spec(tiny_spec_dict(tmp_path, rollout={"prompts_per_iteration": 10}))
    assert iteration_prompts(grpo, run_root, 200, 2) == prompt_indices(200, 10, 2, 0)  # off: unchanged


def test_dapo_runs_whole_iterations_with_dynamic_sampling(tmp_path: Path):
    from rlpipe import loop
    from rlpipe.rollouts import read_table

    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            algorithm={"name": "dapo", "max_oversample": 2.0},
            reward={"functions": [{"type": "tests.toy_plugins:length", "target": 2}]},
        )
    )
    run_root, cache = str(tmp_path / "runs" / spec.name), spec.cache_root
    weights = initialize(spec, run_root, cache)
    for iteration in (1, 2):
        weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, tmp_path, cache)
        rollouts, batch = read_table(str(tmp_path / "rollouts.parquet")), read_table(str(tmp_path / "batch.parquet"))
        assert metrics["dynamic_sampling/groups_sampled"] * 4 == rollouts.num_rows <= 16 * 4  # P x cap groups of 4
        assert batch.num_rows == metrics["dynamic_sampling/groups_kept"] * 4 <= 8 * 4
    assert weights["version"] == 2


@pytest.mark.parametrize("name", ["online_dpo", "dpo"])
def test_kl_coef_is_refused_where_the_algorithm_has_no_kl_term(tmp_path: Path, name: str):
    """DPO's beta is its pull to the reference: a kl_coef would be accepted and ignored."""
    with pytest.raises(ValueError, match=rf"algorithm.kl_coef: {name} already holds .* algorithm.beta.*set kl_coef: 0"):
        _options(tmp_path, name=name, kl_coef=0.1)
    assert _options(tmp_path, name=name).kl_coef == 0.0


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "reinforce_pp", "ppo"])
def test_sequence_sum_divides_by_length_norm_for_every_algorithm_that_offers_it(tmp_path: Path, name: str):
    options = _options(tmp_path, name=name, loss_aggregation="sequence_sum")
    assert options.length_norm == 4  # rollout.max_new_tokens, as the schema says
    assert _options(tmp_path, name=name, loss_aggregation="sequence_sum", length_norm=10).length_norm == 10
    # one completion of 2 tokens, ratio 1, A = 1: -(1 + 1) / 1 sequence / 4
    loss = _terms(options, torch.zeros((1, 2)), torch.zeros((1, 2)), torch.tensor([1.0]), torch.ones((1, 2))).loss
    assert loss.item() == pytest.approx(-2 / 4)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"])
def test_the_dual_clip_caps_a_negative_advantages_loss(tmp_path: Path, name: str):
    """A < 0, ratio e^5: the clipped surrogate alone is -A r = 148.4 on the token (no bound in r); the dual
    clip caps it at -c A = 3 with no gradient. A > 0 and ratios near 1 are untouched."""
    options, off = _options(tmp_path, name=name), _options(tmp_path, name=name, dual_clip=0)
    assert options.dual_clip == 3.0
    old, mask = torch.zeros((1, 1)), torch.ones((1, 1))
    far = torch.tensor([[5.0]], requires_grad=True)
    terms = _terms(options, far, old, torch.tensor([-1.0]), mask)
    assert terms.loss.item() == pytest.approx(3.0) and terms.dual_clip_fraction.item() == 1.0
    terms.loss.backward()
    assert far.grad.abs().max().item() == 0.0
    unbounded = _terms(off, far, old, torch.tensor([-1.0]), mask)
    assert unbounded.loss.item() == pytest.approx(math.exp(5.0), rel=1e-5) and unbounded.dual_clip_fraction.item() == 0
    near = torch.tensor([[0.05]])
    for advantage in (-1.0, 1.0):
        capped = _terms(options, near, old, torch.tensor([advantage]), mask).loss
        assert capped.item() == _terms(off, near, old, torch.tensor([advantage]), mask).loss.item()
    with pytest.raises(ValueError, match="algorithm.dual_clip 0.5: .*needs c > 1"):
        _options(tmp_path, name=name, dual_clip=0.5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "ppo"])
def test_k1_is_refused_as_a_loss_term(tmp_path: Path, name: str):
    """k1 = log pi - log ref: E_{y~pi}[grad k1] = E[grad log pi] = 0, so as a loss term it adds only noise."""
    with pytest.raises(ValueError, match=r"algorithm.kl_estimator: k1 as .* zero expected gradient.*k3.*k2"):
        _options(tmp_path, name=name, kl_coef=0.1, kl_estimator="k1")
    assert _options(tmp_path, name=name, kl_estimator="k1").kl_estimator == "k1"  # kl_coef 0: only tracked
    assert _options(tmp_path, name=name, kl_coef=0.1, kl_estimator="k2").kl_estimator == "k2"


def test_k1_stays_reinforce_pps_reward_estimator(tmp_path: Path):
    assert _options(tmp_path, name="reinforce_pp", kl_coef=0.1).kl_estimator == "k1"  # in the reward: its definition


def test_k1_has_zero_expected_gradient_and_k2_has_the_kls():
    """Exact expectations over a 3-token vocabulary: sum_y pi(y) grad k(y) is 0 for k1, grad KL(pi || ref) for k2."""
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), -1)

    def expected(estimator: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, -1)
        k = kl_estimate(logp, ref, estimator)
        # the score-function gradient of E_{y~pi}[k(y)] with y sampled (no gradient through the sampling)
        surrogate = (logp.exp().detach() * k).sum()
        (grad,) = torch.autograd.grad(surrogate, theta)
        return grad

    logp = torch.log_softmax(theta, -1)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    assert expected("k1").abs().max().item() < 1e-7
    torch.testing.assert_close(expected("k2"), true_grad)


def test_gspo_corrects_stale_rollouts_per_sequence(tmp_path: Path):
    """GSPO's objective is per sequence, so its off-policy weight is the sequence's geometric mean by default."""
    options = _options(tmp_path, name="gspo", off_policy_correction="truncate")
    assert options.is_level == "geometric"
    assert _options(tmp_path, name="grpo", off_policy_correction="truncate").is_level == "token"
    assert _options(tmp_path, name="gspo", is_level="token").is_level == "token"  # set: kept
    with pytest.raises(ValueError, match="algorithm.is_level is not an option of algorithm online_dpo"):
        _options(tmp_path, name="online_dpo", is_level="token")
