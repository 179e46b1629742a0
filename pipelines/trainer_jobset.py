"""The resident trainer on a cluster, derived from the spec: a JobSet (jobset.x-k8s.io/v1alpha2)
that runs `rlpipe.services.trainer.server` under torchrun on trainer.nodes nodes with trainer.gpus
processes each, and a Service that reaches rank 0's HTTP port (trainer.endpoint). `rlpipe compile`
writes both beside the pipeline when trainer.resident.

    pod <name>-node-0-0  torchrun --node-rank 0: global rank 0 serves HTTP :8001  <- Service <name>:8001
    pod <name>-node-0-i  torchrun --node-rank i, rendezvous at pod 0 (<name>-node-0-0.<name>-nodes:29500)

One Indexed Job of trainer.nodes pods, one per node: its completion index is the node rank, so
global rank 0 is always pod 0, which the Service selects. Every pod of the Job restarts together
(a torchrun job cannot take back one lost node): a pod that fails fails the Job, and the JobSet's
failure policy recreates all of them, as `rlpipe run` restarts the local trainer; the restarted
trainer reloads from the weight store. Why JobSet and not Kubeflow Trainer's TrainJob:
manifests/README.md ("The resident trainer on several GPUs and nodes"). With sharing.claim its pods reference the
ResourceClaim the samplers share instead of requesting GPUs (pipelines/shared_device.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from rlpipe.pipelines.cluster_settings import NAMESPACE, security_context
from rlpipe.pipelines.shared_device import container_resources, pod_claims
from rlpipe.services.local_servers import MAX_RESTARTS
from rlpipe.spec import RunSpec
from rlpipe.steps import STEP_NAMES, service_for

PORT = 8001
RENDEZVOUS_PORT = 29500
NODE_JOB = "node"  # the replicated Job's name, part of each pod's host name


def trainer_name(spec: RunSpec) -> str:
    """The JobSet's and the Service's name: a DNS label short enough for the pods' host names."""
    slug = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower())[:25].strip("-")
    return f"rlpipe-trainer-{slug}"


def trainer_url(spec: RunSpec) -> str:
    """trainer.endpoint for the generated Service."""
    return f"http://{trainer_name(spec)}.{NAMESPACE}.svc.cluster.local:{PORT}"


def node_hosts(spec: RunSpec) -> str:
    """JobSet's headless Service: pod i resolves as <name>-node-0-i.<hosts>."""
    return f"{trainer_name(spec)}-nodes"


def trainer_env(spec: RunSpec) -> list[dict[str, Any]]:
    """The trainer container's environment: its node rank, Hugging Face offline in /cache, and the
    secrets of the steps it computes."""
    env: list[dict[str, Any]] = [
        {  # torchrun reads each flag from PET_<FLAG> too: the node rank is the pod's completion index
            "name": "PET_NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
    ]
    served = {step for step in STEP_NAMES if service_for(step, spec) == "trainer"}  # the steps it computes
    env += [
        {"name": s.env, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
        for s in spec.cluster.secrets
        if s.steps is None or served & set(s.steps)
    ]
    return env


def trainer_container(spec: RunSpec) -> dict[str, Any]:
    """The container each node's pod runs: torchrun over `rlpipe.services.trainer.server`."""
    name, cluster, trainer = trainer_name(spec), spec.cluster, spec.trainer
    pod = cluster.trainer
    gpus = 0 if trainer.device == "cpu" else trainer.gpus  # per node; on CPU, trainer.gpus gloo processes
    limits = {key: value for key, value in (("cpu", pod.cpu_limit), ("memory", pod.memory_limit)) if value}
    # gpus of cluster.trainer.accelerator, or with sharing.claim the claim the samplers share
    resources = container_resources(spec, {"cpu": pod.cpu, "memory": pod.memory}, limits, gpus)
    torchrun = ["python3", "-m", "torch.distributed.run", f"--nnodes={trainer.nodes}"]
    torchrun += [f"--nproc-per-node={trainer.gpus}", f"--master-addr={name}-{NODE_JOB}-0-0.{node_hosts(spec)}"]
    torchrun += [f"--master-port={RENDEZVOUS_PORT}", "--max-restarts=0"]  # restarts: the JobSet's, all nodes at once
    serve = ["-m", "rlpipe.services.trainer.server", "--host=0.0.0.0", f"--port={PORT}", f"--device={trainer.device}"]
    mounts = [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}]
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})  # NCCL's shared memory: more than the 64 MiB default
    if cluster.pvc:  # the weight store: read-write, where the steps mount it (it stages v(N+1))
        mounts.append({"name": "weights", "mountPath": cluster.mount_path})
    _, container_security = security_context(cluster)
    return {
        "name": "trainer",
        "image": pod.image,
        "command": torchrun,
        "args": serve,
        "env": trainer_env(spec),
        # no probes: only node 0 serves HTTP, and the steps wait for its /health themselves
        "ports": [
            {"name": "http", "containerPort": PORT},
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
        ],
        "resources": resources,
        "securityContext": container_security | {"readOnlyRootFilesystem": True},
        "volumeMounts": mounts,
    }


def trainer_pod_spec(spec: RunSpec) -> dict[str, Any]:
    """The pod spec of every node: the trainer container, its volumes, where it may be scheduled."""
    cluster = spec.cluster
    pod = cluster.trainer
    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
    ]
    if cluster.pvc:
        volumes.append({"name": "weights", "persistentVolumeClaim": {"claimName": cluster.pvc}})
    pod_security, _ = security_context(cluster)
    containers = [trainer_container(spec)]
    pod_spec = {
        "restartPolicy": "Never",  # a failed pod fails the Job; the JobSet then restarts every node
        "serviceAccountName": "rlpipe-trainer",
        "automountServiceAccountToken": False,  # the trainer never calls the Kubernetes API
        "terminationGracePeriodSeconds": 30,
        "securityContext": pod_security | {"fsGroup": cluster.run_as_user, "fsGroupChangePolicy": "OnRootMismatch"},
        "containers": containers,
        "volumes": volumes,
    } | pod_claims(spec, containers)
    if pod.node_selector:
        pod_spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        pod_spec["tolerations"] = [
            {k: v for k, v in (("key", t.key), ("operator", t.operator), ("value", t.value), ("effect", t.effect)) if v}
            for t in pod.tolerations
        ]
    return pod_spec


def trainer_manifests(spec: RunSpec) -> list[dict[str, Any]]:
    """The JobSet and the Service for the spec's resident trainer."""
    name, trainer = trainer_name(spec), spec.trainer
    labels = {
        "app.kubernetes.io/name": "rlpipe-trainer",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/part-of": "rlpipe",
    }
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            # Kueue admits the whole JobSet at once (every node's GPUs, or none) from the rlpipe queue
            "labels": labels | {"kueue.x-k8s.io/queue-name": "rlpipe"},
        },
        "spec": {
            "failurePolicy": {"maxRestarts": MAX_RESTARTS},
            "network": {"enableDNSHostnames": True, "subdomain": node_hosts(spec), "publishNotReadyAddresses": True},
            "replicatedJobs": [
                {
                    "name": NODE_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": trainer.nodes,
                            "completions": trainer.nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": labels}, "spec": trainer_pod_spec(spec)},
                        }
                    },
                }
            ],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "selector": {"jobset.sigs.k8s.io/jobset-name": name, "batch.kubernetes.io/job-completion-index": "0"},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http"}],
        },
    }
    return [jobset, service]


def trainer_path(pipeline: str | Path) -> Path:
    """Where the trainer's manifests go beside `pipeline`: rl.yaml -> rl.trainer.yaml."""
    pipeline = Path(pipeline)
    return pipeline.with_name(f"{pipeline.stem}.trainer.yaml")


def write_trainer(spec: RunSpec, pipeline: str | Path) -> Path:
    """Write the resident trainer's JobSet and Service beside `pipeline` (`kubectl apply -f` it)."""
    path = trainer_path(pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# The resident trainer of run {spec.name}: {spec.trainer.nodes} node(s) x {spec.trainer.gpus} "
        f"process(es), written by `rlpipe compile`. Needs JobSet (jobset.x-k8s.io) in the cluster;\n"
        f"# apply it before the pipeline runs: kubectl apply -f {path.name}\n"
    )
    path.write_text(header + yaml.safe_dump_all(trainer_manifests(spec), sort_keys=False))
    return path
