"""Steps and services in their images on this machine: `rlpipe run --containers`.

The pipeline is the one the subprocess runner runs; only where each step executes changes. KFP's
`DockerRunner` runs every step in the image the cluster runs it in (cluster.step.image or
cluster.trainer.image, rlpipe.steps.uses_trainer_image), and the long-lived servers (resident
trainer, samplers, rollout producer) run as containers of the same images instead of processes.

    engine      Docker, where its API answers (DOCKER_HOST or the default socket); else Podman, whose
                `podman system service` this run starts on a socket of its own for the Docker SDK
                that DockerRunner speaks. Podman reads its settings from CONTAINERS_CONF
                (images/containers.conf suits sandboxes and CI machines).
    mounts      the working directory, the run root and the cache root, each at the same path, so every
                path a step is given means the same inside and outside (on a cluster: the PVC at
                cluster.mount_path).
    workdir     <run root>/containers/workdir: links to the working directory's entries (relative paths,
                and modules such as a reward `my_rewards:score`, import as with processes), except an
                `rlpipe/` source tree, which would shadow the image's installed rlpipe (run from a checkout).
    env         the steps' settings (rlpipe.pipelines.local_runner.driver.STEP_ENV) and what processes would
                inherit from this one of libraries' settings, credentials and endpoints (FORWARDED_PREFIXES).
    user        this user's uid:gid, so what the steps write stays this user's, as with processes.
                The images' own user (1000) is what clusters run: the contract tests
                (tests/test_containers.py) and the played manifests check it.
    network     the host's: the steps reach the services on loopback as processes do.
    label       `rlpipe.run-root=<run root>` on every container, so stopping a run (or resuming
                one whose driver was killed) removes what it left running.
    warm steps  a step of KFP's lightweight shape runs as a fork of a step server (step_forks, beside this)
                in a container of its image, started at the image's first step with the settings above:
                the interpreter, its imports and the container's start once a run and image, not once a
                step (`rlpipe run --fresh-steps`: a container a step, as KFP's DockerRunner runs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from rlpipe.pipelines.local_runner.step_forks import SERVER, StepLaunches, Task, hold, run_forked, task_of
from rlpipe.services.local_servers import LocalServers, die_with_parent
from rlpipe.spec import RunSpec
from rlpipe.steps import iteration_modules
from rlpipe.store.run_root import is_local

RUN_LABEL = "rlpipe.run-root"
# what the steps' env takes from this one's, as processes inherit it: libraries' settings, credentials
# and endpoints (Hugging Face, MLflow, clouds, storage emulators, vLLM); not PATH, HOME or PYTHONPATH
FORWARDED_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "MLFLOW_", "AWS_", "GOOGLE_", "GCSFS_", "FSSPEC_",
                      "STORAGE_EMULATOR_HOST", "VLLM_", "RLPIPE_", "KFP_")  # fmt: skip
BUILD_HINT = "build them with: bash images/build.sh (images/README.md)"


class ContainersUnavailable(RuntimeError):
    """No container engine, or the images are not built: the message says what to do."""


@dataclass
class LocalContainers:
    """This run's container engine and the settings every container of the run gets."""

    cli: str  # podman or docker: runs the services (`<cli> run`), lists and removes containers
    docker_host: str  # the Docker API DockerRunner's docker SDK speaks
    run_root: str
    mounts: list[str]
    base_env: dict[str, str]
    workdir: str
    user: str = field(default_factory=lambda: f"{os.getuid()}:{os.getgid()}")
    service: subprocess.Popen | None = None  # `podman system service`, when this run started it
    warm: WarmSteps | None = None  # None: a container a step (--fresh-steps)

    def step_runner(self):  # -> kfp.local.DockerRunner
        from docker.types import Mount
        from kfp import local
        from kfp.local import docker_task_handler

        warm = self.warm
        docker_task_handler.DockerTaskHandler.run = lambda handler: run_task(handler, warm)

        return local.DockerRunner(
            network_mode="host",
            user=self.user,
            environment=self.base_env,  # docker SDK containers.run's name for the env
            working_dir=self.workdir,
            mounts=[Mount(target=path, source=path, type="bind") for path in self.mounts],
            labels={RUN_LABEL: self.run_root},
        )

    def run_argv(self, image: str, name: str, argv: list[str], env: dict[str, str]) -> list[str]:
        """`<cli> run` of `argv` (a process's command line, sys.executable first) in `image`, in the
        foreground: stopping this process stops the container (the CLI passes the signal on)."""
        settings = [
            "--rm",
            "--name",
            name,
            "--network",
            "host",
            "--user",
            self.user,
            "--label",
            f"{RUN_LABEL}={self.run_root}",
        ]
        # vLLM's engine exchanges tensors through /dev/shm: the runtimes' 64 MiB default is too small
        settings += ["--shm-size", "1g", "--entrypoint", "python3", "--workdir", self.workdir]
        for path in self.mounts:
            settings += ["--volume", f"{path}:{path}"]
        for key, value in {**self.base_env, **env}.items():
            settings += ["--env", f"{key}={value}"]
        return [self.cli, "run", *settings, image, *argv[1:]]

    def containerize(self, servers: LocalServers, image: str) -> LocalServers:
        """`servers` started as containers of `image` instead of processes (same ports, logs, restarts)."""
        launch = servers.launch
        slug = "".join(c if c.isalnum() else "-" for c in Path(self.run_root).name)

        def in_container(port: int) -> tuple[list[str], dict[str, str]]:
            argv, env = launch(port)
            name = f"rlpipe-{slug}-{servers.kind}-{port}"
            subprocess.run([self.cli, "rm", "-f", name], capture_output=True)  # one a killed CLI left
            return self.run_argv(image, name, argv, env), {}

        servers.launch = in_container
        return servers

    def remove_all(self) -> None:
        """Remove every container of this run still there (a killed driver's, or a step's after Ctrl-C)."""
        found = subprocess.run(
            [self.cli, "ps", "-aq", "--filter", f"label={RUN_LABEL}={self.run_root}"], capture_output=True, text=True
        )
        if ids := found.stdout.split():
            subprocess.run([self.cli, "rm", "-f", "-t", "2", *ids], capture_output=True)

    def stop(self) -> None:
        if self.warm is not None:
            self.warm.stop()
        self.remove_all()
        if self.service is not None:
            self.service.terminate()
            try:
                self.service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.service.kill()


def run_task(handler, warm: WarmSteps | None) -> Any:  # -> kfp.local.status.Status
    """One task in its image: kfp.local.docker_task_handler.DockerTaskHandler.run (kfp==2.17.0) with
    one engine client a thread instead of one a task (docker.from_env asks the engine its API version)
    and the engine's SELinux setting asked once (KFP asks its info on every task): with Podman 0.4 s a
    step. The task's own env is laid over the run's (KFP's replaces it). A lightweight component's task
    is a fork of its image's step server when `warm` (a container of its own when that server cannot start)."""
    from kfp.local import status

    client, selinux = engine_client()
    volumes = handler.get_volumes_to_mount(client=None)
    for volume in volumes.values():
        volume["mode"] += ",z" if selinux else ""
    run_args = dict(handler.runner.container_run_args)
    env = {**run_args.get("environment", {}), **(handler.env_vars or {})}
    code = forked_in(warm, client, handler, volumes, run_args, env) if warm is not None else None
    if code is None:
        command = handler.full_command
        code = run_step_container(client, handler.image, command, volumes, **run_args | {"environment": env})
    return status.Status.SUCCESS if code == 0 else status.Status.FAILURE


def forked_in(warm: WarmSteps, client, handler, volumes: dict, run_args: dict, env: dict[str, str]) -> int | None:
    """The task as a fork of its image's step server, to its exit status; None when it runs in a container
    of its own instead (counted in `warm.launches`, with why): not a lightweight component's task run by
    the image's python3, or no server to take it."""
    task = task_of(handler.full_command, "python3")
    server = warm.server_for(client, handler.image, volumes, run_args) if isinstance(task, Task) else task
    if isinstance(server, str):
        warm.launches.ran_fresh(server)
        return None
    try:
        code = run_forked(server.path, *task, env, cwd=run_args.get("working_dir"), inherit_env=True)
    except ConnectionError:  # the server is gone, and the task was not sent
        warm.launches.ran_fresh(f"the step server in {handler.image} has ended")
        return None
    warm.launches.forked += 1
    if code is None:  # the server's container stopped while the step ran
        code = exit_status(server.container) or 1  # never a success: the step did not finish
        say_stopped(code)
    return code


class StepServer(NamedTuple):
    path: str  # its socket
    lifeline: socket.socket  # rlpipe.pipelines.local_runner.step_forks.hold
    container: Any


@dataclass
class WarmSteps:
    """One step server a step image (rlpipe.pipelines.local_runner.step_forks) in a container of that image, with the
    settings a step's container gets and the servers' socket folder mounted at the same path; kept
    alive by a lifeline from this process, so a driver killed with -9 takes them down."""

    modules: tuple[str, ...] = ()  # what each server imports besides its light steps' (step_forks.serve)
    launches: StepLaunches = field(default_factory=StepLaunches)  # how each task started, and why
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rlpipe-steps-"))
    servers: dict[str, StepServer | str] = field(default_factory=dict)  # by image; why not, when it did not start
    lock: threading.Lock = field(default_factory=threading.Lock)

    def server_for(self, client, image: str, volumes: dict, run_args: dict) -> StepServer | str:
        """`image`'s server, started on its first task; why not, when it could not start."""
        with self.lock:
            if image not in self.servers:
                path = os.path.join(self.folder, f"{len(self.servers)}.sock")
                self.servers[image] = start_step_server(client, image, path, self.modules, volumes, run_args)
            return self.servers[image]

    def stop(self) -> None:
        """Close the lifelines: each server ends, and its container with it."""
        with self.lock:
            for server in self.servers.values():
                if isinstance(server, StepServer):
                    server.lifeline.close()
            self.servers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_step_server(
    client, image: str, path: str, modules: tuple[str, ...], volumes: dict, run_args: dict
) -> StepServer | str:
    """A container of `image` serving steps at `path` and a lifeline to it, or why not (each step then gets a
    container, as KFP runs it) when it does not listen within a minute: an image built before step
    servers, or one that cannot start."""
    import docker

    folder = os.path.dirname(path)
    command = ["python3", "-m", SERVER, path, *modules]
    mounted = {**volumes, folder: {"bind": folder, "mode": "rw"}}
    try:
        container = client.containers.run(image, command, detach=True, init=True, volumes=mounted, **run_args)
    except docker.errors.DockerException as error:  # the task's own container will say what is wrong
        return f"the step server in {image} did not start ({error})"
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        container.reload()
        if container.status not in ("created", "running") or time.monotonic() > deadline:
            said = container.logs().decode(errors="replace").strip()
            container.remove(force=True)
            return f"the step server in {image} did not start ({said[-500:] or container.status})"
        time.sleep(0.05)
    return StepServer(path, hold(path), container)


_ENGINE = threading.local()


def engine_client() -> tuple[Any, bool]:
    """This thread's client of the engine at DOCKER_HOST (docker.from_env) and whether the engine labels
    mounts for SELinux, made on the thread's first task."""
    if getattr(_ENGINE, "host", None) != os.environ.get("DOCKER_HOST"):
        import docker

        _ENGINE.client = docker.from_env()
        _ENGINE.selinux = "name=selinux" in _ENGINE.client.info().get("SecurityOptions", [])
        _ENGINE.host = os.environ.get("DOCKER_HOST")
    return _ENGINE.client, _ENGINE.selinux


def run_step_container(client, image: str, command: list[str], volumes: dict, **run_args) -> int:
    """One step's container, to its exit status (KFP's: kfp.local.docker_task_handler.run_docker_container,
    kfp==2.17.0). KFP's starts the container with auto_remove and reads the status after the container
    is gone: Podman removes it as it exits, so every failed step read as a success. Here the container
    is removed after its status is read. Its output comes through an attach made before it starts,
    which ends as it exits: following its logs (KFP's way) ends at the engine's next poll, a quarter to
    half a second later with Podman, on every step."""
    import codecs

    import docker

    container = client.containers.create(image=image, command=command, volumes=volumes, **run_args)
    try:
        output = client.api.attach(container.id, stdout=True, stderr=True, stream=True, logs=True)
        container.start()
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for chunk in output:
            print(text.decode(chunk), end="")
        status = exit_status(container)
    finally:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass  # removed by the run's stop (rlpipe.pipelines.local_runner.containers.LocalContainers.remove_all)
    say_stopped(status)
    return status


def say_stopped(status: int) -> None:
    """A container stopped from outside (exit 137, 143) says so in the step's log, as the last error line
    the driver reports."""
    if status in (137, 143):
        signal_name = "SIGKILL, or the out-of-memory killer" if status == 137 else "SIGTERM"
        print(f"StepContainerError: the step's container was stopped from outside (exit {status}: {signal_name})")


def exit_status(container) -> int:
    """The exit code of a container whose output has ended: read from its state (Podman: "stopped",
    Docker: "exited"), or waited for while the engine has not yet recorded the exit; 137 when it is gone
    (removed by the run's stop)."""
    import docker

    try:
        container.reload()
        if container.attrs["State"]["Status"] in ("exited", "stopped"):
            return container.attrs["State"]["ExitCode"]
        return container.wait()["StatusCode"]
    except docker.errors.NotFound:
        return 137


def container_mounts(spec: RunSpec, run_root: str) -> list[str]:
    """The host directories every container of the run mounts at the same path: the working directory,
    the run root and the cache root (the local ones), without one inside another."""
    wanted = [os.getcwd(), run_root, spec.cache_root]
    paths = sorted({str(Path(p).resolve()) for p in wanted if is_local(p)}, key=len)
    kept: list[str] = []
    for path in paths:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    for path in kept:
        Path(path).mkdir(parents=True, exist_ok=True)
    return kept


def container_workdir(spec: RunSpec, run_root: str) -> str:
    """<run root>/containers/workdir (a remote run root's: under the cache root), links to the working
    directory's entries but an `rlpipe` package."""
    base = Path(run_root) if is_local(run_root) else Path(spec.cache_root) / spec.name
    workdir = base / "containers" / "workdir"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for entry in Path.cwd().iterdir():
        if not (entry.name == "rlpipe" and (entry / "__init__.py").exists()):
            (workdir / entry.name).symlink_to(entry)
    return str(workdir)


def start_containers(spec: RunSpec, run_root: str, step_env: dict[str, str], launches: StepLaunches) -> LocalContainers:
    """The engine for this run, with its images checked; a clear ContainersUnavailable otherwise.
    `launches.asked_fresh`: a container a step, not forks of a step server per image."""
    mounts = container_mounts(spec, run_root)
    workdir = container_workdir(spec, run_root)
    forwarded = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_PREFIXES)}
    env = {**forwarded, **step_env, "PYTHONPATH": workdir, "HOME": "/tmp"}
    docker_cli = shutil.which("docker")
    if docker_cli and _answers(os.environ.get("DOCKER_HOST")):
        containers = LocalContainers(docker_cli, os.environ.get("DOCKER_HOST", ""), run_root, mounts, env, workdir)
    elif podman := shutil.which("podman"):
        socket = Path(tempfile.mkdtemp(prefix="rlpipe-podman-")) / "docker.sock"
        service = subprocess.Popen(
            [podman, "system", "service", "--time=0", f"unix://{socket}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        containers = LocalContainers(podman, f"unix://{socket}", run_root, mounts, env, workdir, service=service)
        deadline = time.time() + 30
        while not _answers(containers.docker_host):
            if service.poll() is not None or time.time() > deadline:
                said = service.stderr.read().decode(errors="replace").strip() if service.poll() is not None else ""
                containers.stop()
                raise ContainersUnavailable(
                    f"--containers: `podman system service` did not start{': ' + said if said else ''}; "
                    "check that `podman run --rm IMAGE true` works (CONTAINERS_CONF=images/containers.conf "
                    "holds settings for sandboxes and CI machines)"
                )
            time.sleep(0.2)
    else:
        raise ContainersUnavailable(
            "--containers needs Docker (its API answering at DOCKER_HOST or /var/run/docker.sock) or Podman "
            "on PATH: install one (bash images/install-tools.sh installs Podman and Buildah), or run without "
            "--containers"
        )
    os.environ["DOCKER_HOST"] = containers.docker_host  # for DockerRunner's docker.from_env()
    try:
        check_images(containers, images_for(spec))
        containers.remove_all()  # left by a driver that was killed
    except ContainersUnavailable:
        containers.stop()
        raise
    containers.warm = None if launches.asked_fresh else WarmSteps(iteration_modules(spec), launches)
    return containers


def images_for(spec: RunSpec) -> list[str]:
    """The images a run in containers needs: the step and trainer images, and the sampler's when the
    run starts samplers here."""
    images = [spec.cluster.step.image, spec.cluster.trainer.image]
    if spec.rollout.engine == "sampler" and not spec.samplers.endpoints:
        images.append(spec.cluster.sampler_image)
    return images


def check_images(containers: LocalContainers, images: list[str]) -> None:
    missing = [
        image
        for image in dict.fromkeys(images)
        if subprocess.run([containers.cli, "image", "inspect", image], capture_output=True).returncode != 0
    ]
    if missing:
        raise ContainersUnavailable(
            f"--containers: {'these images are' if len(missing) > 1 else 'this image is'} not built here: "
            f"{', '.join(missing)}; {BUILD_HINT}"
        )


def _answers(docker_host: str | None) -> bool:
    """Whether a Docker API answers at `docker_host` (None: the docker SDK's default)."""
    import docker

    try:
        client = docker.DockerClient(base_url=docker_host, timeout=5) if docker_host else docker.from_env(timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 (docker raises several kinds for an absent or broken engine)
        return False
