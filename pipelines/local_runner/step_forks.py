"""KFP's local tasks as forks of one warm process: each step of `rlpipe run` (without --containers).

kfp.local's SubprocessRunner starts every task as `sh -c` -> `python3 -m kfp.dsl.executor_main`: a
fresh interpreter that imports KFP's executor, pyarrow, numpy and rlpipe before the step computes,
~0.15 s a task (five tasks a demo iteration: ~14% of it). Here one server process, started with the
steps' environment, imports them once; each task is a fork of it that runs the same executor on the
same arguments, its output streamed to the driver and its exit status returned as the subprocess's were.

    driver  replaces kfp.local.subprocess_task_handler.run_local_subprocess (kfp==2.17.0) while
            `forked_steps` lasts: a task whose command is exactly KFP's lightweight-component command
            for this interpreter (`task_of`) waits for the server to listen and goes to it; any other
            (one that pip-installs first, another interpreter's) runs as KFP runs it, and `StepLaunches`
            says why in the task's log and the run's progress display
    server  `python -m rlpipe.pipelines.local_runner.step_forks SOCKET`, single-threaded (a fork copies no lock that
            another thread holds): accepts a task, forks, answers each fork's exit status as it ends
            (SIGCHLD wakes it); dies with the driver (PR_SET_PDEATHSIG), its tasks with it
    task    a fork: the driver's environment and working directory at the call, stdout and stderr the
            pipe the driver passed, the component's source in a temporary directory, then
            kfp.dsl.executor_main run as __main__ and the interpreter's normal exit (threads joined,
            atexit run), as in a fresh process
    in a container  the same server in a step image (containers, beside this: `rlpipe run --containers`),
            its socket in a folder mounted at the same path; each task's environment laid over the
            container's (`inherit_env`), and the server ends when the driver's lifeline (`hold`) closes,
            as a driver killed with -9 closes it
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from rlpipe.services.local_servers import die_with_parent

SERVER = "rlpipe.pipelines.local_runner.step_forks"  # `python -m SERVER SOCKET MODULE...` starts a step server
HEADER = 8  # a request: its length in these many bytes (with the output's file descriptor), then its JSON


class Task(NamedTuple):
    """A lightweight component's task as the server runs it: the component's source, the executor's arguments."""

    source: str
    args: list[str]


@dataclass
class StepLaunches:
    """How a run's KFP tasks started: as forks of a warm step server, or as KFP starts them (a fresh
    process or container), with why; what the progress display and summary.json say."""

    forked: int = 0
    fresh: Counter[str] = field(default_factory=Counter)  # why -> tasks
    asked_fresh: bool = False  # rlpipe run --fresh-steps

    def ran_fresh(self, why: str) -> None:
        """Count a task started as KFP starts it, and say why in its log."""
        self.fresh[why] += 1
        print(f"rlpipe: this task starts as KFP starts it, not as a fork of the warm step server: {why}")

    def summary(self) -> str:
        if self.asked_fresh:
            return "each a fresh process or container (--fresh-steps)"
        if not self.fresh:
            return f"forks of a warm step server ({self.forked} tasks)"
        whys = "; ".join(f"{count}: {why}" for why, count in self.fresh.items())
        return f"{sum(self.fresh.values())} of {self.forked + sum(self.fresh.values())} tasks not forked ({whys})"

    def as_dict(self) -> dict:
        return {"forked": self.forked, "fresh": sum(self.fresh.values()), "why": dict(self.fresh)} | (
            {"fresh_steps": True} if self.asked_fresh else {}
        )


@contextlib.contextmanager
def forked_steps(
    modules: Sequence[str] = (), launches: StepLaunches | None = None, log: Path | None = None
) -> Iterator[str]:
    """kfp.local's lightweight tasks run as forks of a server started with this process's environment
    (the steps' settings already in it) while the context lasts; as KFP runs them after. The server
    imports `modules` too (the spec's torch steps' own: rlpipe.steps.iteration_modules), once it listens;
    what it prints goes to `log`. Each task is counted in `launches`. Yields the server's socket path,
    there once it listens."""
    from kfp.local import subprocess_task_handler

    launches = launches if launches is not None else StepLaunches()
    folder = tempfile.mkdtemp(prefix="rlpipe-steps-")
    path = os.path.join(folder, "forks.sock")
    argv = [sys.executable, "-m", SERVER, path, *modules]
    output = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    server = subprocess.Popen(argv, stdout=output, stderr=output, preexec_fn=die_with_parent)
    as_kfp = subprocess_task_handler.run_local_subprocess

    def run_local_subprocess(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
        task = task_of(full_command, sys.executable)
        why = task if isinstance(task, str) else listening(path, server, log)
        if not why:
            try:
                code = run_forked(path, *task, {**os.environ, **(env_vars or {})})
            except ConnectionError:  # the server is gone, and the task was not sent
                why = f"the step server ({SERVER}) has ended" + (f" (its log: {log})" if log else "")
            else:
                launches.forked += 1
                if code is None:
                    print(f"StepServerError: the step server ({SERVER}) ended while the step ran")
                    return 1
                return code
        launches.ran_fresh(why)
        return as_kfp(full_command, env_vars)

    subprocess_task_handler.run_local_subprocess = run_local_subprocess
    try:
        yield path
    finally:
        subprocess_task_handler.run_local_subprocess = as_kfp
        server.terminate()
        server.wait()
        if log is not None:
            output.close()
        shutil.rmtree(folder, ignore_errors=True)


def listening(path: str, server: subprocess.Popen, log: Path | None, timeout_s: float = 120.0) -> str:
    """Wait for the server at `path` to listen: "" once it does, else why it will not (it ended, or it
    did not listen within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if server.poll() is not None:
            return f"the step server ended with code {server.returncode} before it listened" + (
                f" (its log: {log})" if log else ""
            )
        if time.monotonic() > deadline:
            return f"the step server did not listen within {timeout_s:.0f} s"
        time.sleep(0.01)
    return ""


def preloaded() -> list[str]:
    """What the server imports: KFP's executor and what the light steps compute with (rlpipe.steps: the
    steps without torch, and the services' clients); torch stays with the steps that need it."""
    from rlpipe.steps import BY_NAME

    light = [module for step in BY_NAME.values() if not step.torch for module in step.computes_with]
    clients = ["rlpipe.services.trainer.client", "rlpipe.services.producer.buffer"]
    # pyarrow imports pandas, where installed, on the first table it builds from Python objects (pa.table
    # asks whether each is a DataFrame): 0.15 s of score's and advantages' 0.2 s on the demo
    pandas = ["pandas"] if importlib.util.find_spec("pandas") is not None else []
    executor = ["kfp.dsl.executor_main", "numpy", "pyarrow.parquet", *pandas]
    return [*executor, "rlpipe.loop", *dict.fromkeys(light), *clients]


@functools.cache
def executor_script(interpreter: str) -> str:
    """The script of this KFP's lightweight-component command (kfp.dsl.component_factory: `sh -ec SCRIPT
    SOURCE ARGS...`) with its `python3` replaced by `interpreter`, as the local runner replaces it
    (kfp.local.subprocess_task_handler.replace_python_executable; the DockerRunner keeps `python3`)."""
    from kfp import dsl

    def component():  # noqa: ANN202 (under `from __future__ import annotations` KFP reads "None" as a type name)
        pass

    made = dsl.component(component, base_image="python:3.11", install_kfp_package=False)
    script = made.component_spec.implementation.container.command[2]
    return script.replace("python3", interpreter)


def task_of(full_command: list[str], interpreter: str) -> Task | str:
    """The task a command runs, when the command is exactly KFP's lightweight-component command with
    `interpreter` (the server's) running the executor; else why it is not, as a sentence for the log."""
    if full_command[:2] != ["sh", "-ec"] or len(full_command) < 4:
        return (
            "its command is not KFP's lightweight-component command alone (packages_to_install, "
            f"install_kfp_package or a container component run first: {' '.join(full_command)[:120]!r})"
        )
    script, expected = full_command[2], executor_script(interpreter)
    if script != expected:
        before, _, after = executor_script("python3").partition("python3")
        if script.startswith(before) and script.endswith(after):
            other = script[len(before) : len(script) - len(after)]
            return f"it runs the executor with {other}, not the step server's interpreter {interpreter}"
        return f"its script is not kfp {importlib.metadata.version('kfp')}'s lightweight-component script"
    return Task(full_command[3], full_command[4:])


def run_forked(
    path: str, source: str, args: list[str], env: dict[str, str], cwd: str | None = None, inherit_env: bool = False
) -> int | None:
    """One task as a fork of the server at `path`, in `cwd` (default this one's) with `env` (laid over the
    server's with `inherit_env`): its output printed as kfp.local prints a subprocess's, then its exit
    status; None when the server ended while the task ran (ConnectionError: it was not sent)."""
    request = {"source": source, "args": args, "env": env, "cwd": cwd or os.getcwd(), "inherit_env": inherit_env}
    request = json.dumps(request).encode()
    read_end, write_end = os.pipe()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(path)
        except ConnectionError:
            os.close(read_end)
            os.close(write_end)
            raise
        socket.send_fds(conn, [len(request).to_bytes(HEADER, "big")], [write_end])
        os.close(write_end)
        conn.sendall(request)
        with os.fdopen(read_end, errors="replace") as output:
            for line in iter(output.readline, ""):
                print(line, end="")
        print("\n")
        answer = b""
        while chunk := conn.recv(64):
            answer += chunk
    return int(answer) if answer.strip() else None


def hold(path: str) -> socket.socket:
    """The server at `path` lives while the returned connection is open: close it (or end this process)
    and the server ends, its running tasks with it."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"lifeline": True}).encode()
    conn.sendall(len(request).to_bytes(HEADER, "big") + request)  # no output to pass: no file descriptor
    return conn


def serve(path: str, modules: Sequence[str] = ()) -> tuple[socket.socket, int, dict]:
    """Accept tasks and fork one process each, answering each its exit status as it ends; returns
    only in a fork: (its connection, its output's file descriptor, the request). `modules` (torch's,
    seconds) are imported after it listens: a task sent meanwhile waits in the backlog for them rather
    than starting a fresh interpreter; one this image lacks is left to its step to report."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the driver sends tasks once the path exists: the light imports are done
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (torch absent from the step image; a module failing: its step reports it)
            pass
    wakeup, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    waiting: dict[int, socket.socket] = {}  # pid -> the connection its status goes to
    lifelines: list[socket.socket] = []
    while True:
        readable, _, _ = select.select([listener, wakeup, *lifelines], [], [])
        if any(conn in readable for conn in lifelines):
            sys.exit(0)  # the driver closed it, or died: its tasks die with this process (die_with_parent)
        if wakeup in readable:
            os.read(wakeup, 4096)
        if listener in readable:
            conn, request, output = received(listener)
            if request.get("lifeline"):
                lifelines.append(conn)
            elif (pid := os.fork()) == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for each in (listener, *waiting.values(), *lifelines):
                    each.close()
                os.close(wakeup)
                os.close(woken)
                return conn, output, request
            else:
                os.close(output)
                waiting[pid] = conn
        for pid in list(waiting):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                with waiting.pop(pid) as conn:
                    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())


def received(listener: socket.socket) -> tuple[socket.socket, dict, int]:
    """The next task: (its connection, its request, its output's file descriptor; -1 for a lifeline)."""
    conn, _ = listener.accept()
    header, fds, _, _ = socket.recv_fds(conn, HEADER, 1)
    while len(header) < HEADER:
        header += conn.recv(HEADER - len(header))
    size, body = int.from_bytes(header, "big"), b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return conn, json.loads(body), fds[0] if fds else -1


def run_task(conn: socket.socket, output: int, request: dict) -> int:
    """In the fork: the executor as `python3 -m kfp.dsl.executor_main --component_module_path FILE ARGS`
    runs it, with the request's environment, working directory and output; its exit code."""
    conn.close()
    die_with_parent()
    sys.stdout.flush()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    if not request.get("inherit_env"):
        os.environ.clear()
    os.environ.update(request["env"] | {"_KFP_RUNTIME": "true"})
    os.chdir(request["cwd"])
    sys.modules["numpy"].random.seed()  # its own draws, as a fresh process's (Python's random reseeds at fork)
    module = Path(tempfile.mkdtemp()) / "ephemeral_component.py"
    module.write_text(request["source"])
    sys.argv = ["kfp.dsl.executor_main", "--component_module_path", str(module), *request["args"]]
    try:
        runpy.run_module("kfp.dsl.executor_main", run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException as error:  # as a fresh interpreter leaves an uncaught one (atexit hooks read it)
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
        sys.last_exc = error
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    for name in preloaded():
        importlib.import_module(name)
    sys.exit(run_task(*serve(sys.argv[1], sys.argv[2:])))
