"""Sampler plumbing that needs no vLLM: the container entrypoint, endpoint resolution, and the
errors a user sees when samplers are unreachable."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rlpipe.clients.sampler_client import SamplerError, generate_groups, replica_urls, sampler_weights_dir, wait_ready
from rlpipe.services.sampler_fleet import serve


def test_entrypoint_waits_for_published_weights_then_execs_vllm(tmp_path: Path, monkeypatch):
    run_root = tmp_path / "runs" / "demo"
    calls: list[list[str]] = []

    def publish_while_waiting(_seconds: float) -> None:  # the warm start publishes v0 meanwhile
        (run_root / "weights" / "v000000").mkdir(parents=True)
        (run_root / "weights" / "LATEST").write_text("v000000")

    monkeypatch.setattr("rlpipe.services.sampler_fleet.time.sleep", publish_while_waiting)
    monkeypatch.setattr("rlpipe.services.sampler_fleet.os.execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setenv("RLPIPE_RUN_ROOT", str(run_root))
    serve(["--port", "8000", "--max-num-seqs", "512"])
    (argv,) = calls
    assert argv[1:3] == ["-m", "rlpipe.services.vllm_server"]
    flags = dict(zip(argv[3::1], argv[4::1]))
    assert flags["--model"] == str(run_root / "weights" / "v000000")
    assert flags["--worker-extension-cls"] == "rlpipe.services.sampler_worker.PolicyReload"
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
    monkeypatch.setattr("rlpipe.services.sampler_fleet.os.execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr("rlpipe.services.sampler_fleet.os.environ", environment)
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
