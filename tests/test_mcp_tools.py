"""MCP servers as the tools environment's tools (rlpipe.environments.mcp_tools), against a real MCP server
(tests/fixtures/mcp_tools_server.py, the mcp SDK's MCPServer) over stdio and streamable HTTP: a tool call
reaches the server and its result is the observation, token-in/token-out; a server that does not start,
is unreachable, times out or dies ends the trajectory with an error naming it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.environments import Codec, EnvironmentFailure, answers, environment_factory, run_trajectories
from rlpipe.environments.mcp_tools import close_all
from rlpipe.models.loading import build_char_tokenizer
from rlpipe.rollouts import Completions
from rlpipe.spec import EnvironmentSpec

from .conftest import REPO, RLPIPE

SERVER = str(REPO / "tests" / "fixtures" / "mcp_tools_server.py")


def _tools(mcp: dict, call_format: str = "hermes") -> EnvironmentSpec:
    options = {"mcp": mcp, "format": call_format}
    return EnvironmentSpec(type="tools", options=options, max_turns=3, max_tokens=30)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _scripted(tokenizer, turns: list[str]):
    """A sample_turn answering every sequence of call k with turns[k]: a turn that ends at the stop "=" as
    sampled (no eos), the last one with eos."""
    calls = iter(turns)

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        ids = tokenizer(next(calls), add_special_tokens=False)["input_ids"]
        ids += [] if ids[-1] in stop_ids else [tokenizer.eos_token_id]
        return Completions(
            [list(ids) for _ in sequences], [[-1.0] * len(ids) for _ in sequences], ["stop"] * len(sequences)
        )

    return sample_turn


def _trajectories(spec: EnvironmentSpec, turns: list[str], count: int = 4):
    tokenizer = build_char_tokenizer()
    prompt = tokenizer("37*48=")["input_ids"]
    rows = [{"prompt": "37*48=", "prompt_token_ids": prompt}] * count
    codec = Codec.of(tokenizer)
    return run_trajectories(
        _scripted(tokenizer, turns), environment_factory(spec), rows, [prompt] * count, codec, spec, 8
    )


def test_a_tool_call_reaches_the_server_over_stdio_and_its_result_is_the_observation():
    spec = _tools({"command": ["python", SERVER]})
    environment = environment_factory(spec)()
    assert environment.stop == ("</tool_call>",) and answers([lambda: environment.reset({})]) == [""]
    (answered,) = answers([lambda: environment.step(_call("calculator", expression="37*48"), [])])
    assert "<tool_response>\n1776\n</tool_response>" in answered.observation and not answered.done
    assert answered.info == {"tool_call": True, "tool": "calculator"}
    (failed,) = answers([lambda: environment.step(_call("divide", a=1, b=0), [])])  # the tool's own error
    assert "<tool_response>\nerror: " in failed.observation and "division by zero" in failed.observation
    (bad,) = answers([lambda: environment.step(_call("divide", a="x"), [])])  # the model's bad arguments
    assert "error: " in bad.observation and "validation error" in bad.observation
    (missing,) = answers([lambda: environment.step(_call("search", q="x"), [])])
    assert "no tool 'search'; tools: calculator, divide, wait, pid, crash" in missing.observation
    (done,) = answers([lambda: environment.step("The answer is 1776.", [])])
    assert done.done

    # token-in/token-out, expression format: " 37*48=" (the call, as sampled) + "1776 " (the server's) + "1776"
    tokenizer = build_char_tokenizer()
    trajectories = _trajectories(_tools({"command": ["python", SERVER]}, "expression"), [" 37*48=", "1776"])
    call, observation, answer = (
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in (" 37*48=", "1776 ", "1776")
    )
    answer += [tokenizer.eos_token_id]
    for trajectory in trajectories:
        assert trajectory.error == "" and trajectory.tool_calls == 1 and trajectory.final_text == "1776"
        assert trajectory.completion_token_ids == call + observation + answer
        assert trajectory.loss_mask == [1] * len(call) + [0] * len(observation) + [1] * len(answer)
        assert trajectory.turn_offsets == [0, len(call) + len(observation)]


def test_one_server_process_answers_every_trajectory_of_a_process():
    spec = _tools({"command": ["python", SERVER]})
    environments = [environment_factory(spec)() for _ in range(6)]
    answers([lambda e=e: e.reset({}) for e in environments])
    steps = answers([lambda e=e: e.step(_call("pid"), []) for e in environments])
    again = environment_factory(spec)()  # a later step of the same process
    answers([lambda: again.reset({})])
    steps += answers([lambda: again.step(_call("pid"), [])])
    pids = {s.observation.split("<tool_response>\n")[1].split("\n")[0] for s in steps}
    assert len(pids) == 1 and pids.pop().isdigit()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_tool_call_over_streamable_http():
    port = _free_port()
    server = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the MCP server did not start"
                time.sleep(0.2)
        spec = _tools({"url": f"http://127.0.0.1:{port}/mcp"}, "expression")
        trajectories = _trajectories(spec, [" 37*48=", "1776"], count=3)
        assert all(t.error == "" and t.tool_calls == 1 for t in trajectories)
        tokenizer = build_char_tokenizer()
        assert tokenizer.decode(trajectories[0].completion_token_ids, skip_special_tokens=True) == " 37*48=1776 1776"
    finally:
        close_all()  # before the server goes: the session ends with an HTTP DELETE
        server.terminate()
        server.wait(10)


def test_failures_name_the_server_and_what_to_change():
    """A command that does not exist, a server that exits at once (its stderr quoted), an unreachable URL:
    every trajectory fails, so the step does; a call past timeout_s and a server that dies mid-call end
    their own trajectory; the next trajectory gets a new server."""
    missing = _tools({"command": ["no-such-mcp-server", "--stdio"]}, "expression")
    with pytest.raises(EnvironmentFailure, match=r"every trajectory.*MCP server no-such-mcp-server --stdio did not"
                       r" connect: the command does not start \(FileNotFoundError.*fix mcp.command"):  # fmt: skip
        _trajectories(missing, ["1"])
    exits = _tools({"command": ["python", "-c", "import sys; sys.exit('no tools today')"]}, "expression")
    with pytest.raises(
        EnvironmentFailure, match="did not connect: .*Connection closed; its stderr ends: no tools today"
    ):
        _trajectories(exits, ["1"])
    with pytest.raises(EnvironmentFailure, match=r"MCP server http://127.0.0.1:9/mcp did not connect: ConnectError"):
        _trajectories(_tools({"url": "http://127.0.0.1:9/mcp"}, "expression"), ["1"])

    spec = _tools({"command": ["python", SERVER], "timeout_s": 1.0})
    environment = environment_factory(spec)()
    answers([lambda: environment.reset({})])
    started = time.monotonic()
    (slow,) = answers([lambda: environment.step(_call("wait", seconds=5), [])])
    assert isinstance(slow, EnvironmentFailure) and time.monotonic() - started < 4
    assert str(slow) == f"MCP server python {SERVER}: tool 'wait' timed out after timeout_s=1.0 s"
    (crashed,) = answers([lambda: environment.step(_call("crash"), [])])
    closed = f"MCP server python {SERVER} closed the connection: it exited or hung up"
    assert str(crashed) == f"{closed}; its stderr ends: crashing on purpose"
    after = environment_factory(spec)()
    answers([lambda: after.reset({})])
    (answered,) = answers([lambda: after.step(_call("calculator", expression="6*7"), [])])
    assert "\n42\n" in answered.observation


def test_rlpipe_check_starts_the_server_and_names_its_tools(tmp_path: Path):
    from rlpipe.preflight import CheckFailed, check_environment
    from rlpipe.spec import parse_spec

    from .conftest import tiny_spec_dict

    def spec(mcp: dict):
        environment = {"type": "tools", "options": {"mcp": mcp, "format": "expression"}}
        return parse_spec(tiny_spec_dict(tmp_path, rollout={"environment": environment}))

    found = check_environment(spec({"command": ["python", SERVER]}))
    assert found.endswith("MCP tools calculator, divide, wait, pid, crash")
    with pytest.raises(CheckFailed, match="rollout.environment.options.mcp: MCP server no-such-server did not connect"):
        check_environment(spec({"command": ["no-such-server"]}))


def test_bad_mcp_options_say_what_to_change():
    cases = [
        ("python -m server", r"options.mcp: {command: \[program, args...\]} or {url: http://host:port/mcp}"),
        ({}, r"options.mcp: set one of command \(a server started over stdio\) or url"),
        ({"command": "python -m server"}, r"options.mcp.command: a list of strings, e.g. \[python, -m, my_server\]"),
        ({"url": "tools:8000"}, "options.mcp.url: the server's streamable-HTTP endpoint"),
        ({"url": "http://x/mcp", "timeout_s": 0}, r"options.mcp.timeout_s: seconds to wait for the server"),
        ({"url": "http://x/mcp", "headers": {}}, r"options.mcp: unknown \['headers'\]; mcp takes command or url"),
    ]
    for mcp, message in cases:
        with pytest.raises(ValueError, match=message):
            environment_factory(_tools(mcp))
    with pytest.raises(ValueError, match="options: unknown .*takes tools, mcp, format, observation"):
        environment_factory(EnvironmentSpec(type="tools", options={"mpc": {}}))


def test_the_mcp_calculator_example_runs_two_iterations_on_kfp_local(tmp_path: Path):
    """examples/mcp-calculator.yaml at small sizes: the resident trainer starts the example's MCP server
    (examples/mcp_calculator_server.py) and the rollouts call it; the held-out eval does too."""
    from rlpipe.environments.tools import calculator
    from rlpipe.store.run_root import list_metrics, read_eval_samples

    sets = [
        "model.tiny={hidden_size: 64, intermediate_size: 128, num_layers: 1, num_heads: 2, num_kv_heads: 1}",
        "model.warm_start.max_steps=100", "model.warm_start.batch_size=16", "model.warm_start.validation_size=8",
        "data.options={digits: 1, tool_fraction: 1.0}",
        "data.train_size=80", "data.eval_size=20", "rollout.prompts_per_iteration=8", "rollout.samples_per_prompt=4",
        "loop.iterations=2", "loop.iterations_per_run=2", "loop.eval_every=2", f"storage.root={tmp_path / 'runs'}",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    command = [*RLPIPE, "run", "examples/mcp-calculator.yaml", "--run-dir", str(run_dir)]
    result = subprocess.run(
        command + [f"--set={each}" for each in sets], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    iterations = list_metrics(str(run_dir), "iter")
    assert sorted(iterations) == [0, 1, 2]
    assert all(iterations[i]["rollout/tool_call_rate"] > 0 for i in (1, 2))  # calls the server answered:
    assert all(iterations[i]["rollout/environment_error_fraction"] == 0.0 for i in (1, 2))  # none failed
    samples = [s for s in read_eval_samples(str(run_dir), 2) if s["tool_calls"]]
    assert any(s["transcript"].startswith(" ") and s["transcript"][1].isdigit() for s in samples)  # " 4*9=..."
    for sample in samples:  # the held-out eval's calls, answered by the server: " 3*4=" -> "12 "
        call = sample["transcript"][: sample["transcript"].index("=") + 1]
        assert sample["transcript"][len(call) :].startswith(calculator(call.strip()[:-1]) + " ")
