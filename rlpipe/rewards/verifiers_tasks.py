"""A verifiers 0.4 environment's tasks (PyPI `verifiers`, `pip install 'rlpipe[verifiers]'`): the environment
loaded by id with its arguments, its tasks as data rows and back, and its tasks' rewards as reward type `verifiers`.

    data.generator verifiers {env_id, args, shuffle}      the taskset's tasks as rows: prompt, reference (the
                                                           task's `answer`, when it has one), task (TaskData JSON)
    reward {type: verifiers, env_id, args, env_args}      a completion scored by its task's `@vf.reward`
                                                           functions, weighted, as verifiers scores a trace

The multi-turn side (an Env's `run` answering the model's turns) is rlpipe.environments.verifiers_env.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from rlpipe.rewards.registry import RewardError, register_reward_type


def load(options: dict[str, Any], key: str) -> Any:
    """The verifiers Env that options.env_id (+ args for its taskset, env_args for the Env) names."""
    try:
        import verifiers.v1 as vf
        from pydantic import ValidationError
    except ImportError as err:
        raise ValueError(
            f"{key}: verifiers is not installed ({err}); "
            "pip install 'rlpipe[verifiers]' && pip install --no-deps verifiers==0.4.0"
        ) from None
    env_id, args, env_args = options.get("env_id"), options.get("args") or {}, options.get("env_args") or {}
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"{key}.env_id: the verifiers environment's id (its installed module), got {env_id!r}")
    if not isinstance(args, dict) or not isinstance(env_args, dict):
        raise ValueError(f"{key}.args and {key}.env_args: mappings of the environment's arguments")
    try:
        config = vf.resolve_env_config({**env_args, "taskset": {**args, "id": env_id}})
    except ModuleNotFoundError as err:
        raise ValueError(f"{key}.env_id {env_id!r}: {err}") from None
    except ValidationError as err:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        bad = bad.replace("taskset.", f"{key}.args.").replace("taskset: ", f"{key}.args: ")
        raise ValueError(f"{key}: verifiers environment {env_id!r} rejects its arguments ({bad})") from None
    try:
        return vf.load_environment(config)
    except Exception as err:  # the environment's own constructor or loader failing
        raise ValueError(f"{key}.env_id {env_id!r}: loading failed ({type(err).__name__}: {err})") from None


def task_of(env: Any, row: dict[str, Any]) -> Any:
    """The row's verifiers Task: its `task` column (TaskData as JSON, from the verifiers data source),
    else the TaskData fields among its columns."""
    task_type = type(env.taskset).task_type()
    data_type = task_type.data_type()
    if row.get("task"):
        data = data_type.model_validate(json.loads(row["task"]))
    else:
        data = data_type.model_validate({k: v for k, v in row.items() if k in data_type.model_fields})
    return task_type(data, env.taskset.config.task)


def task_rows(rng: Any, n: int, **options: Any) -> list[dict[str, Any]]:
    """data.generator verifiers {env_id, args, env_args, shuffle}: the taskset's first n tasks (shuffled with
    the data seed first when `shuffle`) as rows; a prompt is text, or chat messages with a system prompt."""
    shuffle = options.pop("shuffle", False)
    unknown = set(options) - {"env_id", "args", "env_args"}
    if unknown:
        takes = "env_id, args, env_args, shuffle"
        raise ValueError(f"data.options: unknown {sorted(unknown)}; the verifiers source takes {takes}")
    taskset = load(options, "data.options").taskset
    rows = []
    for task in (taskset.shuffle(rng.randrange(2**31)) if shuffle else taskset).take(n):
        data = task.data
        row = {"prompt": prompt_of(data), "task": data.model_dump_json(exclude_none=True)}
        if isinstance(getattr(data, "answer", None), str | int | float):
            row["reference"] = str(data.answer)
        rows.append(row)
    return rows


def prompt_of(data: Any) -> str | list[dict[str, str]]:
    from verifiers.v1.types import content_text

    if isinstance(data.prompt, str) and not data.system_prompt:
        return data.prompt
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]


def new_trace(task: Any, seat: str) -> Any:
    """A verifiers Trace of `task` holding its opening messages (system prompt, prompt)."""
    import verifiers.v1 as vf

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat),
    )
    if task.data.system_prompt:
        add_message(trace, vf.SystemMessage(content=task.data.system_prompt), False)
    if isinstance(task.data.prompt, str):
        add_message(trace, vf.UserMessage(content=task.data.prompt), False)
    for message in task.data.prompt if isinstance(task.data.prompt, list) else []:
        add_message(trace, message, False)
    return trace


def add_message(trace: Any, message: Any, sampled: bool) -> None:
    """Append `message` to the trace's one branch (sampled: the model wrote it)."""
    import verifiers.v1 as vf

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))


async def score_completion(env: Any, row: dict[str, Any], completion: str) -> float:
    """The task's rewards (weighted sum) on one reply to its prompt."""
    import verifiers.v1 as vf

    task = task_of(env, row)
    trace = new_trace(task, "agent")
    add_message(trace, vf.AssistantMessage(content=completion), True)
    await task.score(trace)
    return trace.reward


def rubric_reward(options: dict[str, Any], key: str) -> Callable[..., Any]:
    """Reward type verifiers {env_id, args, env_args}: each completion scored by its task's rewards."""
    unknown = set(options) - {"env_id", "args", "env_args"}
    if unknown:
        raise RewardError(f"{key}: unknown {sorted(unknown)}; a reward of type verifiers takes env_id, args, env_args")
    try:
        env = load(options, key)
    except ValueError as err:
        raise RewardError(str(err)) from None

    async def verifiers_rewards(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        rows = [{name: values[i] for name, values in columns.items()} for i in range(len(completions))]
        return list(await asyncio.gather(*(score_completion(env, r, c) for r, c in zip(rows, completions))))

    return verifiers_rewards


register_reward_type("verifiers", rubric_reward)
