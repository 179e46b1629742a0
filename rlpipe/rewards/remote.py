"""A reward computed by an HTTP service: {type: remote, url: http://reward-svc:8000/score, ...}.

Each batch of `batch_size` completions is one POST of
    {"prompts": [...], "completions": [...], "columns": {name: [...], ...}}
answered by {"rewards": [...]} (one number per completion). A request that fails to connect, times
out (`timeout_s`) or gets 429/5xx is retried `retries` times with exponential backoff; `concurrency`
batches are in flight at once. `token_env` names an env var holding a bearer token (on a cluster, a
Secret exposed by cluster.secrets), so no secret enters the spec.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlpipe.rewards.registry import RewardError, RewardFunction, register_reward_type
from rlpipe.rewards.shaping import OptionKinds, options_of

# per-token lists a scoring service has no use for; `columns` sends them when named
NOT_SENT = ("prompt_token_ids", "completion_token_ids", "logprobs")


def post_batch(url: str, payload: dict, timeout_s: float, retries: int, headers: dict[str, str], key: str) -> list:
    """The rewards the service answers for one batch, retried with backoff 0.5 s, 1 s, 2 s, ..."""
    from rlpipe.http_json import Unanswered, post_with_retries

    try:
        status, body = post_with_retries(url, payload, timeout_s, retries, headers)
    except Unanswered as err:
        raise RewardError(f"{key}: remote reward {url} failed after {retries + 1} attempts (last: {err})") from None
    if status != 200:
        raise RewardError(f"{key}: remote reward {url} answered HTTP {status}: {body}")
    rewards = body.get("rewards") if isinstance(body, dict) else body
    if not isinstance(rewards, list):
        raise RewardError(f'{key}: remote reward {url} answered {body!r}; expected {{"rewards": [...]}}')
    return rewards


def remote_reward(options: dict[str, Any], key: str) -> RewardFunction:
    allowed: dict[str, OptionKinds] = {
        "url": str,
        "batch_size": int,
        "timeout_s": (int, float),
        "retries": int,
        "concurrency": int,
        "columns": list,
        "token_env": str,
    }
    options_of(options, allowed, ("url",), key, "remote")
    url, batch_size = options["url"], options.get("batch_size", 64)
    timeout_s, retries = float(options.get("timeout_s", 60)), options.get("retries", 3)
    concurrency, wanted = options.get("concurrency", 4), options.get("columns")
    if not url.startswith(("http://", "https://")):
        raise RewardError(f"{key}: remote url {url!r} must start with http:// or https://")
    headers = {}
    if "token_env" in options:
        token = os.environ.get(options["token_env"])
        if not token:
            raise RewardError(f"{key}: remote token_env {options['token_env']} is not set in this step's environment")
        headers["Authorization"] = f"Bearer {token}"

    def score(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        sent = {k: v for k, v in columns.items() if (k in wanted if wanted is not None else k not in NOT_SENT)}
        starts = range(0, len(completions), batch_size)
        payloads = [
            {
                "prompts": prompts[i : i + batch_size],
                "completions": completions[i : i + batch_size],
                "columns": {k: list(v[i : i + batch_size]) for k, v in sent.items()},
            }
            for i in starts
        ]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(lambda p: post_batch(url, p, timeout_s, retries, headers, key), payloads))
        for payload, answer in zip(payloads, answers, strict=True):
            if len(answer) != len(payload["completions"]):
                raise RewardError(
                    f"{key}: remote reward {url} answered {len(answer)} rewards for {len(payload['completions'])}"
                )
        return [value for answer in answers for value in answer]

    return score


register_reward_type("remote", remote_reward)
