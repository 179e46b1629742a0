"""Reward functions: built-in verifiers (math-verify), shaping, a reward model, a remote endpoint,
the code sandbox, async functions and timeouts, and how failures name the reward."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pytest

from rlpipe.http_json import reply_json
from rlpipe.rewards import RewardError, Rewards, call_reward, score_rollouts
from rlpipe.rewards.sandbox import network_namespace
from rlpipe.rollouts import ROLLOUT_SCHEMA, write_table
from rlpipe.spec import parse_spec

from .conftest import tiny_spec_dict


def _call(entry, completions, **columns):
    return call_reward(entry, ["p"] * len(completions), completions, columns, "reward.functions", timeout_s=60)


@pytest.mark.parametrize(
    "completion, reference, equal",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", True),
        ("$2\\sqrt{2}$", "\\sqrt{8}", True),
        ("$x^2+2x+1$", "(x+1)^2", True),
        ("$\\frac{6}{4}$", "\\frac{3}{2}", True),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
        ("so x = 3", "3", True),
        ("I think -7", "-7", True),
        ("\\boxed{3}", "4", False),
        ("\\boxed{x+1}", "x+2", False),
        ("$0.333$", "\\frac{1}{3}", False),
        ("", "1", False),
    ],
)
def test_math_equivalence_on_hand_cases(completion: str, reference: str, equal: bool):
    assert _call("rlpipe.rewards.answer_checks:math_equivalence", [completion], reference=[reference]) == [float(equal)]


@pytest.mark.parametrize(
    "completion",
    [
        "To calculate 77 * 7, we need to perform the multiplication operation",  # what a real policy learned
        "What is 77 * 7? Answer with the number only.",  # the prompt echoed
        "77*7",  # an expression instead of a value
        "$77 \\times 7$",
        "The answer is 77 \\cdot 7.",
        "539 540 541",  # several numbers listed
        "It is 538, 539 or 540",
        "The answer is 538, 539 or 540.",
        "77 * 7 = 547",  # a wrong value
        "",
    ],
)
def test_math_equivalence_gives_nothing_for_games(completion: str):
    """Each scores 0 against 539 = 77 * 7 (math-verify's default extraction took `77*7` from the first
    one, and sympy evaluated it to 539)."""
    assert _call("rlpipe.rewards.answer_checks:math_equivalence", [completion], reference=["539"]) == [0.0]


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("539", "539"),
        ("77 * 7 = 539", "539"),
        ("The answer is 539.", "539"),
        ("Answer: 539", "539"),
        ("\\boxed{539}", "539"),
        ("so 77*7 is $539$", "539"),
        ("7 * 7 = 49, so 77 * 7 = 539", "539"),
        ("Lena gets 7 more, so Lena has 11 + 7 = 18 pencils.", "18"),  # a value and its unit
        ("So, 4 x 3 = 12 stickers are in", "12"),
        ("The answer is \\frac{1}{2}", "0.5"),
        ("x = 1/2.", "0.5"),
        ("The result is 1,234", "1234"),
        ("3.5", "7/2"),
    ],
)
def test_math_equivalence_credits_a_final_answer(completion: str, reference: str):
    assert _call("rlpipe.rewards.answer_checks:math_equivalence", [completion], reference=[reference]) == [1.0]


def test_exact_match_reads_the_answer_column_it_is_given():
    entry = {"type": "exact_match", "answer_column": "answer"}
    assert _call(entry, [" 12", "13", "-1"], answer=["12", "12", "-1"]) == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match=r"exact_match needs the data column 'answer' .*have \['reference'\]"):
        _call(entry, ["1"], reference=["1"])


def test_the_checks_old_module_path_is_refused_with_the_new_one():
    """rlpipe.rewards.verifiers (before 2026-11-28) is rlpipe.rewards.answer_checks: `verifiers` is the PyPI package."""
    new = "write rlpipe.rewards.answer_checks:exact_match instead of 'rlpipe.rewards.verifiers:exact_match'"
    with pytest.raises(RewardError, match=f"reward.verifier: rlpipe.rewards.verifiers is now .*{new}"):
        call_reward("rlpipe.rewards.verifiers:exact_match", ["1"], ["1"], {"reference": ["1"]}, "reward.verifier", 5.0)
    with pytest.raises(RewardError, match="write rlpipe.rewards.answer_checks:strict_match"):
        _call({"type": "function", "function": "rlpipe.rewards.verifiers:strict_match"}, ["1"], reference=["1"])


def test_regex_and_dapo_length_penalty_by_hand():
    regex = {"type": "regex", "pattern": r"<think>.*</think>\s*\d+", "flags": "s"}
    assert _call(regex, ["<think>a\nb</think> 42", "42", "<think></think>x"]) == [1.0, 0.0, 0.0]
    assert _call(regex | {"mode": "search", "pattern": r"\d"}, ["ab7", "abc"]) == [1.0, 0.0]
    # L_max 8, L_cache 4: 0 up to 4 tokens, then (4 - L) / 4 down to -1 at 8, -1 past it
    penalty = {"type": "length_penalty", "max_tokens": 8, "buffer_tokens": 4}
    lengths = [3, 4, 5, 6, 8, 9]
    ids = [[0] * n for n in lengths]
    assert _call(penalty, ["x"] * 6, completion_token_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    # a trajectory's length is its model tokens: 6 tokens, 4 of them an observation, count 2
    assert _call(penalty, ["x"], completion_token_ids=[[0] * 6], loss_mask=[[1, 0, 0, 0, 0, 1]]) == [0.0]
    with pytest.raises(RewardError, match="regex pattern '\\(' does not compile"):
        _call({"type": "regex", "pattern": "("}, ["x"])
    with pytest.raises(RewardError, match=r"length_penalty .*max_tokens"):
        _call({"type": "length_penalty", "buffer_tokens": 4}, ["x"])


def test_reward_model_scores_from_a_tiny_local_classifier(tmp_path: Path):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlpipe.models.loading import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts, completions = ["1+2=", "10+20=", "7+8="], ["3", "30 ", "15"]
    with torch.no_grad():  # one at a time, no padding: what the batched scores must equal
        expected = [
            model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item()
            for p, c in zip(prompts, completions, strict=True)
        ]
    entry = {"type": "reward_model", "path": str(tmp_path / "rm"), "batch_size": 2, "device": "cpu"}
    scores = call_reward(entry, prompts, completions, {}, "reward.functions")
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 3  # a real model, not a constant
    with pytest.raises(RewardError, match=r"reward_model .*missing.* could not be loaded"):
        call_reward(entry | {"path": str(tmp_path / "missing")}, prompts, completions, {}, "reward.functions")


class _Scorer(BaseHTTPRequestHandler):
    """A reward service: 503 for the first `failures` requests, then reward = len(completion)."""

    failures = 0
    delay_s = 0.0
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((body, self.headers.get("Authorization")))
        time.sleep(self.delay_s)
        if type(self).failures > 0:
            type(self).failures -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply_json(self, 200, {"rewards": [float(len(c)) for c in body["completions"]]})

    def log_message(self, *args):
        pass


@pytest.fixture
def scorer():
    _Scorer.failures, _Scorer.delay_s, _Scorer.seen = 0, 0.0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


def test_remote_reward_batches_retries_and_times_out(scorer: str, monkeypatch):
    monkeypatch.setenv("SCORER_TOKEN", "s3cret")
    entry = {"type": "remote", "url": scorer, "batch_size": 2, "retries": 2, "token_env": "SCORER_TOKEN"}
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    _Scorer.failures = 1  # the first request gets 503 and is retried
    scores = _call(entry, completions, answer=["1", "2", "3", "4", "5"], prompt_token_ids=[[1]] * 5)
    assert scores == [1.0, 2.0, 3.0, 4.0, 5.0]
    bodies = [body for body, _ in _Scorer.seen]
    assert len(bodies) == 4  # 3 batches (2 + 2 + 1) and one retry
    assert {tuple(b["completions"]) for b in bodies} == {("a", "bb"), ("ccc", "dddd"), ("eeeee",)}
    assert all(auth == "Bearer s3cret" for _, auth in _Scorer.seen)
    assert set(bodies[0]["columns"]) == {"answer"}  # per-token lists are not sent
    _Scorer.failures = 10
    with pytest.raises(RewardError, match=r"remote reward .* failed after 3 attempts \(last: HTTP 503\)"):
        _call(entry, completions)
    _Scorer.failures, _Scorer.delay_s = 0, 2.0
    started = time.time()
    with pytest.raises(RewardError, match=r"failed after 1 attempts \(last: .*timed out"):
        _call(entry | {"timeout_s": 0.3, "retries": 0}, ["a"])
    assert time.time() - started < 1.9


LOOP = "while True:\n    pass"
ALLOC = "x = bytearray(4 * 1024 ** 3)\nprint(len(x))"
SOCKET = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint(3)"
FORK = "import os\npid = os.fork()\nprint(3)"
SUBPROCESS = "import subprocess\nprint(subprocess.run(['echo', '3'], capture_output=True).stdout)"
WRITE_OUTSIDE = "open('/tmp/rlpipe-sandbox-escape.txt', 'w').write('x')\nprint(3)"
CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "a, b = map(int, input().split())\nprint(a - b)"
LOCAL_WRITE = "open('scratch.txt', 'w').write('ok')\na, b = map(int, input().split())\nprint(a + b)"
# a correct program whose stderr reads like a limit: judged by what happened, not by what it printed
SAYS_LIMITS = "import sys\nsys.stderr.write('MemoryError SIGXCPU')\na, b = map(int, input().split())\nprint(a + b)"


def test_the_sandbox_contains_bad_programs_and_the_step_goes_on(tmp_path: Path):
    escape = Path("/tmp/rlpipe-sandbox-escape.txt")
    escape.unlink(missing_ok=True)
    programs = [CORRECT, WRONG, LOOP, ALLOC, SOCKET, FORK, SUBPROCESS, WRITE_OUTSIDE, LOCAL_WRITE, SAYS_LIMITS]
    tests = [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "10"}]
    rows = len(programs)
    table = {name: [None] * rows for name in ROLLOUT_SCHEMA.names}
    table |= {
        "prompt_id": list(range(rows)),
        "group_id": list(range(rows)),
        "sample_index": [0] * rows,
        "prompt": ["add two numbers"] * rows,
        "prompt_token_ids": [[1]] * rows,
        "completion_token_ids": [[1]] * rows,
        "logprobs": [[-0.1]] * rows,
        "finish_reason": ["stop"] * rows,
        "completion": programs,
        "weights_version": [1] * rows,
        "iteration": [1] * rows,
    }
    columns = pa.table(table, schema=ROLLOUT_SCHEMA).to_pydict() | {"tests": [json.dumps(tests)] * rows}
    write_table(columns, str(tmp_path / "r.parquet"))
    sandbox = {"type": "code_sandbox", "timeout_s": 2, "memory_mb": 256, "partial": False}
    spec = parse_spec(tiny_spec_dict(tmp_path, reward={"functions": [sandbox]}))
    started = time.time()
    stats = score_rollouts(spec, str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"))
    assert time.time() - started < 30  # the loop was killed at its wall limit, not waited for
    scored = pa.parquet.read_table(tmp_path / "s.parquet").to_pydict()
    rewards = dict(
        zip(
            ["correct", "wrong", "loop", "alloc", "socket", "fork", "subprocess", "write", "local", "says_limits"],
            zip(scored["reward"], scored["reward/code_sandbox/reason"], strict=True),
            strict=True,
        )
    )
    assert rewards["correct"] == (1.0, "passed") and rewards["local"] == (1.0, "passed")
    assert rewards["says_limits"] == (1.0, "passed")
    assert rewards["wrong"] == (0.0, "wrong output on case 0")
    assert rewards["loop"][0] == 0.0 and rewards["loop"][1].startswith(("wall", "cpu"))
    assert rewards["alloc"] == (0.0, "memory limit (256 MB)")
    for name in ("socket", "fork", "subprocess", "write"):
        assert rewards[name][0] == 0.0 and rewards[name][1].startswith("blocked"), (name, rewards[name])
    assert not escape.exists()
    assert stats["reward/code_sandbox/mean"] == pytest.approx(3 / 10)
    # the network is also cut off by a namespace where the kernel lets us make one
    print("network namespace:", network_namespace() or "unavailable here; the audit hook blocks sockets")


def test_async_rewards_timeouts_and_failures_name_the_reward(tmp_path: Path):
    assert _call("tests.toy_plugins:async_length", ["ab", "c"]) == [2.0, 1.0]
    started = time.time()
    with pytest.raises(
        RewardError, match=r"reward.functions: tests.toy_plugins:slow raised TimeoutError: .*timeout_s=0.5"
    ):
        call_reward("tests.toy_plugins:slow", ["p"], ["c"], {}, "reward.functions", timeout_s=0.5)
    assert time.time() - started < 3
    with pytest.raises(RewardError, match=r"tests.toy_plugins:broken raised ZeroDivisionError"):
        _call("tests.toy_plugins:broken", ["c"])
    with pytest.raises(RewardError, match=r"cannot import module 'my_missing_rewards'"):
        _call("my_missing_rewards:score", ["c"])
    with pytest.raises(RewardError, match=r"reward.functions type 'nope' is not a registered reward type"):
        _call({"type": "nope"}, ["c"])
    assert isinstance(_call({"type": "code_sandbox"}, [CORRECT], tests=["assert True"]), Rewards)
    asyncio.run(asyncio.sleep(0))  # the event loop the async reward used is closed, not leaked
