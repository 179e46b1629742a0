"""An OpenEnv environment server (openenv-core's create_app) for examples/openenv-addition.yaml: the model
answers a sum; a wrong answer gets a hint, "+ " (higher) or "- " (lower), and a second try; reward 1.0 for
the right answer. Each WebSocket session is one environment; reset gets the row's `reference`.

    pip install 'rlpipe[openenv]' && pip install --no-deps openenv-core==0.3.0
    python examples/openenv_addition_server.py --port 8000
"""

from __future__ import annotations

import argparse

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class AnswerAction(Action):
    message: str = Field(..., description="the model's answer")


class HintObservation(Observation):
    hint: str = Field(default="", description="'+ ' higher, '- ' lower, '' on reset and when right")


class AdditionRetryEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.reference, self._state = 0, State(step_count=0)

    def reset(self, reference: str = "0") -> HintObservation:
        self.reference, self._state = int(reference), State(step_count=0)
        return HintObservation(hint="", done=False, reward=0.0)

    def step(self, action: AnswerAction) -> HintObservation:  # type: ignore[override]
        self._state.step_count += 1
        text = action.message.strip()
        answer = int(text) if text.isdigit() else -1
        right = answer == self.reference
        hint = "" if right else ("+ " if answer < self.reference else "- ")
        return HintObservation(hint=hint, done=right or self._state.step_count >= 2, reward=float(right))

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    AdditionRetryEnvironment, AnswerAction, HintObservation, env_name="addition_retry", max_concurrent_envs=2048
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    uvicorn.run(app, host=arguments.host, port=arguments.port, log_level="warning")
