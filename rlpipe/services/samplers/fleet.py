"""Sampler servers: the vLLM command line, a local fleet `rlpipe run` owns, and the container
entrypoint of the cluster's sampler Deployment.

Local mode (rollout.engine: sampler, samplers.endpoints empty): `rlpipe run` starts
`samplers.replicas` servers on loopback as soon as the weight store has a published version,
restarts one that exits (as a Deployment would), and stops them all by PID when it exits.
`<run root>/samplers/fleet.json` records URL, PID, state and log of each, so a later
`rlpipe run` can stop servers an earlier, killed driver left behind.

Cluster: `python -m rlpipe.services.samplers.fleet --run-root /mnt/rlpipe/runs/<name>` (the sampler
image's entrypoint) waits for the run's first published version, then execs the same vLLM
server on the latest one; sync_weights then reloads it in place at the steps' paths, so the
Deployment mounts the PVC where the steps do.

LoRA (model.lora): a server starts on the sealed base, with LoRA enabled where it serves adapters
(on a GPU; the client hot-loads each version's adapter), without it on CPU (the client merges each
version into the base in place: rlpipe.services.samplers.client). The cluster entrypoint has no spec: it
enables LoRA when the latest version is an adapter, or when its args carry --enable-lora (a run
whose samplers start at v0: add `--enable-lora --max-lora-rank R` to the Deployment's args).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlpipe.engines.sampler_requests import sampler_weights_dir
from rlpipe.engines.vllm_settings import (
    VLLM_CPU_ENV,
    VLLM_CPU_SERVER_ARGS,
    VLLM_ENV,
    cpu_kv_cache,
    has_gpu,
    max_lora_rank,
    serves_adapters,
)
from rlpipe.services.local_servers import LocalServers
from rlpipe.services.samplers.request_log import MIDDLEWARE, REQUEST_LOG_ENV
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem
from rlpipe.store.weights import (
    ADAPTER_CONFIG,
    MANIFEST,
    adapter_base,
    latest_version,
    read_weight_ref,
    version_chain,
    version_uri,
)

SERVER_MODULE = "rlpipe.services.samplers.server"  # vLLM's api_server behind the import guard
# Dev mode exposes /pause, /resume, /collective_rpc and the weight-version endpoints.
SERVER_ENV = VLLM_ENV | {"VLLM_SERVER_DEV_MODE": "1"}
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # /v1/load_lora_adapter, /v1/unload_lora_adapter


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
        "--worker-extension-cls", "rlpipe.engines.vllm_worker.PolicyReload",
        "--middleware", MIDDLEWARE,  # each POST's interval, to $RLPIPE_SAMPLER_REQUEST_LOG when set
        *extra,
    ]  # fmt: skip


def served_model(
    run_root: str, version: int, lora_rank: int | None, adapters: bool = True
) -> tuple[str, list[str], dict[str, str]]:
    """The directory a server for the run's `version` starts on, with its LoRA flags and environment:
    a LoRA run's server (`lora_rank`, or the version is an adapter) runs the sealed base, with LoRA
    enabled and adapters loadable at run time when it serves `adapters` (else the client merges
    each version into the base in place)."""
    model_dir = filesystem(version_uri(run_root, version))[1]
    manifest = Path(model_dir) / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()).get("delta_of") is not None:
        whole = version_chain(read_weight_ref(run_root, version))[-1][0]  # a delta version: start on its whole one
        model_dir = filesystem(whole["uri"])[1]  # (labelled by no version, the server is reloaded by generate)
    base = adapter_base(model_dir)
    if base is not None:
        lora_rank = lora_rank or json.loads((Path(model_dir) / ADAPTER_CONFIG).read_text())["r"]
        model_dir = sampler_weights_dir(base["uri"])
    if lora_rank is None or not adapters:
        return model_dir, [], {}
    flags = ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank))]
    return model_dir, flags, RUNTIME_LORA


def LocalFleet(spec: RunSpec, run_root: str) -> LocalServers:  # noqa: N802 (reads as the thing it builds)
    """`samplers.replicas` vLLM servers on loopback; `<run root>/samplers/fleet.json` records them, and
    `<run root>/logs/sampler-<i>-requests.jsonl` the requests each served (request_log)."""

    def launch(port: int) -> tuple[list[str], dict[str, str]]:
        lora_rank = spec.model.lora.rank if spec.model.lora else None
        version = latest_version(run_root)
        assert version is not None  # LocalServers spawns a server once the weight store has one (wait_for_weights)
        model_dir, lora_flags, lora_env = served_model(run_root, version, lora_rank, serves_adapters(spec))
        index = [replica.port for replica in fleet.replicas].index(port)
        requests_log = Path(run_root) / "logs" / f"sampler-{index}-requests.jsonl"
        env = SERVER_ENV | lora_env | {REQUEST_LOG_ENV: str(requests_log)}
        extra = [*lora_flags, *spec.samplers.extra_args]
        if spec.sharing.enabled and has_gpu():  # /sleep frees the device only with it (vllm-cpu refuses it)
            extra = ["--enable-sleep-mode", *extra]
        if not has_gpu():
            # vLLM pins each CPU server's compute thread to core 0, leaving the other cores to the
            # HTTP front ends, which dominate for tiny models: spreading the compute threads over
            # both cores of this machine made generate ~1.8x slower.
            env |= VLLM_CPU_ENV | cpu_kv_cache(spec.samplers.kv_cache_gib)
            extra = [*VLLM_CPU_SERVER_ARGS, *extra]
        return [sys.executable, *server_args(model_dir, "127.0.0.1", port, spec.seed, extra)], env

    fleet = LocalServers("sampler", run_root, spec.samplers.replicas, launch, marker=SERVER_MODULE)
    return fleet


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
    model_dir, lora_flags, lora_env = served_model(args.run_root, version, None)
    os.environ.update(SERVER_ENV | lora_env | (RUNTIME_LORA if "--enable-lora" in extra else {}))
    if not has_gpu():  # vLLM's CPU build, as LocalFleet starts it; the pod's env and args win
        for key, value in (VLLM_CPU_ENV | cpu_kv_cache(1)).items():
            os.environ.setdefault(key, value)
        extra = [*VLLM_CPU_SERVER_ARGS, *extra]
    command = [sys.executable, *server_args(model_dir, args.host, args.port, args.seed, [*lora_flags, *extra])]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    serve()
