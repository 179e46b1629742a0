"""The sections of the run spec that say where a run keeps its files (storage), what it reports to
(tracking) and how its steps are placed on a cluster (cluster: images, resources, PVC, secrets).
"""

from __future__ import annotations

from typing import Literal

from rlpipe.spec.section import section, setting


@section
class StorageSpec:
    """Where a run keeps its files: run roots, weight versions and their dtype, optimizer state, the cache."""

    root: str = setting(default="./runs", doc="Parent of run directories: a local path or fsspec URI")
    keep_versions: int = setting(default=3, ge=1, doc="Weight versions kept besides v0")
    cache: str | None = setting(default=None, doc="Warm-start cache; default <root>/.cache")
    weights_dtype: Literal["bfloat16"] | None = setting(
        default=None,
        doc="dtype of the weights each version stores (what samplers load): null = the trainer's float32 master "
        "weights; bfloat16 = a serving copy, half the bytes, with the masters kept beside the optimizer state "
        "(optimizer/vN.masters.safetensors) so training loses nothing. Whole-weight versions only (not model.lora)",
    )
    optimizer_every: int = setting(
        default=1,
        ge=1,
        doc="The resident trainer writes its optimizer state (and fp32 masters) every this many versions, in the "
        "background, and at the end of training and of every loop.iterations_per_run block; it keeps each "
        "version's batch until then, and a restarted trainer replays the updates since the last write (exact on "
        "CPU). The update step, a process per update, writes every version",
    )
    full_every: int = setting(
        default=10,
        ge=1,
        doc="With weights_dtype bfloat16: a version is stored whole at least every this many versions, the others "
        "as deltas against their parent (the elements whose bits changed: ~1% at RL learning rates), or whole "
        "whenever a delta would be over half the size. 1: every version whole",
    )


@section
class ModelRegistrySpec:
    """A Kubeflow Model Registry (Kubeflow Hub) that gets each version the MLflow registry gets, through the
    Kubeflow SDK's ModelRegistryClient (`pip install 'rlpipe[kubeflow-hub]'`; rlpipe.tracking.kubeflow_registry)."""

    server_address: str = setting(
        doc="The registry's REST address with its scheme, e.g. https://model-registry-service.kubeflow.svc.cluster.local"
    )
    port: int | None = setting(default=None, ge=1, le=65535, doc="Its port; null: 443 for https://, 8080 for http://")
    is_secure: bool | None = setting(default=None, doc="TLS; null: from the scheme (https:// is secure)")
    author: str = setting(default="rlpipe", doc="Author of the versions and owner of the registered model")
    token_env: str | None = setting(
        default=None,
        doc="Env var holding the bearer token (cluster.secrets can set it); null: the SDK's own: the file "
        "$KF_PIPELINES_SA_TOKEN_PATH names, else the pod's service-account token",
    )


@section
class TrackingSpec:
    """MLflow: where a run's params, metrics and registered models go."""

    uri: str | None = setting(default=None, doc="MLflow tracking URI; default sqlite:///<run dir>/mlflow.db")
    experiment: str = setting(default="rlpipe", doc="MLflow experiment of the run")
    register: Literal["none", "best", "every_eval"] = setting(
        default="best",
        doc="Which evaluated weight versions the MLflow Model Registry gets (a model version pointing at the "
        "sealed version in the weight store, not a copy): each new best held-out eval, every eval, or none. "
        "The alias 'best' follows the best eval; 'gate_passed' marks the version that passed loop.stop_when",
    )
    registered_model: str | None = setting(default=None, doc="The registered model's name; default: the run's name")
    model_registry: ModelRegistrySpec | None = setting(
        default=None,
        doc="Also register each version tracking.register names in this Kubeflow Model Registry (name: the "
        "registered model's, version v<weights version>, the weights URI and the eval metrics as metadata); "
        "null: MLflow's registry only",
    )


@section
class Toleration:
    """A Kubernetes toleration of the pods: a taint of the node pool they may run on."""

    key: str = setting(doc="The taint's key, e.g. nvidia.com/gpu")
    operator: Literal["Equal", "Exists"] = setting(default="Exists", doc="Exists: any value; Equal: `value`")
    value: str | None = setting(default=None, doc="The taint's value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = setting(
        default="NoSchedule", doc="The taint's effect it tolerates; null: all"
    )


CPU = r"([0-9]*[.])?[0-9]+m?"  # what KFP's set_cpu_request accepts
MEMORY = r"[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?"  # what KFP's set_memory_request accepts


@section
class PodSpec:
    """Image, resources and placement for one class of steps on the cluster."""

    image: str = setting(doc="Container image of these steps")
    cpu: str = setting(default="1", pattern=CPU, doc="CPU request: cores, e.g. 4, 0.5 or 500m")
    memory: str = setting(default="2Gi", pattern=MEMORY, doc="Memory request: bytes or with a suffix, e.g. 16Gi")
    cpu_limit: str | None = setting(default=None, pattern=CPU, doc="CPU limit; null: none")
    memory_limit: str | None = setting(default=None, pattern=MEMORY, doc="Memory limit; null: none")
    accelerator: str = setting(
        default="nvidia.com/gpu", doc="Resource name (KFP accelerator type) of the GPUs a step requests (trainer.gpus)"
    )
    node_selector: dict[str, str] = setting(default_factory=dict, doc="Node labels the pods must have")
    tolerations: list[Toleration] = setting(default_factory=list, doc="Taints the pods tolerate")
    timeout_s: int = setting(default=7200, ge=60, doc="Seconds one step may run")


@section
class SecretEnv:
    """Expose one key of a Kubernetes Secret as an env var (by reference: values never enter the spec)."""

    secret: str = setting(doc="The Secret's name")
    key: str = setting(doc="The key in it")
    env: str = setting(doc="The env var that gets its value")
    # the step table (rlpipe.steps) sits above the spec: it checks the names (check_secret_steps), before any step runs
    steps: list[str] | None = setting(default=None, doc="Steps that get it (e.g. [track]); None = every step")


@section
class ClusterSpec:
    """Applied to every task at compile time (`rlpipe compile`); `rlpipe run --containers` takes its images."""

    trainer: PodSpec = setting(
        default_factory=lambda: PodSpec(image="ghcr.io/rlpipe/trainer:0.1.0", cpu="4", memory="16Gi")
    )
    step: PodSpec = setting(default_factory=lambda: PodSpec(image="ghcr.io/rlpipe/step:0.1.0"))
    sampler_image: str = setting(
        default="ghcr.io/rlpipe/sampler:0.1.0",
        doc="vLLM sampler image: the samplers `rlpipe run --containers` starts (the cluster's: manifests/)",
    )
    pvc: str | None = setting(default=None, doc="ReadWriteMany PVC holding the run root (Lustre/Filestore/NFS)")
    mount_path: str = setting(default="/mnt/rlpipe", doc="Where cluster.pvc is mounted in every pod")
    secrets: list[SecretEnv] = setting(default_factory=list, doc="Secret keys the steps get as env vars")
    retries: int = setting(default=2, ge=0, doc="Every step is safe to retry: nothing is visible before sync commits")
    retry_backoff: str = setting(default="30s", doc="Wait before a retry (a KFP duration)")
    run_as_user: int = setting(default=1000, doc="UID and GID the steps' containers run as")
    sandbox_runtime_class: str | None = setting(
        default="gvisor",
        doc="RuntimeClass of the score pod when a code_sandbox reward runs candidates' code (GKE Sandbox: "
        "gvisor); its pod is labelled rlpipe.dev/sandbox=true for the deny-egress NetworkPolicy. null: none",
    )
