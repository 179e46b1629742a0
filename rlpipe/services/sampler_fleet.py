"""Sampler servers: the vLLM command line, a local fleet `rlpipe run` owns, and the container
entrypoint of the cluster's sampler Deployment.

Local mode (rollout.engine: sampler, samplers.endpoints empty): `rlpipe run` starts
`samplers.replicas` servers on loopback as soon as the weight store has a published version,
restarts one that exits (as a Deployment would), and stops them all by PID when it exits.
`<run root>/samplers/fleet.json` records URL, PID, state and log of each, so a later
`rlpipe run` can stop servers an earlier, killed driver left behind.

Cluster: `python -m rlpipe.services.sampler_fleet --run-root /mnt/rlpipe/runs/<name>` (the sampler
image's entrypoint) waits for the run's first published version, then execs the same vLLM
server on the latest one; sync_weights then reloads it in place at the steps' paths, so the
Deployment mounts the PVC where the steps do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from rlpipe.services.local_servers import LocalServers
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem
from rlpipe.store.weights import latest_version, version_uri
from rlpipe.vllm_environment import VLLM_CPU_ENVIRONMENT, VLLM_ENVIRONMENT, cpu_kv_cache

SERVER_MODULE = "rlpipe.services.vllm_server"  # vLLM's api_server behind the import guard
# Dev mode exposes /pause, /resume, /collective_rpc and the weight-version endpoints.
SERVER_ENVIRONMENT = VLLM_ENVIRONMENT | {"VLLM_SERVER_DEV_MODE": "1"}


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
        "--worker-extension-cls", "rlpipe.services.sampler_worker.PolicyReload",
        *extra,
    ]  # fmt: skip


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def LocalFleet(spec: RunSpec, run_root: str) -> LocalServers:  # noqa: N802 (reads as the thing it builds)
    """`samplers.replicas` vLLM servers on loopback; `<run root>/samplers/fleet.json` records them."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        version = latest_version(run_root)
        model_dir = filesystem(version_uri(run_root, version))[1]
        env = dict(SERVER_ENVIRONMENT)
        extra = list(spec.samplers.extra_args)
        if not has_gpu():
            # vLLM pins each CPU server's compute thread to core 0, leaving the other cores to the
            # HTTP front ends, which dominate for tiny models: spreading the compute threads over
            # both cores of this machine made generate ~1.8x slower.
            env |= VLLM_CPU_ENVIRONMENT | cpu_kv_cache(spec.samplers.kv_cache_gib)
            extra = ["--enforce-eager", "--dtype", "float32", *extra]
        return [sys.executable, *server_args(model_dir, "127.0.0.1", port, spec.seed, extra)], env

    return LocalServers("sampler", run_root, spec.samplers.replicas, launch, marker=SERVER_MODULE)


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
