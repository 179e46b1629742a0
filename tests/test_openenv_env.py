"""The openenv environment type against a real OpenEnv server (openenv-core's create_app, in
tests/fixtures/openenv_guess.py, started here on a free port): a multi-turn trajectory token-in/token-out,
and its failures named as the remote type names them (unreachable, timeout, malformed answer)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlpipe.environments import Codec, EnvironmentFailure, answers, environment_factory, run_trajectories
from rlpipe.http_json import is_healthy
from rlpipe.models.loading import build_char_tokenizer
from rlpipe.spec import EnvironmentSpec

from .test_environments import _scripted_turns

SERVER = Path(__file__).parent / "fixtures" / "openenv_guess.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(server: Path, log: Path) -> Iterator[str]:
    """The OpenEnv server `server` in its own process on a free port; its URL once /health answers."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(server), "--port", str(port)], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not is_healthy(url, timeout_s=1.0):
            if process.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not answer /health within 60 s: {log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def openenv_url(tmp_path_factory) -> Iterator[str]:
    with serving(SERVER, tmp_path_factory.mktemp("openenv") / "server.log") as url:
        yield url


def spec_for(url: str, **options) -> EnvironmentSpec:
    return EnvironmentSpec(type="openenv", options={"url": url, "stop": ["="]} | options, max_turns=3, max_tokens=30)


def test_a_session_is_one_environment_across_turns(openenv_url):
    environment = environment_factory(spec_for(openenv_url))()
    try:
        assert answers([lambda: environment.reset({"reference": "42", "prompt_token_ids": [1, 5]})]) == [""]
        (low,) = answers([lambda: environment.step("30", [7, 4])])
        assert (low.observation, low.reward, low.done) == ("+ ", 0.0, False)
        (high,) = answers([lambda: environment.step("50", [9, 4])])
        assert (high.observation, high.reward, high.done) == ("- ", 0.0, False)
        (right,) = answers([lambda: environment.step("42", [8, 6])])
        assert (right.observation, right.reward, right.done) == ("", 1.0, True)
    finally:
        environment.close()


def test_trajectories_token_in_token_out(openenv_url):
    """Guesses 30, 50, 42 against references 42 and 7: observations appended as tokenized alone,
    rewards per turn, done at the right guess or after three."""
    spec = spec_for(openenv_url)
    tokenizer = build_char_tokenizer()
    rows = [
        {"prompt": "4*3=", "reference": ref, "prompt_token_ids": tokenizer("4*3=")["input_ids"]}
        for ref in "42 7".split()
    ]
    started = time.monotonic()
    trajectories = run_trajectories(
        _scripted_turns(tokenizer, ["30", "50", "42"]),
        environment_factory(spec),
        rows,
        [r["prompt_token_ids"] for r in rows],
        Codec.of(tokenizer),
        spec,
        8,
    )
    first, second = trajectories
    assert first.error == "" and second.error == ""
    assert first.turn_rewards == [0.0, 0.0, 1.0] and first.finish_reason == "stop" and first.final_text == "42"
    assert second.turn_rewards == [0.0, 0.0, 0.0]  # 7: wrong three times, done by the server
    assert tokenizer.decode(first.completion_token_ids, skip_special_tokens=True) == "30+ 50- 42"
    observation = tokenizer("+ ", add_special_tokens=False)["input_ids"]
    assert first.completion_token_ids[3:5] == observation and first.loss_mask[:6] == [1, 1, 1, 0, 0, 1]  # "30<eos>+ 5"
    assert [m for m, lp in zip(first.loss_mask, first.logprobs, strict=True) if lp != 0.0] == [1] * sum(first.loss_mask)
    assert time.monotonic() - started < 10.0


def test_an_error_from_the_environment_ends_its_trajectory(openenv_url):
    environment = environment_factory(spec_for(openenv_url))()
    try:
        answers([lambda: environment.reset({"reference": "42"})])
        (failed,) = answers([lambda: environment.step("9999", [9])])
        assert isinstance(failed, EnvironmentFailure) and "step answered an error" in str(failed)
        assert "the guess broke the environment" in str(failed)
    finally:
        environment.close()


def test_a_step_past_timeout_s_is_named(openenv_url):
    environment = environment_factory(spec_for(openenv_url, timeout_s=0.5))()
    try:
        answers([lambda: environment.reset({"reference": "42"})])
        (failed,) = answers([lambda: environment.step("8888", [9])])
        assert isinstance(failed, EnvironmentFailure)
        assert f"openenv environment {openenv_url}/ws step failed after 1 attempts" in str(failed)
        assert "timed out" in str(failed) and "rollout.environment.options.timeout_s" in str(failed)
    finally:
        environment.close()


def test_no_server_on_the_port_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    environment = environment_factory(spec_for(url, retries=1, timeout_s=2))()
    (failed,) = answers([lambda: environment.reset({"reference": "1"})])
    assert isinstance(failed, EnvironmentFailure)
    assert f"openenv environment {url}/ws reset failed after 2 attempts" in str(failed)
    assert "ConnectionRefusedError" in str(failed) and "rollout.environment.options.url" in str(failed)


def test_a_server_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        environment = environment_factory(spec_for(url, retries=0, timeout_s=0.5))()
        started = time.monotonic()
        (failed,) = answers([lambda: environment.reset({"reference": "1"})])
        assert time.monotonic() - started < 3.0
    assert isinstance(failed, EnvironmentFailure)
    assert f"openenv environment {url}/ws reset failed after 1 attempts" in str(failed) and "timed out" in str(failed)
    assert "rollout.environment.options.timeout_s" in str(failed)


class Garbage(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        body = b"<html>not an environment</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_malformed_answer_is_named():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        spec = spec_for(url, retries=2, timeout_s=2)
        tokenizer = build_char_tokenizer()
        with pytest.raises(EnvironmentFailure) as failed:
            run_trajectories(
                _scripted_turns(tokenizer, ["1"]),
                environment_factory(spec),
                [{"reference": "1"}],
                [[1, 5]],
                Codec.of(tokenizer),
                spec,
                4,
            )
        message = str(failed.value)
        assert (
            "every trajectory" in message
            and "not a WebSocket" in message
            and f"openenv environment {url}/ws reset answered InvalidMessage" in message
        )
        assert "rollout.environment.options.url" in message
    finally:
        server.shutdown()
        server.server_close()


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown.*openenv takes url"):
        environment_factory(EnvironmentSpec(type="openenv", options={"url": "http://x", "actoin": {}}))
    with pytest.raises(ValueError, match="options.url"):
        environment_factory(EnvironmentSpec(type="openenv", options={"url": "ws://x"}))


def test_the_openenv_example_runs_two_iterations_on_kfp_local(tmp_path: Path):
    """examples/openenv-addition.yaml at small sizes against its server (examples/openenv_addition_server.py):
    every rollout is a session on the server, none fails, and the server's rewards are the rollouts'."""
    from rlpipe.store.run_root import list_metrics

    from .conftest import REPO, RLPIPE

    with serving(REPO / "examples" / "openenv_addition_server.py", tmp_path / "server.log") as url:
        sets = [
            "model.tiny={hidden_size: 64, intermediate_size: 128, num_layers: 1, num_heads: 2, num_kv_heads: 1}",
            "model.warm_start.max_steps=50", "model.warm_start.batch_size=16", "model.warm_start.validation_size=8",
            "data.train_size=80", "data.eval_size=20", "rollout.prompts_per_iteration=8",
            "rollout.samples_per_prompt=4", "loop.iterations=2", "loop.iterations_per_run=2", "loop.eval_every=2",
            f"storage.root={tmp_path / 'runs'}", f"rollout.environment.options.url={url}",
        ]  # fmt: skip
        command = [*RLPIPE, "run", "examples/openenv-addition.yaml", "--run-dir", str(tmp_path / "run")]
        command += [f"--set={each}" for each in sets]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    iterations = list_metrics(str(tmp_path / "run"), "iter")
    assert sorted(iterations) == [0, 1, 2]
    for i in (1, 2):
        assert iterations[i]["rollout/environment_error_fraction"] == 0.0
        assert 1.0 <= iterations[i]["rollout/turns_mean"] <= 3.0
