"""verifiers environments (PyPI `verifiers` 0.4), trained on as their users load them: the multi-turn side.

A verifiers 0.4 environment is an installed module (its id) exporting a Taskset subclass and, for
multi-turn logic, an Env subclass; rlpipe.rewards.verifiers_tasks loads it with its arguments, makes its
tasks data rows and scores with its tasks' rewards. Here, rollout.environment
{type: verifiers, options: {env_id, args, env_args, observation, tool_observation, stop}}: the Env's
`run(task, agents)` plays each trajectory with rlpipe's policy in its one agent seat; each
`interaction.turn(message)` is an observation, each reply a model turn, and when `run` returns the
task's rewards score the trace (the trajectory's reward, {type: environment}). A Task's Toolsets answer
Hermes-style <tool_call> turns in-process. Harness programs, runtimes (sandboxes) and multi-agent envs
are not run: see docs/environments.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from rlpipe.environments.registry import Environment, EnvironmentFailure, StepResult, background_loop
from rlpipe.rewards.verifiers_tasks import add_message, load, new_trace, task_of

CHATML_USER = "<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
CHATML_TOOL = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
OPTIONS = {"env_id", "args", "env_args", "observation", "tool_observation", "stop"}


def tools_of(env: Any, task: Any) -> dict[str, Callable[..., Any]]:
    """The `@vf.tool` methods of the task's and the taskset's Toolsets, by tool name."""
    from verifiers.v1.utils.decorators import discover_decorated

    toolsets = [*type(task).toolsets(task.config), *type(env.taskset).toolsets(env.taskset.config)]
    return {
        getattr(fn, "tool_name", None) or fn.__name__: fn
        for toolset in toolsets
        for fn in discover_decorated(toolset, "tool")
    }


class Episode:
    """One trajectory's `Env.run`, on the background loop, paused at each model turn.

    `request` resolves when the Env wants a model turn (("turn", observation, info)) or is done
    (("done", reward, info)); `reply` is the pending model turn's text."""

    def __init__(self, env: Any, task: Any, templates: tuple[str, str]) -> None:
        self.env, self.task, self.templates = env, task, templates
        self.tools = tools_of(env, task)
        self.seat: str | None = None
        self.trace: Any = None
        self.reply: asyncio.Future | None = None
        self.request: Future = Future()
        self.running: Future | None = None

    def start(self) -> None:
        self.running = asyncio.run_coroutine_threadsafe(self.play(), background_loop())

    async def play(self) -> None:
        try:
            await self.env.run(self.task, Seats(self))
            if self.trace is None:
                raise EnvironmentFailure(f"{type(self.env).__name__}.run ended without asking the model anything")
            await self.task.score(self.trace)
            rewards = {name: r.score for name, r in self.trace.rewards.items() if r is not None}
            self.request.set_result(("done", self.trace.reward, {"rewards": rewards}))
        except Exception as err:  # noqa: BLE001 (ends this trajectory, recorded by the turn loop)
            if not self.request.done():
                self.request.set_exception(err)

    async def ask(self, observation: str, info: dict[str, Any]) -> str:
        """Hand rlpipe the observation before the next model turn; the turn's text."""
        self.reply = asyncio.get_running_loop().create_future()
        self.request.set_result(("turn", observation, info))
        return await self.reply

    def answer(self, text: str) -> Future:
        """Deliver the model's turn; the future of what the Env asks next."""
        assert self.reply is not None  # ask() made it before it asked for this turn
        self.request = Future()
        background_loop().call_soon_threadsafe(self.reply.set_result, text)
        return self.request


class Seats:
    """The Env's `agents`: rlpipe's policy plays one seat (the name the Env asks for first)."""

    def __init__(self, episode: Episode) -> None:
        self._episode = episode

    def __getattr__(self, name: str) -> Seat:
        episode = self._episode
        if episode.seat not in (None, name):
            raise EnvironmentFailure(
                f"{type(episode.env).__name__} asks for agent seats {episode.seat!r} and {name!r}; "
                "rlpipe's policy plays one seat (multi-agent verifiers envs are not supported)"
            )
        episode.seat = name
        return Seat(episode, name)


class Seat:
    """What `agents.<seat>` is to the Env: `interaction(task)` and `run(task)` (one segment)."""

    def __init__(self, episode: Episode, name: str) -> None:
        self.episode, self.name = episode, name

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        self.episode.trace = new_trace(task, self.name)
        yield Channel(self.episode, task.data.prompt is not None)

    async def run(self, task: Any, **_: Any) -> Any:
        async with self.interaction(task) as channel:
            await channel.turn()
        return self.episode.trace


class Channel:
    """An interaction: `turn(message)` renders the message as the observation and returns the model's
    reply as a verifiers Segment (tool calls answered within the segment, as a harness does)."""

    def __init__(self, episode: Episode, prompted: bool) -> None:
        self.episode, self.prompted, self.started = episode, prompted, False

    @property
    def trace(self) -> Any:
        return self.episode.trace

    async def close(self) -> Any:
        return self.episode.trace

    async def turn(self, message: Any = None) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.types import content_text

        episode, (user_template, tool_template) = self.episode, self.episode.templates
        if message is None and (self.started or not self.prompted):
            raise ValueError("a bare turn() takes a prompted task's opening reply; later turns take a message")
        messages = [vf.UserMessage(content=message)] if isinstance(message, str) else list(message or [])
        messages = [vf.UserMessage(**m) if isinstance(m, dict) else m for m in messages]
        for m in messages:
            add_message(self.trace, m, False)
        text = "\n".join(content_text(m.content) for m in messages)
        self.started = True
        reply = await episode.ask(user_template.format(content=text) if messages else "", {})
        produced = []
        while True:
            call, result = await call_tool(episode.tools, reply) if episode.tools else (None, "")
            calls = [vf.ToolCall(id=f"call_{len(self.trace.nodes)}", **call)] if call else None
            produced.append(vf.AssistantMessage(content=reply, tool_calls=calls))
            add_message(self.trace, produced[-1], True)
            if call is None:
                return vf.Segment(messages=produced)
            assert calls is not None  # made from this turn's call
            produced.append(vf.ToolMessage(tool_call_id=calls[0].id, content=result, name=call["name"]))
            add_message(self.trace, produced[-1], False)
            info = {"tool_call": True, "tool": call["name"]}
            reply = await episode.ask(tool_template.format(content=result), info)


async def call_tool(tools: dict[str, Callable[..., Any]], text: str) -> tuple[dict[str, str] | None, str]:
    """The turn's Hermes-style tool call ({name, arguments as JSON}) and its result; (None, "") for a
    turn that calls no tool. A call that fails answers with the error, as a real tool server would."""
    import inspect

    from rlpipe.environments.tools import parse_call

    try:
        parsed = parse_call(text, "hermes")
    except ValueError as err:
        return {"name": "", "arguments": "{}"}, f"error: {err}"
    if parsed is None:
        return None, ""
    name, arguments = parsed
    call = {"name": name, "arguments": json.dumps(arguments)}
    if name not in tools:
        return call, f"error: no tool {name!r}; tools: {', '.join(tools)}"
    try:
        result = tools[name](**arguments)
        return call, str(await result if inspect.isawaitable(result) else result)
    except Exception as err:  # noqa: BLE001 (the model sees the error)
        return call, f"error: {type(err).__name__}: {err}"


class VerifiersEnvironment:
    """rlpipe's environment interface over one verifiers episode."""

    def __init__(self, env: Any, templates: tuple[str, str], stop: tuple[str, ...]) -> None:
        self.env, self.templates, self.stop = env, templates, stop
        self.episode: Episode | None = None

    async def reset(self, row: dict[str, Any]) -> str:
        self.episode = Episode(self.env, task_of(self.env, row), self.templates)
        self.episode.start()
        kind, observation, _ = await asyncio.wrap_future(self.episode.request)
        if kind == "done":
            raise EnvironmentFailure(f"{type(self.env).__name__}.run ended before the model's first turn")
        return observation

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        assert self.episode is not None  # reset started it: the turn loop resets before any step
        kind, value, info = await asyncio.wrap_future(self.episode.answer(text))
        if kind == "done":
            return StepResult(reward=float(value), done=True, info=info)
        return StepResult(value, info=info)

    def close(self) -> None:
        if self.episode is not None and self.episode.running is not None:
            self.episode.running.cancel()


def verifiers_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    """{env_id, args, env_args, observation: '...{content}...', tool_observation, stop: [...]}."""
    key = f"{key}.options"
    unknown = set(options) - OPTIONS
    if unknown:
        raise ValueError(
            f"{key}: unknown {sorted(unknown)}; the verifiers environment takes {', '.join(sorted(OPTIONS))}"
        )
    env = load(options, key)
    templates = (options.get("observation", CHATML_USER), options.get("tool_observation", CHATML_TOOL))
    stop = tuple(options.get("stop", ()))
    return lambda: VerifiersEnvironment(env, templates, stop)
