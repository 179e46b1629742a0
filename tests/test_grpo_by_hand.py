"""GRPO advantages and the clipped loss against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from rlpipe.algorithms.grpo import STD_EPS, group_advantages
from rlpipe.algorithms.policy_gradient import clipped_policy_loss


def test_group_advantages_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = group_advantages(rewards, groups, "group")
    # group 0: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [0.5 / (std + STD_EPS), -0.5 / (std + STD_EPS), -0.5 / (std + STD_EPS), 0.5 / (std + STD_EPS)]
    assert advantages[:4] == pytest.approx(expected)
    assert advantages[4:] == pytest.approx([0.0] * 4)  # identical rewards: no signal


def test_group_advantages_other_scalings():
    rewards = np.array([1.0, 0.0, 3.0, 1.0])
    groups = np.array([7, 7, 9, 9])  # ids need not be contiguous from 0
    none = group_advantages(rewards, groups, "none")
    assert none == pytest.approx([0.5, -0.5, 1.0, -1.0])
    batch = group_advantages(rewards, groups, "batch")
    batch_std = np.std(rewards, ddof=1)
    assert batch == pytest.approx(np.array([0.5, -0.5, 1.0, -1.0]) / (batch_std + STD_EPS))


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        group_advantages(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]))


def _loss(logp, old, adv, mask, **kw):
    """(loss, statistics) with one advantage per sequence, laid along its row: [B] -> [B, T]."""
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    terms = clipped_policy_loss(t(logp), t(old), t(adv).unsqueeze(-1).expand_as(t(logp)), t(mask), **kw)
    return terms.loss, {"clip_fraction": terms.clip_fraction, "kl": terms.kl, "ratio": terms.ratio}


def test_clipped_loss_by_hand():
    # one sequence, two tokens: ratios e^{0.5} = 1.6487 (clipped to 1.2 for A > 0) and e^{-0.1} = 0.9048
    logp, old = [[0.0, -0.1]], [[-0.5, 0.0]]
    loss, stats = _loss(logp, old, [2.0], [[1.0, 1.0]], clip_eps=0.2)
    token_terms = [-min(math.exp(0.5) * 2, 1.2 * 2), -min(math.exp(-0.1) * 2, max(0.8, math.exp(-0.1)) * 2)]
    assert loss.item() == pytest.approx(sum(token_terms) / 2, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)  # only the first token hit the bound


def test_negative_advantage_clips_below():
    # A < 0 and ratio 0.5 < 1 - eps: the clipped term (0.8 * A) is the min of -(.) -> max of (.)
    loss, stats = _loss([[math.log(0.5)]], [[0.0]], [-1.0], [[1.0]], clip_eps=0.2)
    assert loss.item() == pytest.approx(0.8)
    assert stats["clip_fraction"].item() == 1.0


def test_mask_and_aggregation():
    # sequence 0 has 1 real token (loss 1 * A), sequence 1 has 3 (each 1 * A); ratio 1 everywhere
    logp = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    seq, _ = _loss(logp, logp, [1.0, -2.0], mask, clip_eps=0.2, aggregation="sequence_mean")
    assert seq.item() == pytest.approx((-1.0 + 2.0) / 2)  # mean over sequences of per-sequence means
    tok, _ = _loss(logp, logp, [1.0, -2.0], mask, clip_eps=0.2, aggregation="token_mean")
    assert tok.item() == pytest.approx((-1.0 + 3 * 2.0) / 4)


def test_k3_kl_penalty_by_hand():
    # logp = -1, ref = -2: delta = -1, k3 = e^{-1} + 1 - 1 = 0.3679; ratio 1, A = 0
    loss, stats = _loss(
        [[-1.0]], [[-1.0]], [0.0], [[1.0]], clip_eps=0.2, ref_logprobs=torch.tensor([[-2.0]]), kl_coef=0.1
    )
    k3 = math.exp(-1.0) + 1.0 - 1.0
    assert stats["kl"].item() == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)


def test_advantages_must_be_token_shaped():
    with pytest.raises(ValueError, match=r"advantages must be \[B, T\]"):
        clipped_policy_loss(torch.zeros((2, 3)), torch.zeros((2, 3)), torch.ones(2), torch.ones((2, 3)), clip_eps=0.2)


def test_gradient_is_the_policy_gradient_at_ratio_one():
    # at ratio 1, d loss / d logp_t = -A / |o| per token (sequence_mean)
    logp = torch.zeros((1, 2), requires_grad=True)
    loss = clipped_policy_loss(
        logp, torch.zeros((1, 2)), torch.full((1, 2), 3.0), torch.ones((1, 2)), clip_eps=0.2
    ).loss
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.5, -1.5])
