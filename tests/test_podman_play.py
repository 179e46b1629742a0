"""The manifests' pods under `podman kube play` (pipelines/local_runner/podman_play.py): MLflow, the vLLM sampler
and the resident trainer run as the manifests say (uid 1000, no capabilities, no privilege
escalation, read-only root, host network), and a run whose steps run on the host trains through
them and logs to them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from .conftest import CONTAINERS_CONF, REPO, tiny_spec_dict

pytestmark = pytest.mark.containers

MLFLOW_IMAGE = "localhost/rlpipe/mlflow:3.17.2"


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert not check or done.returncode == 0, f"podman {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="session")
def mlflow_image(images: dict[str, str]) -> str:
    """images/mlflow/Dockerfile, on the Debian base images/build.sh made (the `images` fixture)."""
    os.environ.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    certs = ["-v", "/etc/ssl/certs:/etc/ssl/certs:ro"] if Path("/etc/ssl/certs").is_dir() else []
    base = "localhost/rlpipe/python:3.11-bookworm"
    podman(
        "build", "-f", str(REPO / "images" / "mlflow" / "Dockerfile"), "--build-arg", f"BASE_IMAGE={base}",
        *certs, "-t", MLFLOW_IMAGE, str(REPO), timeout=900,
    )  # fmt: skip
    return MLFLOW_IMAGE


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def wait_healthy(url: str, timeout: float, pod: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    logs = podman("logs", "--tail", "40", pod, check=False)
    pytest.fail(f"{url} not healthy after {timeout:.0f} s; {pod}:\n{logs.stdout}\n{logs.stderr}")


def test_manifests_play_and_serve_a_run(tmp_path: Path, mlflow_image: str) -> None:
    from rlpipe.pipelines.local_runner.podman_play import main

    mlflow_port, sampler_port, trainer_port, rendezvous_port = free_ports(4)
    sampler_url, trainer_url = f"http://127.0.0.1:{sampler_port}", f"http://127.0.0.1:{trainer_port}"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    data = tiny_spec_dict(
        tmp_path,
        trainer={"resident": True, "mini_batches": 2},
        rollout={"engine": "sampler"},
        samplers={"endpoints": [sampler_url]},
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    storage, run_root, mlflow_data = tmp_path / "runs", tmp_path / "runs" / "tiny", tmp_path / "mlflow"
    play = tmp_path / "play.yaml"
    assert main([
        str(spec_path), "-o", str(play), "--run-root", str(run_root), "--mlflow-data", str(mlflow_data),
        "--mlflow-image", mlflow_image, "--mlflow-port", str(mlflow_port), "--trainer-port", str(trainer_port),
        "--rendezvous-port", str(rendezvous_port), "--prefix", "play-",
    ]) == 0  # fmt: skip

    docs = list(yaml.safe_load_all(play.read_text()))
    pods = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Pod"}
    assert set(pods) == {"play-mlflow", "play-rlpipe-sampler-0", "play-rlpipe-trainer-tiny"}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"] == ["mlflow-config"]
    for name, pod in pods.items():
        assert pod["hostNetwork"] and pod["securityContext"]["runAsNonRoot"], name
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 1000, name
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert not {"ports", "livenessProbe", "readinessProbe", "startupProbe"} & set(container), name
        assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {})), name
    mounts = {
        name: {m["mountPath"]: m.get("readOnly", False) for m in pod["containers"][0]["volumeMounts"]}
        for name, pod in pods.items()
    }
    assert mounts["play-rlpipe-trainer-tiny"][str(run_root)] is False  # read-write, at the steps' path
    assert mounts["play-rlpipe-sampler-0"][str(run_root)] is True
    assert mounts["play-mlflow"]["/mlflow"] is False

    for directory in (storage, run_root, storage / ".cache", mlflow_data):  # the pods run as uid 1000
        directory.chmod(0o777)
    started = time.monotonic()
    podman("kube", "play", "--replace", str(play))
    try:
        wait_healthy(f"{mlflow_url}/health", 120, "play-mlflow-mlflow")
        wait_healthy(f"{trainer_url}/health", 120, "play-rlpipe-trainer-tiny-trainer")
        print(f"play to healthy: {time.monotonic() - started:.1f} s")

        started = time.monotonic()
        rlpipe = Path(sys.executable).with_name("rlpipe")
        command = [
            str(rlpipe), "run", str(spec_path), "--iterations", "2",
            "--set", f"trainer.endpoint={trainer_url}", "--set", f"tracking.uri={mlflow_url}",
        ]  # fmt: skip
        # umask 0: what the host's steps (root here) create, the trainer (uid 1000) writes into
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, umask=0)
        print(f"rlpipe run: {time.monotonic() - started:.1f} s")
        sampler_log = podman("logs", "--tail", "30", "play-rlpipe-sampler-0-sampler", check=False)
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\nsampler:\n{sampler_log.stdout}{sampler_log.stderr}"
        state = json.loads((run_root / "state.json").read_text())
        assert state["iteration"] == 2 and state["weights_version"] == 2

        from mlflow import MlflowClient

        mlflow_run = MlflowClient(tracking_uri=mlflow_url).get_run(state["mlflow_run_id"])
        assert "eval/accuracy_greedy" in mlflow_run.data.metrics
        assert len(mlflow_run.data.metrics) > 10
        trainer_log = podman("logs", "play-rlpipe-trainer-tiny-trainer").stdout
        trainer_log += podman("logs", "play-rlpipe-trainer-tiny-trainer").stderr
        assert "POST /update" in trainer_log  # the update ran in the trainer's pod
        sampler_log = podman("logs", "play-rlpipe-sampler-0-sampler")
        assert "/collective_rpc" in sampler_log.stdout + sampler_log.stderr  # sync_weights reloaded the sampler

        for container in ("play-mlflow-mlflow", "play-rlpipe-sampler-0-sampler", "play-rlpipe-trainer-tiny-trainer"):
            assert podman("exec", container, "id", "-u").stdout.strip() == "1000", container
            status = podman("exec", container, "cat", "/proc/1/status").stdout
            assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status, container
            (inspect,) = json.loads(podman("inspect", container).stdout)
            assert not inspect["EffectiveCaps"] and not inspect["HostConfig"]["CapAdd"], container
            assert "no-new-privileges" in inspect["HostConfig"]["SecurityOpt"], container
            assert inspect["HostConfig"]["ReadonlyRootfs"] and inspect["HostConfig"]["NetworkMode"] == "host", container
            assert inspect["Config"]["User"] == "1000:1000", container
    finally:
        podman("kube", "down", str(play), check=False)
