"""The reward types by name, and what every reward function and type shares: imported by the built-ins
(which register themselves) and by rlpipe.rewards (which imports them), so no module imports its package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

RewardFunction = Callable[..., Sequence[float]]
# a reward type: (the entry's options, the spec key naming it) -> a reward function
REWARD_TYPES: dict[str, Callable[[dict[str, Any], str], RewardFunction]] = {}


def register_reward_type(name: str, build: Callable[[dict[str, Any], str], RewardFunction]) -> None:
    REWARD_TYPES[name] = build


class RewardError(RuntimeError):
    """A reward function or verifier failed or returned something unusable; the message names it."""


class Rewards(list):
    """A reward function's values with a reason for each (e.g. why a program scored 0)."""

    def __init__(self, values: Sequence[float], reasons: Sequence[str]) -> None:
        super().__init__(values)
        self.reasons = list(reasons)
