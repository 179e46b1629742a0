"""The algorithm record, the typed values its parts take and give, the registry, and the options.

An algorithm is a record of typed parts, registered by name (as verl's `register_adv_est` /
`register_policy_loss`), each loss configured from the options it reads where it is built (as
torchtune's loss components):

    advantages(scored: Scored, options) -> Advantages     numpy only: the advantages step never imports torch
    loss(options) -> PolicyLoss                           the policy loss with its options bound
        PolicyLoss(PolicyInputs) -> LossTerms             torch, called by the update for each micro-batch
    value_loss(options) -> ValueLoss                      algorithms that need a "critic" (PPO)
        ValueLoss(values, old_values, returns, mask) -> ValueTerms
    options                                               its options: a section subclassing AlgorithmSpec
                                                          (rlpipe.spec), declared beside it with its defaults

where `options` is the spec's `algorithm` section, an instance of that class (parse_spec builds the class the
name registers), with what depends on other sections filled in (`resolve_options`). Adding an algorithm touches
its own module and this registry, never rlpipe.spec. Nothing here imports torch: tensor types are annotations only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from rlpipe.plugins import look_up
from rlpipe.spec.algorithm import register_options

if TYPE_CHECKING:
    import torch

    from rlpipe.spec import AlgorithmSpec, RunSpec


@dataclass(frozen=True)
class Scored:
    """What an advantage estimator reads of the scored rollouts, one entry per completion (N of them)."""

    rewards: np.ndarray  # [N] float64
    group_ids: np.ndarray  # [N]: completions of one prompt share an id
    values: list[np.ndarray] | None = None  # the values step's V_t, one array per completion ("critic" only)
    loss_masks: list[np.ndarray] | None = None  # multi-turn: 1 at the model's tokens (rlpipe.environments)


@dataclass(frozen=True)
class Advantages:
    """An estimator's result, exactly one of:

    - per_sequence: [N] A_i, one per completion (the batch's `advantage` column);
    - per_token: N arrays [T_i] A_it, per completion token (the `token_advantages` column), with
      returns: N arrays [T_i] G_it, the critic's regression targets (the `returns` column).
    """

    per_sequence: np.ndarray | None = None
    per_token: list[np.ndarray] | None = None
    returns: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        if (self.per_sequence is None) == (self.per_token is None):
            raise ValueError("an advantage estimate is per_sequence or per_token, exactly one of them")
        if self.returns is not None and self.per_token is None:
            raise ValueError("returns (a critic's targets) come with per_token advantages")


@dataclass(frozen=True)
class PolicyInputs:
    """One micro-batch as a policy loss reads it. Every tensor is [B, T]: B completions, T target
    positions (rlpipe.training.batching.MicroBatch)."""

    logprobs: torch.Tensor  # log pi_theta of each target token, with the gradient
    old_logprobs: torch.Tensor  # the ratio's denominator: the sampler's log pi_old, or pi_prox (decoupled)
    advantages: torch.Tensor  # A_it: a per-sequence A_i along its row, or a critic's per token
    mask: torch.Tensor  # 1 where the target is a completion token
    ref_logprobs: torch.Tensor | None = None  # the frozen reference's, when the update has them


@dataclass(frozen=True)
class LossTerms:
    """A policy loss: the scalar to descend and its statistics (no gradient), token means over the mask.
    `extra`: the algorithm's own (DPO: preference_accuracy, ...), reported as policy/<name>."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)
    dual_clip_fraction: torch.Tensor | None = None  # of tokens whose loss the dual clip capped


@dataclass(frozen=True)
class ValueTerms:
    """A value loss: the scalar to descend, and the fraction of tokens whose clipped term was the larger."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    value_mean: torch.Tensor


class PolicyLoss(Protocol):
    def __call__(self, inputs: PolicyInputs) -> LossTerms: ...


class ValueLoss(Protocol):
    def __call__(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> ValueTerms: ...


Options = TypeVar("Options", bound="AlgorithmSpec")  # an algorithm's options section: what its parts are given


@dataclass(frozen=True)
class Algorithm(Generic[Options]):
    name: str
    needs: frozenset[str]  # "groups" (G samples per prompt), "critic" (a value model), "pairs", "reference"
    advantages: Callable[[Scored, Options], Advantages]
    loss: Callable[[Options], PolicyLoss]
    options: type[Options]  # the spec's `algorithm` section for it: its options and their defaults
    value_loss: Callable[[Options], ValueLoss] | None = None  # with "critic"
    # where kl_coef puts the KL to v0: a loss term, a per-token reward (REINFORCE++), or nowhere (DPO,
    # whose beta already holds the policy to its reference)
    kl_term: Literal["loss", "reward", "none"] = "loss"


ALGORITHMS: dict[str, Algorithm[Any]] = {}  # each is given the options its name builds (parse_spec): Any of them


def register_algorithm(algorithm: Algorithm[Options]) -> Algorithm[Options]:
    """Register `algorithm` by its name, and its options section with the spec (rlpipe.spec.register_options),
    which builds the `algorithm` section of a spec naming it as that class."""
    ALGORITHMS[algorithm.name] = algorithm
    register_options(algorithm.name, algorithm.options)
    return algorithm


def get_algorithm(name: str) -> Algorithm[Any]:
    """The algorithm `name` ('grpo', or 'package.module:name') names; a clear error otherwise."""
    return look_up(name, ALGORITHMS, "algorithm.name", "algorithm", "rlpipe.algorithms.register_algorithm")[1]


def needs_critic(spec: RunSpec) -> bool:
    """Whether the spec's algorithm trains a value model (PPO): the iteration then has a values step."""
    return "critic" in get_algorithm(spec.algorithm.name).needs


def resolve_options(spec: RunSpec) -> AlgorithmSpec:
    """The spec's algorithm options (parse_spec built them as the algorithm's class, its defaults in place of
    what the spec leaves out) with what depends on other sections filled in: length_norm to rollout.max_new_tokens
    where the aggregation is sequence_sum, critic_lr to trainer.lr, off_policy_correction to truncate in
    asynchronous runs (loop.max_staleness >= 1) and none otherwise. An option set to no effect is an error
    naming what to write instead."""
    options = spec.algorithm
    algorithm = get_algorithm(options.name)
    if type(options) is not algorithm.options:
        raise ValueError(
            f"spec.algorithm is a {type(options).__name__}, and algorithm {algorithm.name} takes a "
            f"{algorithm.options.__name__}: build it with rlpipe.spec.parse_spec (not dataclasses.replace of name)"
        )
    check_kl(algorithm, options.kl_coef, options.kl_estimator)
    has = {f.name for f in dataclasses.fields(options)}
    filled: dict[str, Any] = {}
    if options.length_norm is not None and options.loss_aggregation != "sequence_sum":
        raise ValueError(
            f"algorithm.length_norm divides the sequence_sum aggregation only, and {algorithm.name} aggregates by "
            f"{options.loss_aggregation} here; remove length_norm, or set algorithm.loss_aggregation: sequence_sum"
        )
    if "length_norm" in has and options.loss_aggregation == "sequence_sum" and options.length_norm is None:
        filled["length_norm"] = spec.rollout.max_new_tokens
    if "critic_lr" in has and options.critic_lr is None:
        filled["critic_lr"] = spec.trainer.lr
    pairs = "pairs" in algorithm.needs
    if options.off_policy_correction is None:
        filled["off_policy_correction"] = "truncate" if spec.loop.max_staleness and not pairs else "none"
    elif pairs and options.off_policy_correction != "none":
        raise ValueError(
            f"algorithm.off_policy_correction: {algorithm.name} trains on preference pairs against its reference, "
            "with no importance ratio to correct; remove the setting (or set it to none)"
        )
    return dataclasses.replace(options, **filled)


def check_kl(algorithm: Algorithm[Any], kl_coef: float, estimator: str | None) -> None:
    """kl_coef > 0 must do something: DPO has no KL term (its beta is the pull to the reference), and k1
    as a loss term has zero expected gradient, E_{y~pi}[grad (log pi(y) - log ref(y))] = E[grad log pi(y)] = 0,
    so it only adds noise; k2's gradient is the KL's, k3 is GRPO's (k1 belongs in the reward, REINFORCE++)."""
    if kl_coef <= 0:
        return
    if algorithm.kl_term == "none":
        raise ValueError(
            f"algorithm.kl_coef: {algorithm.name} already holds the policy to its reference through algorithm.beta "
            "(DPO's temperature: a larger beta stays closer); set kl_coef: 0"
        )
    if algorithm.kl_term == "loss" and estimator == "k1":
        raise ValueError(
            f"algorithm.kl_estimator: k1 as {algorithm.name}'s loss term has zero expected gradient (it only adds "
            "noise); set kl_estimator: k3 (unbiased, GRPO's) or k2 (its gradient is the KL's), or put the KL in the "
            "reward with algorithm.name: reinforce_pp"
        )
