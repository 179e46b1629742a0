"""The evaluated weight versions in the MLflow Model Registry (tracking.register: each new best held-out
eval, every eval, or none; and the version that passed loop.stop_when), and the same versions as the
Kubeflow Model Registry gets them (rlpipe.tracking.kubeflow_registry). A model version's source is the
sealed version in the weight store: nothing is copied."""

from __future__ import annotations

import socket
import urllib.parse
from typing import TYPE_CHECKING, Any

from rlpipe.metric_keys import EVAL_ACCURACY, EVAL_WEIGHTS_VERSION
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import list_metrics, read_state
from rlpipe.tracking.uri import tracking_uri

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

RUN_TAG = "rlpipe.run_uid"
ITERATION_TAG = "rlpipe.iteration"
BEST_ALIAS = "best"  # follows the best held-out eval
GATE_ALIAS = "gate_passed"  # the version that passed loop.stop_when


def registered_model_name(spec: RunSpec) -> str:
    return spec.tracking.registered_model or spec.name


def versions_to_register(spec: RunSpec, run_root: str) -> dict[int, dict[str, Any]]:
    """{iteration: its eval metrics} for the committed evals tracking.register keeps: each new best
    held-out accuracy ('best'; ties keep the earlier), or every eval; and the one that passed
    loop.stop_when. The weight store keeps these versions (rlpipe.store.weights.prune)."""
    if spec.tracking.register == "none":
        return {}
    state = read_state(run_root) or {}
    evals = {n: m for n, m in sorted(list_metrics(run_root, "eval").items()) if n <= state.get("iteration", -1)}
    chosen, best = {}, None
    for iteration, metrics in evals.items():
        if best is None or metrics[EVAL_ACCURACY] > best:
            best = metrics[EVAL_ACCURACY]
            chosen[iteration] = metrics
        elif spec.tracking.register == "every_eval":
            chosen[iteration] = metrics
    stopped = state.get("stopped")
    if stopped and "when" in stopped and stopped["iteration"] in evals:  # the eval gate's (a sign's names no `when`)
        chosen[stopped["iteration"]] = evals[stopped["iteration"]]
    return dict(sorted(chosen.items()))


def eval_weights_version(iteration: int, metrics: dict[str, float]) -> int:
    """The weights version an eval measured (iteration N's eval: vN, unless its metrics say otherwise)."""
    return int(metrics.get(EVAL_WEIGHTS_VERSION, iteration))


def registered_versions(spec: RunSpec, run_root: str) -> frozenset[int]:
    """The weight versions `versions_to_register` names: the store keeps them (rlpipe.store.commit)."""
    return frozenset(eval_weights_version(n, m) for n, m in versions_to_register(spec, run_root).items())


def registry_source(spec: RunSpec, weights_uri: str, tracking: str) -> str:
    """A model version's source: the sealed version's URI in the weight store. A tracking server refuses a
    local path (to the server it names its own files), so with one a run root on the cluster's volume
    registers pvc://<cluster.pvc>/<path under cluster.mount_path>, any other local path
    rlpipe-local://<host>/<path> (tag rlpipe.weights_uri keeps the path as the steps see it)."""
    if urllib.parse.urlparse(weights_uri).scheme not in ("", "file") or not tracking.startswith(("http:", "https:")):
        return weights_uri
    path = weights_uri.removeprefix("file://")
    mount = spec.cluster.mount_path.rstrip("/")
    if spec.cluster.pvc and path.startswith(f"{mount}/"):
        return f"pvc://{spec.cluster.pvc}{path[len(mount) :]}"
    return f"rlpipe-local://{socket.gethostname()}{path}"


def register_versions(spec: RunSpec, run_root: str, run_id: str, client: MlflowClient) -> list[int]:
    """Register each version `versions_to_register` names that the registry lacks (a model version whose
    source is the sealed version in the weight store: nothing is copied; tags: iteration, eval accuracy,
    sha256), then point the alias 'best' at the best eval's and 'gate_passed' at the stop gate's.
    Returns the iterations registered now."""
    from mlflow.exceptions import MlflowException

    from rlpipe.store.weights import read_weight_ref

    chosen = versions_to_register(spec, run_root)
    if not chosen:
        return []
    name = registered_model_name(spec)
    try:
        client.create_registered_model(name, description=f"rlpipe run {spec.name}: evaluated policy versions")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    state = read_state(run_root) or {}
    mine = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get(RUN_TAG) == state["run_uid"]]
    model_version = {int(v.tags[ITERATION_TAG]): v.version for v in mine}
    registered = []
    for iteration, metrics in chosen.items():
        if iteration in model_version:
            continue
        version = eval_weights_version(iteration, metrics)
        try:
            published = read_weight_ref(run_root, version)
        except FileNotFoundError:  # pruned before this flush (a run from before registration kept it)
            continue
        tags = {
            RUN_TAG: state["run_uid"],
            ITERATION_TAG: str(iteration),
            "rlpipe.weights_version": str(version),
            "rlpipe.sha256": published["sha256"],
            EVAL_ACCURACY: f"{metrics[EVAL_ACCURACY]:.4f}",
        } | {key: f"{value:.4f}" for key, value in metrics.items() if key.startswith("harness/")}
        source = registry_source(spec, published["uri"], tracking_uri(spec, run_root))
        tags |= {} if source == published["uri"] else {"rlpipe.weights_uri": published["uri"]}
        created = client.create_model_version(
            name, source=source, run_id=run_id, tags=tags, description=f"iteration {iteration}"
        )
        model_version[iteration] = created.version
        registered.append(iteration)
    best = max(chosen, key=lambda n: (chosen[n][EVAL_ACCURACY], -n))
    if best in model_version:
        client.set_registered_model_alias(name, BEST_ALIAS, model_version[best])
    stopped = state.get("stopped")
    if stopped and "when" in stopped and stopped["iteration"] in model_version:  # the eval gate passed there
        client.set_registered_model_alias(name, GATE_ALIAS, model_version[stopped["iteration"]])
    return registered


def kubeflow_records(spec: RunSpec, run_root: str, run_id: str) -> list[dict[str, Any]]:
    """What the Kubeflow Model Registry gets of each version `register_versions` registers (one the store
    still has): the weights version, its source (`registry_source`, as a server sees it), its URI in the
    store, a description and the metadata: run, MLflow run, iteration, sha256 and eval metrics."""
    from rlpipe.store.weights import read_weight_ref

    state = read_state(run_root) or {}
    records = []
    for iteration, metrics in versions_to_register(spec, run_root).items():
        version = eval_weights_version(iteration, metrics)
        try:
            published = read_weight_ref(run_root, version)
        except FileNotFoundError:  # pruned before registration was asked for: MLflow skips it too
            continue
        registry = spec.tracking.model_registry
        assert registry is not None  # records are made only for a set tracking.model_registry (mlflow_runs)
        source = registry_source(spec, published["uri"], registry.server_address)
        metadata = {
            RUN_TAG: state["run_uid"],
            "rlpipe.run_name": spec.name,
            "rlpipe.run_root": run_root,
            "mlflow.run_id": run_id,
            ITERATION_TAG: iteration,
            "rlpipe.weights_version": version,
            "rlpipe.sha256": published["sha256"],
            "rlpipe.weights_uri": published["uri"],
        } | {key: float(value) for key, value in sorted(metrics.items()) if key != EVAL_WEIGHTS_VERSION}
        description = f"rlpipe run {spec.name}, iteration {iteration}: {EVAL_ACCURACY} {metrics[EVAL_ACCURACY]:.4f}"
        record = {"version": version, "uri": source, "weights_uri": published["uri"], "description": description}
        records.append(record | {"metadata": metadata})
    return records
