"""verifiers 0.4 environments (rlpipe.environments.verifiers_env), offline: environments written as their users
write them (tests/fixtures/vf_sums.py single-turn with a tool, vf_guess.py multi-turn, examples/verifiers/), loaded
by id with their arguments, run token-in/token-out and scored by their own rewards."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlpipe.data import get_source
from rlpipe.environments import Codec, environment_factory, run_trajectories
from rlpipe.rewards import RewardError, load_reward
from rlpipe.rollouts import Completions
from rlpipe.spec import EnvironmentSpec

from .conftest import RLPIPE, tiny_spec_dict

REPO = Path(__file__).parents[1]
FIXTURES = REPO / "tests" / "fixtures"
BYTES = Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode())  # one token a byte


@pytest.fixture(scope="module")
def verifiers_path() -> list[str]:
    """verifiers 0.4.0 is installed by the README's test command (`pip install --no-deps verifiers==0.4.0`,
    after `.[test]`: its mcp and openai pins clash with ours, and it runs with both)."""
    assert importlib.util.find_spec("verifiers") is not None, (
        "verifiers is not installed: .venv/bin/pip install --no-deps verifiers==0.4.0 (README, command 2)"
    )
    return []


@pytest.fixture(autouse=True)
def installed(monkeypatch, verifiers_path: list[str]) -> list[str]:
    """The fixtures' environments importable by their ids, as installed environment modules are."""
    for path in [*verifiers_path, str(FIXTURES)]:
        monkeypatch.syspath_prepend(path)
    return verifiers_path


def scripted(answer):
    """A sample_turn whose reply to each sequence is answer(sequence text, turn number), ending at eos (0)."""
    turn = iter(range(1, 100))

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        k = next(turn)
        replies = [list(answer(BYTES.decode(s), k).encode()) for s in sequences]
        return Completions(replies, [[-0.5] * len(r) for r in replies], ["stop"] * len(replies))

    return sample_turn


def roll(spec: EnvironmentSpec, rows: list[dict], answer) -> list:
    prompts = [BYTES.encode(r["prompt"]) for r in rows]
    return run_trajectories(scripted(answer), environment_factory(spec), rows, prompts, BYTES, spec, 8)


def test_single_turn_environment_its_tasks_turns_and_rewards():
    rows = get_source("verifiers")(random.Random(0), 6, env_id="vf_sums", args={"size": 6})
    assert len(rows) == 6 and all(set(r) == {"prompt", "reference", "task"} for r in rows)
    a, b = rows[0]["prompt"][:-1].split("+")
    assert (
        rows[0]["reference"] == str(int(a) + int(b)) and json.loads(rows[0]["task"])["answer"] == rows[0]["reference"]
    )
    shuffled = get_source("verifiers")(random.Random(0), 6, env_id="vf_sums", args={"size": 6}, shuffle=True)
    assert shuffled != rows and sorted(r["task"] for r in shuffled) == sorted(r["task"] for r in rows)

    spec = EnvironmentSpec(
        type="verifiers", options={"env_id": "vf_sums", "args": {"size": 6}, "observation": "{content}"}, max_tokens=16
    )
    right = {r["prompt"]: r["reference"] for r in rows[:2]}  # the first two answered right, the rest "123"
    trajectories = roll(spec, rows, lambda text, k: right.get(text, "123"))
    for row, t in zip(rows, trajectories, strict=True):
        reply = right.get(row["prompt"], "123")
        assert t.error == "" and t.completion_token_ids == list(reply.encode()) and t.loss_mask == [1] * len(reply)
        # the rubric: correct (weight 1) + short (len <= 2, weight 0.5)
        assert t.turn_rewards == [float(reply == row["reference"]) + 0.5 * (len(reply) <= 2)]
        assert t.turn_rewards == [verifiers_own_score(row, reply)]

    _, verifier = load_reward({"type": "verifiers", "env_id": "vf_sums", "args": {"size": 6}})
    completions = [rows[0]["reference"], "123", "9"]
    columns = {"task": [r["task"] for r in rows[:3]], "reference": [r["reference"] for r in rows[:3]]}
    scores = asyncio.run(verifier([r["prompt"] for r in rows[:3]], completions, **columns))
    assert scores == [1.5, 0.0, 0.5 + float(rows[2]["reference"] == "9")]
    assert scores == [verifiers_own_score(r, c) for r, c in zip(rows, completions)]
    # the spec's own data: without a `task` column, the TaskData fields among the columns make the task
    assert asyncio.run(verifier(["2+2="], ["4"], answer=["4"], id=["x"])) == [1.5]


def verifiers_own_score(row: dict, completion: str) -> float:
    """What verifiers scores: the task's `@vf.reward` functions as verifiers finds, calls and weighs them."""
    import vf_sums
    from verifiers.v1.utils.decorators import invoke

    task = vf_sums.SumTask(vf_sums.SumData.model_validate_json(row["task"]))
    trace = SimpleNamespace(last_reply=completion.strip())
    total = 0.0
    for fn in task.hooks("reward"):
        value = invoke(fn, {"task": task.data, "trace": trace})
        total += (asyncio.run(value) if inspect.isawaitable(value) else value) * fn._vf_weight
    return total


def test_a_tool_call_is_answered_by_the_tasks_toolset_and_masked():
    rows = get_source("verifiers")(random.Random(0), 1, env_id="vf_sums", args={"size": 1})
    options = {"env_id": "vf_sums", "args": {"size": 1}, "observation": "{content}", "tool_observation": "<{content}>"}
    spec = EnvironmentSpec(type="verifiers", options=options, max_turns=3, max_tokens=200)
    a, b = rows[0]["prompt"][:-1].split("+")
    call = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
    (t,) = roll(spec, rows, lambda text, k: f"<tool_call>{call}</tool_call>" if k == 1 else text.rsplit("<")[-1][:-1])
    first, observation = f"<tool_call>{call}</tool_call>".encode(), f"<{rows[0]['reference']}>".encode()
    second = rows[0]["reference"].encode()
    assert t.error == "" and t.tool_calls == 1 and t.final_text == rows[0]["reference"]
    assert t.completion_token_ids == list(first + observation + second)
    assert t.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert t.turn_rewards == [0.0, 1.5]


def test_multi_turn_environment_answers_the_models_turns():
    rows = get_source("verifiers")(random.Random(0), 8, env_id="vf_guess", args={"size": 8})
    options = {"env_id": "vf_guess", "args": {"size": 8}, "env_args": {"hint_lower": "v "}, "observation": "{content}"}
    spec = EnvironmentSpec(type="verifiers", options=options, max_turns=4, max_tokens=16)
    answer = {r["prompt"]: r["reference"] for r in rows}
    trajectories = roll(spec, rows, lambda text, k: "50" if k == 1 else answer[text.split("*")[0] + "*"])
    for row, t in zip(rows, trajectories, strict=True):
        target = int(row["reference"])
        assert t.error == "" and t.final_text == row["reference"]
        if target == 50:
            assert t.loss_mask == [1, 1] and t.turn_rewards == [1.5]
            continue
        hint = b"+ " if target > 50 else b"v "
        assert t.completion_token_ids == list(b"50" + hint + row["reference"].encode())
        assert t.loss_mask == [1, 1, 0, 0] + [1] * len(row["reference"])
        assert t.turn_rewards == [0.0, 1.0 + 0.5 * 0.5]  # correct + solved_fast (1 / 2 turns, weight 0.5)

    _, verifier = load_reward({"type": "verifiers", "env_id": "vf_guess"})
    scores = asyncio.run(verifier(["x"] * 2, [rows[0]["reference"], "-1"], task=[rows[0]["task"]] * 2))
    assert scores == [1.0, 0.0]  # the task's reward alone: what the Env's run recorded needs the trajectory


def test_errors_name_the_key():
    with pytest.raises(ValueError, match=r"rollout.environment.options.env_id 'vf_missing': taskset 'vf_missing' not"):
        environment_factory(EnvironmentSpec(type="verifiers", options={"env_id": "vf_missing"}))
    with pytest.raises(ValueError, match=r"rejects its arguments \(rollout.environment.options.args.sise: Extra"):
        environment_factory(EnvironmentSpec(type="verifiers", options={"env_id": "vf_sums", "args": {"sise": 3}}))
    with pytest.raises(ValueError, match=r"options: unknown \['envid'\]"):
        environment_factory(EnvironmentSpec(type="verifiers", options={"envid": "vf_sums"}))
    with pytest.raises(ValueError, match=r"rollout.environment.options.env_id: the verifiers environment's id"):
        environment_factory(EnvironmentSpec(type="verifiers"))
    with pytest.raises(RewardError, match=r"reward.functions.env_id 'vf_missing'"):
        load_reward({"type": "verifiers", "env_id": "vf_missing"})
    with pytest.raises(ValueError, match=r"data.options: verifiers environment 'vf_sums' rejects .*data.options.args"):
        get_source("verifiers")(random.Random(0), 2, env_id="vf_sums", args={"size": "many"})
    with pytest.raises(ValueError, match=r"data.options: unknown \['size'\]"):
        get_source("verifiers")(random.Random(0), 2, env_id="vf_sums", size=3)


@pytest.mark.slow  # ~70 s on 2 cores
def test_example_runs_two_iterations_on_kfp_local(tmp_path: Path, installed: list[str]):
    """examples/verifiers-addition.yaml, made small, on KFP's local runner: the environment's tasks, its
    multi-turn run and its rewards through generate, score, update and a greedy multi-turn eval."""
    from rlpipe.store.run_root import list_metrics

    example = yaml.safe_load((REPO / "examples" / "verifiers-addition.yaml").read_text())
    small = tiny_spec_dict(
        tmp_path,
        data={**example["data"], "options": {"env_id": "vf_addition_retry", "args": {"size": 120}}, "train_size": 100},
        reward=example["reward"],
        rollout={"environment": example["rollout"]["environment"], "max_new_tokens": 4},
        loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2},
    )
    small["data"]["eval_size"] = 20
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(small))
    paths = [str(REPO / "examples" / "verifiers"), *installed, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*RLPIPE, "run", str(spec), "--run-dir", str(run_dir)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    iterations = list_metrics(str(run_dir), "iter")
    assert sorted(iterations) == [0, 1, 2]
    for iteration in (1, 2):
        assert 1.0 <= iterations[iteration]["rollout/turns_mean"] <= 2.0
        assert iterations[iteration]["rollout/environment_error_fraction"] == 0.0
    assert "eval/accuracy_greedy" in list_metrics(str(run_dir), "eval")[2]
