"""One accelerator shared on a cluster (sharing.claim): the resident trainer's JobSet and the samplers' Deployment
reference one pre-made DRA ResourceClaim (resource.k8s.io/v1), so the scheduler puts every pod that references it on
the node holding its devices, and the pods take turns on them (sharing.enabled). `rlpipe compile` writes the claim
and the samplers' Deployment beside the pipeline (rl.yaml -> rl.shared-device.yaml, next to rl.trainer.yaml):

    ResourceClaim <claim.name>   exactly claim.count devices of claim.device_class matching claim.selector (CEL)
    Deployment rlpipe-sampler    pod: resourceClaims [{name: device, resourceClaimName: <claim.name>}]
                                 container: resources.claims [{name: device}], no cluster.trainer.accelerator
    JobSet (rl.trainer.yaml)     the same reference in its pod template (container_resources, pod_claims)

No KFP task uses the device: KFP 2.17 has no call for DRA claims, and the one kubeflow/pipelines#14243 added later
(kfp-kubernetes add_resource_claim) takes ResourceClaimTemplates only, one claim per pod, never a pre-made shared
claim. So with sharing the tasks request no accelerator (cluster_settings.task_gpus) and the few that would compute
on one do so on the CPU (steps_without_the_device); docs/sharing-accelerators.md says the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlpipe.pipelines.cluster_settings import NAMESPACE, security_context
from rlpipe.spec import RunSpec
from rlpipe.steps import gpus_for, iteration_steps

POD_CLAIM = "device"  # the claim's name in a pod (resourceClaims[].name, resources.claims[].name)
REQUEST = "device"  # the one request of the claim: all of its devices
SAMPLER = "rlpipe-sampler"  # manifests/base/sampler.yaml's Deployment, Services and ServiceAccount
SAMPLER_PORT = 8000
WEIGHTS_PVC = "rlpipe-weights"  # manifests/base/weights-pvc.yaml, where the spec names no cluster.pvc
SELECTOR_EXAMPLE = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'


def check_cluster_sharing(spec: RunSpec) -> None:
    """Refuse, with the key to change, a sharing section the cluster cannot honour (before anything is written)."""
    from rlpipe.dpo_loop import is_offline_dpo

    sharing = spec.sharing
    if not sharing.enabled:
        return
    if sharing.claim is None:
        raise ValueError(
            "sharing.enabled on a cluster needs sharing.claim: without it the trainer's and the samplers' pods "
            f"request {spec.cluster.trainer.accelerator} devices of their own and cannot share one; set "
            "sharing.claim: {device_class: gpu.nvidia.com} (the DeviceClass of your DRA driver)"
        )
    if sharing.claim.selector is not None:
        check_selector(sharing.claim.selector)
    if is_offline_dpo(spec):
        raise ValueError(
            "sharing.enabled: algorithm.name dpo trains in the pipeline's own KFP tasks, and no KFP task can use the "
            "shared claim (docs/sharing-accelerators.md); set sharing.enabled: false"
        )


def check_selector(selector: str) -> None:
    """Refuse a sharing.claim.selector that does not parse as CEL (the API server would refuse the claim)."""
    try:
        import celpy  # cel-python: the cluster extra
    except ImportError:
        raise ValueError(
            "sharing.claim.selector is checked as CEL with cel-python: pip install 'rlpipe[cluster]'"
        ) from None
    try:
        celpy.Environment().compile(selector)
    except celpy.CELParseError as err:
        where = f" at column {err.column}" if getattr(err, "column", None) else ""
        raise ValueError(
            f"sharing.claim.selector {selector!r} is not a CEL expression (a parse error{where}); write one over "
            f"device.attributes or device.capacity, e.g. {SELECTOR_EXAMPLE}, or null for any device of the class"
        ) from None


def steps_without_the_device(spec: RunSpec) -> tuple[str, ...]:
    """The steps that would compute on the accelerator in KFP tasks of their own (warm_start's SFT, score with a
    reward model): with sharing they request none and compute on the CPU. The other torch steps are the resident
    trainer's and the samplers' (rlpipe.steps.service_for)."""
    steps = ("warm_start", *iteration_steps(spec)) if spec.model.warm_start.max_steps else iteration_steps(spec)
    return tuple(step for step in steps if gpus_for(step, spec))


def claim_reference(claim_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pod spec's resourceClaims entry for the pre-made claim `claim_name`, and its container's resources.claims
    entry naming it."""
    return {"name": POD_CLAIM, "resourceClaimName": claim_name}, {"name": POD_CLAIM}


def container_resources(spec: RunSpec, requests: dict[str, Any], limits: dict[str, Any], devices: int) -> dict:
    """A device user's container resources: `requests` and `limits`, and `devices` of cluster.trainer.accelerator,
    or, with sharing.claim, the shared claim instead (DRA allocates its devices: no extended resource is counted)."""
    requests, limits = dict(requests), dict(limits)
    claims = []
    if devices and spec.sharing.claim is not None:
        claims.append(claim_reference(spec.sharing.claim.name)[1])
    elif devices:
        requests[spec.cluster.trainer.accelerator] = limits[spec.cluster.trainer.accelerator] = devices
    return {"requests": requests} | ({"limits": limits} if limits else {}) | ({"claims": claims} if claims else {})


def pod_claims(spec: RunSpec, containers: list[dict[str, Any]]) -> dict[str, Any]:
    """What a pod spec adds for the claims its `containers` name: resourceClaims, the shared claim by name."""
    named = {claim["name"] for c in containers for claim in c.get("resources", {}).get("claims", [])}
    if not named or spec.sharing.claim is None:
        return {}
    return {"resourceClaims": [claim_reference(spec.sharing.claim.name)[0]]}


def device_claim(spec: RunSpec) -> dict[str, Any]:
    """The ResourceClaim of sharing.claim: exactly `count` devices of `device_class` that match `selector`."""
    claim = spec.sharing.claim
    if claim is None:
        raise ValueError("sharing.claim is not set: there is no shared device to write")
    exactly: dict[str, Any] = {"deviceClassName": claim.device_class, "allocationMode": "ExactCount"}
    exactly["count"] = claim.count
    if claim.selector is not None:
        exactly["selectors"] = [{"cel": {"expression": claim.selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "rlpipe"}},
        "spec": {"devices": {"requests": [{"name": REQUEST, "exactly": exactly}]}},
    }


def sampler_env(run_root: str) -> list[dict[str, str]]:
    """manifests/base/sampler.yaml's environment, with the run root of this run."""
    env = {
        "RLPIPE_RUN_ROOT": run_root,  # the fleet waits for its weights/LATEST, then serves that version
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc reload_policy, /pause, /resume
        "HF_HUB_OFFLINE": "1",
        # the root filesystem is read-only: every cache goes to the /cache emptyDir; USER: uid 1000 may have no
        # passwd entry, and torch's cache paths call getpass.getuser()
        "HOME": "/cache",
        "USER": "rlpipe",
        "XDG_CACHE_HOME": "/cache",
        "VLLM_CACHE_ROOT": "/cache/vllm",
        "HF_HOME": "/cache/huggingface",
        "TRITON_CACHE_DIR": "/cache/triton",
    }
    return [{"name": name, "value": value} for name, value in env.items()]


def sampler_container(spec: RunSpec, run_root: str) -> dict[str, Any]:
    """The vLLM sampler, as manifests/base/sampler.yaml runs it, on the shared claim."""
    cluster = spec.cluster
    _, container_security = security_context(cluster)
    # no CPU limit: throttling the tokenizer/scheduler threads only adds latency
    resources = container_resources(spec, {"cpu": "4", "memory": "32Gi"}, {"memory": "64Gi"}, devices=1)
    return {
        "name": "sampler",
        "image": cluster.sampler_image,
        "command": ["python", "-m", "rlpipe.services.samplers.fleet"],
        # /sleep frees the device only with sleep mode on (docs/sharing-accelerators.md, "vLLM on a CPU and on a GPU")
        "args": ["--host=0.0.0.0", f"--port={SAMPLER_PORT}", "--enable-sleep-mode"],
        "env": sampler_env(run_root),
        "ports": [{"name": "http", "containerPort": SAMPLER_PORT}],
        "readinessProbe": {  # no livenessProbe: /health fails while the fleet waits for the run's first weights
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "resources": resources,
        "securityContext": container_security | {"readOnlyRootFilesystem": True},
        "volumeMounts": [
            {"name": "weights", "mountPath": cluster.mount_path, "readOnly": True},  # the steps' path
            {"name": "cache", "mountPath": "/cache"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},  # NCCL / torch shared memory: more than the 64Mi default
        ],
    }


def sampler_deployment(spec: RunSpec, run_root: str) -> dict[str, Any]:
    """The samplers' Deployment: manifests/base/sampler.yaml's, with samplers.replicas replicas of
    cluster.sampler_image serving run `run_root`, on the shared claim, where the trainer's pods are placed (the
    claim's node is the one node all of them run on). The base's Services and ServiceAccount select and run it."""
    cluster = spec.cluster
    pod_security, _ = security_context(cluster)
    labels = {"app.kubernetes.io/name": SAMPLER, "app.kubernetes.io/component": "sampler"}
    labels |= {"app.kubernetes.io/part-of": "rlpipe"}
    containers = [sampler_container(spec, run_root)]
    pod: dict[str, Any] = {
        "serviceAccountName": SAMPLER,
        "automountServiceAccountToken": False,  # the sampler never calls the Kubernetes API
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security | {"fsGroup": cluster.run_as_user, "fsGroupChangePolicy": "OnRootMismatch"},
        "containers": containers,
        "volumes": [
            {"name": "weights", "persistentVolumeClaim": {"claimName": cluster.pvc or WEIGHTS_PVC, "readOnly": True}},
            {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        ],
    } | pod_claims(spec, containers)
    trainer_pod = cluster.trainer
    if trainer_pod.node_selector:
        pod["nodeSelector"] = dict(trainer_pod.node_selector)
    if trainer_pod.tolerations:
        pod["tolerations"] = [
            {k: v for k, v in (("key", t.key), ("operator", t.operator), ("value", t.value), ("effect", t.effect)) if v}
            for t in trainer_pod.tolerations
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": SAMPLER, "namespace": NAMESPACE, "labels": dict(labels)},
        "spec": {
            "replicas": spec.samplers.replicas,
            # replace one replica at a time, never two servers more on the device than the run has
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "selector": {"matchLabels": {"app.kubernetes.io/name": SAMPLER}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def shared_device_path(pipeline: str | Path) -> Path:
    """Where the shared device's manifests go beside `pipeline`: rl.yaml -> rl.shared-device.yaml."""
    pipeline = Path(pipeline)
    return pipeline.with_name(f"{pipeline.stem}.shared-device.yaml")


def write_shared_device(spec: RunSpec, pipeline: str | Path, run_root: str) -> Path:
    """Write the ResourceClaim and the samplers' Deployment beside `pipeline` (`kubectl apply -f` it)."""
    claim = device_claim(spec)
    path = shared_device_path(pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    request = claim["spec"]["devices"]["requests"][0]["exactly"]
    header = (
        f"# The device run {spec.name} shares, ResourceClaim {claim['metadata']['name']} ({request['count']} x "
        f"{request['deviceClassName']}), and the samplers on it,\n# written by `rlpipe compile`. Needs DRA "
        "(resource.k8s.io/v1: Kubernetes 1.34+) and a DRA driver serving the class.\n"
        f"# Apply it after manifests/ and before the trainer: kubectl apply -f {path.name}\n"
    )
    docs = [claim, sampler_deployment(spec, run_root)]
    path.write_text(header + yaml.safe_dump_all(docs, sort_keys=False))
    return path
