"""Rewards: the score step (`score_rollouts`), and the reward functions it calls, resolved one way.

A reward function has TRL's batch signature
    fn(prompts: list[str], completions: list[str], **columns) -> list[float]
where `columns` are every other column of the rows (reference, prompt_id, ...). A verifier is a
reward function whose 1.0 means "correct" (held-out accuracy = its mean).

A `reward.functions` entry is 'module:function', or a mapping {type: <reward type>, ...options}
that a registered reward type builds into a reward function (`register_reward_type`; a type
'package.module:name' is registered by that module, imported first). Built in: `function`
({type: function, function: 'module:function'}); reward models and sandboxed code come next.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.metric_keys import REWARD_MEAN
from rlpipe.plugins import look_up
from rlpipe.rollouts import read_table, validate_rollouts, write_table

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec

RewardFunction = Callable[..., Sequence[float]]
# a reward type: (the entry's options, the spec key naming it) -> a reward function
REWARD_TYPES: dict[str, Callable[[dict[str, Any], str], RewardFunction]] = {}


def register_reward_type(name: str, build: Callable[[dict[str, Any], str], RewardFunction]) -> None:
    REWARD_TYPES[name] = build


class RewardError(RuntimeError):
    """A reward function or verifier failed or returned something unusable; the message names it."""


def load_reward_function(ref: str, key: str = "reward.functions") -> Callable[..., Any]:
    """The callable behind 'module:function'; `key` is the spec key that named it."""
    module_name, _, function_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself failing at import
        raise RewardError(
            f"{key}: cannot import module {module_name!r} for {ref!r} ({type(err).__name__}: {err}); "
            "check the module name and that it is importable (installed, or on PYTHONPATH)"
        ) from None
    fn = getattr(module, function_name, None)
    if fn is None:
        raise RewardError(f"{key}: module {module_name!r} has no function {function_name!r} (from {ref!r})")
    if not callable(fn):
        raise RewardError(f"{key}: {ref} is a {type(fn).__name__}, not a function")
    return fn


def load_reward(entry: str | dict[str, Any], key: str = "reward.functions") -> tuple[str, RewardFunction]:
    """(name, reward function) for a `reward.functions` entry or the verifier (see the module doc)."""
    if isinstance(entry, str):
        return entry.rsplit(":", 1)[-1], load_reward_function(entry, key)
    try:
        short, build = look_up(
            str(entry.get("type")), REWARD_TYPES, f"{key} type", "reward type", "rlpipe.rewards.register_reward_type"
        )
    except ValueError as err:
        raise RewardError(str(err)) from None
    options = {k: v for k, v in entry.items() if k not in ("type", "name")}
    return str(entry.get("name", short)), build(options, key)


def call_reward(
    entry: str | dict[str, Any],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: dict[str, Sequence[Any]],
    key: str,
) -> list[float]:
    """Call the reward `entry` names on a batch and check what it returns: one finite number per
    completion. Every failure raises RewardError naming the reward and the spec key."""
    name, fn = load_reward(entry, key)
    return checked_rewards(entry if isinstance(entry, str) else name, fn, prompts, completions, columns, key)


def checked_rewards(
    ref: str,
    fn: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: dict[str, Sequence[Any]],
    key: str,
) -> list[float]:
    """fn's rewards for the batch, checked: one finite number per completion (RewardError naming `ref`)."""
    try:
        values = fn(list(prompts), list(completions), **columns)
    except Exception as err:  # a user function: say which one, keep storage untouched
        raise RewardError(f"{key}: {ref} raised {type(err).__name__}: {err}") from None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(
            f"{key}: {ref} returned {type(values).__name__}; it must return a list of floats, one per completion"
        )
    if len(values) != len(completions):
        raise RewardError(f"{key}: {ref} returned {len(values)} values for {len(completions)} completions")
    rewards: list[float] = []
    for index, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"{key}: {ref} returned {value!r} for completion {index}; rewards must be numbers"
            ) from None
        if not math.isfinite(number):
            raise RewardError(
                f"{key}: {ref} returned {number} for completion {index}; rewards must be finite (no NaN or inf)"
            )
        rewards.append(number)
    return rewards


def score_rollouts(spec: RunSpec, rollouts_path: str, out_path: str) -> dict[str, float]:
    """Add `reward` (weighted sum) and `reward/<fn>` columns; return reward statistics."""
    started = time.time()
    table = read_table(rollouts_path)
    validate_rollouts(table)
    columns = table.to_pydict()
    extra = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
    weights = spec.reward.weights or [1.0] * len(spec.reward.functions)
    total = np.zeros(table.num_rows)
    for entry, weight in zip(spec.reward.functions, weights, strict=True):
        name, fn = load_reward(entry, "reward.functions")
        ref = entry if isinstance(entry, str) else name
        values = checked_rewards(ref, fn, columns["prompt"], columns["completion"], extra, "reward.functions")
        columns[f"reward/{name}"] = values
        total += weight * np.asarray(values)
    columns["reward"] = total.tolist()
    write_table(columns, out_path)
    return {
        REWARD_MEAN: float(total.mean()),
        "reward/std": float(total.std()),
        "reward/min": float(total.min()),
        "reward/max": float(total.max()),
        "time/score_s": time.time() - started,
    }


def _function_reward(options: dict[str, Any], key: str) -> RewardFunction:
    """{type: function, function: 'module:function'}: the same as the string form."""
    if not isinstance(options.get("function"), str):
        raise RewardError(f"{key}: a reward of type function needs `function: 'package.module:function'`")
    return load_reward_function(options["function"], key)


register_reward_type("function", _function_reward)
