"""Each image honours its contract, tested inside it (Podman, images/build.sh): the step image runs
prepare / score / advantages / sync_weights / track without torch, the trainer image runs warm_start /
generate / update / evaluate and the resident trainer service, the sampler image serves vLLM's CPU engine,
answers a completion and reloads a new version in place; all as the images' own user (uid 1000), on a
run root mounted at the same path, as a cluster runs them. `rlpipe run --containers` end to end: the
same weights and curve as the subprocess runner, and its failures say what to do."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from rlpipe.spec import parse_spec, spec_to_json
from rlpipe.store.run_root import read_state

from .conftest import REPO, tiny_spec_dict

pytestmark = pytest.mark.containers
RLPIPE = str(Path(sys.executable).with_name("rlpipe"))


@pytest.fixture
def shared_dir():
    """A directory the images' user (1000) can write, mounted at the same path (pytest's tmp_path lies
    under a root-only directory here)."""
    path = Path(tempfile.mkdtemp(prefix="rlpipe-containers-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_in(image: str, root: Path, *argv: str, name: str | None = None, detach: bool = False) -> str:
    """`python3 argv` in `image` as its own user, host network, `root` mounted at the same path."""
    command = ["podman", "run", "--rm", "--network", "host", "--volume", f"{root}:{root}", "--workdir", str(root)]
    command += ["--env", "OMP_NUM_THREADS=1", "--env", "HF_HUB_OFFLINE=1"]
    if name:
        command += ["--name", name]
    if detach:
        command += ["--detach"]
    command += [image, *argv] if detach else ["--entrypoint", "python3", image, *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{' '.join(argv[:3])} in {image} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def argo_step(image: str, root: Path, step: str, spec_json: str, run_root: str) -> str:
    """One step of one iteration, as the Argo export runs it (pipelines/argo_steps.py)."""
    return run_in(
        image, root, "-m", "rlpipe.pipelines.argo_steps", step, "--spec-json", spec_json, "--run-root", run_root
    )


def initialize(images: dict[str, str], root: Path, spec_json: str, run_root: str) -> None:
    """prepare in the step image, the warm start in the trainer image, v0 published by the step image."""
    prepared = run_in(
        images["step"], root, "-c",
        "import importlib.util, os, sys\n"
        "from rlpipe import loop\nfrom rlpipe.spec import spec_from_json\n"
        f"print(loop.prepare(spec_from_json({spec_json!r}), {run_root!r}))\n"
        "print('uid', os.getuid(), 'torch', importlib.util.find_spec('torch'), 'imported', 'torch' in sys.modules)\n"
        "from kubeflow.hub import ModelRegistryClient\nprint('registry client', ModelRegistryClient.__name__)",
    )  # fmt: skip
    assert "uid 1000 torch None imported False" in prepared
    assert "registry client ModelRegistryClient" in prepared  # the track step's tracking.model_registry
    run_in(
        images["trainer"], root, "-c",
        "import json\nfrom rlpipe import loop\nfrom rlpipe.spec import spec_from_json\n"
        f"spec = spec_from_json({spec_json!r})\n"
        f"staged, metrics = loop.warm_start(spec, {run_root!r}, spec.cache_root)\n"
        f"open({run_root!r} + '/warm.json', 'w').write(json.dumps([staged, metrics]))",
    )  # fmt: skip
    run_in(
        images["step"], root, "-c",
        "import json\nfrom rlpipe import loop\nfrom rlpipe.spec import spec_from_json\n"
        f"staged, metrics = json.load(open({run_root!r} + '/warm.json'))\n"
        f"loop.sync_weights(spec_from_json({spec_json!r}), {run_root!r}, staged, 0, metrics)",
    )  # fmt: skip


def wait_healthy(url: str, timeout_s: float, container: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    logs = subprocess.run(["podman", "logs", container], capture_output=True, text=True)
    pytest.fail(f"{container} not healthy after {timeout_s} s:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


def free_port() -> int:
    from rlpipe.services.local_servers import free_port

    return free_port()


def test_step_and_trainer_images_run_every_step_of_an_iteration(images, shared_dir):
    spec = parse_spec(tiny_spec_dict(shared_dir, loop={"iterations": 1, "eval_every": 1}))
    run_root, spec_json = str(shared_dir / "runs" / "tiny"), spec_to_json(spec)
    initialize(images, shared_dir, spec_json, run_root)
    for step in ("generate", "score", "advantages", "update", "sync_weights", "evaluate", "track"):
        image = images["trainer"] if step in ("generate", "update", "evaluate") else images["step"]
        argo_step(image, shared_dir, step, spec_json, run_root)
    state = read_state(run_root)
    assert state["iteration"] == 1 and state["mlflow_run_id"]
    assert (shared_dir / "runs" / "tiny" / "weights" / "v000001" / "model.safetensors").exists()


def test_resident_trainer_serves_from_the_trainer_image(images, shared_dir):
    """The trainer image's service computes generate and update; the step image's thin clients ask it."""
    port = free_port()
    spec = parse_spec(
        tiny_spec_dict(
            shared_dir, trainer={"resident": True, "endpoint": f"http://127.0.0.1:{port}", "mini_batches": 2}
        )
    )
    run_root, spec_json = str(shared_dir / "runs" / "tiny"), spec_to_json(spec)
    name = f"rlpipe-test-trainer-{port}"
    run_in(images["trainer"], shared_dir, "python3", "-m", "rlpipe.services.trainer.server", "--host", "127.0.0.1",
           "--port", str(port), name=name, detach=True)  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120, name)
        initialize(images, shared_dir, spec_json, run_root)
        for step in ("generate", "score", "advantages", "update", "sync_weights"):
            argo_step(images["step"], shared_dir, step, spec_json, run_root)  # no torch: the service computes
        served = subprocess.run(["podman", "exec", name, "id", "-u"], capture_output=True, text=True).stdout.strip()
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "2", name], capture_output=True)
    assert read_state(run_root)["iteration"] == 1
    assert served == "1000"


@pytest.mark.vllm
def test_sampler_image_serves_answers_and_reloads_in_place(images, shared_dir):
    """The sampler Deployment's container: waits for the run's weights, serves vLLM's CPU engine, answers
    a completion, and sync_weights (step image) reloads v1 into it without a restart."""
    port = free_port()
    spec = parse_spec(
        tiny_spec_dict(
            shared_dir,
            rollout={"engine": "sampler", "prompts_per_iteration": 8, "samples_per_prompt": 4, "max_new_tokens": 4},
            samplers={"endpoints": [f"http://127.0.0.1:{port}"], "startup_timeout_s": 300},
        )
    )
    run_root, spec_json = str(shared_dir / "runs" / "tiny"), spec_to_json(spec)
    name = f"rlpipe-test-sampler-{port}"
    subprocess.run(
        ["podman", "run", "--rm", "--detach", "--network", "host", "--shm-size", "1g", "--name", name, "--volume", f"{shared_dir}:{shared_dir}",
         "--env", f"RLPIPE_RUN_ROOT={run_root}", images["sampler"], "--port", str(port), "--poll-s", "1"],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        initialize(images, shared_dir, spec_json, run_root)
        wait_healthy(f"http://127.0.0.1:{port}", 300, name)
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "policy", "prompt": "12+34=", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
        started = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.StartedAt}}", name], capture_output=True, text=True
        ).stdout
        argo_step(images["step"], shared_dir, "generate", spec_json, run_root)  # the step image's sampler client
        for step, image in (("score", "step"), ("advantages", "step"), ("update", "trainer"), ("sync_weights", "step")):
            argo_step(images[image], shared_dir, step, spec_json, run_root)
        from rlpipe.engines.sampler_requests import weight_version

        assert weight_version(f"http://127.0.0.1:{port}") == "1"  # reloaded in place: the same container
        assert (
            subprocess.run(
                ["podman", "inspect", "--format", "{{.State.StartedAt}}", name], capture_output=True, text=True
            ).stdout
            == started
        )
        assert (
            subprocess.run(["podman", "exec", name, "id", "-u"], capture_output=True, text=True).stdout.strip()
            == "1000"
        )
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "2", name], capture_output=True)


def write_spec(root: Path, **sections) -> Path:
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(tiny_spec_dict(root, **sections)))
    return path


def rlpipe(root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([RLPIPE, *args], cwd=root, capture_output=True, text=True, timeout=timeout)


def labelled(run_root: Path) -> list[str]:
    found = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", f"label=rlpipe.run-root={run_root}"],
                           capture_output=True, text=True)  # fmt: skip
    return found.stdout.split()


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# the demo (examples/addition.yaml: the resident trainer) at sizes where a few iterations move the weights
DEMO_SMOKE = [
    "model.warm_start.max_steps=150", "data.train_size=2000", "data.eval_size=100", "evaluation.samples=0",
    "evaluation.sets=[]", "rollout.prompts_per_iteration=32", "trainer.mini_batches=2", "loop.iterations=3",
    "loop.iterations_per_run=1", "loop.eval_every=1",
]  # fmt: skip


def demo(root: Path, *args: str) -> list[str]:
    sets = [f"--set={each}" for each in [*DEMO_SMOKE, f"storage.root={root / 'runs'}"]]
    return ["run", str(REPO / "examples" / "addition.yaml"), *sets, *args]


def test_run_in_containers_matches_processes(images, shared_dir):
    """`rlpipe run --containers` on the demo spec (resident trainer) commits the weights of the subprocess
    runner at every version, warm start included, and the same held-out curve."""
    processes, run_root = shared_dir / "runs" / "processes", shared_dir / "runs" / "addition-demo"
    reference = rlpipe(
        shared_dir, *demo(shared_dir, "--run-dir", str(processes), f"--set=storage.cache={processes}-cache")
    )
    assert reference.returncode == 0, reference.stderr
    contained = rlpipe(shared_dir, *demo(shared_dir, "--containers"))
    assert contained.returncode == 0, contained.stdout[-2000:] + contained.stderr[-2000:]
    assert labelled(run_root) == []  # the run's containers are gone
    for version in range(4):
        manifest = f"weights/v{version:06d}/manifest.json"
        assert (
            json.loads((run_root / manifest).read_text())["sha256"]
            == json.loads((processes / manifest).read_text())["sha256"]
        )
    curve = json.loads((run_root / "summary.json").read_text())["evals"]
    assert curve == json.loads((processes / "summary.json").read_text())["evals"] and len(curve) == 4


def test_run_in_containers_killed_resumes(images, shared_dir):
    """SIGKILL of the driver after its first commit leaves its step and trainer containers running; the
    same command removes them and resumes to a consistent run root (as tests/test_local_runner.py's kills)."""
    from .test_local_runner import _check_consistent

    spec = write_spec(
        shared_dir,
        trainer={"resident": True, "mini_batches": 2},
        loop={"iterations": 3, "iterations_per_run": 3, "eval_every": 1},
    )
    run_root = shared_dir / "runs" / "tiny"
    driver = subprocess.Popen([RLPIPE, "run", str(spec), "--containers"], cwd=shared_dir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: (read_state(str(run_root)) or {}).get("iteration", 0) >= 1, 600, "the first commit")
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    resumed = rlpipe(shared_dir, "run", str(spec), "--containers")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert labelled(run_root) == []
    _check_consistent(run_root, 3)


def test_containers_failures_say_what_to_do(images, shared_dir):
    spec = write_spec(shared_dir, loop={"iterations": 1, "iterations_per_run": 1, "eval_every": 1})
    missing = rlpipe(
        shared_dir, "run", str(spec), "--containers", "--set", "cluster.step.image=ghcr.io/rlpipe/step:not-built"
    )
    assert missing.returncode == 1
    assert "ghcr.io/rlpipe/step:not-built" in missing.stderr and "images/build.sh" in missing.stderr
    assert "Traceback" not in missing.stderr

    run_root = shared_dir / "runs" / "tiny"
    # a container a step (a step server's container killed under its step: tests/test_step_forks.py)
    driver = subprocess.Popen([RLPIPE, "run", str(spec), "--containers", "--fresh-steps"], cwd=shared_dir,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: labelled(run_root), 300, "a step's container")
    subprocess.run(["podman", "kill", labelled(run_root)[0]], capture_output=True)
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 1, out + err
    assert (
        "StepContainerError: the step's container was stopped from outside (exit 137" in err
        and "run the same command again" in err
        and "Traceback" not in err
    )
    resumed = rlpipe(shared_dir, "run", str(spec), "--containers")
    assert resumed.returncode == 0, resumed.stderr
    assert read_state(str(run_root))["iteration"] == 1


def test_benchmark_runs_both_runners_side_by_side(images, shared_dir):
    """benchmarks/containers.py --smoke, as a user runs it: both runners, one results file."""
    done = subprocess.run(
        [sys.executable, "benchmarks/containers.py", "--smoke", "--runs", str(shared_dir / "runs"), "--results-dir", str(shared_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((shared_dir / "containers.json").read_text())
    assert record["smoke"] and record["same_weights"] and record["ratio"] > 0
    assert "containers / processes" in (shared_dir / "containers.md").read_text()


@pytest.mark.vllm
def test_run_in_containers_starts_its_samplers_as_containers(images, shared_dir):
    """rollout.engine sampler: `rlpipe run --containers` starts the vLLM sampler in the sampler image
    (its server is PID 1 of its container), reloads each version into it, and removes it at the end."""
    spec = write_spec(shared_dir, rollout={"engine": "sampler"}, samplers={"startup_timeout_s": 300},
                      loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2})  # fmt: skip
    done = rlpipe(shared_dir, "run", str(spec), "--containers")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_root = shared_dir / "runs" / "tiny"
    assert read_state(str(run_root))["iteration"] == 2 and labelled(run_root) == []
    log = (run_root / "logs" / "sampler-0.log").read_text()
    assert "(APIServer pid=1)" in log and "collective_rpc" in log


def test_a_step_container_streams_its_output_and_returns_its_status(images, shared_dir, capsys):
    """What DockerRunner runs each task with (rlpipe.pipelines.local_runner.containers.run_step_container), against
    `podman system service`: the output as the step prints it, a failed step's own exit code, a step
    silent for longer than the client's read timeout, and the container removed after."""
    import docker

    from rlpipe.pipelines.local_runner.containers import run_step_container

    socket = shared_dir / "docker.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{socket}"])
    try:
        wait_for(socket.exists, 30, "podman system service")
        client = docker.DockerClient(base_url=f"unix://{socket}", timeout=2)
        script = "echo one; sleep 3; echo two >&2; exit 3"  # silent 3 s: past the client's 2-s read timeout
        status = run_step_container(client, images["step"], ["sh", "-c", script], {}, labels={"t": "rlpipe-step"})
        assert status == 3 and capsys.readouterr().out.split() == ["one", "two"]
        assert run_step_container(client, images["step"], ["true"], {}, labels={"t": "rlpipe-step"}) == 0
        assert client.containers.list(all=True, filters={"label": "t=rlpipe-step"}) == []
    finally:
        service.terminate()
        service.wait(timeout=10)
