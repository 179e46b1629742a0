"""Sampler plumbing that needs no vLLM: the container entrypoint, endpoint resolution, and the
errors a user sees when samplers are unreachable."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlpipe.engines.sampler_requests import SamplerError, generate_groups, replica_urls, sampler_weights_dir, wait_ready
from rlpipe.http_json import reply_json
from rlpipe.services.samplers.fleet import serve


def test_entrypoint_waits_for_published_weights_then_execs_vllm(tmp_path: Path, monkeypatch):
    run_root = tmp_path / "runs" / "demo"
    calls: list[list[str]] = []

    def publish_while_waiting(_seconds: float) -> None:  # the warm start publishes v0 meanwhile
        (run_root / "weights" / "v000000").mkdir(parents=True)
        (run_root / "weights" / "LATEST").write_text("v000000")

    monkeypatch.setattr("rlpipe.services.samplers.fleet.time.sleep", publish_while_waiting)
    monkeypatch.setattr("rlpipe.services.samplers.fleet.os.execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setenv("RLPIPE_RUN_ROOT", str(run_root))
    serve(["--port", "8000", "--max-num-seqs", "512"])
    (argv,) = calls
    assert argv[1:3] == ["-m", "rlpipe.services.samplers.server"]
    flags = dict(zip(argv[3::1], argv[4::1]))
    assert flags["--model"] == str(run_root / "weights" / "v000000")
    assert flags["--worker-extension-cls"] == "rlpipe.engines.vllm_worker.PolicyReload"
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in argv
    assert flags["--max-num-seqs"] == "512"  # extra args go to vLLM


def test_entrypoint_serves_an_adapter_version_as_its_base_with_lora(tmp_path: Path, monkeypatch):
    """model.lora: the latest version is an adapter; the server starts on the sealed base, LoRA on."""
    import json

    run_root = tmp_path / "runs" / "demo"
    base, adapter = run_root / "weights" / "v000000", run_root / "weights" / "v000001"
    base.mkdir(parents=True)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 12}))
    (adapter / "base.json").write_text(json.dumps({"uri": str(base), "version": 0, "sha256": "0" * 64}))
    (run_root / "weights" / "LATEST").write_text("v000001")
    calls: list[list[str]] = []
    environment: dict[str, str] = {}
    monkeypatch.setattr("rlpipe.services.samplers.fleet.os.execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr("rlpipe.services.samplers.fleet.os.environ", environment)
    serve(["--run-root", str(run_root)])
    (argv,) = calls
    flags = dict(zip(argv[3::1], argv[4::1]))
    assert flags["--model"] == str(base) and "--enable-lora" in argv
    assert flags["--max-lora-rank"] == "16"  # the smallest rank vLLM sizes for that holds 12
    assert environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"  # /v1/load_lora_adapter


def test_entrypoint_needs_a_run_root(monkeypatch, capsys):
    monkeypatch.delenv("RLPIPE_RUN_ROOT", raising=False)
    with pytest.raises(SystemExit):
        serve([])
    assert "RLPIPE_RUN_ROOT" in capsys.readouterr().err


def test_endpoints_resolve_or_say_which_entry_is_wrong():
    assert replica_urls(["http://127.0.0.1:8000/"]) == ["http://127.0.0.1:8000"]
    assert len(replica_urls(["http://localhost:8000"])) == 1  # one server, even if it has v4 and v6 addresses
    with pytest.raises(SamplerError, match="samplers.endpoints is empty"):
        wait_ready([], 5)
    with pytest.raises(SamplerError, match="no-such-sampler.invalid"):
        replica_urls(["http://no-such-sampler.invalid:8000"])


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_samplers_fail_with_what_to_do():
    url = _closed_port()
    with pytest.raises(SamplerError, match="no sampler is ready after 1s.*rerun to resume"):
        wait_ready([url], 1)
    with pytest.raises(SamplerError, match="2 of 2 prompts unsampled: every sampler failed.*rerun to resume"):
        generate_groups([url], [[1, 2], [1, 3]], 2, {"max_tokens": 2}, 0, 0, 2, 5)


def test_samplers_need_the_store_on_a_shared_filesystem():
    assert sampler_weights_dir("/mnt/rlpipe/runs/x/weights/v000001") == "/mnt/rlpipe/runs/x/weights/v000001"
    with pytest.raises(SamplerError, match="storage.root on a path the samplers mount"):
        sampler_weights_dir("gs://bucket/runs/x/weights/v000001")


def test_the_log_probs_check_tells_log_probs_at_the_temperature_from_log_probs_at_1():
    """A replica's reported log-probs against the temperature-1 log-probs of the same tokens (its prompt
    log-probs), in vLLM's wire format: log softmax(z / T) passes, log softmax(z) (vLLM's default
    raw_logprobs) does not, at temperatures either side of 1."""
    import math
    import random

    from rlpipe.engines.logprobs_check import at_temperature, logprob_gaps

    def log_softmax(z: list[float]) -> list[float]:
        top = max(z)
        norm = top + math.log(sum(math.exp(v - top) for v in z))
        return [v - norm for v in z]

    rng = random.Random(0)
    logits = [[rng.gauss(0, 2) for _ in range(16)] for _ in range(6)]  # one row per completion position
    sampled = [rng.randrange(16) for _ in logits]
    prompt_length = 3
    at_one = [log_softmax(z) for z in logits]
    top = [max(range(16), key=lambda v, lp=lp: lp[v]) for lp in at_one]
    prompt_logprobs = [None, *[{} for _ in range(prompt_length - 1)]]
    prompt_logprobs += [{str(t): {"logprob": lp[t]} for t in (s, a)} for lp, s, a in zip(at_one, sampled, top)]
    for temperature in (0.6, 0.9, 1.4):
        for processed in (True, False):
            lps = [log_softmax([v / temperature for v in z]) if processed else log_softmax(z) for z in logits]
            content = [
                {"token_id": s, "logprob": lp[s], "top_logprobs": [{"token_id": t, "logprob": lp[t]} for t in (s, a)]}
                for lp, s, a in zip(lps, sampled, top)
            ]
            gaps = logprob_gaps({"logprobs": {"content": content}}, prompt_logprobs, prompt_length)
            assert len(gaps) == sum(s != a for s, a in zip(sampled, top)) > 0
            assert at_temperature(gaps, temperature) is processed, (temperature, processed)
    assert at_temperature([], 0.7) is None  # every sampled token the only one listed: nothing to judge by


class StandInSampler(ThreadingHTTPServer):
    """A real HTTP server with a vLLM sampler's reload endpoints, whose /collective_rpc (the weights
    reload) can hang until released, or die: the process a reload waits on, not the client under test."""

    def __init__(self, port: int = 0, mode: str = "serve"):
        self.label, self.paused, self.mode, self.released = "0", False, mode, threading.Event()
        super().__init__(("127.0.0.1", port), StandInHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def die(self) -> None:
        threading.Thread(target=self.shutdown).start()
        self.socket.close()  # new connections are refused


class StandInHandler(BaseHTTPRequestHandler):
    server: StandInSampler

    def log_message(self, *args) -> None:
        pass

    def answer(self, body: dict) -> None:
        reply_json(self, 200, body)

    def do_GET(self) -> None:  # noqa: N802
        loaded = {"/weight_info": {"weight_version": self.server.label}, "/v1/models": {"data": []}}
        self.answer(loaded.get(self.path, {}))

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        s, path = self.server, self.path.split("?")[0]
        if path == "/collective_rpc" and s.mode == "hang":
            s.released.wait()
        if path == "/collective_rpc" and s.mode == "die":
            s.die()
            self.connection.shutdown(socket.SHUT_RDWR)  # no answer: the process is gone
            return
        if path == "/v1/load_lora_adapter" and s.mode == "no-lora":  # started without runtime LoRA: no such route
            return reply_json(self, 404, {"detail": "Not Found"})
        if path == "/v1/load_lora_adapter" and s.mode == "lora-missing":  # vLLM's own 404: no adapter there
            error = {"message": f"no adapter at {body['lora_path']}", "type": "NotFoundError", "code": 404}
            return reply_json(self, 404, {"error": error})
        if path == "/update_weight_version":
            s.label = body["new_version"]
        s.paused = {"/pause": True, "/resume": False}.get(path, s.paused)
        self.answer({})


def test_a_sampler_without_runtime_lora_is_told_apart_from_an_adapter_it_cannot_find(tmp_path: Path):
    """Both answer 404: a route the server does not have (FastAPI's own answer) names the flags to start
    it with; vLLM's own error for an adapter it cannot load is passed on as it is."""
    from rlpipe.services.samplers.client import swap_adapter

    (tmp_path / "adapter_config.json").write_text("{}")
    without, missing = StandInSampler(mode="no-lora"), StandInSampler(mode="lora-missing")
    try:
        with pytest.raises(SamplerError, match=r"answered 404 \(no such route\).*--enable-lora"):
            swap_adapter(without.url, str(tmp_path), 3, 5.0)
        with pytest.raises(SamplerError, match=r"answered 404: .*no adapter at") as raised:
            swap_adapter(missing.url, str(tmp_path), 3, 5.0)
        assert "--enable-lora" not in str(raised.value)
    finally:
        without.die()
        missing.die()


@pytest.mark.parametrize("failure", ["hang", "die"])
def test_a_sampler_that_hangs_or_dies_mid_reload_fails_the_reload_in_its_timeout_naming_it(tmp_path: Path, failure):
    """The weights reload (sync_weights, generate's catch-up) ends within samplers.request_timeout_s, naming
    the replica; the replica is left labelled by no version, so once it serves again the next generate
    reloads it (and resumes it, paused or not) before sampling from it."""
    from rlpipe.services.samplers.client import ensure_version, sync_replicas

    sampler = StandInSampler(mode=failure)
    url, started = sampler.url, time.time()
    try:
        with pytest.raises(SamplerError) as raised:
            sync_replicas([url], str(tmp_path), 3, 2.0)
        took = time.time() - started
    finally:
        sampler.released.set()
    assert took < 3.0, f"the reload took {took:.1f}s with a 2s timeout"
    why = "no answer to /collective_rpc in time" if failure == "hang" else "the connection failed at /collective_rpc"
    assert str(raised.value).startswith(
        f"sampler {url} did not load weights v3 within samplers.request_timeout_s (2s): {why}"
    ), raised.value
    assert "rerun to resume" in str(raised.value)
    if failure == "hang":  # it answers at last: loaded, but paused and labelled by no version
        assert (sampler.label, sampler.paused) == ("loading v3", True)
    else:  # back, as a restart brings it: on the same address, unlabelled
        sampler = StandInSampler(port=sampler.server_address[1])
        sampler.label = "default"
    assert ensure_version([url], str(tmp_path), 3, 5.0)["samplers/reloaded_stale"] == 1
    assert (sampler.label, sampler.paused) == ("3", False)
    sampler.shutdown()
