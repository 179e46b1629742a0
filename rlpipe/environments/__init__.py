"""Environments: multi-turn rollouts, where the model's turns alternate with an environment's observations.

An environment (rollout.environment) is one object per trajectory, as TRL's environment_factory and
SkyRL's BaseTextEnv are:
    reset(row) -> str                         the first observation after the prompt ("" for none)
    step(text, token_ids) -> StepResult       the model's turn (decoded, and as sampled) -> the next
                                              observation, this turn's reward, done, info
    close()
`step` may be `async def` (a remote environment): the turns of a batch then run concurrently.
`stop` lists the strings that end a model turn besides eos (each one token of the tokenizer: the
turn loop stops on token ids), e.g. "=" for the calculator, "</tool_call>" for chat tool calls.

Token-in/token-out (`run_trajectories`): the model's tokens are kept exactly as sampled, and each
observation is tokenized alone and appended; history is never re-rendered, so the update trains on
the very token ids that were sampled. One trajectory = the prompt, then `completion_token_ids` (the
model's and the environment's tokens), `loss_mask` (1 = a model token) and the sampling log-prob of
every token (0.0 at environment tokens, which no loss reads).

`rollout.environment.type` is a registered environment (`register_environment`) or
'package.module:name' for one that module registers. Built in:
  calculator  rlpipe.environments.tools: "37*48=" is answered "1776 " (the tiny model's demo)
  tools       rlpipe.environments.tools: plain Python functions, Hermes-style <tool_call> JSON, and an MCP
              server's tools (options.mcp: rlpipe.environments.mcp_tools)
  remote      rlpipe.environments.remote: an environment service over HTTP (its own pod)
  gymnasium   rlpipe.environments.text_gym: Gymnasium-style text environments (reset / step)
  verifiers   rlpipe.environments.verifiers_env: verifiers 0.4 environments (load_environment, Env.run, rewards)
  openenv     rlpipe.environments.openenv_env: an OpenEnv environment server (reset / step over its WebSocket)
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlpipe.environments.registry import (
    ENVIRONMENTS,
    Environment,
    EnvironmentFailure,
    StepResult,
    environment_factory,
    register_environment,
)
from rlpipe.rollouts import Completions

if TYPE_CHECKING:
    from rlpipe.spec import EnvironmentSpec


# (sequences: prompt and everything so far, max new tokens, stop ids) -> one more turn each, through eos or a stop id
TurnSampler = Callable[[list[list[int]], int, set[int]], Completions]


@dataclass
class Trajectory:
    """One multi-turn rollout after its prompt."""

    completion_token_ids: list[int] = field(default_factory=list)  # model and environment tokens
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob; 0.0 at environment tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 = a model token
    turn_offsets: list[int] = field(default_factory=list)  # where each model turn starts
    turn_rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    finish_reason: str = "stop"  # stop: done after a turn that ended at eos or a stop id; length: a turn or the
    # token budget ran out; turns: the turn limit; error: the environment failed
    final_text: str = ""  # the last model turn, decoded: what the verifier judges
    error: str = ""  # why the environment ended it early ("" if it did not)

    def last_turn(self) -> list[int]:
        return self.completion_token_ids[self.turn_offsets[-1] :]

    def append(self, token_ids: list[int], logprobs: list[float] | None) -> None:
        """Add a model turn (`logprobs` given) or an observation (None)."""
        if logprobs is not None:
            self.turn_offsets.append(len(self.completion_token_ids))
        self.completion_token_ids += token_ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)
        self.loss_mask += [1 if logprobs is not None else 0] * len(token_ids)


@dataclass(frozen=True)
class Codec:
    """Text to token ids and back, as the policy's tokenizer does it, without special tokens added
    (an observation is appended as is) and with them skipped in decoded text."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    @classmethod
    def of(cls, tokenizer: Any) -> Codec:
        """A Hugging Face tokenizer's (PreTrainedTokenizerBase)."""
        return cls(
            lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )


def stop_token_ids(codec: Codec, stop: tuple[str, ...]) -> set[int]:
    """The token id of each stop string; each must be one token, since turns end on token ids."""
    ids = set()
    for text in stop:
        encoded = codec.encode(text)
        if len(encoded) != 1:
            raise ValueError(
                f"rollout.environment: stop string {text!r} is {len(encoded)} tokens of this tokenizer; "
                "a turn ends on one token id: use a stop that is a single (special) token"
            )
        ids.add(encoded[0])
    return ids


async def _answers(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, or the exception it raised; awaitables run concurrently."""

    async def one(call: Callable[[], Any]) -> Any:
        try:
            result = call()
            return await result if inspect.isawaitable(result) else result
        except Exception as err:  # noqa: BLE001 (recorded on the trajectory it ends)
            return err

    return await asyncio.gather(*(one(call) for call in calls))


def answers(calls: list[Callable[[], Any]]) -> list[Any]:
    """`_answers` from synchronous code (the generate step's)."""
    return asyncio.run(_answers(calls))


def run_trajectories(
    sample_turn: TurnSampler,
    make_environment: Callable[[], Environment],
    rows: list[dict[str, Any]],
    prompt_ids: list[list[int]],
    codec: Codec,
    spec: EnvironmentSpec,
    max_new_tokens: int,
) -> list[Trajectory]:
    """Roll out one trajectory per row (rows repeated for a group's samples), all turns batched:

        for turn in 1 .. max_turns:  sample each active sequence's next turn (<= max_new_tokens, <= its budget)
                                     env.step(turn text, turn ids) -> observation, reward, done
                                     done, or the budget spent -> finished; else append the observation

    The budget is spec.max_tokens tokens after the prompt (model and environment). An environment
    that raises ends its trajectory (error recorded, reward 0); when every trajectory fails, so does
    the step, with the first error."""
    environments = [make_environment() for _ in rows]
    trajectories = [Trajectory() for _ in rows]
    try:
        stops = stop_token_ids(codec, tuple(environments[0].stop)) if environments else set()
        first = answers([functools.partial(e.reset, r) for e, r in zip(environments, rows, strict=True)])
        active = []
        for i, observation in enumerate(first):
            if isinstance(observation, Exception):
                fail(trajectories[i], observation)
            elif append_observation(trajectories[i], observation, codec, spec.max_tokens):
                active.append(i)
        for turn in range(spec.max_turns):
            if not active:
                break
            budgets = [spec.max_tokens - len(trajectories[i].completion_token_ids) for i in active]
            sequences = [prompt_ids[i] + trajectories[i].completion_token_ids for i in active]
            sampled = sample_turn(sequences, min(max_new_tokens, max(budgets)), stops)
            texts, ended = [], {}
            for k, i in enumerate(active):
                ids, logprobs = sampled.token_ids[k][: budgets[k]], sampled.logprobs[k][: budgets[k]]
                trajectories[i].append(ids, logprobs)
                texts.append(codec.decode(ids))
                trajectories[i].final_text = texts[-1]
                ended[i] = sampled.finish_reasons[k] == "stop" and len(ids) == len(sampled.token_ids[k])
            results = answers(
                [
                    functools.partial(environments[i].step, t, trajectories[i].last_turn())
                    for i, t in zip(active, texts, strict=True)
                ]
            )
            still = []
            for i, result in zip(active, results, strict=True):
                trajectory = trajectories[i]
                if isinstance(result, Exception):
                    fail(trajectory, result)
                    continue
                trajectory.turn_rewards.append(float(result.reward))
                trajectory.tool_calls += bool(result.info.get("tool_call"))
                if result.done:
                    trajectory.finish_reason = "stop" if ended[i] else "length"
                elif turn == spec.max_turns - 1:
                    trajectory.finish_reason = "turns"
                elif append_observation(trajectory, result.observation, codec, spec.max_tokens):
                    still.append(i)
            active = still
        if rows and all(t.error for t in trajectories):
            raise EnvironmentFailure(
                f"rollout.environment {spec.type!r} failed on every trajectory of this step; the first: "
                f"{trajectories[0].error}"
            )
    finally:
        for environment in environments:
            try:
                environment.close()
            except Exception:  # noqa: BLE001, S110 (a close that fails loses nothing)
                pass
    return trajectories


def append_observation(trajectory: Trajectory, observation: str, codec: Codec, budget: int) -> bool:
    """Append the observation's tokens (tokenized alone); False when they leave no room for a model
    turn within `budget` (the trajectory then ends, finish_reason "length")."""
    ids = codec.encode(observation) if observation else []
    if len(trajectory.completion_token_ids) + len(ids) >= budget:
        trajectory.finish_reason = "length"
        return False
    trajectory.append(ids, None)
    return True


def fail(trajectory: Trajectory, err: Exception) -> None:
    trajectory.error = f"{type(err).__name__}: {err}"
    trajectory.finish_reason = "error"
    trajectory.turn_rewards.append(0.0)


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """rollout/turns_mean, tool_call_rate (the share of trajectories with a tool call), tool_calls_mean,
    model_tokens_mean, environment_error_fraction."""
    n = max(len(trajectories), 1)
    return {
        "rollout/turns_mean": sum(len(t.turn_offsets) for t in trajectories) / n,
        "rollout/tool_call_rate": sum(t.tool_calls > 0 for t in trajectories) / n,
        "rollout/tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "rollout/model_tokens_mean": sum(sum(t.loss_mask) for t in trajectories) / n,
        "rollout/environment_error_fraction": sum(bool(t.error) for t in trajectories) / n,
    }


from rlpipe.environments import remote, text_gym, tools  # noqa: E402 (the built-ins)

register_environment("calculator", tools.calculator_environment)
register_environment("tools", tools.tool_environment)
register_environment("remote", remote.remote_environment)
register_environment("gymnasium", text_gym.gymnasium_environment)

from rlpipe.environments import verifiers_env  # noqa: E402 (imports verifiers only when used)

register_environment("verifiers", verifiers_env.verifiers_environment)

from rlpipe.environments import openenv_env  # noqa: E402 (imports websockets only when used)

register_environment("openenv", openenv_env.openenv_environment)

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentFailure",
    "StepResult",
    "environment_factory",
    "register_environment",
]


def __getattr__(name: str) -> Any:
    if name == "Step":  # one meaning per name: a Step is a pipeline step (rlpipe.steps)
        raise ImportError("rlpipe.environments.Step is now StepResult: rename it in your environment")
    raise AttributeError(f"module 'rlpipe.environments' has no attribute {name!r}")
