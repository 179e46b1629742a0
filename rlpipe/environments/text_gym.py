"""Gymnasium-style text environments: {type: gymnasium, options: {make: 'my.module:make_env', stop: ["="], ...}}.

`make(**the other options)` returns an environment with Gymnasium's API over text, as a
gymnasium.Env subclass is (or anything with the same two methods):
    reset(seed=None, options={"row": row}) -> (observation: str, info)
    step(action: str) -> (observation: str, reward, terminated, truncated, info)
`terminated or truncated` ends the trajectory; `stop` lists the strings that end a model turn
(besides eos). Each trajectory gets its own environment, reset with its data row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.environments.registry import Environment, StepResult


class GymTextEnvironment:
    def __init__(self, env: Any, stop: tuple[str, ...]) -> None:
        self.env, self.stop = env, stop

    def reset(self, row: dict[str, Any]) -> str:
        observation, _ = self.env.reset(options={"row": row})
        return str(observation or "")

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        observation, reward, terminated, truncated, info = self.env.step(text)
        done = bool(terminated or truncated)
        return StepResult("" if done else str(observation or ""), float(reward), done, dict(info or {}))

    def close(self) -> None:
        self.env.close()


def gymnasium_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    from rlpipe.rewards import RewardError, load_reward_function

    options = dict(options)
    make_ref, stop = options.pop("make", None), tuple(options.pop("stop", ()))
    if not isinstance(make_ref, str):
        raise ValueError(
            f"{key}.options.make: 'package.module:function' that returns the environment, got {make_ref!r}"
        )
    try:
        make = load_reward_function(make_ref, f"{key}.options.make")
    except RewardError as err:
        raise ValueError(str(err)) from None
    return lambda: GymTextEnvironment(make(**options), stop)
