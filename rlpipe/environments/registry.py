"""The environment types by name, the interface every environment fills, and the background event loop of
those that live across turns: imported by the built-ins (which register themselves) and by
rlpipe.environments (which imports them), so no module imports its package."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
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
    """reset and step may be `async def` (the turn loop awaits what they return when it is awaitable)."""

    stop: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> str | Awaitable[str]: ...

    def step(self, text: str, token_ids: list[int]) -> StepResult | Awaitable[StepResult]: ...

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


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop): a forked child makes its own
_LOOP_LOCK = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """This process's one event loop in a daemon thread, for what lives across turns (an MCP session, a
    verifiers Env's `run`): the turn loop runs each batch of turns in an `asyncio.run` of its own."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rlpipe-environments", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]
