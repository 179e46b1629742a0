"""Tool-calling environments over plain Python functions.

A model turn that calls a tool gets the tool's result back as the next observation; any other turn
is the final answer (done, reward 0: the answer is scored by reward.functions). Two call formats:
  hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as the Qwen2.5 / Hermes chat
              templates render tool calls; the result comes back as `observation` with {result}
              filled in (default: a ChatML user turn holding <tool_response>), stop "</tool_call>"
  expression  the turn is an integer expression ending in "=" (the tiny char model's calculator; the
              demo's calls start with a space): the result and a space come back, stop "="

    {type: tools, tools: [calculator, python, 'my.module:search'], format: hermes}
    {type: calculator}                       (= tools [calculator] in the expression format)
    {type: tools, options: {mcp: {command: [python, -m, my_server]}}}   an MCP server's tools (mcp_tools)
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rlpipe.environments.registry import Environment, StepResult

if TYPE_CHECKING:
    from rlpipe.environments.mcp_tools import McpConnection, McpServer

EXPRESSION = re.compile(r"\s*-?\d+(\s*[-+*]\s*-?\d+)*\s*")
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>)?\s*$", re.DOTALL)
CHATML_TOOL_RESPONSE = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
STOPS = {"hermes": ("</tool_call>",), "expression": ("=",)}


def calculator(expression: str) -> str:
    """The value of an integer expression over + - * (at most 64 characters), or "" when it is not one."""
    if len(expression) > 64 or not EXPRESSION.fullmatch(expression):
        return ""
    canonical = re.sub(r"\d+", lambda number: str(int(number.group())), expression)  # "07" is 7, as typed
    return str(eval(canonical, {"__builtins__": {}}, {}))  # noqa: S307 (digits, + - * and spaces only)


def python(code: str) -> str:
    """Run a Python program in the code sandbox (rlpipe.rewards.sandbox: limits, no network) and
    return its stdout, or why it failed."""
    from rlpipe.rewards.sandbox import Limits, run_candidate

    outcome = run_candidate(code, "", Limits())
    return outcome.stdout if outcome.passed else f"{outcome.reason}\n{outcome.stdout}".strip()


BUILT_IN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}


def parse_call(text: str, call_format: str) -> tuple[str, dict[str, Any]] | None:
    """(tool name, arguments) of the turn's tool call, None when the turn calls no tool; ValueError
    for a call that does not parse."""
    if call_format == "expression":
        stripped = text.strip()
        return ("calculator", {"expression": stripped[:-1]}) if stripped.endswith("=") else None
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as err:
        raise ValueError(f"the tool call is not JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('a tool call is {"name": <tool>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates send the arguments JSON-encoded
        arguments = json.loads(arguments)
    return call["name"], arguments


class ToolEnvironment:
    """One trajectory's tools: each tool call is answered with its result, the first turn without
    a call ends the trajectory. A tool that raises answers with the error, as a real API would."""

    def __init__(self, tools: dict[str, Callable[..., Any]], call_format: str, observation: str) -> None:
        self.tools, self.call_format, self.observation = tools, call_format, observation
        self.stop: tuple[str, ...] = STOPS[call_format]

    # Awaitable: McpToolEnvironment answers asynchronously (the turn loop awaits what is awaitable)
    def reset(self, row: dict[str, Any]) -> str | Awaitable[str]:
        return ""

    def step(self, text: str, token_ids: list[int]) -> StepResult | Awaitable[StepResult]:
        call = self.parsed(text)
        return call if isinstance(call, StepResult) else self.answer(call[0], self.run(*call))

    def parsed(self, text: str) -> StepResult | tuple[str, Any]:
        """The turn's tool call (name, arguments), or what answers a turn without a valid one: the error,
        or the trajectory's end when the turn calls no tool."""
        try:
            call = parse_call(text, self.call_format)
        except ValueError as err:
            return self.answer(None, f"error: {err}")
        return StepResult(done=True) if call is None else call

    def answer(self, name: str | None, result: str) -> StepResult:
        return StepResult(self.observation.format(result=result), info={"tool_call": True, "tool": name})

    def run(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self.tools:
            return f"error: no tool {name!r}; tools: {', '.join(self.tools)}"
        try:
            return str(self.tools[name](**arguments))
        except Exception as err:  # noqa: BLE001 (the model sees the error, as from a real tool)
            return f"error: {type(err).__name__}: {err}"

    def close(self) -> None:
        pass


class McpToolEnvironment(ToolEnvironment):
    """ToolEnvironment whose tools include an MCP server's (rlpipe.environments.mcp_tools); the Python
    tools named in `tools` come first when a name is both."""

    def __init__(
        self, tools: dict[str, Callable[..., Any]], call_format: str, observation: str, server: McpServer
    ) -> None:
        super().__init__(tools, call_format, observation)
        self.server = server
        self.remote: list[str] = []
        self.connection: McpConnection | None = None

    async def reset(self, row: dict[str, Any]) -> str:
        from rlpipe.environments.mcp_tools import connection

        self.connection = await asyncio.to_thread(connection, self.server)  # the process's, opened once
        self.remote = [name for name in self.connection.tools if name not in self.tools]
        return ""

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        call = self.parsed(text)
        if isinstance(call, StepResult):
            return call
        name, arguments = call
        if name in self.remote:
            if not isinstance(arguments, dict):
                return self.answer(name, f"error: the arguments of {name!r} are not a JSON object")
            assert self.connection is not None  # reset opened it: the turn loop resets before any step
            return self.answer(name, await self.connection.call(name, arguments))
        if name not in self.tools:
            return self.answer(name, f"error: no tool {name!r}; tools: {', '.join([*self.tools, *self.remote])}")
        return self.answer(name, self.run(name, arguments))


def resolve_tool(name: str, key: str) -> Callable[..., Any]:
    """A built-in tool by name, or 'module:function'."""
    if name in BUILT_IN_TOOLS:
        return BUILT_IN_TOOLS[name]
    from rlpipe.rewards import RewardError, load_reward_function

    try:
        return load_reward_function(name, f"{key}.tools")
    except RewardError as err:
        raise ValueError(f"{err} (built-in tools: {', '.join(BUILT_IN_TOOLS)})") from None


def tool_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    """{tools: [...], format: hermes | expression, observation: '...{result}...'}."""
    unknown = set(options) - {"tools", "mcp", "format", "observation"}
    if unknown:
        raise ValueError(
            f"{key}.options: unknown {sorted(unknown)}; the tools environment takes tools, mcp, format, observation"
        )
    call_format = options.get("format", "hermes")
    if call_format not in STOPS:
        raise ValueError(f"{key}.options.format {call_format!r}: one of {', '.join(STOPS)}")
    names = options.get("tools") or []
    if not names and "mcp" not in options:
        raise ValueError(
            f"{key}.options.tools: name at least one tool ({', '.join(BUILT_IN_TOOLS)} or 'module:function'), "
            "or an MCP server's (options.mcp)"
        )
    tools = {name.rsplit(":", 1)[-1]: resolve_tool(name, key) for name in names}
    observation = options.get("observation", CHATML_TOOL_RESPONSE if call_format == "hermes" else "{result} ")
    if "mcp" in options:
        from rlpipe.environments.mcp_tools import mcp_server

        server = mcp_server(options["mcp"], f"{key}.options.mcp")
        return lambda: McpToolEnvironment(dict(tools), call_format, observation, server)
    return lambda: ToolEnvironment(tools, call_format, observation)


def calculator_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    """The calculator in the expression format: " 37*48=" is answered "1776 "."""
    if options:
        raise ValueError(f"{key}.options: the calculator environment takes none, got {sorted(options)}")
    return tool_environment({"tools": ["calculator"], "format": "expression"}, key)
