"""OpenEnv environments (openenv-core): {type: openenv, options: {url: http://host:8000, action_field: message}}.

An OpenEnv server (openenv-core's `create_app` around an `Environment` subclass) keeps one environment
per WebSocket session at {url}/ws; its HTTP /reset and /step build and drop a fresh environment on every
request, so a trajectory is one WebSocket session:

    {"type": "reset", "data": {...the row's columns}}        -> {"type": "observation", "data":
    {"type": "step", "data": {action_field: text, ...action}}      {"observation": {...}, "reward": number | null,
                                                                    "done": bool}}   (or {"type": "error", ...})
    {"type": "close"}

The server hands reset only the columns its `Environment.reset` names as parameters. The model's turn
(decoded text) fills the action's `action_field`; `action` adds fixed fields. The next observation is the
observation's `observation_field` (default: its only string field); a null reward counts 0.

Only the server needs openenv-core: this side speaks the protocol with `websockets`' sync client, each
call in a thread as the remote type's are. Failures are named as the remote type names them: a server
that cannot be reached (the connection is retried `retries` times with backoff 0.5 s, 1 s, ...), one
that does not answer within `timeout_s`, an answer that is not the shape above; each ends its trajectory
with the error recorded (reward 0).
Options: url, action_field ("message"), action ({}), observation_field, timeout_s (30), retries (2),
stop (the turn-ending strings, ["</tool_call>"]).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from rlpipe.environments.registry import Environment, EnvironmentFailure, StepResult

NOT_SENT = ("prompt_token_ids",)
OPTIONS = ("url", "action_field", "action", "observation_field", "timeout_s", "retries", "stop")


def connect(url: str, key: str, timeout_s: float, retries: int, stack: ExitStack) -> Any:
    """A WebSocket connection to {url}/ws that `stack` closes, in at most retries + 1 attempts (an
    unreachable or silent server is retried; one that answers but not as a WebSocket is not)."""
    try:
        from websockets.exceptions import InvalidHandshake, InvalidStatus
        from websockets.sync.client import connect as ws_connect
    except ImportError:
        raise EnvironmentFailure(f"{key}: type openenv needs websockets: pip install 'rlpipe[openenv]'") from None

    ws_url = "ws" + url.removeprefix("http") + "/ws"
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(0.5 * 2 ** (attempt - 1))
        try:
            # entered as a context manager: websockets 17 deprecates a bare connect()
            return stack.enter_context(
                ws_connect(ws_url, open_timeout=timeout_s, close_timeout=min(timeout_s, 2.0), max_size=None)
            )
        except InvalidStatus as err:
            raise EnvironmentFailure(
                f"openenv environment {url}/ws reset answered HTTP {err.response.status_code}, not a WebSocket; "
                f"{key}.options.url must name an OpenEnv server (openenv-core's create_app)"
            ) from None
        except InvalidHandshake as err:
            cause = f" ({err.__cause__})" if err.__cause__ else ""
            raise EnvironmentFailure(
                f"openenv environment {url}/ws reset answered {type(err).__name__}: {err}{cause}, not a WebSocket; "
                f"{key}.options.url must name an OpenEnv server (openenv-core's create_app)"
            ) from None
        except (OSError, TimeoutError) as err:
            problem = f"{type(err).__name__}: {err or 'timed out'}"
    raise EnvironmentFailure(
        f"openenv environment {url}/ws reset failed after {retries + 1} attempts ({problem}); "
        f"is an OpenEnv server running at {key}.options.url, and does it answer within {key}.options.timeout_s?"
    )


def exchange(connection: Any, message: dict, url: str, route: str, key: str, timeout_s: float) -> dict:
    """The server's `data` in answer to one message; EnvironmentFailure when none comes within
    `timeout_s`, the connection drops, or the answer is not an observation. Not retried: a step
    sent twice would act twice."""
    from websockets.exceptions import ConnectionClosed

    try:
        connection.send(json.dumps(message))
        raw = connection.recv(timeout=timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(
            f"openenv environment {url}/ws {route} failed after 1 attempts (timed out after {timeout_s} s); "
            f"raise {key}.options.timeout_s if the environment's {route} takes longer"
        ) from None
    except (ConnectionClosed, OSError) as err:
        raise EnvironmentFailure(
            f"openenv environment {url}/ws {route} failed after 1 attempts ({type(err).__name__}: {err}); "
            f"the server at {key}.options.url dropped the session"
        ) from None
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw
    if isinstance(body, dict) and body.get("type") == "error":
        raise EnvironmentFailure(f"openenv environment {url}/ws {route} answered an error: {body.get('data')!r}")
    if not isinstance(body, dict) or body.get("type") != "observation" or not isinstance(body.get("data"), dict):
        raise EnvironmentFailure(
            f"openenv environment {url}/ws {route} answered {body!r}; "
            'expected {"type": "observation", "data": {"observation": {...}, "reward": ..., "done": ...}}'
        )
    return body["data"]


def checked_result(data: dict, url: str, route: str, key: str, observation_field: str | None) -> StepResult:
    """An observation answer as a StepResult; EnvironmentFailure naming the field when it is malformed."""
    observation, reward, done = data.get("observation"), data.get("reward"), data.get("done")
    where = f"openenv environment {url}/ws {route} answered {data!r}"
    if not isinstance(observation, dict):
        raise EnvironmentFailure(f"{where}: `observation` must be an object")
    if reward is not None and not isinstance(reward, (int, float)):
        raise EnvironmentFailure(f"{where}: `reward` must be a number or null")
    if not isinstance(done, bool):
        raise EnvironmentFailure(f"{where}: `done` must be a bool")
    if observation_field is None:
        texts = [name for name, value in observation.items() if isinstance(value, str)]
        if len(texts) != 1:
            raise EnvironmentFailure(
                f"{where}: the observation has string fields {texts}; set {key}.options.observation_field "
                "to the one the model reads"
            )
        observation_field = texts[0]
    text = observation.get(observation_field)
    if not isinstance(text, str):
        raise EnvironmentFailure(
            f"{where}: `observation.{observation_field}` must be a str ({key}.options.observation_field)"
        )
    return StepResult(text, float(reward or 0.0), done, {})


class OpenEnvEnvironment:
    """One trajectory's WebSocket session on an OpenEnv server."""

    def __init__(self, url: str, key: str, options: dict[str, Any]) -> None:
        self.url, self.key = url, key
        self.action_field: str = options.get("action_field", "message")
        self.action: dict[str, Any] = dict(options.get("action", {}))
        self.observation_field: str | None = options.get("observation_field")
        self.timeout_s, self.retries = float(options.get("timeout_s", 30.0)), int(options.get("retries", 2))
        self.stop = tuple(options.get("stop", ["</tool_call>"]))
        self.connection: Any = None
        self.stack = ExitStack()
        self.failed = False

    def call(self, route: str, message: dict) -> StepResult:
        try:
            if self.connection is None:
                self.connection = connect(self.url, self.key, self.timeout_s, self.retries, self.stack)
            data = exchange(self.connection, message, self.url, route, self.key, self.timeout_s)
            return checked_result(data, self.url, route, self.key, self.observation_field)
        except EnvironmentFailure:
            self.failed = True
            raise

    async def reset(self, row: dict[str, Any]) -> str:
        sent = {k: v for k, v in row.items() if k not in NOT_SENT}
        first = await asyncio.to_thread(self.call, "reset", {"type": "reset", "data": sent})
        return first.observation

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        action = self.action | {self.action_field: text}
        return await asyncio.to_thread(self.call, "step", {"type": "step", "data": action})

    def close(self) -> None:
        """Ask the server to end the session and wait for it to close the socket (closing first makes
        openenv's server log a traceback per session); a failed session is dropped without waiting."""
        from websockets.exceptions import ConnectionClosed

        try:
            if self.connection is not None and not self.failed:
                self.connection.send(json.dumps({"type": "close"}))
                self.connection.recv(timeout=min(self.timeout_s, 2.0))
            elif self.connection is not None:
                self.connection.close_timeout = 0
        except (ConnectionClosed, TimeoutError, OSError):
            pass  # closed, as asked; or the server drops the session when the socket goes
        finally:
            self.connection = None
            self.stack.close()


def openenv_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"{key}.options: unknown {sorted(unknown)}; openenv takes {', '.join(OPTIONS)}")
    url = options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{key}.options.url: the OpenEnv server's http(s):// URL, got {url!r}")
    if not isinstance(options.get("action_field", "message"), str):
        raise ValueError(f"{key}.options.action_field: the action field the model's text fills, e.g. message")
    if not isinstance(options.get("action", {}), dict):
        raise ValueError(f"{key}.options.action: fixed action fields, a mapping")
    return lambda: OpenEnvEnvironment(url.rstrip("/"), key, options)
