"""`rlpipe run`'s steps as forks of one warm process (rlpipe.services.step_forks) under the real KFP
local runner: a task sees what the server imported, its own env, and fails as a process does; after
the context, tasks are KFP's fresh interpreters again."""

import time
from pathlib import Path

import pytest
from kfp import dsl, local

from rlpipe.services.step_forks import forked_steps, preloaded, task_of


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def probe(fail: bool) -> str:
    import os
    import sys

    if fail:
        raise ValueError("the step failed")
    return f"{'rlpipe.loop' in sys.modules} {os.environ.get('PROBE')}"


@dsl.pipeline
def one_task(fail: bool) -> str:
    task = probe(fail=fail)
    task.set_env_variable("PROBE", "seen")
    return task.output


def test_tasks_run_as_forks_of_the_warm_server_and_fail_as_processes_do(tmp_path: Path, capsys):
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    with forked_steps() as path:
        deadline = time.time() + 60
        while not Path(path).exists():
            assert time.time() < deadline, "the fork server did not listen"
            time.sleep(0.1)
        assert one_task(fail=False).output == "True seen"  # rlpipe.loop: imported by the server, not the task
        with pytest.raises(RuntimeError, match="probe"):
            one_task(fail=True)
        assert "ValueError: the step failed" in capsys.readouterr().out
    assert not Path(path).exists()
    assert one_task(fail=False).output == "False seen"  # KFP's own: a fresh interpreter


def test_only_the_executor_alone_goes_to_the_server():
    run = ["sh", "-c", 'program_path=$(mktemp -d)\npython3 -m kfp.dsl.executor_main "$@"', "SOURCE", "--x", "1"]
    assert task_of(run) == ("SOURCE", ["--x", "1"])
    installs = [run[0], run[1], "python3 -m pip install kfp && " + run[2], *run[3:]]
    assert task_of(installs) is None and task_of(["python3", "-c", "pass"]) is None


def test_the_server_imports_what_light_steps_compute_with_and_no_torch():
    import subprocess
    import sys

    modules = preloaded()
    light = {"rlpipe.rewards", "rlpipe.algorithms", "rlpipe.store.commit", "rlpipe.services.trainer.client"}
    assert light <= set(modules)
    probe = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
