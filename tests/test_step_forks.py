"""`rlpipe run`'s steps as forks of one warm process (rlpipe.pipelines.local_runner.step_forks) under the real KFP
local runner: a task sees what the server imported, its own env, and fails as a process does; after
the context, tasks are KFP's fresh interpreters again. With --containers, under KFP's DockerRunner
(marker containers): forks of a server in a container of the step's image, which lives while the
driver's lifeline is open."""

import concurrent.futures
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kfp import dsl, local

from rlpipe.pipelines.local_runner.step_forks import StepLaunches, Task, forked_steps, hold, preloaded, task_of


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


def command_of(component, interpreter: str) -> list[str]:
    """The command kfp.local's runner gives a task of `component`: its `python3` replaced by `interpreter`."""
    from kfp.local.subprocess_task_handler import replace_python_executable

    container = component.component_spec.implementation.container
    return replace_python_executable([*container.command, *container.args], interpreter)


def test_a_task_is_forked_by_what_it_runs_from_any_path_and_otherwise_said_why():
    """KFP's own command for a lightweight component goes to the server whatever the interpreter's path
    (a checkout or venv named rlpipe: r-l-p-i-p-e); one that installs packages first, or runs another
    interpreter, does not, and the reason names it."""
    for interpreter in (sys.executable, "/home/me/rlpipe/.venv/bin/python3", "/opt/pip tools/bin/python"):
        task = task_of(command_of(probe, interpreter), interpreter)
        assert isinstance(task, Task) and "def probe(fail: bool)" in task.source
        assert task.args[:2] == ["--executor_input", "{{$}}"] and task.args[-1] == "probe"
    elsewhere = task_of(command_of(probe, "/usr/bin/python3.12"), sys.executable)
    assert (
        elsewhere
        == f"it runs the executor with /usr/bin/python3.12, not the step server's interpreter {sys.executable}"
    )
    installs = dsl.component(
        probe.python_func, base_image="python:3.11", packages_to_install=["six"], install_kfp_package=False
    )
    said = task_of(command_of(installs, sys.executable), sys.executable)
    assert isinstance(said, str) and said.startswith("its command is not KFP's lightweight-component command alone")
    assert isinstance(task_of(command_of(probe, "python3"), "python3"), Task)  # in a container: the image's python3


def test_a_task_that_cannot_be_forked_runs_as_kfp_runs_it_and_says_why(capsys):
    """Counted in the run's StepLaunches (the progress display's `steps` row, summary.json) and said in the
    task's log."""
    from kfp.local import subprocess_task_handler

    launches = StepLaunches()
    with forked_steps((), launches):
        assert subprocess_task_handler.run_local_subprocess(["sh", "-c", "echo ran"], {}) == 0
    assert launches.as_dict() == {"forked": 0, "fresh": 1, "why": {next(iter(launches.fresh)): 1}}
    out = capsys.readouterr().out
    assert "not as a fork of the warm step server: its command is not KFP's lightweight-component" in out
    assert "ran" in out and "1 of 1 tasks not forked" in launches.summary()


def test_rlpipe_run_forks_every_step_from_a_checkout_and_venv_named_rlpipe(tmp_path: Path):
    """A clone into its default directory: the working directory and the interpreter's path both hold the
    project's name (r-l-p-i-p-e holds "pip"). A plain `rlpipe run` forks every KFP task it runs (each
    "Executing task" of its KFP log counted in summary.json's steps), none starts as a fresh process."""
    import yaml

    from .conftest import tiny_spec_dict

    home = tmp_path / "rlpipe"
    home.mkdir()
    (home / ".venv").symlink_to(sys.prefix, target_is_directory=True)  # this venv, at a path named after the project
    python = str(home / ".venv" / "bin" / "python")
    seen = subprocess.run([python, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    assert seen.stdout.strip() == python  # the path KFP writes into each task's script
    spec = tiny_spec_dict(home, loop={"iterations": 1, "iterations_per_run": 1, "eval_every": 1})
    (home / "spec.yaml").write_text(yaml.safe_dump(spec))
    command = [python, "-m", "rlpipe.pipelines.cli", "run", "spec.yaml", "--run-dir", "runs/tiny"]
    ran = subprocess.run(command, cwd=home, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = json.loads((home / "runs" / "tiny" / "summary.json").read_text())
    log = (home / "runs" / "tiny" / "logs" / "kfp-local.log").read_text()
    tasks = re.findall(r"Executing task \x1b\[\d+m'([\w-]+)'", log)
    assert len(tasks) >= 8 and summary["steps"] == {"forked": len(tasks), "fresh": 0, "why": {}}, summary["steps"]
    assert "not as a fork of the warm step server" not in log + ran.stdout


def test_the_server_imports_what_light_steps_compute_with_and_no_torch():
    import subprocess
    import sys

    modules = preloaded()
    light = {"rlpipe.rewards", "rlpipe.algorithms", "rlpipe.store.commit", "rlpipe.services.trainer.client"}
    assert light <= set(modules)
    probe = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_the_server_lives_while_its_lifeline_is_open(tmp_path: Path):
    path = tmp_path / "forks.sock"
    server = subprocess.Popen([sys.executable, "-m", "rlpipe.pipelines.local_runner.step_forks", str(path)])
    try:
        deadline = time.time() + 60
        while not path.exists():
            assert time.time() < deadline and server.poll() is None, "the fork server did not listen"
            time.sleep(0.1)
        lifeline = hold(str(path))
        time.sleep(0.5)
        assert server.poll() is None
        lifeline.close()  # as a driver killed with -9 closes it
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()


def probe_in_image(started: str, sleep_s: float) -> str:
    import os
    import pathlib
    import sys
    import time

    pathlib.Path(started).write_text(str(os.getpid()))
    time.sleep(sleep_s)
    seen = [os.environ.get(key, "-") for key in ("PROBE", "OMP_NUM_THREADS", "RUN_ENV")]
    return " ".join([str("rlpipe.loop" in sys.modules), *seen])


@pytest.mark.containers
def test_steps_in_containers_are_forks_of_a_server_in_their_image(images, capsys, monkeypatch):
    """KFP's DockerRunner as `rlpipe run --containers` sets it up (rlpipe.pipelines.local_runner.containers): a task
    of the step image runs in a fork of the step server in a container of that image (it finds rlpipe.loop
    imported), with the image's env (OMP_NUM_THREADS), the run's and its own; a server container killed
    under a running step fails that step and says so; the next step gets a container of its own; stopping
    removes the server's container."""
    from rlpipe.pipelines.local_runner.containers import LocalContainers, WarmSteps

    shared = Path(tempfile.mkdtemp(prefix="rlpipe-warm-", dir="/tmp"))
    sock = shared / "docker.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"])
    containers = LocalContainers("podman", f"unix://{sock}", str(shared), [str(shared)], {"RUN_ENV": "run"},
                                 str(shared), warm=WarmSteps())  # fmt: skip
    component = dsl.component(base_image=images["step"], install_kfp_package=False)(probe_in_image)

    @dsl.pipeline
    def in_image(started: str, sleep_s: float) -> str:
        task = component(started=started, sleep_s=sleep_s)
        task.set_env_variable("PROBE", "seen")
        return task.output

    def labelled() -> list[str]:
        found = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=rlpipe.run-root={shared}"],
                               capture_output=True, text=True)  # fmt: skip
        return found.stdout.split()

    try:
        deadline = time.time() + 30
        while not sock.exists():
            assert time.time() < deadline, "podman system service did not listen"
            time.sleep(0.2)
        monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
        local.init(runner=containers.step_runner(), pipeline_root=str(shared / "kfp"))
        assert in_image(started=str(shared / "a"), sleep_s=0.0).output == "True seen 1 run"
        assert in_image(started=str(shared / "b"), sleep_s=0.0).output == "True seen 1 run"
        assert len(labelled()) == 1  # the server's container: no container a step

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(in_image, started=str(shared / "c"), sleep_s=120.0)
            deadline = time.time() + 60
            while not (shared / "c").exists():
                assert time.time() < deadline, "the step did not start"
                time.sleep(0.2)
            subprocess.run(["podman", "kill", *labelled()], capture_output=True, check=True)
            with pytest.raises(RuntimeError, match="probe-in-image"):
                running.result(timeout=120)
        assert "StepContainerError: the step's container was stopped from outside (exit 137" in capsys.readouterr().out
        assert in_image(started=str(shared / "d"), sleep_s=0.0).output == "False seen 1 run"  # a fresh interpreter
        assert dict(containers.warm.launches.fresh) == {f"the step server in {images['step']} has ended": 1}
        assert "not as a fork of the warm step server: the step server in" in capsys.readouterr().out
    finally:
        containers.warm.stop()
        containers.remove_all()
        service.terminate()
        service.wait(timeout=10)
    assert labelled() == []


def test_a_spec_whose_steps_compute_with_torch_has_the_server_import_it():
    """The demo's resident trainer leaves its steps thin clients (nothing of torch to import); with
    trainer.resident false, generate, update and evaluate compute in their tasks: the server imports
    their modules, so a task is a fork of a process that has torch (seconds a task otherwise)."""
    from rlpipe.spec import parse_spec
    from rlpipe.steps import iteration_modules

    from .conftest import tiny_spec_dict

    resident = iteration_modules(parse_spec(tiny_spec_dict(Path("/tmp"), trainer={"resident": True})))
    per_step = iteration_modules(parse_spec(tiny_spec_dict(Path("/tmp"), trainer={"resident": False})))
    torch_steps = {"rlpipe.engines", "rlpipe.training.session", "rlpipe.evaluation.accuracy"}
    assert "rlpipe.services.trainer.client" in resident and not torch_steps & set(resident)
    assert torch_steps <= set(per_step)
    fused = iteration_modules(parse_spec(tiny_spec_dict(Path("/tmp"), loop={"fuse_steps": True})))
    assert torch_steps <= set(fused)
