"""Cluster settings, applied in one place to every task: image, resources, GPUs, node pool,
tolerations, the shared-FS PVC, secrets as env by reference, retries, timeout, security. The pods'
security settings come from `security_context`, on every path: KFP tasks, Argo templates
(pipelines/argo_export.py) and the trainer JobSet (pipelines/trainer_jobset.py).

KFP's own task settings land in the PipelineSpec; kfp-kubernetes settings in the PlatformSpec.
The local runner ignores both, so `rlpipe run` builds the pipeline with cluster=None.

With sharing.enabled no task requests the accelerator (task_gpus): the device is the one ResourceClaim the resident
trainer and the samplers share (pipelines/shared_device.py), and KFP cannot give a task a pre-made claim. KFP 2.17
has no call for DRA claims at all; kfp-kubernetes' add_resource_claim (kubeflow/pipelines#14243, after 2.17) takes
ResourceClaimTemplates only, one claim per pod. So no task here ever needs that call, and none is made.
"""

from typing import Any

from kfp import dsl, kubernetes

from rlpipe.spec import ClusterSpec, RunSpec
from rlpipe.steps import BY_NAME, gpus_for, sandboxed, task_steps, uses_trainer_image

NAMESPACE = "rlpipe"  # manifests/base/namespace.yaml: the trainer's and the shared device's manifests
SANDBOX_LABEL = "rlpipe.dev/sandbox"  # selected by manifests/base/sandbox.yaml's NetworkPolicies
RUNTIME_CLASS_ANNOTATION = "rlpipe.dev/runtime-class"


def security_context(cluster: ClusterSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's and each container's securityContext (Kubernetes field names), for the `restricted`
    Pod Security profile: a non-root user and group, seccomp RuntimeDefault; no privilege escalation and
    no capabilities. On KFP, kfp-kubernetes sets the pod's user fields on each task and KFP 2.17's backend
    applies the container's (kfp.kubernetes.set_security_context: "Platform security defaults
    (allowPrivilegeEscalation=false, drop ALL capabilities, seccompProfile=RuntimeDefault) are enforced")."""
    pod = {
        "runAsNonRoot": True,
        "runAsUser": cluster.run_as_user,
        "runAsGroup": cluster.run_as_user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def task_gpus(step: str, spec: RunSpec) -> int:
    """GPUs the step's KFP task requests: gpus_for's, none with sharing.enabled (the trainer and the samplers
    share the device; a task could not reference their claim)."""
    return 0 if spec.sharing.enabled else gpus_for(step, spec)


def place(task: dsl.PipelineTask, step: str, spec: RunSpec | None) -> dsl.PipelineTask:
    """Configure `task` (the `step` component) for the cluster `spec` describes (None: the local
    runner); results are never cached: every step reads or changes run state."""
    task.set_caching_options(False)
    if spec is None:
        return task
    cluster = spec.cluster
    pod = cluster.trainer if uses_trainer_image(step, spec) else cluster.step
    task.set_container_image(pod.image)
    task.set_cpu_request(pod.cpu).set_memory_request(pod.memory)
    if pod.cpu_limit:
        task.set_cpu_limit(pod.cpu_limit)
    if pod.memory_limit:
        task.set_memory_limit(pod.memory_limit)
    if gpus := task_gpus(step, spec):
        task.set_accelerator_type(pod.accelerator).set_accelerator_limit(gpus)
    for label, value in pod.node_selector.items():
        kubernetes.add_node_selector(task, label, value)
    for toleration in pod.tolerations:
        kubernetes.add_toleration(
            task, key=toleration.key, operator=toleration.operator, value=toleration.value, effect=toleration.effect
        )
    kubernetes.set_timeout(task, pod.timeout_s)
    if cluster.pvc and BY_NAME[step].run_root:
        kubernetes.mount_pvc(task, pvc_name=cluster.pvc, mount_path=cluster.mount_path)
    for secret in cluster.secrets:
        if secret.steps is None or set(task_steps(step, spec)) & set(secret.steps):
            kubernetes.use_secret_as_env(task, secret_name=secret.secret, secret_key_to_env={secret.key: secret.env})
    if cluster.retries:
        task.set_retry(cluster.retries, backoff_duration=cluster.retry_backoff)
    pod_security, _ = security_context(cluster)  # the container's: KFP's backend (security_context)
    kubernetes.set_security_context(
        task,
        run_as_user=pod_security["runAsUser"],
        run_as_group=pod_security["runAsGroup"],
        run_as_non_root=pod_security["runAsNonRoot"],
    )
    if sandboxed(step, spec):
        # KFP's PlatformSpec has no runtimeClassName (kubeflow/pipelines#8052): the pod carries it as an
        # annotation, which the cluster's admission policy applies (manifests/README.md, "Sandboxed
        # scoring"); the Argo export sets runtimeClassName itself.
        kubernetes.add_pod_label(task, SANDBOX_LABEL, "true")
        if cluster.sandbox_runtime_class:
            kubernetes.add_pod_annotation(task, RUNTIME_CLASS_ANNOTATION, cluster.sandbox_runtime_class)
    return task
