"""A toy algorithm, data source and reward type, registered from outside the rlpipe package.

Each is one function plus its registration; a spec names them as 'tests.toy_plugins:<name>'.
"""

import asyncio
import random
import time

import numpy as np

from rlpipe.algorithms import Advantages, Algorithm, Scored, register_algorithm
from rlpipe.algorithms.policy_gradient import ClippedSurrogate, PolicyGradientOptions
from rlpipe.data import register_source
from rlpipe.rewards import register_reward_type
from rlpipe.spec import section, setting


@section
class SignOptions(PolicyGradientOptions):
    """The sign algorithm's options: the clipped surrogate's, and its own dead zone."""

    dead_zone: float = setting(default=0.0, ge=0, doc="|r_i - mean| at most this: A_i = 0")
    scale: float = setting(default=1.0, gt=0, doc="|A_i| of a completion outside the dead zone")


def sign_advantages(scored: Scored, options: SignOptions) -> Advantages:
    """A_i = scale sign(r_i - mean of its group): +scale above the group's mean, -scale below, 0 within dead_zone."""
    rewards, group_ids = scored.rewards, scored.group_ids
    means = {g: rewards[group_ids == g].mean() for g in np.unique(group_ids)}
    centered = rewards - np.array([means[g] for g in group_ids])
    return Advantages(per_sequence=options.scale * np.sign(centered) * (np.abs(centered) > options.dead_zone))


register_algorithm(
    Algorithm("sign", frozenset({"groups"}), sign_advantages, ClippedSurrogate.from_options, SignOptions)
)


def doubling_rows(rng: random.Random, n: int, **_: object) -> list[dict[str, str]]:
    """'12*2=' -> '24': n distinct problems."""
    return [{"prompt": f"{a}*2=", "reference": str(2 * a)} for a in rng.sample(range(1000), n)]


register_source("doubling", doubling_rows)


def build_length_reward(options: dict, key: str):
    """{type: tests.toy_plugins:length, target: N}: 1.0 for completions of exactly N characters."""
    target = int(options["target"])
    return lambda prompts, completions, **_: [float(len(c.strip()) == target) for c in completions]


register_reward_type("length", build_length_reward)


async def async_length(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """An async reward (e.g. one that awaits a service): len(completion)."""
    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]


def slow(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    time.sleep(5)
    return [0.0] * len(completions)


def nothing(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """No completion earns anything: a reward reading the wrong column (rlpipe.evaluation.diagnosis.no_reward)."""
    return [0.0] * len(completions)


def broken(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [1 / 0 for _ in completions]
