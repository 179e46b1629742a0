"""An environment that runs as its own service: {type: remote, options: {url: http://calc-env:8000}}.

On a cluster an environment that needs isolation or its own scaling (a sandbox, a browser, a search
index) runs as a Deployment beside the pipeline (manifests/base/environment-service.yaml: deny-all
egress, like the score step's sandbox), and the generate step speaks to it over JSON:

    POST {url}/reset  {"row": {...the data columns}}                  -> {"session": str, "observation": str}
    POST {url}/step   {"session": str, "text": str, "token_ids": [...]} -> {"observation": str, "reward": float,
                                                                           "done": bool, "info": {...}}
    POST {url}/close  {"session": str}                                 (best effort)

`rlpipe serve-environment` (rlpipe.environments.server) serves any registered environment
so. Calls run concurrently (each trajectory's in a thread); one that cannot connect, times out
(`timeout_s`) or gets 429/5xx is retried `retries` times with backoff; what still fails, or an answer
that is not the shape above, ends that trajectory with the error recorded (reward 0).
Options: url, timeout_s (30), retries (2), stop (the turn-ending strings, ["</tool_call>"]).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rlpipe.environments.registry import Environment, EnvironmentFailure, StepResult

NOT_SENT = ("prompt_token_ids",)


def call(url: str, route: str, payload: dict, timeout_s: float, retries: int) -> dict:
    """The service's JSON answer to POST {url}/{route}, retried with backoff 0.5 s, 1 s, ..."""
    from rlpipe.http_json import Unanswered, post_with_retries

    try:
        status, body = post_with_retries(f"{url}/{route}", payload, timeout_s, retries)
    except Unanswered as err:
        raise EnvironmentFailure(
            f"remote environment {url}/{route} failed after {retries + 1} attempts ({err})"
        ) from None
    if status != 200 or not isinstance(body, dict):
        raise EnvironmentFailure(f"remote environment {url}/{route} answered HTTP {status}: {body!r}")
    return body


def checked_step(body: dict, url: str) -> StepResult:
    """A /step answer as a StepResult; EnvironmentFailure naming the field when it is malformed."""
    expected: dict[str, type | tuple[type, ...]] = {"observation": str, "reward": (int, float), "done": bool}
    for name, kind in expected.items():
        if not isinstance(body.get(name), kind):
            raise EnvironmentFailure(
                f"remote environment {url}/step answered {body!r}: `{name}` must be a "
                f"{kind.__name__ if isinstance(kind, type) else 'number'}"
            )
    info = body.get("info") or {}
    return StepResult(body["observation"], float(body["reward"]), body["done"], info if isinstance(info, dict) else {})


class RemoteEnvironment:
    """One trajectory's session on an environment service."""

    def __init__(self, url: str, timeout_s: float, retries: int, stop: tuple[str, ...]) -> None:
        self.url, self.timeout_s, self.retries, self.stop = url, timeout_s, retries, stop
        self.session: str | None = None

    async def reset(self, row: dict[str, Any]) -> str:
        sent = {k: v for k, v in row.items() if k not in NOT_SENT}
        body = await asyncio.to_thread(call, self.url, "reset", {"row": sent}, self.timeout_s, self.retries)
        if not isinstance(body.get("session"), str) or not isinstance(body.get("observation"), str):
            raise EnvironmentFailure(
                f"remote environment {self.url}/reset answered {body!r}; "
                'expected {"session": str, "observation": str}'
            )
        self.session = body["session"]
        return body["observation"]

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        payload = {"session": self.session, "text": text, "token_ids": list(token_ids)}
        body = await asyncio.to_thread(call, self.url, "step", payload, self.timeout_s, self.retries)
        return checked_step(body, self.url)

    def close(self) -> None:
        if self.session is not None:
            try:
                call(self.url, "close", {"session": self.session}, self.timeout_s, 0)
            except EnvironmentFailure:
                pass  # the service forgets idle sessions itself


def remote_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    unknown = set(options) - {"url", "timeout_s", "retries", "stop"}
    if unknown:
        raise ValueError(f"{key}.options: unknown {sorted(unknown)}; remote takes url, timeout_s, retries, stop")
    url = options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{key}.options.url: the environment service's http(s):// URL, got {url!r}")
    timeout_s, retries = float(options.get("timeout_s", 30.0)), int(options.get("retries", 2))
    stop = tuple(options.get("stop", ["</tool_call>"]))
    return lambda: RemoteEnvironment(url.rstrip("/"), timeout_s, retries, stop)
