"""Shaping rewards, built from their options in a `reward.functions` entry:

{type: regex, pattern: '<think>.*</think>.*', mode: full}   format reward: 1.0 when it matches
{type: length_penalty, max_tokens: 512, buffer_tokens: 128}  DAPO's soft overlong punishment
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlpipe.rewards.registry import RewardError, RewardFunction, register_reward_type

# what an option may be: one type, or any of a tuple of them (isinstance's second argument)
OptionKinds = type | tuple[type, ...]


def options_of(
    options: dict[str, Any], allowed: Mapping[str, OptionKinds], required: tuple[str, ...], key: str, kind: str
) -> dict[str, Any]:
    """`options` checked against the names and types a reward type takes; RewardError otherwise."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RewardError(f"{key}: {kind} does not take {unknown}; it takes {', '.join(sorted(allowed))}")
    for name in required:
        if name not in options:
            raise RewardError(f"{key}: {kind} needs `{name}`")
    for name, value in options.items():
        allowed_kinds = allowed[name]
        kinds = allowed_kinds if isinstance(allowed_kinds, tuple) else (allowed_kinds,)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise RewardError(f"{key}: {kind} option {name} must be {' or '.join(k.__name__ for k in kinds)}")
    return options


def regex_reward(options: dict[str, Any], key: str) -> RewardFunction:
    """1.0 when the completion matches `pattern` (mode full: the whole completion, search: anywhere;
    `flags`: letters of re flags, e.g. 's' for DOTALL), else 0.0."""
    options_of(options, {"pattern": str, "mode": str, "flags": str, "value": (int, float)}, ("pattern",), key, "regex")
    mode = options.get("mode", "full")
    if mode not in ("full", "search"):
        raise RewardError(f"{key}: regex mode must be full or search, not {mode!r}")
    flags = 0
    for letter in options.get("flags", ""):
        flags |= {"s": re.DOTALL, "i": re.IGNORECASE, "m": re.MULTILINE}.get(letter, 0) or _bad_flag(letter, key)
    try:
        pattern = re.compile(options["pattern"], flags)
    except re.error as err:
        raise RewardError(f"{key}: regex pattern {options['pattern']!r} does not compile: {err}") from None
    match = pattern.fullmatch if mode == "full" else pattern.search
    value = float(options.get("value", 1.0))

    def regex(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [value if match(c) else 0.0 for c in completions]

    return regex


def _bad_flag(letter: str, key: str) -> int:
    raise RewardError(f"{key}: regex flag {letter!r} is not one of s, i, m")


def length_penalty(options: dict[str, Any], key: str) -> RewardFunction:
    """DAPO's soft overlong punishment of a completion of L tokens, with L_max = max_tokens and
    L_cache = buffer_tokens:
        R = 0                                   if L <= L_max - L_cache
        R = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (0 down to -1)
        R = -1                                  if L > L_max
    L counts the completion's sampled tokens (the completion_token_ids column; of a multi-turn
    trajectory, the model's: its loss_mask)."""
    options_of(
        options, {"max_tokens": int, "buffer_tokens": int}, ("max_tokens", "buffer_tokens"), key, "length_penalty"
    )
    limit, buffer = options["max_tokens"], options["buffer_tokens"]
    if not 0 < buffer <= limit:
        raise RewardError(f"{key}: length_penalty needs 0 < buffer_tokens <= max_tokens")

    def penalty(
        prompts: list[str], completions: list[str], completion_token_ids: list, loss_mask: list | None = None, **_: Any
    ) -> list[float]:
        scores = []
        for ids, mask in zip(completion_token_ids, loss_mask or [None] * len(completion_token_ids), strict=True):
            length = len(ids) if mask is None else sum(mask)
            scores.append(
                0.0 if length <= limit - buffer else -1.0 if length > limit else (limit - buffer - length) / buffer
            )
        return scores

    return penalty


register_reward_type("regex", regex_reward)
register_reward_type("length_penalty", length_penalty)
