"""Compile the run pipeline to KFP IR YAML, with the spec and run root as parameter defaults."""

import dataclasses
from pathlib import Path

from kfp import compiler

from rlpipe.pipelines.shared_device import check_cluster_sharing
from rlpipe.pipelines.trainer_jobset import trainer_url
from rlpipe.spec import RunSpec, spec_to_json
from rlpipe.steps import check_secret_steps
from rlpipe.store.run_root import run_root_for


def default_cluster_run_root(spec: RunSpec) -> str:
    """Where cluster steps keep the run: on the PVC when one is set, else storage.root (a URI)."""
    if spec.cluster.pvc:
        return f"{spec.cluster.mount_path.rstrip('/')}/runs/{spec.name}"
    if "://" not in spec.storage.root:
        raise ValueError(
            "storage.root is a local path but cluster.pvc is not set: cluster steps cannot reach it. "
            "Set cluster.pvc (a ReadWriteMany PVC), storage.root to gs://..., or pass --run-root"
        )
    return run_root_for(spec.storage.root, spec.name)


def cluster_spec_and_root(spec: RunSpec, run_root: str | None) -> tuple[RunSpec, str]:
    """The spec as cluster steps must see it (storage paths on the cluster) and the run root."""
    check_secret_steps(spec)  # a secret for no step would reach no pod
    check_cluster_sharing(spec)  # sharing.enabled: its claim, a CEL selector, no KFP task needing the device
    run_root = run_root or default_cluster_run_root(spec)
    if spec.rollout.engine == "sampler" and not spec.samplers.endpoints:
        raise ValueError(
            "rollout.engine sampler on a cluster needs samplers.endpoints, e.g. "
            "[http://rlpipe-sampler-pods.rlpipe.svc.cluster.local:8000] (manifests/base/sampler.yaml)"
        )
    if spec.trainer.resident and not spec.trainer.endpoint:  # the Service of the JobSet rlpipe compile writes
        spec = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, endpoint=trainer_url(spec)))
    cache = spec.storage.cache or (f"{spec.cluster.mount_path.rstrip('/')}/cache" if spec.cluster.pvc else None)
    storage = dataclasses.replace(spec.storage, root=run_root.rsplit("/", 1)[0], cache=cache)
    return dataclasses.replace(spec, storage=storage), run_root


def compile_pipeline(spec: RunSpec, output: str | Path, run_root: str | None = None) -> Path:
    """Write the K-iteration pipeline (K = loop.iterations_per_run); one run advances the loop by K.

    The run root must be storage every step can reach on the cluster (gs://..., or a path on
    the shared-FS PVC); default: <cluster.mount_path>/runs/<name> when cluster.pvc is set. The
    spec is a pipeline parameter, editable when creating a run. `spec.cluster` is applied to
    every task (pipelines/cluster_settings.py).
    """
    from rlpipe.pipelines.dpo_pipeline import build_pipeline_for

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    spec, run_root = cluster_spec_and_root(spec, run_root)
    compiler.Compiler().compile(
        pipeline_func=build_pipeline_for(spec, placement=spec),  # offline DPO's, or the RL loop's
        package_path=str(output),
        pipeline_parameters={
            "spec": spec_to_json(spec),
            "run_root": run_root,
        },
    )
    return output
