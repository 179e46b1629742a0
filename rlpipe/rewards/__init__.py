"""Rewards: the score step, and reward functions and verifiers resolved from 'module:function'
and called with one contract.

A reward function has TRL's batch signature
    fn(prompts: list[str], completions: list[str], **columns) -> list[float]
where `columns` are every other column of the rows (reference, prompt_id, ...). A verifier is a
reward function whose 1.0 means "correct" (held-out accuracy = its mean).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.rollouts import read_table, validate_rollouts, write_table

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


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


def call_reward(
    ref: str, prompts: Sequence[str], completions: Sequence[str], columns: dict[str, Sequence[Any]], key: str
) -> list[float]:
    """Call the function behind `ref` on a batch and check what it returns: one finite number per
    completion. Every failure raises RewardError naming `ref` and the spec key."""
    fn = load_reward_function(ref, key)
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
    for ref, weight in zip(spec.reward.functions, weights, strict=True):
        values = call_reward(ref, columns["prompt"], columns["completion"], extra, "reward.functions")
        columns[f"reward/{ref.rsplit(':', 1)[1]}"] = values
        total += weight * np.asarray(values)
    columns["reward"] = total.tolist()
    write_table(columns, out_path)
    return {
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std()),
        "reward/min": float(total.min()),
        "reward/max": float(total.max()),
        "time/score_s": time.time() - started,
    }
