"""The steps' side of the resident trainer (rlpipe.services.trainer.server); torch-free.

request_update    copy the batch into the run root (the trainer may be another pod), POST /update
request_generate  rollout.engine torch: POST /generate; the trainer samples with the policy it
                  holds and writes the rollouts into the run root; copy them out
request_evaluate  POST /evaluate: greedy held-out accuracy of the policy it holds
request_offload   POST /offload, request_onload POST /onload: its device memory given back between its
                  turns on a shared device, and taken again (sharing.enabled: rlpipe.sharing.handover)

A trainer that dies mid-request is waited for (the local driver or Kubernetes restarts it) and
asked again: nothing is published before sync_weights, and it reloads v(N) from storage.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlpipe.http_json import Unreachable, is_healthy, request_json
from rlpipe.metric_keys import GENERATE_LOAD, GENERATE_TIME, UPDATE_LOAD, UPDATE_TIME, VALUES_TIME
from rlpipe.spec import RunSpec, spec_to_dict
from rlpipe.store.run_root import failed_services, filesystem, join
from rlpipe.store.weights import WeightRef, as_weight_ref

READY_TIMEOUT_S = 600.0
ATTEMPTS = 3


class TrainerError(RuntimeError):
    """The resident trainer is unreachable or failed the update; the message says why."""


def wait_for_trainer(url: str, run_root: str) -> None:
    """Until the trainer answers /health; at once an error when `rlpipe run`'s supervisor gave up on it."""
    timeout_s = READY_TIMEOUT_S
    deadline = time.time() + timeout_s
    while not is_healthy(url):
        if why := failed_services(run_root, "trainer").get(url):
            raise TrainerError(f"the resident trainer {url} stopped: {why}")
        if time.time() > deadline:
            log = Path(run_root) / "logs" / "trainer-0.log"
            where = f"; its log: {log}" if log.exists() else ""
            raise TrainerError(
                f"resident trainer {url} not ready after {timeout_s:.0f} s{where}. Check that it runs "
                "(cluster: the JobSet `rlpipe compile` wrote beside the pipeline, and trainer.endpoint), or set "
                "trainer.resident: false"
            )
        time.sleep(0.5)


def post(spec: RunSpec, run_root: str, route: str, payload: dict, iteration: int) -> dict:
    """POST to the resident trainer; a trainer that dies mid-request is waited for and asked again."""
    url = (spec.trainer.endpoint or "").rstrip("/")
    if not url:
        raise TrainerError("trainer.resident is set but trainer.endpoint is empty: name the trainer's URL")
    payload = {"spec": spec_to_dict(spec), "run_root": run_root, "iteration": iteration, **payload}
    for attempt in range(1, ATTEMPTS + 1):
        wait_for_trainer(url, run_root)
        try:
            status, body = request_json("POST", f"{url}{route}", payload)
            break
        except Unreachable:  # it died mid-request; restarted, it reloads v(N) from storage
            if attempt == ATTEMPTS:
                raise TrainerError(
                    f"resident trainer {url} died in {ATTEMPTS} attempts at {route} of iteration {iteration}; "
                    f"see its log ({run_root}/logs/trainer-0.log locally)"
                ) from None
    if status != 200:
        if not (isinstance(body, dict) and "error" in body):
            raise TrainerError(f"resident trainer {url}{route} answered HTTP {status} without an error body")
        raise TrainerError(f"resident trainer {url}{route}: {body['error']}: {body['message']}")
    return body


def request_generate(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, out_path: str, cache_root: str
) -> dict[str, float]:
    """The iteration's rollouts, sampled by the resident trainer with the policy it holds, at `out_path`."""
    started = time.time()
    rollouts_uri = join(run_root, "trainer", f"rollouts-{iteration:06d}.parquet")
    fs, remote = filesystem(rollouts_uri)
    payload = {"weights": as_weight_ref(weights), "rollouts_uri": rollouts_uri, "cache_root": cache_root}
    try:
        metrics = post(spec, run_root, "/generate", payload, iteration)["metrics"]
        fs.get_file(remote, out_path)
    finally:
        if fs.exists(remote):
            fs.rm_file(remote)
    served_s = metrics[GENERATE_LOAD] + metrics[GENERATE_TIME]
    metrics["overhead/generate_request_s"] = time.time() - started - served_s
    return metrics


def request_values(
    spec: RunSpec,
    run_root: str,
    weights: WeightRef,
    iteration: int,
    scored_path: str,
    out_path: str,
    cache_root: str,
) -> dict[str, float]:
    """The scored rollouts with the values of the critic the resident trainer holds beside the policy
    (both files cross through the run root: the trainer may be another pod)."""
    started = time.time()
    scored_uri, valued_uri = (join(run_root, "trainer", f"{n}-{iteration:06d}.parquet") for n in ("scored", "valued"))
    fs, scored_remote = filesystem(scored_uri)
    _, valued_remote = filesystem(valued_uri)
    fs.makedirs(scored_remote.rsplit("/", 1)[0], exist_ok=True)
    fs.put_file(scored_path, scored_remote)
    payload = {
        "weights": as_weight_ref(weights),
        "scored_uri": scored_uri,
        "valued_uri": valued_uri,
        "cache_root": cache_root,
    }
    try:
        metrics = post(spec, run_root, "/values", payload, iteration)["metrics"]
        fs.get_file(valued_remote, out_path)
    finally:
        for remote in (scored_remote, valued_remote):
            if fs.exists(remote):
                fs.rm_file(remote)
    metrics["overhead/values_request_s"] = time.time() - started - metrics[VALUES_TIME]
    return metrics


def request_evaluate(
    spec: RunSpec, run_root: str, weights: WeightRef, iteration: int, cache_root: str
) -> dict[str, float]:
    """Held-out greedy accuracy of `weights`, evaluated by the resident trainer (it records it)."""
    payload = {"weights": as_weight_ref(weights), "cache_root": cache_root}
    return post(spec, run_root, "/evaluate", payload, iteration)["metrics"]


def request_offload(spec: RunSpec, run_root: str, iteration: int, weights: bool) -> dict[str, float]:
    """The trainer's optimizer state (and, with `weights`, its weights) to host memory, its gradients dropped:
    {seconds, bytes} (the bytes its device gave back)."""
    return post(spec, run_root, "/offload", {"weights": weights}, iteration)


def request_onload(spec: RunSpec, run_root: str, iteration: int) -> dict[str, float]:
    """What /offload moved, back on the trainer's device: {seconds, bytes}."""
    return post(spec, run_root, "/onload", {}, iteration)


def request_update(
    spec: RunSpec, run_root: str, weights: WeightRef, batch_path: str, iteration: int, cache_root: str
) -> tuple[WeightRef, dict[str, float]]:
    """Train on the batch on the resident trainer (the batch is copied into the run root: the
    trainer may be another pod); returns the staged v(N+1) and the update's metrics."""
    started = time.time()
    batch_uri = join(run_root, "trainer", f"batch-{iteration:06d}.parquet")
    fs, remote = filesystem(batch_uri)
    fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
    fs.put_file(batch_path, remote)
    payload = {"weights": as_weight_ref(weights), "batch_uri": batch_uri, "cache_root": cache_root}
    try:
        body = post(spec, run_root, "/update", payload, iteration)
    finally:
        fs.rm_file(remote)
    metrics = body["metrics"]
    served_s = metrics[UPDATE_LOAD] + metrics[UPDATE_TIME]
    metrics["overhead/update_request_s"] = time.time() - started - served_s
    return as_weight_ref(body["staged"]), metrics
