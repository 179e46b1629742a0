"""The local driver: run the pipeline on KFP's local runner, one pipeline run per chunk of
iterations, until state.json says the loop is done. This is `rlpipe run`.

Each pipeline run is a real KFP run (kfp.local.SubprocessRunner, every step its own
process: a fork of one process that imported what the steps import, step_forks beside this);
the driver holds no training state, so killing it at any moment and running it again continues
from the last committed iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live

from rlpipe.evaluation.stopping import stopped
from rlpipe.pipelines.local_runner.progress import Progress
from rlpipe.pipelines.local_runner.step_forks import StepLaunches, forked_steps
from rlpipe.preflight import preflight
from rlpipe.services.local_servers import LocalServers
from rlpipe.spec import RunSpec, resume_changes, spec_to_dict, spec_to_json
from rlpipe.steps import iteration_modules, service_for
from rlpipe.store.run_root import (
    data_uri,
    filesystem,
    join,
    read_json,
    read_state,
    run_root_for,
    write_json,
)
from rlpipe.tracking.mlflow_runs import LIVE_TRACKING_ENV, flush_as_it_commits, live_tracking
from rlpipe.tracking.uri import run_url

if TYPE_CHECKING:
    from rlpipe.pipelines.local_runner.containers import LocalContainers

# Steps are separate processes: keep each to one thread and quiet library progress bars.
# glibc's malloc starts every process cold (large tensors mmapped and zeroed on each
# allocation until its thresholds adapt): fixed thresholds cut a fresh update step's
# compute ~30% (benchmarks/results/iteration_breakdown.md).
STEP_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "PYTHONWARNINGS": "ignore",
}


class PipelineRunFailed(RuntimeError):
    """A KFP task failed; the message names it and points at its log."""


class RunStopped(Exception):
    """SIGTERM or SIGINT stopped `rlpipe run`; every process it started was stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name}: every step and service this run started is stopped; "
            "run the same command again to resume from the last committed iteration"
        )


@contextlib.contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """SIGTERM (what a supervisor, systemd or a container runtime sends) stops the run as Ctrl-C does:
    both raise KeyboardInterrupt in the main thread, so the `finally` blocks stop what the run started
    (the running KFP step, then the services); a second signal during that is ignored. Raises
    RunStopped naming the signal. kfp.local waits on its step inside `with Popen(...)`, which waits
    for the child forever on any exception but KeyboardInterrupt: hence that exception."""
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)
        for each in (signal.SIGTERM, signal.SIGINT):
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {each: signal.signal(each, stop) for each in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except KeyboardInterrupt:
        raise RunStopped(received[0] if received else signal.SIGINT) from None
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def stop_step_processes(services: list[LocalServers], grace_s: float = 5.0) -> None:
    """Stop this driver's other child processes (a KFP step kfp.local was running, and the processes it
    started), leaving the services, which stop themselves: SIGTERM, then SIGKILL after `grace_s`."""
    import psutil

    service_groups = {pid for servers in services for pid in servers.started_pids}
    steps = []
    for child in psutil.Process().children(recursive=True):
        try:
            if os.getpgid(child.pid) not in service_groups:
                steps.append(child)
        except (ProcessLookupError, psutil.Error):
            pass
    for process in steps:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(steps, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def check_spec_unchanged(spec: RunSpec, run_root: str) -> None:
    """A resumed run keeps its spec once something was committed, except the settings in
    rlpipe.spec.RESUMABLE_KEYS: how far it goes (loop), where it stores and tracks to (storage, the
    registry), and where rollouts and updates are computed (engines, samplers, the resident trainer,
    device, threads), which give the same results. A refusal names each key with both values.
    Before the first commit (an initialization that failed) the new spec replaces the old one, and
    data prepared for the old one is dropped."""
    saved = read_json(join(run_root, "spec.json"))
    current = spec_to_dict(spec)
    if saved is None or read_state(run_root) is None:
        if saved is not None and saved != current:
            fs, data_dir = filesystem(data_uri(run_root, "train").rsplit("/", 1)[0])
            if fs.exists(data_dir):
                fs.rm(data_dir, recursive=True)
        write_json(join(run_root, "spec.json"), current)
        return
    if changes := resume_changes(saved, spec):
        lines = "".join(f"\n    {key}: started with {json.dumps(a)}, now {json.dumps(b)}" for key, a, b in changes)
        raise ValueError(
            f"{run_root} was started with a different spec; these settings differ:{lines}\n"
            "  restore them to resume, or start a new run (another name: or --run-dir; `rlpipe fork` to branch off "
            "a committed iteration)"
        )
    write_json(join(run_root, "spec.json"), current)


def run_locally(
    spec: RunSpec,
    run_dir: str | None = None,
    console: Console | None = None,
    containers: bool = False,
    fresh_steps: bool = False,
    compiled: Callable[..., Any] | None = None,
) -> dict:
    """Drive the loop to `spec.loop.iterations`; returns the final state. `containers`: every step and
    service in its image (rlpipe.pipelines.local_runner.containers), else each step a process. Steps are forks of a warm
    process (one a step image in containers: rlpipe.pipelines.local_runner.step_forks); `fresh_steps`: each a fresh
    process or container, as KFP's runners start them. `compiled`: the pipeline a compiled file holds, as
    KFP loads it (rlpipe.pipelines.local_runner.rehearse), instead of the one built from `spec`."""
    from rlpipe.pipelines.dpo_pipeline import build_pipeline_for

    console = console or Console(file=sys.stdout)  # bound now: stdout is redirected to the log below
    run_root = str(Path(run_dir).resolve()) if run_dir else run_root_for(spec.storage.root, spec.name)
    preflight(spec, run_root)
    check_spec_unchanged(spec, run_root)
    # the driver flushes to MLflow as each iteration commits (flush_as_it_commits), and the track steps wait for it
    step_env = STEP_ENV | ({LIVE_TRACKING_ENV: "1"} if live_tracking(run_root) else {})
    os.environ.update(step_env)
    log_path = Path(run_root) / "logs" / "kfp-local.log"
    log_path.parent.mkdir(exist_ok=True)
    launches = StepLaunches(asked_fresh=fresh_steps)
    with contextlib.ExitStack() as stack:
        engine = None
        if containers:
            from rlpipe.pipelines.local_runner.containers import start_containers

            engine = start_containers(spec, run_root, step_env, launches)
            stack.callback(engine.stop)
        elif not fresh_steps:  # each step a fork of one process that has imported what the steps import
            stack.enter_context(forked_steps(iteration_modules(spec), launches, log_path.with_name("step-server.log")))
        # offline DPO's pipeline, or the RL loop's; in containers, each task on its image as the cluster places it
        pipeline = compiled or build_pipeline_for(spec, placement=containers_placement(spec) if engine else None)
        return _drive(spec, run_root, log_path, console, engine, launches, pipeline)


def containers_placement(spec: RunSpec) -> RunSpec:
    """The spec that places each task in containers: on the cluster's images (the local runner ignores the
    rest of the cluster section), without retries (a failed step ends the run, which the same command
    resumes, as with processes)."""
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, retries=0))


def local_services(
    spec: RunSpec, run_root: str, engine: LocalContainers | None, say: Callable[[str], None]
) -> tuple[RunSpec, LocalServers | None, LocalServers | None, LocalServers | None]:
    """The long-lived servers this run starts (not yet started): samplers, the resident trainer, the rollout
    producer, as processes or, with `engine`, containers; and the spec the steps get, with their addresses."""
    served = spec  # the spec the steps get: with the addresses of the services started here
    fleet = None
    if spec.rollout.engine == "sampler" and not spec.samplers.endpoints:
        from rlpipe.engines.vllm_settings import local_samplers
        from rlpipe.services.samplers.fleet import LocalFleet

        served = local_samplers(served)  # LoRA: adapters on a GPU, merged on CPU
        fleet = LocalFleet(served, run_root)
        if engine is not None:
            engine.containerize(fleet, spec.cluster.sampler_image)
        served = dataclasses.replace(served, samplers=dataclasses.replace(served.samplers, endpoints=fleet.urls))
        say(f"        samplers {', '.join(fleet.urls)} (logs {Path(run_root) / 'logs'}/sampler-*.log)")
    trainer = None
    if spec.trainer.resident and not spec.trainer.endpoint:
        from rlpipe.services.trainer.server import LocalTrainer

        if spec.trainer.nodes > 1:
            raise ValueError(
                "trainer.nodes > 1 is a multi-node job for a cluster (rlpipe compile writes its JobSet); "
                "on this machine set trainer.nodes: 1 (trainer.gpus processes)"
            )
        trainer = LocalTrainer(run_root, spec.trainer.gpus, spec.trainer.device)
        if engine is not None:
            engine.containerize(trainer, spec.cluster.trainer.image)
        served = dataclasses.replace(served, trainer=dataclasses.replace(served.trainer, endpoint=trainer.urls[0]))
        say(f"        resident trainer {trainer.urls[0]} (log {Path(run_root) / 'logs'}/trainer-0.log)")

    producer = None
    if service_for("generate", spec) == "producer":  # asynchronous: generation runs ahead into the rollout buffer
        from rlpipe.services.producer.server import LocalProducer

        producer_spec = Path(run_root) / "producers" / "spec.json"
        producer_spec.parent.mkdir(exist_ok=True)
        producer_spec.write_text(spec_to_json(served))  # with the local samplers' endpoints
        producer = LocalProducer(run_root, str(producer_spec), spec.cache_root)
        if engine is not None:
            engine.containerize(producer, spec.cluster.trainer.image)
        logs = Path(run_root) / "logs"
        say(f"        rollout producer, loop.max_staleness {spec.loop.max_staleness} (log {logs}/producer-0.log)")

    return served, fleet, trainer, producer


def _drive(
    spec: RunSpec,
    run_root: str,
    log_path: Path,
    console: Console,
    engine: LocalContainers | None,
    launches: StepLaunches,
    pipeline: Callable[..., Any],
) -> dict:
    from kfp import local

    runner = engine.step_runner() if engine else local.SubprocessRunner(use_venv=False)
    local.init(runner=runner, pipeline_root=str(Path(run_root) / "kfp"))
    progress = Progress(total=spec.loop.iterations, launches=launches)

    def say(text: str) -> None:  # paths must not wrap or be read as markup
        console.print(text, soft_wrap=True, markup=False, highlight=False)

    say(f"rlpipe: run root {run_root}\n        KFP task logs {log_path}")
    served, fleet, trainer, producer = local_services(spec, run_root, engine, say)
    spec_arg = spec_to_json(served)
    stop, interactive, printed = threading.Event(), console.is_terminal, {}

    def watch(live: Live | None) -> None:
        while not stop.wait(1.0):
            progress.refresh(run_root, log_path)
            if live is not None:
                live.update(progress.render())
            else:
                for line in progress.new_lines(printed):
                    say(line)

    services = [servers for servers in (fleet, trainer, producer) if servers is not None]
    with signals_stop_the_run(), contextlib.ExitStack() as stack:
        if fleet is not None:
            fleet.start()  # the servers start once the weight store has a version
            stack.callback(fleet.stop)
        if trainer is not None:
            trainer.start()
            stack.callback(trainer.stop)
        if producer is not None:
            producer.start()
            stack.callback(producer.stop)
        stack.callback(stop_step_processes, services)  # first, before the services the steps talk to
        live = (
            stack.enter_context(Live(progress.render(), console=console, refresh_per_second=2)) if interactive else None
        )
        watcher = threading.Thread(target=watch, args=(live,), daemon=True)
        watcher.start()
        tracker = threading.Thread(target=flush_as_it_commits, args=(served, run_root, stop), daemon=True)
        tracker.start()  # MLflow as each iteration commits; the pipeline runs' track steps find it done
        try:
            run_chunks(spec, pipeline, spec_arg, run_root, log_path)
        finally:
            stop.set()
            watcher.join()
            tracker.join()
            progress.refresh(run_root, log_path)
            if live is not None:
                live.update(progress.render())
    state = read_state(run_root) or {}
    if not interactive:
        for line in progress.new_lines(printed):
            say(line)
    for line in how_it_ended(spec, run_root, state, launches):
        say(line)
    summary = {"run_root": run_root, "state": state, "evals": progress.evals, "steps": launches.as_dict()}
    (Path(run_root) / "summary.json").write_text(json.dumps(summary, indent=2))
    return state


def run_chunks(spec: RunSpec, pipeline: Callable[..., Any], spec_arg: str, run_root: str, log_path: Path) -> None:
    """One pipeline run after another, each advancing the loop by up to loop.iterations_per_run, until
    state.json says the loop is done (or a gate or a sign stopped it); KFP's output goes to `log_path`.
    PipelineRunFailed, naming the failed task and its exception, when a run fails."""
    while True:
        offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                pipeline(spec=spec_arg, run_root=run_root)
            except RuntimeError as err:
                failure = err
            else:
                failure = None
        state = read_state(run_root) or {}
        stop = stopped(spec, state)  # the eval gate, or a sign (then the next generate refused: no failure)
        if failure is not None and (stop is None or stop.sign is None):
            raise PipelineRunFailed(_failure_message(failure, log_path, offset)) from None
        if state.get("iteration", 0) >= spec.loop.iterations or stop is not None:
            return


def how_it_ended(spec: RunSpec, run_root: str, state: dict, launches: StepLaunches) -> list[str]:
    """What `rlpipe run` says last: the eval gate that ended the loop, or the sign that stopped it with its
    likely causes (rlpipe.evaluation.stopping), how its steps started when some were not forks, and where
    the MLflow run is."""
    lines = [f"steps: {launches.summary()}"] if launches.fresh else []
    if stop := stopped(spec, state):
        lines.append(stop.message(run_root))
    if state.get("mlflow_run_id"):
        lines.append(f"MLflow run: {run_url(spec, run_root, state['mlflow_run_id'])}")
    return lines


def _failure_message(err: RuntimeError, log_path: Path, offset: int) -> str:
    """The failed task and the exception it raised (from its part of this pipeline run's log, else the
    whole run's: not the exit handler's that ran after it), colors stripped."""
    text = re.sub(r"\x1b\[\d+m", "", str(err))
    with log_path.open("rb") as f:
        f.seek(offset)
        run_log = re.sub(r"\x1b\[\d+m", "", f.read().decode(errors="replace"))
    if (task := re.search(r"Inner task failed: '([\w-]+)'", text)) and (
        failed := re.search(
            rf"Executing task '{task[1]}'(.*?)Task '{task[1]}' finished with status FAILURE", run_log, re.S
        )
    ):
        run_log = failed[1]
    reasons = [r for r in raised(run_log) if not r.startswith("RuntimeError: Pipeline") and "Task" not in r[:30]]
    reason = reasons[-1] if reasons else "the step ended without a Python exception (killed? out of memory?)"
    return (
        f"{text}\n  cause: {reason}\n  full log: {log_path}\n"
        "Storage is consistent: fix the cause and run the same command again to resume."
    )


def raised(log: str) -> list[str]:
    """The exceptions `log` reports, without their module path (`rlpipe.rewards.RewardError: ...` ->
    `RewardError: ...`): the one each traceback ends with, whatever its name (`EnvironmentFailure: ...`),
    found as the first line after the frames (indented more) back at the indentation of its "Traceback
    (most recent call last):", passing over lines indented less (another process's, written into the same log
    mid-traceback); in a log without tracebacks, the lines that read `...Error: ...`."""
    lines = log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() != "Traceback (most recent call last):":
            continue
        indent = len(line) - len(line.lstrip())
        for after in lines[i + 1 :]:
            if after.strip() and len(after) - len(after.lstrip()) == indent:
                found.append(re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+(?::|$))", "", after.strip()))
                break
    if not found:
        found = re.findall(r"^\s*(?:[A-Za-z_]\w*\.)*(\w+(?:Error|Exception): .*)$", log, flags=re.MULTILINE)
    return [reason.strip() for reason in found]
