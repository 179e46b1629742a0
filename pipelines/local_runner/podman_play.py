"""The manifests' services on one machine: the MLflow server (manifests/base/mlflow.yaml), the vLLM
sampler (manifests/base/sampler.yaml) and the resident trainer (the JobSet pod `rlpipe compile` writes,
pipelines/trainer_jobset.py), as one YAML file that `podman kube play` runs, for a run whose steps run
on the host (`rlpipe run SPEC --set trainer.endpoint=... --set tracking.uri=...`).

    python -m rlpipe.pipelines.local_runner.podman_play SPEC -o play.yaml --run-root DIR --mlflow-data DIR \\
        --mlflow-image localhost/rlpipe/mlflow:3.17.2
    podman kube play play.yaml ... podman kube down play.yaml

Each pod keeps its manifest's image, command, args, env, resources and securityContext (non-root uid/gid
1000, seccomp RuntimeDefault, all capabilities dropped, no privilege escalation, read-only root with
the emptyDirs), and runs on the host network, each service on its own port. The run root is a hostPath
mounted at the host's own path (read-write for the trainer, read-only for the sampler), since the steps
and the trainer name files by their paths; MLflow's PVC becomes a hostPath. Both must be writable by
uid 1000. The mlflow-config ConfigMap (base/kustomization.yaml's generator) goes in the same file.

What does not map to podman kube play (podman 4.3), and is left out or changed:
- Services (mlflow, rlpipe-sampler, the headless rlpipe-sampler-pods, the trainer's) and DNS: pods
  reach each other on 127.0.0.1 and the ports given here. `ports` are dropped (podman refuses port
  mappings with the host network).
- Deployments and the JobSet as such: each becomes one Pod (restartPolicy Always for a Deployment,
  OnFailure for the JobSet's pod, whose failurePolicy restarts the node); replicas, rollout strategy,
  Indexed Jobs and the JobSet's headless Service are gone. The trainer is one node (trainer.nodes 1):
  torchrun meets itself at 127.0.0.1 and PET_NODE_RANK is 0. One sampler pod per samplers.replicas,
  on consecutive ports.
- Probes: podman runs a livenessProbe as a `curl` healthcheck inside the container (the images have
  no curl) on systemd timers, and ignores readiness and startup probes; all are dropped, wait for
  /health from outside.
- PVCs and their storage classes and access modes: hostPath volumes. emptyDirs become named volumes
  (`<pod>-<volume>`, removed by `podman kube down`; sizeLimit is ignored). podman has no memory-backed
  emptyDir (a named volume at /dev/shm is root-owned) and its own /dev/shm is 64 MiB, less than vLLM's
  CPU engine needs (160 MiB): medium Memory becomes a hostPath to the host's /dev/shm, shared with it.
- GPUs: podman kube play gives none from resources (`podman run --device nvidia.com/gpu=all`, CDI,
  does); cpu=True drops the nvidia.com/gpu (cluster.trainer.accelerator) requests and gives the
  sampler vllm-cpu's environment (its entrypoint adds vllm-cpu's flags itself). A DRA ResourceClaim
  (sharing.claim) is dropped from the pods and their containers: podman has no DRA.
- Node selectors and tolerations: dropped (one machine). Secrets (cluster.secrets) stay secretKeyRefs,
  which podman resolves from `podman secret create NAME`.
- ServiceAccounts, automountServiceAccountToken, fsGroup(ChangePolicy): ignored (no API server, no
  tokens; a hostPath keeps its host owner). RBAC, NetworkPolicies, the Namespace's Pod Security labels,
  Kueue (ResourceFlavors, queues, the queue-name label) and RuntimeClasses have no podman counterpart
  and are not in the output.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from rlpipe.engines.vllm_settings import VLLM_CPU_ENV, cpu_kv_cache
from rlpipe.pipelines.trainer_jobset import PORT as TRAINER_PORT
from rlpipe.pipelines.trainer_jobset import RENDEZVOUS_PORT, trainer_manifests, trainer_name
from rlpipe.spec import RunSpec, load_spec

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "base"
MLFLOW_PORT, SAMPLER_PORT = 5000, 8000


def manifest(kind: str, name: str, manifests: Path = MANIFESTS) -> dict[str, Any]:
    """The object `kind`/`name` from the YAML files in `manifests`."""
    for path in sorted(manifests.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind and doc["metadata"]["name"] == name:
                return doc
    raise LookupError(f"no {kind} {name} in {manifests}")


def config_maps(manifests: Path = MANIFESTS) -> list[dict[str, Any]]:
    """The ConfigMaps kustomization.yaml's configMapGenerator makes (literals only, no hash suffix)."""
    kustomization = yaml.safe_load((manifests / "kustomization.yaml").read_text())
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": dict(literal.split("=", 1) for literal in generator.get("literals", [])),
        }
        for generator in kustomization.get("configMapGenerator", [])
    ]


def with_flag(items: list[str], flag: str, value: Any) -> list[str]:
    """`items` with `flag=...` (or `flag ...`) set to `value`, appended when absent."""
    items = [item for item in items if not item.startswith(f"{flag}=")]
    if flag in items:
        del items[items.index(flag) : items.index(flag) + 2]
    return [*items, f"{flag}={value}"]


def host_path(name: str, path: str, mount_path: str | None = None, read_only: bool = False) -> tuple[dict, dict]:
    """A hostPath volume and its mount: the host's `path`, at the same path unless `mount_path`."""
    mount = {"name": name, "mountPath": mount_path or path} | ({"readOnly": True} if read_only else {})
    return {"name": name, "hostPath": {"path": path, "type": "Directory"}}, mount


def play_pod(
    name: str,
    template: dict[str, Any],
    restart: str,
    host_paths: list[tuple[dict, dict]],
    images: dict[str, str],
    drop_resources: set[str],
) -> dict[str, Any]:
    """A Pod from a pod template, on the host network, without ports and probes: its PVCs replaced by
    `host_paths` (host_path's), each emptyDir a volume named after the pod, a memory-backed one the
    host's /dev/shm."""
    spec = copy.deepcopy(template["spec"])
    claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    renamed = {v["name"]: f"{name}-{v['name']}" for v in spec.get("volumes", []) if v["name"] not in claims}
    volumes = []
    for volume in spec.get("volumes", []):
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            volume = {"name": volume["name"], "hostPath": {"path": "/dev/shm", "type": "Directory"}}
        if volume["name"] in renamed:
            volumes.append(volume | {"name": renamed[volume["name"]]})
    spec["volumes"] = volumes + [volume for volume, _ in host_paths]
    for container in spec["containers"]:
        container["image"] = images.get(container["image"], container["image"])
        for key in ("ports", "livenessProbe", "readinessProbe", "startupProbe"):  # see the module's docstring
            container.pop(key, None)
        resources = container.get("resources", {})
        resources.pop("claims", None)  # a DRA claim (sharing.claim): podman has no DRA; see the module's docstring
        for key, bound in list(resources.items()):
            resources[key] = {resource: value for resource, value in bound.items() if resource not in drop_resources}
            if not resources[key]:
                del resources[key]
        mounts = [m | {"name": renamed[m["name"]]} for m in container.get("volumeMounts", []) if m["name"] in renamed]
        container["volumeMounts"] = mounts + [mount for _, mount in host_paths]
    for key in ("nodeSelector", "tolerations", "resourceClaims"):
        spec.pop(key, None)
    spec |= {"hostNetwork": True, "restartPolicy": restart}
    labels = template.get("metadata", {}).get("labels", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def url_port(url: str | None, default: int) -> int:
    """The port of `url` (a spec endpoint), else `default`."""
    return (urlsplit(url).port if url and "://" in url else None) or default


def play_manifests(
    spec: RunSpec,
    run_root: str,
    mlflow_data: str,
    *,
    mlflow_port: int | None = None,
    sampler_port: int | None = None,
    trainer_port: int | None = None,
    rendezvous_port: int = RENDEZVOUS_PORT,
    images: dict[str, str] | None = None,
    cpu: bool = True,
    prefix: str = "",
    manifests: Path = MANIFESTS,
) -> list[dict[str, Any]]:
    """The documents `podman kube play` runs: the ConfigMaps, the MLflow pod, the sampler pods
    (rollout.engine sampler) and the resident trainer's pod (trainer.resident). Ports default to the
    spec's tracking.uri, samplers.endpoints and trainer.endpoint, else the manifests'."""
    images = images or {}
    mlflow_port = mlflow_port or url_port(spec.tracking.uri, MLFLOW_PORT)
    sampler_port = sampler_port or url_port(next(iter(spec.samplers.endpoints), None), SAMPLER_PORT)
    trainer_port = trainer_port or url_port(spec.trainer.endpoint, TRAINER_PORT)
    gpus = {"nvidia.com/gpu", spec.cluster.trainer.accelerator} if cpu else set()
    samplers = spec.samplers.replicas if spec.rollout.engine == "sampler" else 0
    ports = [mlflow_port, *range(sampler_port, sampler_port + samplers)]
    ports += [trainer_port, rendezvous_port] if spec.trainer.resident else []
    if len(set(ports)) < len(ports):  # one host network
        raise ValueError(f"ports {ports} (mlflow, samplers, trainer, rendezvous) must differ on the host network")
    docs = config_maps(manifests)

    mlflow = manifest("Deployment", "mlflow", manifests)["spec"]["template"]
    data = host_path("mlflow-data", mlflow_data, "/mlflow")  # the PVC, at the manifest's path
    pod = play_pod(f"{prefix}mlflow", mlflow, "Always", [data], images, gpus)
    server = pod["spec"]["containers"][0]
    server["args"] = with_flag(server["args"], "--port", mlflow_port)
    docs.append(pod)

    cache_root = spec.cache_root
    shared = [host_path("run-root", run_root)]  # the PVC, read-write, at the steps' paths
    if not Path(cache_root).is_relative_to(run_root):  # the trainer's requests name the steps' cache too
        shared.append(host_path("cache-root", cache_root))

    if samplers:
        sampler = manifest("Deployment", "rlpipe-sampler", manifests)["spec"]["template"]
        for replica in range(samplers):
            weights = host_path("run-root", run_root, read_only=True)  # the PVC, read-only
            pod = play_pod(f"{prefix}rlpipe-sampler-{replica}", sampler, "Always", [weights], images, gpus)
            server = pod["spec"]["containers"][0]
            server["args"] = with_flag(server["args"], "--port", sampler_port + replica)
            env = {item["name"]: item for item in server["env"]} | {
                "RLPIPE_RUN_ROOT": {"name": "RLPIPE_RUN_ROOT", "value": run_root}
            }
            if cpu:  # LocalFleet's vllm-cpu environment; the entrypoint adds its flags (VLLM_CPU_SERVER_ARGS)
                extra = VLLM_CPU_ENV | cpu_kv_cache(spec.samplers.kv_cache_gib)
                env |= {key: {"name": key, "value": value} for key, value in extra.items()}
            server["env"] = list(env.values())
            server["args"] += spec.samplers.extra_args
            docs.append(pod)

    if spec.trainer.resident:
        if spec.trainer.nodes != 1:
            raise ValueError(f"trainer.nodes {spec.trainer.nodes}: podman kube play runs the trainer on one node")
        jobset = trainer_manifests(spec)[0]
        template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        pod = play_pod(f"{prefix}{trainer_name(spec)}", template, "OnFailure", shared, images, gpus)
        trainer = pod["spec"]["containers"][0]
        trainer["command"] = with_flag(trainer["command"], "--master-addr", "127.0.0.1")
        trainer["command"] = with_flag(trainer["command"], "--master-port", rendezvous_port)
        trainer["args"] = with_flag(trainer["args"], "--port", trainer_port)
        trainer["env"] = [
            {"name": "PET_NODE_RANK", "value": "0"} if item["name"] == "PET_NODE_RANK" else item
            for item in trainer["env"]
        ]
        docs.append(pod)
    return docs


def write_play(docs: list[dict[str, Any]], path: str | Path) -> Path:
    """Write `docs` as one multi-document YAML file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# podman kube play this file (pipelines/local_runner/podman_play.py wrote it from manifests/)\n"
    path.write_text(header + yaml.safe_dump_all(docs, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="run spec YAML")
    parser.add_argument("-o", "--output", default="play.yaml")
    parser.add_argument("--run-root", help="the run root on the host (default <storage.root>/<name>)")
    parser.add_argument("--mlflow-data", help="MLflow's database and artifacts (default <run root>/../mlflow)")
    parser.add_argument("--mlflow-image", help="instead of the manifest's ghcr.io/mlflow/mlflow image")
    parser.add_argument("--image", action="append", default=[], metavar="OLD=NEW", help="replace an image")
    parser.add_argument("--mlflow-port", type=int)
    parser.add_argument("--sampler-port", type=int)
    parser.add_argument("--trainer-port", type=int)
    parser.add_argument("--rendezvous-port", type=int, default=RENDEZVOUS_PORT)
    parser.add_argument("--gpu", action="store_true", help="keep GPU requests, no vllm-cpu environment")
    parser.add_argument("--prefix", default="", help="prefix of the pods' names")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec, {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)})
    root = str(Path(spec.storage.root).resolve())
    spec = dataclasses.replace(spec, storage=dataclasses.replace(spec.storage, root=root))
    run_root = str(Path(args.run_root or Path(root) / spec.name).resolve())
    mlflow_data = str(Path(args.mlflow_data or Path(run_root).parent / "mlflow").resolve())
    images = dict(item.split("=", 1) for item in args.image)
    if args.mlflow_image:
        (server,) = manifest("Deployment", "mlflow")["spec"]["template"]["spec"]["containers"]
        images[server["image"]] = args.mlflow_image
    for directory in (run_root, mlflow_data, spec.cache_root):
        Path(directory).mkdir(parents=True, exist_ok=True)
    docs = play_manifests(
        spec, run_root, mlflow_data,
        mlflow_port=args.mlflow_port, sampler_port=args.sampler_port, trainer_port=args.trainer_port,
        rendezvous_port=args.rendezvous_port, images=images, cpu=not args.gpu, prefix=args.prefix,
    )  # fmt: skip
    path = write_play(docs, args.output)
    print(f"wrote {path}: {', '.join(d['metadata']['name'] for d in docs if d['kind'] == 'Pod')}")
    writable = " ".join(sorted({run_root, mlflow_data, spec.cache_root}))
    print(f"the pods run as uid 1000: make {writable} writable by it, then: podman kube play {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
