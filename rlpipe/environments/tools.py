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
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from rlpipe.environments.registry import Environment, StepResult

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
        self.stop = STOPS[call_format]

    def reset(self, row: dict[str, Any]) -> str:
        return ""

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        try:
            call = parse_call(text, self.call_format)
        except ValueError as err:
            return StepResult(self.observation.format(result=f"error: {err}"), info={"tool_call": True, "tool": None})
        if call is None:
            return StepResult(done=True)
        name, arguments = call
        if name not in self.tools:
            result = f"error: no tool {name!r}; tools: {', '.join(self.tools)}"
        else:
            try:
                result = str(self.tools[name](**arguments))
            except Exception as err:  # noqa: BLE001 (the model sees the error, as from a real tool)
                result = f"error: {type(err).__name__}: {err}"
        return StepResult(self.observation.format(result=result), info={"tool_call": True, "tool": name})

    def close(self) -> None:
        pass


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
    unknown = set(options) - {"tools", "format", "observation"}
    if unknown:
        raise ValueError(
            f"{key}.options: unknown {sorted(unknown)}; the tools environment takes tools, format, observation"
        )
    call_format = options.get("format", "hermes")
    if call_format not in STOPS:
        raise ValueError(f"{key}.options.format {call_format!r}: one of {', '.join(STOPS)}")
    names = options.get("tools") or []
    if not names:
        raise ValueError(
            f"{key}.options.tools: name at least one tool ({', '.join(BUILT_IN_TOOLS)} or 'module:function')"
        )
    tools = {name.rsplit(":", 1)[-1]: resolve_tool(name, key) for name in names}
    observation = options.get("observation", CHATML_TOOL_RESPONSE if call_format == "hermes" else "{result} ")
    return lambda: ToolEnvironment(tools, call_format, observation)


def calculator_environment(options: dict[str, Any], key: str) -> Callable[[], Environment]:
    """The calculator in the expression format: " 37*48=" is answered "1776 "."""
    if options:
        raise ValueError(f"{key}.options: the calculator environment takes none, got {sorted(options)}")
    return tool_environment({"tools": ["calculator"], "format": "expression"}, key)
