"""sharing.claim on a cluster: `rlpipe compile` writes one ResourceClaim beside the pipeline, and the resident
trainer's JobSet and the samplers' Deployment reference it instead of requesting GPUs; no KFP task requests one.
Checked offline: the Kubernetes 1.34 schemas (kubernetes-validate, strict), JobSet's CRD schema, and every
reference resolved; bad input is refused by the real CLI with one line that names the key."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, RLPIPE, strict_schema

K8S_VERSION = "1.34.0"  # resource.k8s.io/v1 is GA from 1.34
JOBSET_SCHEMA = REPO / "tests" / "fixtures" / "jobset-v0.12.0-v1alpha2.schema.json"
ENDPOINTS = ["http://rlpipe-sampler-pods.rlpipe.svc.cluster.local:8000"]
SELECTOR = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'
CLAIM = {"device_class": "gpu.nvidia.com", "selector": SELECTOR}


def _spec_file(tmp_path: Path, example: str = "addition.yaml", **changes) -> Path:
    """examples/<example> with a resident trainer, samplers on the cluster and the sharing section, plus `changes`."""
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data["trainer"]["resident"] = True
    data["rollout"]["engine"] = "sampler"
    data["samplers"] = {"endpoints": ENDPOINTS}
    data["cluster"] = {**data.get("cluster", {}), "pvc": "rlpipe-weights"}
    data["sharing"] = {"enabled": True, "claim": CLAIM}
    data.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _compile(spec: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [*RLPIPE, "compile", str(spec), "-o", str(out), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """The demo with sharing compiled once: its stdout and each file's documents."""
    tmp = tmp_path_factory.mktemp("shared")
    done = _compile(_spec_file(tmp), tmp / "rl.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    docs = {name: list(yaml.safe_load_all((tmp / name).read_text())) for name in ("rl.yaml", "rl.trainer.yaml")}
    docs["rl.shared-device.yaml"] = list(yaml.safe_load_all((tmp / "rl.shared-device.yaml").read_text()))
    return {"stdout": done.stdout, **docs}


def _pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(kind/name, pod spec) of every workload in `docs`: Deployments and JobSets' Jobs."""
    pods = []
    for doc in docs:
        ident = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Deployment":
            pods.append((ident, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "JobSet":
            pods += [(ident, job["template"]["spec"]["template"]["spec"]) for job in doc["spec"]["replicatedJobs"]]
    return pods


def test_the_claim_validates_and_holds_the_spec(compiled):
    import kubernetes_validate

    claim, deployment = compiled["rl.shared-device.yaml"]
    assert kubernetes_validate.validate(claim, K8S_VERSION, strict=True) == "1.34"
    assert claim["kind"] == "ResourceClaim" and claim["apiVersion"] == "resource.k8s.io/v1"
    assert claim["metadata"] == {
        "name": "rlpipe-shared-device",
        "namespace": "rlpipe",
        "labels": {"app.kubernetes.io/part-of": "rlpipe"},
    }
    assert claim["spec"]["devices"]["requests"] == [
        {
            "name": "device",
            "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": SELECTOR}}],
            },
        }
    ]
    assert "rl.shared-device.yaml: ResourceClaim rlpipe-shared-device (1 x gpu.nvidia.com)" in compiled["stdout"]
    # warm_start's SFT runs in a KFP task of its own, which cannot use the claim: compile says so
    assert "compute on the CPU: warm_start" in compiled["stdout"]


def test_the_pods_validate_and_every_claim_resolves(compiled):
    """The Deployment (1.34, strict) and the JobSet (its CRD schema; its Job 1.34, strict): each pod's
    resourceClaims name a ResourceClaim written beside it, each container's claims a pod entry, and no pod that
    references the claim requests the accelerator as well."""
    import jsonschema
    import kubernetes_validate

    claims, deployment = compiled["rl.shared-device.yaml"]
    jobset, _service = compiled["rl.trainer.yaml"]
    assert kubernetes_validate.validate(deployment, K8S_VERSION, strict=True) == "1.34"
    jsonschema.validate(jobset, strict_schema(json.loads(JOBSET_SCHEMA.read_text())))
    for job in jobset["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(
            {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job["template"]["spec"]},
            K8S_VERSION,
            strict=True,
        )
    written = {
        (doc["metadata"]["namespace"], doc["metadata"]["name"])
        for docs in compiled.values()
        if isinstance(docs, list)
        for doc in docs
        if doc and doc.get("kind") == "ResourceClaim"
    }
    pods = _pod_templates([deployment, jobset])
    assert [ident for ident, _ in pods] == ["Deployment/rlpipe-sampler", f"JobSet/{jobset['metadata']['name']}"]
    for (ident, pod), namespace in zip(pods, (deployment["metadata"]["namespace"], jobset["metadata"]["namespace"])):
        entries = {entry["name"]: entry for entry in pod.get("resourceClaims", [])}
        assert entries, f"{ident} references no claim"
        for entry in entries.values():
            assert (namespace, entry["resourceClaimName"]) in written, f"{ident}: {entry} names no claim written"
        for container in pod["containers"]:
            resources = container["resources"]
            assert resources.get("claims"), f"{ident} {container['name']} uses no claim"
            assert {claim["name"] for claim in resources["claims"]} <= set(entries), ident
            requested = set(resources.get("requests", {})) | set(resources.get("limits", {}))
            assert not {key for key in requested if "gpu" in key}, f"{ident} requests {requested} besides the claim"
    assert claims["metadata"]["name"] == "rlpipe-shared-device"


def test_podman_play_drops_the_claim(compiled):
    """`rlpipe podman-play` (pipelines/local_runner/podman_play.py) plays the samplers of a spec with sharing.claim:
    podman has no DRA, so the pod and its containers lose the claim and keep everything else."""
    from rlpipe.pipelines.local_runner.podman_play import play_pod

    _claims, deployment = compiled["rl.shared-device.yaml"]
    pod = play_pod("sampler-0", deployment["spec"]["template"], "Always", [], {}, {"nvidia.com/gpu"})
    assert "resourceClaims" not in pod["spec"]
    for container in pod["spec"]["containers"]:
        assert "claims" not in container.get("resources", {}), container["resources"]
    assert pod["spec"]["containers"][0]["args"] == deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_no_kfp_task_requests_the_accelerator(compiled):
    """The device users are the trainer and the samplers: KFP cannot give a task the pre-made claim."""
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    pipeline, platform = compiled["rl.yaml"]
    json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
    executors = pipeline["deploymentSpec"]["executors"]
    assert "exec-warm-start" in executors  # the one trainer-image task, which would otherwise request a GPU
    for name, executor in executors.items():
        assert "accelerator" not in executor["container"].get("resources", {}), name


def test_samplers_are_the_base_manifest_on_the_claim(tmp_path: Path):
    """The Deployment compile writes is manifests/base/sampler.yaml's but for what the spec sets (image, replicas,
    run root, PVC), the device and vLLM's sleep mode: the base's Services select it, its ServiceAccount runs it.
    Its pods go where the trainer's do (the claim's node is the one node both run on)."""
    from rlpipe.pipelines.shared_device import sampler_deployment
    from rlpipe.spec import load_spec

    spec = load_spec(_spec_file(tmp_path, "addition-gke.yaml"), {"samplers.replicas": 3})
    ours = sampler_deployment(spec, "/mnt/rlpipe/runs/addition-demo-x")
    base_docs = list(yaml.safe_load_all((REPO / "manifests" / "base" / "sampler.yaml").read_text()))
    base = next(d for d in base_docs if d["kind"] == "Deployment")
    assert ours["metadata"]["name"] == base["metadata"]["name"] and ours["spec"]["replicas"] == 3
    assert ours["spec"]["selector"] == base["spec"]["selector"] and ours["spec"]["strategy"] == base["spec"]["strategy"]
    labels = ours["spec"]["template"]["metadata"]["labels"]
    for service in (d for d in base_docs if d["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items(), service["metadata"]["name"]
    pod, base_pod = ours["spec"]["template"]["spec"], base["spec"]["template"]["spec"]
    for key in ("serviceAccountName", "automountServiceAccountToken", "terminationGracePeriodSeconds"):
        assert pod[key] == base_pod[key], key
    assert pod["securityContext"] == base_pod["securityContext"]
    (c,), (b,) = pod["containers"], base_pod["containers"]
    assert c["image"] == spec.cluster.sampler_image
    for key in ("name", "command", "ports", "readinessProbe", "securityContext", "volumeMounts"):
        assert c[key] == b[key], key
    assert c["args"] == [*b["args"], "--enable-sleep-mode"]  # /sleep frees the device only with it
    run_root = {"name": "RLPIPE_RUN_ROOT", "value": "/mnt/rlpipe/runs/addition-demo-x"}
    assert c["env"] == [run_root if e["name"] == "RLPIPE_RUN_ROOT" else e for e in b["env"]]
    gpu = spec.cluster.trainer.accelerator
    for kind in ("requests", "limits"):
        assert c["resources"][kind] == {k: v for k, v in b["resources"][kind].items() if k != gpu}, kind
    assert c["resources"]["claims"] == [{"name": "device"}]
    assert pod["volumes"] == base_pod["volumes"]  # the PVC: cluster.pvc, rlpipe-weights as in the base
    trainer = spec.cluster.trainer
    assert pod["nodeSelector"] == trainer.node_selector == {"cloud.google.com/gke-nodepool": "trainer-pool"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_the_overlay_claim_is_the_default_one(tmp_path: Path):
    """manifests/overlays/shared-device's ResourceClaim is what compile writes for sharing.claim's defaults and
    a device class alone (tests/test_manifests.py renders and validates the overlay)."""
    from rlpipe.pipelines.shared_device import device_claim
    from rlpipe.spec import load_spec

    path = REPO / "manifests" / "overlays" / "shared-device" / "resourceclaim.yaml"
    overlay = yaml.safe_load(path.read_text())
    spec = load_spec(_spec_file(tmp_path, sharing={"enabled": True, "claim": {"device_class": "gpu.nvidia.com"}}))
    ours = device_claim(spec)
    assert overlay["metadata"] == {k: v for k, v in ours["metadata"].items() if k != "labels"}
    assert overlay["spec"] == ours["spec"]


def test_the_overlay_lets_the_pipeline_pods_take_the_lease():
    """What rlpipe/sharing/kubernetes_lease.py calls (read, create, replace a Lease) is what the overlay's Role
    grants the pipeline pods' ServiceAccount, and nothing more."""
    import re

    path = REPO / "manifests" / "overlays" / "shared-device" / "lease-role.yaml"
    role, binding = yaml.safe_load_all(path.read_text())
    calls = set(re.findall(r"api\.(\w+)_namespaced_lease", (REPO / "rlpipe/sharing/kubernetes_lease.py").read_text()))
    verbs = {"read": "get", "create": "create", "replace": "update"}
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
    assert calls == set(verbs) and set(rule["verbs"]) == {verbs[c] for c in calls}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "rlpipe-pipeline-runner"  # the KFP pods' (manifests/base/rbac.yaml)
    assert "lease-role.yaml" in (path.parent / "kustomization.yaml").read_text()


BAD = {
    "a selector that is not CEL": (
        {"sharing": {"enabled": True, "claim": {"device_class": "gpu.nvidia.com", "selector": "device.attributes["}}},
        (),
        "sharing.claim.selector 'device.attributes[' is not a CEL expression",
    ),
    "sharing without a claim": (
        {"sharing": {"enabled": True}},
        (),
        "sharing.enabled on a cluster needs sharing.claim",
    ),
    "offline DPO": (
        {"algorithm": {"name": "dpo"}},
        (),
        "sharing.enabled: algorithm.name dpo trains in the pipeline's own KFP tasks",
    ),
}


def test_no_argo_template_requests_the_accelerator(tmp_path: Path):
    """`rlpipe compile --target argo` with sharing: like the KFP tasks, no step template requests a device."""
    out = tmp_path / "rl.yaml"
    done = _compile(_spec_file(tmp_path), out, "--target", "argo")
    assert done.returncode == 0, done.stdout + done.stderr
    templates = [t for doc in yaml.safe_load_all(out.read_text()) for t in doc["spec"].get("templates", [])]
    requested = {key for t in templates if "container" in t for key in t["container"]["resources"]["requests"]}
    assert templates and requested == {"cpu", "memory"}, requested
    assert (tmp_path / "rl.shared-device.yaml").exists() and (tmp_path / "rl.trainer.yaml").exists()


def test_per_step_device_steps_are_refused_naming_what_kfp_offers(tmp_path: Path):
    """Sharing with the update as a KFP task of its own (trainer.resident false): refused when the spec is read,
    naming why no KFP version can give a task the shared claim."""
    from rlpipe.spec import SpecError, load_spec

    with pytest.raises(SpecError) as refused:
        load_spec(_spec_file(tmp_path), {"trainer.resident": False})
    said = str(refused.value)
    assert "sharing.enabled needs trainer.resident: true" in said and "KFP 2.17, installed, has no DRA call" in said
    assert "kfp.kubernetes.add_resource_claim takes claim templates only" in said


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_in_one_line(tmp_path: Path, case: str):
    changes, args, message = BAD[case]
    out = tmp_path / "rl.yaml"
    started = time.monotonic()
    done = _compile(_spec_file(tmp_path, **changes), out, *args)
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("rlpipe: ") and message in done.stderr, done.stderr
    assert not list(tmp_path.glob("rl*.yaml")), "nothing is written for a refused spec"
