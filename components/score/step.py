"""score: run the spec's reward functions over rollouts (no torch).

A reward function is referenced as 'module:function' with TRL's batch signature:
    fn(prompts: list[str], completions: list[str], **columns) -> list[float]
where columns are the rollout columns (reference, prompt_id, ...).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable

import numpy as np

from rlpipe.rollouts import read_table, validate_rollouts, write_table
from rlpipe.spec import RunSpec


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


def load_reward_function(ref: str) -> Callable[..., list[float]]:
    module_name, _, function_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward.functions: cannot import module {module_name!r} for {ref!r}: {err}") from None
    try:
        return getattr(module, function_name)
    except AttributeError:
        raise RewardError(f"reward.functions: module {module_name!r} has no function {function_name!r}") from None


def score_rollouts(spec: RunSpec, rollouts_path: str, out_path: str) -> dict[str, float]:
    """Add `reward` (weighted sum) and `reward/<fn>` columns; return reward statistics."""
    started = time.time()
    table = read_table(rollouts_path)
    validate_rollouts(table)
    columns = table.to_pydict()
    weights = spec.reward.weights or [1.0] * len(spec.reward.functions)
    total = np.zeros(table.num_rows)
    for ref, weight in zip(spec.reward.functions, weights, strict=True):
        fn = load_reward_function(ref)
        extra = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
        try:
            values = fn(columns["prompt"], columns["completion"], **extra)
        except Exception as err:  # a user function: report which one and keep storage untouched
            raise RewardError(f"reward function {ref} raised {type(err).__name__}: {err}") from err
        values = [float(v) for v in values]
        if len(values) != table.num_rows:
            raise RewardError(f"reward function {ref} returned {len(values)} rewards for {table.num_rows} completions")
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"reward function {ref} returned NaN or inf; rewards must be finite")
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
