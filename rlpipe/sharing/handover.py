"""The handovers of one device between the resident trainer and the samplers (sharing.enabled;
docs/sharing-accelerators.md, "Inside one run: turns"). Each turn leaves the device free at its end:

    train turn   samplers_sleep (those still awake) -> trainer_onload -> update / values / evaluate
                 -> trainer_offload (optimizer state and gradients, the weights with sharing.offload_weights)
    sample turn  samplers_wake (+ serve v(N) in place) -> generate -> samplers_sleep

The samplers sleep and wake by vLLM's dev-mode routes (the servers run with VLLM_SERVER_DEV_MODE=1):
POST /sleep?level=L&mode=wait drains what is in flight, then frees the KV cache (level 1 keeps the weights in
host memory, level 2 discards them); a level-2 sleeper wakes as vLLM's RL recipe has it, /wake_up?tags=weights
-> reload every tensor -> /wake_up?tags=kv_cache. Each handover is timed from here (its HTTP included) and
returned as metrics (sharing/sleep_s, wake_s, onload_s, offload_s, offload_bytes). A turn that fails leaves its
closing handover undone; the next train turn puts any sampler still awake to sleep, and a trainer that failed
holds no session. Without sharing.enabled there is no turn and no handover: the samplers only serve v(N).
The samplers' modules (requests) are imported where a sampler is asked: a trainer's step imports neither."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rlpipe.http_json import Unreachable, request_json
from rlpipe.metric_keys import SHARING_OFFLOAD, SHARING_OFFLOAD_BYTES, SHARING_ONLOAD, SHARING_SLEEP, SHARING_WAKE
from rlpipe.services.trainer.client import request_offload, request_onload
from rlpipe.sharing.turns import device_turn

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


@contextlib.contextmanager
def train_turn(spec: RunSpec, run_root: str, iteration: int) -> Iterator[dict[str, float]]:
    """The trainer's turn (update, values, evaluate on the resident trainer): the samplers asleep and the trainer's
    state on the device while the block runs, in host memory after. Yields the turn's metrics."""
    with device_turn(spec, run_root, "train", iteration) as turn:
        if spec.sharing.enabled:
            turn |= samplers_sleep(spec, run_root) | trainer_onload(spec, run_root, iteration)
        yield turn
        if spec.sharing.enabled:
            turn |= trainer_offload(spec, run_root, iteration)


@contextlib.contextmanager
def sample_turn(spec: RunSpec, run_root: str, weights: WeightRef, iteration: int) -> Iterator[dict[str, float]]:
    """The samplers' turn: awake and serving `weights` while the block runs (without sharing: serving it), asleep
    after. Yields the turn's metrics, the catch-up reload's among them."""
    with device_turn(spec, run_root, "sample", iteration) as turn:
        turn |= samplers_wake(spec, run_root, weights)
        yield turn
        if spec.sharing.enabled:
            turn |= samplers_sleep(spec, run_root)


def samplers_sleep(spec: RunSpec, run_root: str) -> dict[str, float]:
    """Every ready sampler asleep at sharing.sleep_level, in-flight requests drained first (mode=wait); those
    starting are waited for (a starting server takes the device). {} when all were asleep already."""
    from rlpipe.engines.sampler_requests import SamplerError, ready_replicas

    s = spec.samplers
    try:
        urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    except SamplerError:  # none serves (each stopped, or none started in time): none holds the device
        return {}
    started = time.time()
    with ThreadPoolExecutor(len(urls)) as pool:
        slept = sum(pool.map(lambda url: _sleep(url, spec.sharing.sleep_level, s.request_timeout_s), urls))
    return {SHARING_SLEEP: time.time() - started} if slept else {}


def samplers_wake(spec: RunSpec, run_root: str, weights: WeightRef) -> dict[str, float]:
    """Every ready sampler awake and serving `weights` (rlpipe.services.samplers.client.serve_version). Level 1:
    wake whole, then reload what is stale; level 2: wake the weights' memory, reload every tensor, then the KV
    cache's. Without sharing.enabled: serve_version alone."""
    from rlpipe.engines.sampler_requests import ready_replicas
    from rlpipe.services.samplers.client import serve_version

    if not spec.sharing.enabled:
        return serve_version(spec, run_root, weights)
    s, level = spec.samplers, spec.sharing.sleep_level
    urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    started = time.time()
    _each(urls, "/wake_up", {"tags": "weights"} if level == 2 else {}, s.request_timeout_s)
    woken = time.time() - started
    metrics = serve_version(spec, run_root, weights, discarded=level == 2)
    if level == 2:
        started = time.time()
        _each(urls, "/wake_up", {"tags": "kv_cache"}, s.request_timeout_s)
        woken += time.time() - started
    return metrics | {SHARING_WAKE: woken}


def trainer_onload(spec: RunSpec, run_root: str, iteration: int) -> dict[str, float]:
    """The resident trainer's state back on its device (POST /onload; nothing when it holds no session)."""
    started = time.time()
    request_onload(spec, run_root, iteration)
    return {SHARING_ONLOAD: time.time() - started}


def trainer_offload(spec: RunSpec, run_root: str, iteration: int) -> dict[str, float]:
    """The resident trainer's optimizer state (and weights, with sharing.offload_weights) in host memory and its
    gradients dropped (POST /offload): the bytes its device gave back."""
    started = time.time()
    body = request_offload(spec, run_root, iteration, spec.sharing.offload_weights)
    return {SHARING_OFFLOAD: time.time() - started, SHARING_OFFLOAD_BYTES: float(body["bytes"])}


def _sleep(url: str, level: int, timeout_s: float) -> bool:
    """Put one sampler to sleep unless it sleeps already (GET /is_sleeping); whether it was put to sleep."""
    status, body = _call("GET", f"{url}/is_sleeping", timeout_s)
    if body.get("is_sleeping"):
        return False
    _call("POST", f"{url}/sleep?level={level}&mode=wait", timeout_s)
    return True


def _each(urls: list[str], route: str, query: dict[str, str], timeout_s: float) -> None:
    """POST `route` to every sampler at once."""
    suffix = "".join(f"{'&' if i else '?'}{k}={v}" for i, (k, v) in enumerate(query.items()))
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: _call("POST", f"{url}{route}{suffix}", timeout_s), urls))


def _call(method: str, url: str, timeout_s: float) -> tuple[int, dict]:
    from rlpipe.engines.sampler_requests import SamplerError

    try:
        status, body = request_json(method, url, read_timeout_s=timeout_s)
    except Unreachable as err:
        raise SamplerError(f"sharing: {err}") from None
    if status != 200:
        raise SamplerError(f"sharing: {method} {url} answered {status}: {body}")
    return status, body if isinstance(body, dict) else {}
