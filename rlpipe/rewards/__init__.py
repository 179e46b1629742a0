"""Rewards: the score step (`score_rollouts`), and the reward functions it calls, resolved one way.

A reward function has TRL's batch signature
    fn(prompts: list[str], completions: list[str], **columns) -> list[float]
where `columns` are every other column of the rows: the data's (reference, ...) and the rollout's
(prompt_id, completion_token_ids, ...). It may be `async def`; each call gets reward.timeout_s.
It may return `Rewards(values, reasons)`, a list that also says why each value is what it is
(recorded as the column reward/<name>/reason). A verifier is a reward function whose 1.0 means
"correct" (held-out accuracy = its mean).

A `reward.functions` entry is 'module:function', or a mapping {type: <reward type>, ...options}
that a registered reward type builds into a reward function (`register_reward_type`; a type
'package.module:name' is registered by that module, imported first); `guard: true` in any mapping
scores 0 the completions that game a verifier (rlpipe.rewards.answer_guard). Built in:
  function       {type: function, function: 'module:function'}
  environment    a multi-turn trajectory's reward from its environment (rlpipe.environments)
  regex          rlpipe.rewards.shaping: 1.0 when the completion matches a pattern (format rewards)
  length_penalty rlpipe.rewards.shaping: DAPO's soft overlong punishment
  reward_model   rlpipe.rewards.reward_model: AutoModelForSequenceClassification, batched
  remote         rlpipe.rewards.remote: an HTTP endpoint, batched, with timeouts and retries
  code_sandbox   rlpipe.rewards.sandbox: candidate programs run against tests under limits
  verifiers      rlpipe.rewards.verifiers_tasks: a verifiers 0.4 environment's task rewards
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlpipe.metric_keys import REWARD_COUNT, REWARD_MAX, REWARD_MEAN, REWARD_STD
from rlpipe.plugins import look_up
from rlpipe.rewards.registry import REWARD_TYPES, RewardError, RewardFunction, Rewards, register_reward_type
from rlpipe.rollouts import read_table, validate_rollouts, write_table

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


# rlpipe's modules renamed since a spec could name them: refused (at pre-flight) with the path to write instead
RENAMED_MODULES = {
    "rlpipe.rewards.verifiers": (  # 2026-11-28: `verifiers` is the PyPI package of environments
        "rlpipe.rewards.answer_checks",
        "rlpipe's answer checks were renamed so that `verifiers` names only the PyPI package of environments",
    ),
}


def load_reward_function(target: str, key: str = "reward.functions") -> Callable[..., Any]:
    """The callable behind 'module:function'; `key` is the spec key that named it."""
    module_name, _, function_name = target.partition(":")
    if module_name in RENAMED_MODULES:
        new, why = RENAMED_MODULES[module_name]
        raise RewardError(
            f"{key}: {module_name} is now {new} ({why}); write {new}:{function_name} instead of {target!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself failing at import
        raise RewardError(
            f"{key}: cannot import module {module_name!r} for {target!r} ({type(err).__name__}: {err}); "
            "check the module name and that it is importable (installed, or on PYTHONPATH)"
        ) from None
    fn = getattr(module, function_name, None)
    if fn is None:
        raise RewardError(f"{key}: module {module_name!r} has no function {function_name!r} (from {target!r})")
    if not callable(fn):
        raise RewardError(f"{key}: {target} is a {type(fn).__name__}, not a function")
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
    guard = entry.get("guard", False)
    if not isinstance(guard, bool):
        raise RewardError(f"{key}: guard must be true or false (rlpipe.rewards.answer_guard), not {guard!r}")
    fn = build({k: v for k, v in entry.items() if k not in ("type", "name", "guard")}, key)
    if guard:
        from rlpipe.rewards.answer_guard import with_guard

        fn = with_guard(fn)
    return str(entry.get("name", short)), fn


def reward_label(entry: str | dict[str, Any], name: str) -> str:
    """How errors name a reward: its 'module:function', or its name and type."""
    return entry if isinstance(entry, str) else f"{name} ({{type: {entry.get('type')}}})"


def call_with_timeout(
    fn: RewardFunction, args: tuple, kwargs: Mapping[str, Any], timeout_s: float | None, label: str
) -> Any:
    """fn(*args, **kwargs), awaited when it is async, in a thread given `timeout_s` seconds. A call
    past its time raises TimeoutError (the thread is left behind: Python cannot stop it)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            outcome["value"] = result
        except BaseException as err:  # noqa: BLE001 (handed to the caller)
            outcome["error"] = err

    worker = threading.Thread(target=run, name=f"reward {label}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"took longer than reward.timeout_s={timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def call_reward(
    entry: str | dict[str, Any],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    key: str,
    timeout_s: float | None = None,
    loaded: tuple[str, RewardFunction] | None = None,
) -> list[float]:
    """Call the reward `entry` names on a batch and check what it returns: one finite number per
    completion (a `Rewards` result keeps its reasons). Every failure raises RewardError naming the
    reward and the spec key. `loaded`: load_reward(entry, key), when the caller has it already."""
    name, fn = loaded or load_reward(entry, key)
    target = reward_label(entry, name)
    try:
        values = call_with_timeout(fn, (list(prompts), list(completions)), columns, timeout_s, target)
    except Exception as err:  # a user function: say which one, keep storage untouched
        raise RewardError(f"{key}: {target} raised {type(err).__name__}: {err}") from None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(
            f"{key}: {target} returned {type(values).__name__}; it must return a list of floats, one per completion"
        )
    if len(values) != len(completions):
        raise RewardError(f"{key}: {target} returned {len(values)} values for {len(completions)} completions")
    rewards: list[float] = []
    for index, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"{key}: {target} returned {value!r} for completion {index}; rewards must be numbers"
            ) from None
        if not math.isfinite(number):
            raise RewardError(
                f"{key}: {target} returned {number} for completion {index}; rewards must be finite (no NaN or inf)"
            )
        rewards.append(number)
    return Rewards(rewards, values.reasons) if isinstance(values, Rewards) else rewards


def score_rollouts(spec: RunSpec, rollouts_path: str, out_path: str) -> dict[str, float]:
    """Add `reward` (weighted sum) and `reward/<fn>` columns; return reward statistics."""
    started = time.time()
    table = read_table(rollouts_path)
    validate_rollouts(table)
    columns = table.to_pydict()
    extra = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
    reward_weights = spec.reward.weights or [1.0] * len(spec.reward.functions)
    total = np.zeros(table.num_rows)
    stats: dict[str, float] = {}
    for entry, reward_weight in zip(spec.reward.functions, reward_weights, strict=True):
        name, fn = load_reward(entry, "reward.functions")
        prompts, completions = columns["prompt"], columns["completion"]
        values = call_reward(entry, prompts, completions, extra, "reward.functions", spec.reward.timeout_s, (name, fn))
        columns[f"reward/{name}"] = list(values)
        stats[f"reward/{name}/mean"] = float(np.mean(values))
        if isinstance(values, Rewards):
            columns[f"reward/{name}/reason"] = values.reasons
        total += reward_weight * np.asarray(values)
    if "environment_error" in columns:  # a trajectory its environment ended by failing scores 0
        failed = np.asarray([bool(error) for error in columns["environment_error"]])
        total[failed] = 0.0
        stats["reward/environment_error_fraction"] = float(failed.mean())
    columns["reward"] = total.tolist()
    write_table(columns, out_path)
    return stats | {
        REWARD_MEAN: float(total.mean()),
        REWARD_STD: float(total.std()),
        "reward/min": float(total.min()),
        REWARD_MAX: float(total.max()),
        REWARD_COUNT: float(total.size),
        "time/score_s": time.time() - started,
    }


def _function_reward(options: dict[str, Any], key: str) -> RewardFunction:
    """{type: function, function: 'module:function'}: the same as the string form."""
    if not isinstance(options.get("function"), str):
        raise RewardError(f"{key}: a reward of type function needs `function: 'package.module:function'`")
    return load_reward_function(options["function"], key)


def _environment_reward(options: dict[str, Any], key: str) -> RewardFunction:
    """{type: environment}: a multi-turn trajectory's reward from its environment (the sum of its turns')."""
    if options:
        raise RewardError(f"{key}: a reward of type environment takes no options, got {sorted(options)}")

    def environment(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        if "environment_reward" not in columns:
            raise RewardError(
                f"{key}: type environment reads the environment_reward column, which only multi-turn rollouts "
                "have; set rollout.environment or remove this reward"
            )
        return [float(value) for value in columns["environment_reward"]]

    return environment


register_reward_type("function", _function_reward)
register_reward_type("environment", _environment_reward)

# the built-in reward types register themselves in rlpipe.rewards.registry (each imports its heavy parts when built)
from rlpipe.rewards import answer_checks, remote, reward_model, sandbox, shaping, verifiers_tasks  # noqa: E402, F401

__all__ = ["REWARD_TYPES", "RewardError", "RewardFunction", "Rewards", "register_reward_type"]
