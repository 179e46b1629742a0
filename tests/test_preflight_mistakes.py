"""Mistakes a user makes in a spec that used to run to the end, or fail minutes later without naming the
key (issue 43, items 9-15): each is named at pre-flight, in seconds, with what to change."""

import json
import os
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from rlpipe.preflight import CheckFailed, check_data, check_environment, check_evaluation, check_model
from rlpipe.spec import SpecError, parse_spec, with_overrides

from .conftest import RLPIPE, tiny_spec_dict
from .test_failures import _fails_clearly, _rlpipe, _spec


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 9: loop.stop_when naming a metric no eval records ----------------------------------------------------


def test_a_gate_on_a_metric_no_eval_records_stops_the_run_before_any_step(tmp_path: Path):
    loop = {"iterations": 1, "iterations_per_run": 1, "eval_every": 1, "stop_when": "eval/acuracy_greedy >= 0.5"}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, loop=loop)))
    started = time.monotonic()
    message = _fails_clearly(
        _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run")),
        "loop.stop_when 'eval/acuracy_greedy >= 0.5': no eval of this spec records eval/acuracy_greedy",
        "(did you mean eval/accuracy_greedy?)",
        "Its evals record eval/weights_version, eval/accuracy_greedy, eval/accuracy_strict",
    )
    assert time.monotonic() - started < 20, message
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize(
    ("gate", "named"),
    [
        ("eval/pass_at_16 >= 0.9", "(pass_at_16 needs evaluation.samples: 16)"),
        ("eval/hard/accuracy_greedy > 0.5", "(evaluation.sets has no set named 'hard'; its sets: ['three_digit'])"),
        ("eval/three_digit/pass_at_8 > 0.5", "(pass_at_8 needs the samples of evaluation.sets' three_digit: 8)"),
    ],
)
def test_gates_no_eval_records_are_refused_listing_what_the_evals_record(tmp_path: Path, gate: str, named: str):
    three_digit = {"name": "three_digit", "generator": "addition", "options": {"digits": 3}, "size": 10}
    evaluation = {"samples": 4, "sets": [three_digit]}
    spec = parse_spec(tiny_spec_dict(tmp_path, loop={"stop_when": gate}, evaluation=evaluation))
    with pytest.raises(CheckFailed) as failed:
        check_evaluation(spec)
    assert named in str(failed.value) and "so the loop would never stop" in str(failed.value)
    assert "eval/pass_at_4" in str(failed.value) and "eval/three_digit/pass_at_4" in str(failed.value)


def test_a_gate_on_a_harness_task_the_spec_does_not_run_is_refused(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path, loop={"stop_when": "harness/gsm8k/exact_match > 0.5"}))
    with pytest.raises(CheckFailed, match=r"evaluation.harness.tasks \(no harness section\) does not run"):
        check_evaluation(spec)


@pytest.mark.parametrize(
    "gate", ["eval/pass_at_4 >= 0.9", "eval/three_digit/maj_at_4 > 0.5", "eval/weights_version >= 2"]
)
def test_gates_on_recorded_metrics_pass(tmp_path: Path, gate: str):
    three_digit = {"name": "three_digit", "generator": "addition", "options": {"digits": 3}, "size": 10}
    evaluation = {"samples": 4, "sets": [three_digit]}
    spec = parse_spec(tiny_spec_dict(tmp_path, loop={"stop_when": gate}, evaluation=evaluation))
    assert check_evaluation(spec) == f"evaluation: loop.stop_when {gate!r}"


# --- 10: evaluation.harness.tasks naming a task lm_eval does not have ------------------------------------


def test_a_harness_task_lm_eval_lacks_is_named_with_the_include_path(tmp_path: Path, monkeypatch):
    pytest.importorskip("lm_eval")
    import rlpipe.evaluation.harness

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "doubles.yaml").write_text("task: rlpipe_doubles\ndataset_path: json\noutput_type: generate_until\n")
    # lm_eval's own thousands of tasks take seconds to index: the local ones alone here
    local_only = lambda manager_class, path, _: manager_class(include_path=path, include_defaults=False)  # noqa: E731
    monkeypatch.setattr(rlpipe.evaluation.harness, "task_manager", local_only)
    harness = {"tasks": ["rlpipe_doubles", "rlpipe_doubels"], "include_path": str(tasks)}
    spec = parse_spec(tiny_spec_dict(tmp_path, evaluation={"harness": harness}))
    with pytest.raises(CheckFailed) as failed:
        check_evaluation(spec)
    assert (
        f"evaluation.harness.tasks ['rlpipe_doubels']: no such lm_eval task in its registry or in include_path {tasks}"
    ) in str(failed.value)
    assert "close: rlpipe_doubles" in str(failed.value)
    harness["tasks"] = ["rlpipe_doubles"]
    fixed = parse_spec(tiny_spec_dict(tmp_path, evaluation={"harness": harness}))
    assert check_evaluation(fixed) == "evaluation: no eval gate, harness tasks ['rlpipe_doubles']"


# --- 11: --set a.b=value where section a is null ------------------------------------------------------------


def test_set_creates_a_null_section_and_names_a_value_in_the_way(tmp_path: Path):
    stored = {"evaluation": {"harness": None, "sets": [{"name": "x"}]}, "model": {"tiny": {"hidden_size": 64}}}
    created = with_overrides(json.loads(json.dumps(stored)), {"evaluation.harness.tasks": ["gsm8k"]})
    assert created["evaluation"]["harness"] == {"tasks": ["gsm8k"]}
    with pytest.raises(SpecError, match=r"--set model.tiny.hidden_size.x: model.tiny.hidden_size is 64, not a section"):
        with_overrides(json.loads(json.dumps(stored)), {"model.tiny.hidden_size.x": 1})
    with pytest.raises(SpecError, match=r"evaluation.sets is \[\{\"name\": \"x\"\}\], not a section; set it whole"):
        with_overrides(json.loads(json.dumps(stored)), {"evaluation.sets.name": "y"})


# --- 12: a hub id while offline -------------------------------------------------------------------------------


def test_a_hub_id_offline_and_not_cached_names_model_path(tmp_path: Path):
    spec = _spec(tmp_path, model={"path": "rlpipe-test/no-such-model"})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")}
    started = time.monotonic()
    result = _rlpipe_env(env, "run", str(spec), "--run-dir", str(tmp_path / "run"))
    message = _fails_clearly(
        result, "model.path rlpipe-test/no-such-model is a hub id and the hub cannot be reached (HF_HUB_OFFLINE=1)"
    )
    assert f"config.json in {tmp_path / 'hf'}" in message and "hf download rlpipe-test/no-such-model" in message
    assert time.monotonic() - started < 20


def test_a_hub_id_is_read_from_the_cache_when_the_hub_does_not_answer(tmp_path: Path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    spec = parse_spec(tiny_spec_dict(tmp_path, model={"path": "org/model"}, storage={"cache": str(tmp_path / "c")}))
    with pytest.raises(CheckFailed, match="model.path org/model is a hub id and the hub cannot be reached"):
        check_model(spec)
    caches = {tmp_path / "hf": ["config.json", "model.safetensors"], tmp_path / "c" / "hub": ["tokenizer.json"]}
    for cache, files in caches.items():
        snapshot = cache / "models--org--model" / "snapshots" / "abc"
        snapshot.mkdir(parents=True)
        (cache / "models--org--model" / "refs").mkdir()
        (cache / "models--org--model" / "refs" / "main").write_text("abc")
        for name in files:
            (snapshot / name).write_text("{}")
    assert check_model(spec).startswith("model: hub id org/model from the HF cache (http://127.0.0.1:")


def _rlpipe_env(env: dict, *args: str):
    import subprocess

    command = [*RLPIPE, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env)


# --- 13: a gs:// run root that cannot be reached --------------------------------------------------------------


def test_an_unreachable_bucket_is_named_in_seconds_without_library_tracebacks(tmp_path: Path, monkeypatch, capfd):
    pytest.importorskip("gcsfs")
    import fsspec

    from rlpipe.preflight import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_closed_port()}")  # gcsfs retries it for ~1 min
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
    monkeypatch.setattr(storage, "PROBE_S", 2.0)
    spec = parse_spec(tiny_spec_dict(tmp_path, storage={"root": "gs://rlpipe-test/runs", "cache": str(tmp_path / "c")}))
    started = time.monotonic()
    with pytest.raises(CheckFailed, match="storage.root: the run root gs://rlpipe-test/runs/tiny did not answer in 2"):
        storage.check_run_root(spec, "gs://rlpipe-test/runs/tiny")
    assert time.monotonic() - started < 5
    assert "Traceback" not in capfd.readouterr().err


def test_library_messages_during_preflight_go_to_its_log(tmp_path: Path):
    import logging

    from rlpipe.preflight import library_logs_to

    with library_logs_to(tmp_path / "logs" / "preflight.log") as logged:
        assert not logged()
        try:
            raise ConnectionError("Cannot connect to host storage.googleapis.com:443")
        except ConnectionError:
            logging.getLogger("gcsfs").exception("_request out of retries on exception")
        assert logged()
    log = (tmp_path / "logs" / "preflight.log").read_text()
    assert "_request out of retries" in log and "Traceback" in log and "ConnectionError: Cannot connect" in log
    assert not [h for h in logging.getLogger().handlers if getattr(h, "baseFilename", "").startswith(str(tmp_path))]


# --- 14: a remote environment that cannot be reached; every failed step's cause on the terminal ----------------


def _remote(tmp_path: Path, url: str):
    environment = {"type": "remote", "options": {"url": url, "stop": ["="]}}
    return parse_spec(tiny_spec_dict(tmp_path, rollout={"environment": environment}))


def test_an_unreachable_remote_environment_is_named_at_preflight(tmp_path: Path):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(CheckFailed, match=f"rollout.environment.options.url {url} is not reachable"):
        check_environment(_remote(tmp_path, url))

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert check_environment(_remote(tmp_path, url)).endswith(f", service {url} answers")
    finally:
        server.shutdown()


def test_the_terminal_carries_the_exception_of_a_failed_step_whatever_its_name(tmp_path: Path):
    """EnvironmentFailure ends in neither Error nor Exception: it was "cause: see the log". The exit handler's
    task runs after the failed one; what it logs is not the cause."""
    from rlpipe.pipelines.local_runner.driver import _failure_message

    failed = RuntimeError("Pipeline 'rlpipe-run' finished with status FAILURE. Inner task failed: 'warm-start'.")
    log = tmp_path / "kfp-local.log"
    log.write_text(
        "17:33:01.000 - INFO - Executing task 'warm-start'\n"
        "    Traceback (most recent call last):\n"
        '      File "/work/main/rlpipe/environments/__init__.py", line 231, in run_trajectories\n'
        "        raise EnvironmentFailure(\n"
        "    rlpipe.environments.EnvironmentFailure: rollout.environment 'remote' failed on every trajectory; the "
        "first: remote environment http://calc-env:8000/reset failed after 3 attempts\n"
        "    \n"
        "17:33:33.947 - ERROR - Task 'warm-start' finished with status FAILURE\n"
        "17:33:33.948 - INFO - Executing task 'track'\n"
        "    Traceback (most recent call last):\n"
        '      File "/work/main/rlpipe/tracking/mlflow_runs.py", line 1, in flush\n'
        "    mlflow.exceptions.MlflowException: no run to flush\n"
        "17:33:36.195 - INFO - Task 'track' finished with status SUCCESS\n"
    )
    message = _failure_message(failed, log, 0)
    assert "cause: EnvironmentFailure: rollout.environment 'remote' failed on every trajectory" in message
    log.write_text(  # killed: no traceback
        "17:33:01.000 - INFO - Executing task 'warm-start'\n"
        "17:33:33.947 - ERROR - Task 'warm-start' finished with status FAILURE\n"
    )
    assert "cause: the step ended without a Python exception (killed? out of memory?)" in _failure_message(
        failed, log, 0
    )


# --- 15: prompts longer than the model's context ---------------------------------------------------------------


def test_prompts_past_the_models_context_are_named_with_the_limit_and_max_prompt_tokens(tmp_path: Path):
    """'12+34=' is 7 tokens with bos; with 12 new tokens that is 19, over a tiny model of 16 positions."""
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    model = {"tiny": tiny | {"max_position_embeddings": 16}}
    spec = parse_spec(tiny_spec_dict(tmp_path, model=model, rollout={"max_new_tokens": 12}))
    with pytest.raises(CheckFailed) as failed:
        check_data(spec)
    message = str(failed.value)
    assert "data: the longest train prompt checked (data.max_prompt_tokens: None), '" in message
    assert "is 7 tokens; with rollout.max_new_tokens 12 that is 19, over the model's context of 16" in message
    assert "set data.max_prompt_tokens: 4 to drop longer prompts, or lower rollout.max_new_tokens to 9" in message
    assert check_data(parse_spec(tiny_spec_dict(tmp_path, model=model, rollout={"max_new_tokens": 9})))


# --- issue 58, item 4: a file named .gguf that is not one; an OpenEnv server that is not there -------------------

NOT_GGUF = "is not a GGUF file ({}): point model.path at a GGUF file from llama.cpp's converter, or at a Hugging Face"


def _gguf_header(version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<I", version) + bytes(24)


def test_a_file_named_gguf_that_is_not_one_is_named_at_preflight_with_model_path(tmp_path: Path):
    """gguf's reader said "Sorry, file appears to be version 0 which we cannot handle" at conversion, naming
    neither the file nor the key; pre-flight reads the first 8 bytes of every piece."""
    text = tmp_path / "model.gguf"
    text.write_text("hello, I am a text file\n")
    started = time.monotonic()
    message = _fails_clearly(
        _rlpipe("run", str(_spec(tmp_path, model={"path": str(text)})), "--run-dir", str(tmp_path / "run")),
        f"model.path {text} " + NOT_GGUF.format("it starts with b'hell', not b'GGUF'"),
    )
    assert time.monotonic() - started < 20, message
    assert not (tmp_path / "run" / "state.json").exists()

    def refused(path: Path) -> str:
        spec = parse_spec(tiny_spec_dict(tmp_path, model={"path": str(path)}))
        started = time.monotonic()
        with pytest.raises(CheckFailed) as failed:
            check_model(spec)
        assert time.monotonic() - started < 2
        return str(failed.value)

    empty, noise, zero = tmp_path / "empty.gguf", tmp_path / "noise.gguf", tmp_path / "zero.gguf"
    empty.write_bytes(b"")
    noise.write_bytes(bytes(range(200, 256)) * 100)
    zero.write_bytes(_gguf_header(version=0))
    assert refused(empty) == f"model.path {empty} {NOT_GGUF.format('it is empty')} model directory"
    assert f"model.path {noise} " + NOT_GGUF.format(f"it starts with {bytes(range(200, 204))!r}, not b'GGUF'") in (
        refused(noise)
    )
    assert refused(zero).startswith(f"model.path {zero} is GGUF version 0, which the gguf reader does not read")
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    (pieces / "m-00001-of-00002.gguf").write_bytes(_gguf_header())
    (pieces / "m-00002-of-00002.gguf").write_text("not the second piece")
    assert f"model.path {pieces / 'm-00002-of-00002.gguf'} is not a GGUF file" in refused(pieces)
    (pieces / "m-00002-of-00002.gguf").write_bytes(_gguf_header(version=2))
    assert check_model(parse_spec(tiny_spec_dict(tmp_path, model={"path": str(pieces)}))).startswith("model: GGUF")


def test_a_step_converting_a_file_that_is_not_gguf_names_it_too(tmp_path: Path):
    """A step that skipped pre-flight: the conversion checks the header against the installed gguf reader."""
    gguf = pytest.importorskip("gguf")
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    from rlpipe.models.files import resolve_model_source
    from rlpipe.models.gguf import MAGIC, VERSIONS

    assert MAGIC == struct.pack("<I", gguf.GGUF_MAGIC) and VERSIONS == tuple(READER_SUPPORTED_VERSIONS)
    text = tmp_path / "model.gguf"
    text.write_text("hello, I am a text file\n")
    with pytest.raises(ValueError, match=re.escape(f"model.path {text} is not a GGUF file (it starts with b'hell'")):
        resolve_model_source(str(text), tmp_path / "cache")
    for index, content in ((1, _gguf_header()), (2, b"GGUF\x03")):
        (tmp_path / f"m-0000{index}-of-00002.gguf").write_bytes(content)
    with pytest.raises(ValueError, match=r"m-00002-of-00002.gguf is not a GGUF file \(it ends after 5 bytes\)"):
        resolve_model_source(str(tmp_path / "m-00001-of-00002.gguf"), tmp_path / "cache")


def _openenv(tmp_path: Path, url: str):
    environment = {"type": "openenv", "options": {"url": url, "stop": ["="]}}
    return parse_spec(tiny_spec_dict(tmp_path, rollout={"environment": environment}))


def test_an_unreachable_openenv_server_is_named_at_preflight_in_seconds(tmp_path: Path):
    """The run named it after options.timeout_s (30 s) and its retries; pre-flight asks GET /health, as
    openenv-core's create_app answers it, with a short timeout."""
    url = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(CheckFailed) as failed:
        check_environment(_openenv(tmp_path, url))
    assert time.monotonic() - started < 2
    assert str(failed.value).startswith(f"rollout.environment.options.url {url}: no OpenEnv server answers there (")
    assert "Connection refused" in str(failed.value)
    assert str(failed.value).endswith("; start the environment server or fix rollout.environment.options.url")

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers 501: not an OpenEnv server
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        other = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(CheckFailed, match=re.escape(f"(GET {other}/health answered HTTP 501)")):
            check_environment(_openenv(tmp_path, other))
    finally:
        server.shutdown()

    pytest.importorskip("openenv")
    from .test_openenv_env import SERVER, serving

    with serving(SERVER, tmp_path / "server.log") as url:
        assert check_environment(_openenv(tmp_path, url + "/")).endswith(f", OpenEnv server {url} answers")


# --- cluster.secrets naming a step that is not one (the step table checks it, not the spec) -----------------


def test_a_secret_for_a_step_that_is_not_one_is_named_before_any_step(tmp_path: Path):
    from rlpipe.preflight import PreflightError, check_secrets, preflight
    from rlpipe.steps import STEP_NAMES

    secrets = [{"secret": "mlflow", "key": "token", "env": "MLFLOW_TRACKING_TOKEN", "steps": ["track", "trak"]}]
    spec = parse_spec(tiny_spec_dict(tmp_path, cluster={"secrets": secrets}))  # the spec knows no steps
    named = f"cluster.secrets steps ['trak'] are not steps; allowed: {', '.join(STEP_NAMES)}"
    with pytest.raises(CheckFailed) as failed:
        check_secrets(spec)
    assert str(failed.value) == named
    with pytest.raises(PreflightError) as failed_preflight:
        preflight(spec, str(tmp_path / "runs" / "tiny"))
    assert "(no step ran)" in str(failed_preflight.value) and named in str(failed_preflight.value)
    assert not (tmp_path / "runs" / "tiny" / "state.json").exists()
    secrets[0]["steps"] = ["track"]
    assert "cluster.secrets: 1" in check_secrets(parse_spec(tiny_spec_dict(tmp_path, cluster={"secrets": secrets})))


# --- a lease on storage other runs sharing the device cannot lock -------------------------------------------------


def test_a_lease_on_an_object_store_is_named_at_preflight(tmp_path: Path):
    """sharing.lease on a gs:// run root (no lock file there): the pre-flight names the key and the way out; on a
    local path it says where the turns are kept."""
    from rlpipe.preflight import CheckFailed, check_lease

    sections = {
        "trainer": {"resident": True},
        "rollout": {"engine": "sampler"},
        "samplers": {"endpoints": ["http://127.0.0.1:8000"]},
    }
    sharing = {"enabled": True, "lease": "gpu-0"}
    remote = tiny_spec_dict(tmp_path, **sections, sharing=sharing, storage={"root": "gs://rlpipe-test/runs"})
    with pytest.raises(CheckFailed, match=r"storage.root \(sharing.lease_root is not set\).*sharing.lease_root"):
        check_lease(parse_spec(remote))
    shared = sharing | {"lease_root": str(tmp_path / "shared")}
    said = check_lease(parse_spec(tiny_spec_dict(tmp_path, **sections, sharing=shared)))
    assert said == f"sharing.lease gpu-0: turns under {tmp_path / 'shared' / 'leases' / 'gpu-0'} (fifo)"
