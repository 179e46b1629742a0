"""sync_weights: publish v(N+1) atomically, record the iteration's metrics, commit state.json.

Commit order (a kill at any point leaves a resumable store):
  1. verify + move staged weights to weights/v(N+1), then LATEST      (weight_store.publish)
  1b. rollout.engine sampler, synchronous: reload every sampler in place with v(N+1) (model.lora: swap
      in its adapter) and confirm its label (a rerun that redoes iteration N+1 finds them labelled N+1;
      generate reloads v(N)). sync/bytes: the version's weight bytes, what each sampler loads
  2. write metrics/iter_(N+1).json
  3. state.json: iteration = N+1                                       <- the commit point
     (asynchronous runs: with the buffered chunks the iteration took, rlpipe.rollout_buffer)
  4. prune old weight and optimizer versions (the policy's and a critic's; not the versions
     tracking.register keeps in the MLflow Model Registry); asynchronous runs move the iteration's
     buffer to consumed/
A rerun after a kill before 3 redoes the iteration from v(N); after 3 it is a no-op.
"""

from __future__ import annotations

import time

from rlpipe.metric_keys import ITERATION_OVERHEAD, ITERATION_WALL, STARTED_AT
from rlpipe.rollout_buffer import iteration_uri, retire, taken_record
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import commit_state, filesystem, iteration_metrics_uri, optimizer_dir, read_state, write_json
from rlpipe.store.weights import WeightRef, prune, publish, read_ref, weights_bytes
from rlpipe.tracking import registered_versions


def reload_samplers(spec: RunSpec, ref: WeightRef) -> dict[str, float]:
    """Swap the published version into every running sampler in place (no restart, no model load).
    Samplers still starting are not waited for: they load LATEST, and generate labels them."""
    from rlpipe.services.sampler_client import is_healthy, replica_urls, sampler_weights_dir, sync_replicas

    s = spec.samplers
    urls = [url for url in replica_urls(s.endpoints) if is_healthy(url)]
    if not urls:
        return {"samplers/replicas": 0.0}
    adapters = spec.model.lora is not None
    return sync_replicas(urls, sampler_weights_dir(ref["uri"]), ref["version"], s.request_timeout_s, adapters)


def sync_weights(
    spec: RunSpec, run_root: str, staged: WeightRef, iteration: int, step_metrics: dict[str, float]
) -> tuple[WeightRef, dict[str, float]]:
    """Publish `staged` as the policy after `iteration`; returns the published ref and metrics."""
    started = time.time()
    state = read_state(run_root) or {}
    committed = state.get("iteration", -1)
    if committed >= iteration:  # a retried sync after its own commit: nothing to do
        return read_ref(run_root, state["weights_version"]), {}
    if committed != iteration - 1:
        raise RuntimeError(
            f"state.json is at iteration {committed}, cannot commit iteration {iteration}; "
            "another run is writing to this run root? Rerun `rlpipe run` to continue from the state."
        )
    ref = publish(run_root, staged)
    metrics = dict(step_metrics) | {"sync/bytes": float(weights_bytes(ref["uri"]))}  # an adapter's, or all weights
    if spec.rollout.engine == "sampler" and not spec.loop.max_staleness:  # asynchronous: the producer pulls it
        metrics |= reload_samplers(spec, ref)
    metrics["time/sync_weights_s"] = time.time() - started
    if STARTED_AT in metrics:  # wall clock from the generate step's process start to here
        wall = time.time() - metrics.pop(STARTED_AT)
        compute = sum(v for k, v in metrics.items() if k.startswith("time/") and k.endswith("_s"))
        metrics[ITERATION_WALL] = wall
        metrics[ITERATION_OVERHEAD] = max(0.0, wall - compute)
        if spec.loop.max_staleness:
            metrics["async/training_busy_share"] = metrics.get("time/update_s", 0.0) / max(wall, 1e-9)
    write_json(iteration_metrics_uri(run_root, iteration), metrics)
    taken = taken_record(run_root, iteration) if spec.loop.max_staleness and iteration else None
    if spec.loop.max_staleness and iteration and taken is None:  # never commit without what it trained on
        raise RuntimeError(
            f"iteration {iteration} took its rollouts from the buffer, but its record of them "
            f"({iteration_uri(run_root, iteration)}/taken.json) is gone: not committing it. "
            "Rerun `rlpipe run`: the iteration takes its chunks again"
        )
    commit_state(
        run_root,
        iteration=iteration,
        weights_version=ref["version"],
        weights_sha256=ref["sha256"],
        **({"rollouts_taken": taken} if taken else {}),
    )
    if spec.loop.max_staleness:
        retire(run_root, iteration, spec.storage.keep_versions)
    registered = registered_versions(spec, run_root)
    for lineage in ("policy", "critic"):
        prune(
            run_root,
            spec.storage.keep_versions,
            ref["version"],
            lineage,
            registered if lineage == "policy" else frozenset(),
        )
        fs, opt_dir = filesystem(optimizer_dir(run_root, lineage))
        if fs.exists(opt_dir):
            for path in fs.ls(opt_dir, detail=False):
                name = path.rsplit("/", 1)[-1]
                stale = name.endswith(".pt") and int(name[1:7]) < ref["version"]
                if name.startswith("v") and (stale or name.endswith(".tmp")):  # .tmp: a save killed midway
                    fs.rm(path)
    return ref, metrics
