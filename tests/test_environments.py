"""Multi-turn rollouts (rlpipe.environments): the environment's tokens carry no loss term, the trained
token ids are the sampled ones across turns, tool calls are answered, and a failing environment costs
its own trajectory, not the step."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gymnasium
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe.environments import (
    Codec,
    EnvironmentFailure,
    StepResult,
    environment_factory,
    register_environment,
    run_trajectories,
)
from rlpipe.environments.tools import calculator, parse_call
from rlpipe.http_json import reply_json
from rlpipe.models.loading import build_char_tokenizer
from rlpipe.spec import EnvironmentSpec, parse_spec
from rlpipe.training.batching import pack
from rlpipe.training.trainer import train_on_batch

from .conftest import RLPIPE, tiny_spec_dict
from .test_precision_and_memory import _make, _params


def _multi_turn_rows(count: int = 16) -> list[dict]:
    """Trajectories of a model turn, an observation and a model turn, with every per-token column."""
    rng = random.Random(0)
    rows = []
    for i in range(count):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(3, 7))]
        turns = [(rng.randrange(1, 4), 1), (rng.randrange(1, 4), 0), (rng.randrange(1, 4), 1)]
        mask = [flag for length, flag in turns for _ in range(length)]
        completion = [rng.randrange(4, 19) for _ in mask]
        rows.append(
            {
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "loss_mask": mask,
                "logprobs": [-rng.uniform(1.5, 4.0) if m else 0.0 for m in mask],
                "ref_logprobs": [-rng.uniform(1.5, 4.0) if m else 0.0 for m in mask],
                "token_advantages": [rng.uniform(-1.5, 1.5) if m else 0.0 for m in mask],
                "advantage": rng.uniform(-1.5, 1.5),
                "group_id": i // 4,
            }
        )
    return rows


def _write(rows: list[dict], path: Path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _changed(rows: list[dict], column: str, on_model: bool) -> list[dict]:
    """`rows` with `column` changed at the environment's positions (or the model's)."""
    changed = copy.deepcopy(rows)
    for row in changed:
        row[column] = [v + 0.7 if bool(m) == on_model else v for v, m in zip(row[column], row["loss_mask"])]
    return changed


def _update(
    tmp_path: Path, name: str, rows: list[dict], algorithm: str, options: dict | None = None, **trainer
) -> tuple[dict, dict]:
    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            algorithm={"name": algorithm, "kl_coef": 0.05, **(options or {})},
            trainer={"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, **trainer},
        )
    )
    trainer_ = _make(spec)
    trainer_.weights = {"version": 0, "sha256": "-"}  # pi_prox computed here (nothing cached for these weights)
    metrics = train_on_batch(trainer_, _write(rows, tmp_path / f"{name}.parquet"), iteration=1)
    return metrics, _params(trainer_)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"])
def test_environment_tokens_carry_no_loss_term(tmp_path: Path, algorithm: str):
    """Changing the advantages, old log-probs or reference log-probs at environment positions leaves the
    loss and every updated weight exactly as they were; changing them at the model's positions does not."""
    rows = _multi_turn_rows()
    metrics, params = _update(tmp_path, "base", rows, algorithm)
    for column in ("token_advantages", "logprobs", "ref_logprobs"):
        other_metrics, other = _update(tmp_path, column, _changed(rows, column, on_model=False), algorithm)
        assert other_metrics["policy/loss"] == metrics["policy/loss"], column
        assert other_metrics["kl/mean"] == metrics["kl/mean"], column
        for name, value in params.items():
            assert torch.equal(other[name], value), (column, name)
    moved_metrics, moved = _update(tmp_path, "model", _changed(rows, "token_advantages", on_model=True), algorithm)
    assert any(not torch.equal(moved[name], value) for name, value in params.items())  # the test can fail


@pytest.mark.parametrize("correction, level", [("truncate", "token"), ("mask", "sequence"), ("truncate", "geometric")])
def test_off_policy_weights_skip_environment_tokens(tmp_path: Path, correction: str, level: str):
    """With an off-policy correction (pi_prox / pi_behaviour per token, or per sequence over the model's
    tokens), the behaviour log-probs at environment positions change nothing either."""
    rows = _multi_turn_rows()
    options = {"off_policy_correction": correction, "is_level": level, "is_threshold": 1.5}
    metrics, params = _update(tmp_path, "base", rows, "grpo", options)
    assert "off_policy/is_weight_mean" in metrics
    other_metrics, other = _update(tmp_path, "env", _changed(rows, "logprobs", on_model=False), "grpo", options)
    assert other_metrics["policy/loss"] == metrics["policy/loss"]
    assert other_metrics["off_policy/is_weight_mean"] == metrics["off_policy/is_weight_mean"]
    assert all(torch.equal(other[name], value) for name, value in params.items())
    moved_metrics, _ = _update(tmp_path, "model", _changed(rows, "logprobs", on_model=True), "grpo", options)
    assert moved_metrics["off_policy/is_weight_mean"] != metrics["off_policy/is_weight_mean"]


def test_micro_batches_of_trajectories_equal_the_one_pass_update(tmp_path: Path):
    """Token means count the model's tokens only, so gradient accumulation still gives the one-pass update."""
    rows = _multi_turn_rows()
    for row in rows:
        del row["token_advantages"]
    one_metrics, one = _update(tmp_path, "one", rows, "dr_grpo")
    parts_metrics, parts = _update(tmp_path, "parts", rows, "dr_grpo", micro_batch_tokens=40)
    assert parts_metrics["policy/micro_batches"] > one_metrics["policy/micro_batches"]
    assert parts_metrics["policy/loss"] == pytest.approx(one_metrics["policy/loss"], rel=1e-5, abs=1e-7)
    for name, value in one.items():
        torch.testing.assert_close(parts[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_pack_masks_the_environment_tokens():
    rows = _multi_turn_rows(3)
    mb = pack(rows, pad_id=0)
    for i, row in enumerate(rows):
        start = len(row["prompt_token_ids"]) - 1 - mb.start
        window = mb.completion_mask[i, start : start + len(row["loss_mask"])]
        assert window.tolist() == [float(m) for m in row["loss_mask"]]
        assert float(mb.completion_mask[i].sum()) == sum(row["loss_mask"])


class Recorder:
    """An environment that answers each turn with "<turn number>2 " for two turns and records what it saw."""

    seen: list[tuple[str, list[int]]] = []
    stop = ("=",)

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, row: dict) -> str:
        return ""

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        Recorder.seen.append((text, list(token_ids)))
        self.turn += 1
        return StepResult(f"{self.turn}2 ", reward=0.25, done=self.turn >= 2, info={"tool_call": True})

    def close(self) -> None:
        pass


register_environment("recorder", lambda options, key: Recorder)


def test_trained_token_ids_are_the_sampled_ones(initialized_run, tmp_path: Path):
    """Token-in/token-out: each trajectory is its model turns exactly as sampled (what the environment saw)
    and its observations tokenized alone; the update packs those ids, masks the observations, and its
    forward pass reproduces the sampling log-probs at every model token."""
    from rlpipe.engines import generate_rollouts
    from rlpipe.models.loading import load_policy
    from rlpipe.rewards import score_rollouts
    from rlpipe.store.weights import local_path, read_weight_ref
    from rlpipe.training.logprobs import completion_logits, token_logprobs

    spec, run_root, cache = initialized_run
    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            rollout={"environment": {"type": "recorder", "max_turns": 3, "max_tokens": 40}, "max_new_tokens": 6},
            reward={"functions": [{"type": "environment"}]},
        )
    )
    Recorder.seen.clear()
    weights = read_weight_ref(run_root, 0)
    metrics = generate_rollouts(spec, run_root, weights, 1, str(tmp_path / "r.parquet"), cache)
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert len(rows) == 8 * 4 and metrics["rollout/turns_mean"] == 2.0 and metrics["rollout/tool_call_rate"] == 1.0
    tokenizer = build_char_tokenizer()
    seen = iter(Recorder.seen)  # turn 1 of every trajectory, then turn 2 of every trajectory
    first = [next(seen) for _ in rows]
    second = [next(seen) for _ in rows]
    for row, (_, turn1), (text2, turn2) in zip(rows, first, second, strict=True):
        observation = tokenizer("12 ", add_special_tokens=False)["input_ids"]
        assert row["completion_token_ids"] == turn1 + observation + turn2
        assert row["loss_mask"] == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
        assert row["turn_offsets"] == [0, len(turn1) + len(observation)]
        assert row["completion"] == text2 and row["environment_reward"] == 0.5 and row["turns"] == 2

    model, _ = load_policy(local_path(weights, cache))
    mb = pack([{**r, "advantage": 0.0} for r in rows], tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        sequence = row["prompt_token_ids"] + row["completion_token_ids"]
        assert mb.input_ids[i, : len(sequence)].tolist() == sequence  # byte for byte
    with torch.no_grad():
        recomputed = token_logprobs(completion_logits(model, mb), mb.targets, spec.rollout.temperature)
    assert torch.allclose(recomputed * mb.completion_mask, mb.old_logprobs, atol=1e-4)

    scored = score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    assert scored["reward/mean"] == pytest.approx(0.5)  # the environment's turn rewards, summed


def test_calculator_and_tool_calls():
    assert calculator("37*48") == "1776" and calculator("2+3*4") == "14" and calculator("3a") == ""
    assert calculator(" 07*01 ") == "7"  # leading zeros, as a model may type them
    assert calculator("9" * 70) == ""  # too long to be a sum the task asks for
    assert parse_call("37*48=", "expression") == ("calculator", {"expression": "37*48"})
    assert parse_call("1776", "expression") is None
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert parse_call(call, "hermes") == ("calculator", {"expression": "6*7"})
    with pytest.raises(ValueError, match="not JSON"):
        parse_call("<tool_call>{name: calculator}</tool_call>", "hermes")

    make = environment_factory(EnvironmentSpec(type="tools", options={"tools": ["calculator"]}))
    environment = make()
    assert environment.stop == ("</tool_call>",)
    answered = environment.step(call, [])
    assert "<tool_response>\n42\n</tool_response>" in answered.observation and not answered.done
    missing = environment.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>', [])
    assert "no tool 'search'" in missing.observation and missing.info["tool_call"]
    assert environment.step("The answer is 42.", []).done

    demo = environment_factory(EnvironmentSpec(type="calculator"))()
    assert demo.step("37*48=", []).observation == "1776 " and demo.step("1776", []).done


def test_environment_spec_errors_say_what_to_change(tmp_path: Path):
    with pytest.raises(ValueError, match="not a registered environment; registered: .*calculator"):
        environment_factory(EnvironmentSpec(type="calculater"))
    with pytest.raises(ValueError, match="options.tools: name at least one tool"):
        environment_factory(EnvironmentSpec(type="tools"))
    with pytest.raises(ValueError, match="use online_dpo"):
        parse_spec(tiny_spec_dict(tmp_path, algorithm={"name": "dpo"}, rollout={"environment": {"type": "calculator"}}))


class Flaky(Recorder):
    """Fails on prompts whose first token is even; `always` fails on every one."""

    always = False

    def reset(self, row: dict) -> str:
        self.even = row["prompt_token_ids"][1] % 2 == 0
        return ""

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        if Flaky.always or self.even:
            raise ConnectionError("the environment service went away")
        return StepResult(done=True, reward=1.0)


register_environment("flaky", lambda options, key: Flaky)


def test_a_failing_environment_costs_its_trajectory_not_the_step(initialized_run, tmp_path: Path):
    from rlpipe.engines import generate_rollouts
    from rlpipe.rewards import score_rollouts
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized_run
    spec = parse_spec(
        tiny_spec_dict(
            tmp_path, rollout={"environment": {"type": "flaky"}}, reward={"functions": [{"type": "environment"}]}
        )
    )
    weights = read_weight_ref(run_root, 0)
    Flaky.always = False
    metrics = generate_rollouts(spec, run_root, weights, 1, str(tmp_path / "r.parquet"), cache)
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    failed = [r for r in rows if r["environment_error"]]
    assert 0 < len(failed) < len(rows)
    assert metrics["rollout/environment_error_fraction"] == len(failed) / len(rows)
    assert all(r["environment_error"] == "ConnectionError: the environment service went away" for r in failed)
    assert all(r["finish_reason"] == "error" for r in failed)
    score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    scored = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert all(r["reward"] == (0.0 if r["environment_error"] else 1.0) for r in scored)

    Flaky.always = True
    with pytest.raises(EnvironmentFailure, match="failed on every trajectory.*service went away"):
        generate_rollouts(spec, run_root, weights, 1, str(tmp_path / "r2.parquet"), cache)


def test_warm_start_transcripts_train_on_model_turns_only():
    from rlpipe.spec import WarmStartSpec
    from rlpipe.training.warm_start import sft_example

    tokenizer = build_char_tokenizer()
    turns = [{"role": "model", "text": "3*4="}, {"role": "environment", "text": "12 "}, {"role": "model", "text": "12"}]
    row = {"prompt": "3*4=", "prompt_token_ids": tokenizer("3*4=")["input_ids"], "demonstration": json.dumps(turns)}
    ids, labels = sft_example(tokenizer, row, WarmStartSpec(transcript="demonstration"))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "".join(tokens[1:-1]) == "3*4=3*4=12 12" and tokens[-1] == "<eos>"
    trained = [t for t, label in zip(tokens, labels) if label != -100]
    assert "".join(trained) == "3*4=12<eos>"  # the observation "12 " and the prompt carry no loss
    with pytest.raises(ValueError, match="names column 'transcript'"):
        sft_example(tokenizer, row, WarmStartSpec(transcript="transcript"))


def _scripted_turns(tokenizer, turns: list[str]):
    """A sample_turn that answers every sequence of call k with turns[k] (ids as the tokenizer gives)."""
    from rlpipe.rollouts import Completions

    calls = iter(turns)

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        ids = tokenizer(next(calls), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return Completions(
            [list(ids) for _ in sequences], [[-1.0] * len(ids) for _ in sequences], ["stop"] * len(sequences)
        )

    return sample_turn


class EnvironmentService:
    """A real HTTP environment service (rlpipe.environments.server) on loopback, in a thread."""

    def __init__(self, server) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_remote_environment_over_http():
    from rlpipe.environments import answers
    from rlpipe.environments.server import Sessions, make_server

    sessions = Sessions(EnvironmentSpec(type="calculator"), idle_s=60)
    service = EnvironmentService(make_server("127.0.0.1", 0, sessions))
    try:
        spec = EnvironmentSpec(type="remote", options={"url": service.url, "stop": ["="]}, max_turns=3, max_tokens=30)
        environment = environment_factory(spec)()
        assert environment.stop == ("=",)
        assert answers([lambda: environment.reset({"prompt": "37*48=", "reference": "1776"})]) == [""]
        (step,) = answers([lambda: environment.step("37*48=", [7, 11, 17, 8, 12, 16])])
        assert step.observation == "1776 " and not step.done and step.info["tool_call"]
        (done,) = answers([lambda: environment.step("1776", [5, 11, 11, 10])])
        assert done.done and sessions.live == {}  # a finished session is closed by the service

        tokenizer = build_char_tokenizer()
        rows = [{"prompt": "37*48=", "prompt_token_ids": tokenizer("37*48=")["input_ids"]}] * 2
        trajectories = run_trajectories(
            _scripted_turns(tokenizer, ["37*48=", "1776"]),
            environment_factory(spec),
            rows,
            [r["prompt_token_ids"] for r in rows],
            Codec.of(tokenizer),
            spec,
            8,
        )
        assert [t.final_text for t in trajectories] == ["1776", "1776"] and all(t.tool_calls == 1 for t in trajectories)
        assert tokenizer.decode(trajectories[0].completion_token_ids, skip_special_tokens=True) == "37*48=1776 1776"
    finally:
        service.stop()


class Misbehaving(BaseHTTPRequestHandler):
    """An environment service that fails as real ones do, as the row's `mode` asks: slow (past the
    timeout), malformed (an answer of the wrong shape), crash (the connection dropped), busy (HTTP 503
    once, then fine), ok."""

    answered_busy: set[str] = set()

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            return self.reply(200, {"session": request["row"]["mode"], "observation": ""})
        mode = request.get("session")
        if self.path == "/close":
            return self.reply(200, {})
        if mode == "slow":
            time.sleep(1.5)
        if mode == "crash":
            self.close_connection = True
            return
        if mode == "malformed":
            return self.reply(200, {"observation": 3, "reward": 1.0, "done": True})
        if mode == "busy" and mode not in Misbehaving.answered_busy:
            Misbehaving.answered_busy.add(mode)
            return self.reply(503, {"error": "overloaded"})
        self.reply(200, {"observation": "", "reward": 1.0, "done": True, "info": {}})

    def reply(self, status: int, body: dict) -> None:
        reply_json(self, status, body)


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # the client that timed out left: expected
        pass


def test_remote_environment_failures_are_named_and_the_step_goes_on():
    """A timeout, a dropped connection and a malformed answer each end their own trajectory with the error
    recorded; a 503 is retried; the other trajectories of the step finish."""
    service = EnvironmentService(QuietServer(("127.0.0.1", 0), Misbehaving))
    try:
        options = {"url": service.url, "timeout_s": 0.5, "retries": 1, "stop": ["="]}
        spec = EnvironmentSpec(type="remote", options=options)
        tokenizer = build_char_tokenizer()
        modes = ["ok", "slow", "crash", "malformed", "busy"]
        rows = [{"mode": mode, "prompt_token_ids": [1, 5]} for mode in modes]
        started = time.monotonic()
        trajectories = run_trajectories(
            _scripted_turns(tokenizer, ["12"]),
            environment_factory(spec),
            rows,
            [[1, 5]] * 5,
            Codec.of(tokenizer),
            spec,
            4,
        )
        errors = dict(zip(modes, (t.error for t in trajectories), strict=True))
        assert errors["ok"] == "" and errors["busy"] == ""  # retried after the 503
        assert "step failed after 2 attempts" in errors["slow"] and "timed out" in errors["slow"]
        assert "step failed after 2 attempts" in errors["crash"]
        assert "`observation` must be a str" in errors["malformed"]
        assert [t.turn_rewards for t in trajectories] == [[1.0], [0.0], [0.0], [0.0], [1.0]]
        assert time.monotonic() - started < 4.0  # the sessions ran concurrently, not one after another

        dead = EnvironmentSpec(type="remote", options={"url": "http://127.0.0.1:9", "retries": 0, "stop": ["="]})
        with pytest.raises(EnvironmentFailure, match="every trajectory.*reset failed after 1 attempts"):
            run_trajectories(
                _scripted_turns(tokenizer, ["1"]),
                environment_factory(dead),
                rows[:2],
                [[1, 5]] * 2,
                Codec.of(tokenizer),
                dead,
                4,
            )
    finally:
        service.stop()


class GuessTheNumber(gymnasium.Env):
    """A Gymnasium text environment: guess the row's reference; told "higher"/"lower" by a sign, 3 guesses."""

    def __init__(self, guesses: int = 3) -> None:
        self.guesses = guesses

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target, self.left = int(options["row"]["reference"]), self.guesses
        return "", {}

    def step(self, action: str):
        self.left -= 1
        guess = int(action) if action.strip().isdigit() else -1
        if guess == self.target:
            return "", 1.0, True, False, {}
        return ("+ " if guess < self.target else "- "), 0.0, False, self.left == 0, {"tool_call": False}


def make_guess_env(guesses: int = 3) -> GuessTheNumber:
    return GuessTheNumber(guesses)


def test_gymnasium_environment_end_to_end(initialized_run, tmp_path: Path):
    """The adapter runs a gymnasium.Env through the generate step and the score step."""
    from rlpipe.engines import generate_rollouts
    from rlpipe.rewards import score_rollouts
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized_run
    environment = {"type": "gymnasium", "options": {"make": "tests.test_environments:make_guess_env", "guesses": 2}}
    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            rollout={"environment": {**environment, "max_turns": 4, "max_tokens": 24}},
            reward={"functions": [{"type": "environment"}]},
        )
    )
    generate_rollouts(spec, run_root, read_weight_ref(run_root, 0), 1, str(tmp_path / "r.parquet"), cache)
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert {r["turns"] for r in rows} <= {1, 2}  # truncated after 2 guesses, unless one is right
    for row in rows:
        assert row["environment_error"] == ""
        if row["turns"] == 2:  # the sign came back between the guesses, masked
            assert 0 in row["loss_mask"] and ("+ " in row["transcript"] or "- " in row["transcript"])
    score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    scored = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert all(r["reward"] == r["environment_reward"] for r in scored)
    with pytest.raises(ValueError, match="options.make"):
        environment_factory(EnvironmentSpec(type="gymnasium"))


def test_multi_turn_run_on_kfp_local_and_its_compiled_yaml(tmp_path: Path):
    """The calculator task end to end on KFP's local runner (warm start on transcripts, multi-turn
    generate, score, update, greedy multi-turn eval, MLflow), and the same spec compiled for a cluster."""
    import subprocess

    import yaml
    from mlflow.tracking import MlflowClient

    from rlpipe.store.run_root import list_metrics, read_eval_samples

    sections = {
        "data": {
            "generator": "multiplication",
            "options": {"digits": 1, "tool_fraction": 0.5},
            "train_size": 80,
            "eval_size": 20,
        },
        "model": {"warm_start": {"max_steps": 5, "batch_size": 8, "validation_size": 8, "transcript": "demonstration"}},
        "rollout": {"environment": {"type": "calculator", "max_turns": 3, "max_tokens": 20}, "max_new_tokens": 6},
        "loop": {"iterations": 2, "iterations_per_run": 2, "eval_every": 2},
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, **sections)))
    run_dir = tmp_path / "run"
    cli = RLPIPE
    result = subprocess.run([*cli, "run", str(spec), "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    iterations = list_metrics(str(run_dir), "iter")
    assert sorted(iterations) == [0, 1, 2]
    for iteration in (1, 2):
        assert 1.0 <= iterations[iteration]["rollout/turns_mean"] <= 3.0
        assert 0.0 <= iterations[iteration]["rollout/tool_call_rate"] <= 1.0
    evals = list_metrics(str(run_dir), "eval")
    assert {"eval/tool_call_rate", "eval/turns_mean"} <= set(evals[2])
    samples = read_eval_samples(str(run_dir), 2)
    assert len(samples) == 20 and all("transcript" in s and "tool_calls" in s for s in samples)
    state = json.loads((run_dir / "state.json").read_text())
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(state["mlflow_run_id"], "rollout/tool_call_rate")] == [1, 2]

    out = tmp_path / "pipeline.yaml"
    gke = str(Path(__file__).parents[1] / "examples" / "addition-gke.yaml")
    environment = "rollout.environment={type: tools, options: {tools: [calculator, python]}, max_turns: 4}"
    compiled = subprocess.run(
        [*cli, "compile", gke, "--target", "kfp", "-o", str(out), "--set", environment], capture_output=True, text=True
    )
    assert compiled.returncode == 0, compiled.stderr
    pipeline, platform = yaml.safe_load_all(out.read_text())
    carried = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    assert carried["rollout"]["environment"] == {
        "type": "tools",
        "options": {"tools": ["calculator", "python"]},
        "max_turns": 4,
        "max_tokens": 64,
    }
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    generate = [executors[name] for name in executors if name.startswith("exec-generate")]
    assert generate and all(e["podMetadata"]["labels"] == {"rlpipe.dev/sandbox": "true"} for e in generate)
    assert "podMetadata" not in executors["exec-update"]  # only the step that runs model-written code


@pytest.mark.parametrize("whiten", [False, True])
def test_ppo_gae_steps_over_the_model_tokens_only(whiten: bool):
    """PPO's GAE on a trajectory is GAE on its model tokens alone: the critic's values at observation
    tokens change nothing, and those tokens get advantage and return 0."""
    from types import SimpleNamespace

    import numpy as np

    from rlpipe.algorithms.ppo import gae, ppo_advantages
    from rlpipe.algorithms.registry import Scored

    options = SimpleNamespace(gamma=1.0, lam=0.95, whiten_advantages=whiten)
    mask = np.array([1, 1, 0, 0, 1, 1], dtype=bool)
    rewards, groups = np.array([1.0, 0.0]), np.array([0, 0])
    values = [np.array([0.1, 0.2, 9.0, 9.0, 0.3, 0.4]), np.array([0.5, 0.1, -3.0, 2.0, 0.2, 0.7])]
    estimate = ppo_advantages(Scored(rewards, groups, values, [mask, mask]), options)
    other = [v.copy() for v in values]
    for v in other:
        v[~mask] = -7.0
    again = ppo_advantages(Scored(rewards, groups, other, [mask, mask]), options)
    for a, b in zip(estimate.per_token + estimate.returns, again.per_token + again.returns, strict=True):
        assert np.array_equal(a, b) and not a[~mask].any()
    if not whiten:
        alone, returns = gae(np.array([0.0, 0.0, 0.0, 1.0]), values[0][mask], 1.0, 0.95)
        assert np.allclose(estimate.per_token[0][mask], alone) and np.allclose(estimate.returns[0][mask], returns)
