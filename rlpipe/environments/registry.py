"""The environment types by name, and the interface every environment fills: imported by the built-ins
(which register themselves) and by rlpipe.environments (which imports them), so no module imports its
package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlpipe.plugins import look_up

if TYPE_CHECKING:
    from rlpipe.spec import EnvironmentSpec


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str = ""  # appended before the model's next turn (tokenized alone)
    reward: float = 0.0  # this turn's reward (the trajectory's: their sum)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # tool_call: True counts a tool call


class Environment(Protocol):
    stop: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> str: ...

    def step(self, text: str, token_ids: list[int]) -> StepResult: ...

    def close(self) -> None: ...


class EnvironmentFailure(RuntimeError):
    """An environment failed in a way that ends its trajectory (recorded, zero reward) or, when every
    trajectory of a step fails, the step (the message names the environment and what to change)."""


# an environment type: (its options, the spec key naming it) -> a factory of one environment per trajectory
ENVIRONMENTS: dict[str, Callable[[dict[str, Any], str], Callable[[], Environment]]] = {}


def register_environment(name: str, build: Callable[[dict[str, Any], str], Callable[[], Environment]]) -> None:
    ENVIRONMENTS[name] = build


def environment_factory(spec: EnvironmentSpec) -> Callable[[], Environment]:
    """The factory rollout.environment names, built from its options."""
    _, build = look_up(
        spec.type,
        ENVIRONMENTS,
        "rollout.environment.type",
        "environment",
        "rlpipe.environments.register_environment",
    )
    return build(dict(spec.options), "rollout.environment")
