"""The pre-flight (`rlpipe check`, the start of every `rlpipe run`) catches what would otherwise fail
later or hang: a device the trainer cannot use, a tracking URI MLflow does not accept, and every data
problem at once. Each fails with the key to change, no traceback, before any step runs."""

import importlib.util
import time
from pathlib import Path

import pytest

from rlpipe.preflight import gpus_problem, tracking_store_problem

from .conftest import REPO
from .test_failures import _fails_clearly, _rlpipe, _spec


def _check_fails(result, *named: str) -> str:
    """`rlpipe check` failed, printing each check's result (FAIL lines name the keys), no traceback."""
    assert result.returncode == 1 and "check(s) failed" in result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for text in named:
        assert text in result.stdout, result.stdout
    return result.stdout


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "per-step"])
def test_cuda_without_a_gpu_fails_at_once(tmp_path: Path, resident: bool):
    """The issue's hang (resident trainer, warm start cached) cannot start: no step runs."""
    spec = _spec(tmp_path, trainer={"device": "cuda", "resident": resident})
    started = time.monotonic()
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    took = time.monotonic() - started
    message = _fails_clearly(result, "pre-flight check failed", "trainer.device is cuda but torch sees no GPU")
    assert "set trainer.device: auto or cpu" in message
    assert took < 30, f"took {took:.0f} s"
    assert not (tmp_path / "run" / "state.json").exists()


def test_more_gpus_than_torch_sees_names_trainer_gpus():
    assert "trainer.gpus is 4 but torch sees 2 GPU(s) here; set trainer.gpus: 2" in gpus_problem(4, "cuda", 2)
    assert gpus_problem(2, "cuda", 2) is None
    assert gpus_problem(4, "cpu", 0) is None  # on cpu, trainer.gpus gloo processes


def test_auto_on_a_machine_without_gpu_devices_is_the_cpu_without_importing_torch(tmp_path: Path):
    """check_device reads /dev for GPU device files before importing torch (a second of every run's start);
    trainer.device cuda still asks torch."""
    import subprocess
    import sys

    from rlpipe.preflight.machine import gpu_device_nodes

    code = (
        "import sys\nfrom rlpipe.preflight import check_device\nfrom rlpipe.spec import parse_spec\n"
        "from tests.conftest import tiny_spec_dict\nfrom pathlib import Path\n"
        f"print(check_device(parse_spec(tiny_spec_dict(Path({str(tmp_path)!r})))))\n"
        "print('torch imported:', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    if gpu_device_nodes():  # a GPU machine: torch decides
        assert "torch imported: True" in out
    else:
        assert "-> cpu (no GPU device on this machine)" in out and "torch imported: False" in out


def test_an_unknown_tracking_scheme_is_refused_with_the_ones_mlflow_accepts(tmp_path: Path):
    result = _rlpipe("check", str(_spec(tmp_path, tracking={"uri": "bogus://x"})), "--run-dir", str(tmp_path / "r"))
    message = _check_fails(result, "tracking.uri bogus://x: MLflow accepts no 'bogus' URI")
    assert all(scheme in message for scheme in ("http", "https", "sqlite", "postgresql", "databricks"))
    assert "'file'" not in message and ", file," not in message


@pytest.mark.skipif(importlib.util.find_spec("pymysql") is not None, reason="pymysql is installed here")
def test_a_database_tracking_uri_needs_its_driver_and_is_not_connected_to():
    problem = tracking_store_problem("mysql+pymysql://me:secret@db/mlflow")
    assert "tracking.uri mysql+pymysql://me:***@db/mlflow: SQLAlchemy's mysql driver pymysql cannot be" in problem
    assert "secret" not in problem
    assert "MLflow accepts no 'postgres' URI; use one of" in tracking_store_problem("postgres://db/mlflow")
    assert tracking_store_problem("sqlite:///somewhere/mlflow.db") is None  # the driver is the stdlib's
    assert tracking_store_problem("databricks") is None  # accepted by MLflow, not probed


def test_prompts_all_dropped_by_max_prompt_tokens_are_caught_before_any_step(tmp_path: Path):
    spec = _spec(tmp_path, data={"max_prompt_tokens": 2})  # "12+34=" is 7 tokens with bos
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    _fails_clearly(result, "pre-flight check failed", "data.max_prompt_tokens 2 drops every train prompt")
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "state.json").exists()


def test_every_data_problem_is_listed_at_once(tmp_path: Path):
    """Too few rows for the warm start and a template column the rows lack, in one failure."""
    spec = _spec(tmp_path, data={"train_size": 10, "prompt_template": "{question} ="})
    message = _check_fails(
        _rlpipe("check", str(spec)),
        "model.warm_start: 10 train rows cannot hold validation_size",
        "data.prompt_template names column 'question' that the rows lack",
    )
    assert message.count("FAIL") == 1  # one check, listing both


@pytest.mark.parametrize("template", ["{0} =", "{prompt.text} ="])
def test_a_prompt_template_that_cannot_render_is_named_not_a_traceback(tmp_path: Path, template: str):
    _check_fails(_rlpipe("check", str(_spec(tmp_path, data={"prompt_template": template}))), "fix data.prompt_template")


def test_an_environment_whose_turns_cannot_end_is_caught_before_any_step(tmp_path: Path):
    """A tools environment in the Hermes format on the character tokenizer: "</tool_call>" is 12 tokens,
    and turns end on one token id. `rlpipe check` says so; the calculator passes."""
    hermes = {"type": "tools", "options": {"tools": ["calculator"]}}
    result = _rlpipe("check", str(_spec(tmp_path, rollout={"environment": hermes})))
    _check_fails(result, "stop string '</tool_call>' is 12 tokens of this tokenizer")
    result = _rlpipe("check", str(_spec(tmp_path, rollout={"environment": {"type": "calculator"}})))
    assert "ok  environment calculator: turns end at eos or ['=']" in result.stdout, result.stdout + result.stderr
