"""The kustomize base and overlays under manifests/: built with `kubectl kustomize` (offline) and
checked against the Kubernetes 1.32 OpenAPI schemas (kubernetes-validate, strict: unknown fields
fail), the Pod Security `restricted` profile, and what rlpipe needs from each piece."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import RLPIPE, strict_schema

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
NAMESPACE = "rlpipe"
K8S_VERSION = "1.32.0"  # kubernetes-validate bundles v1.32.0 schemas (see test_core_kinds_match_k8s_schema)
DRA_K8S_VERSION = "1.34.0"  # resource.k8s.io/v1 (the shared-device overlay's ResourceClaim) is GA from 1.34

BUILDS = {
    "base": "base",
    "dev": "overlays/dev",
    "gke": "overlays/gke",
    "gke-lustre": "overlays/gke-lustre",
    "shared-device": "overlays/shared-device",
}
WEIGHTS_STORAGE_CLASS = {
    "base": None,
    "dev": "nfs-client",
    "gke": "standard-rwx",
    "gke-lustre": "lustre",
    "shared-device": None,
}
GKE_BUILDS = ("gke", "gke-lustre")

# API groups validated against the bundled Kubernetes schemas; everything else must be a CRD group
# listed here, so no new kind slips through unvalidated.
CORE_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "networking.k8s.io",
    "node.k8s.io",  # RuntimeClass (gVisor for sandboxed scoring)
    "scheduling.k8s.io",
    "resource.k8s.io",  # ResourceClaim (the shared-device overlay), validated at DRA_K8S_VERSION
}
CRD_GROUPS = {"kueue.x-k8s.io"}
CLUSTER_SCOPED = {
    "Namespace",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "ResourceFlavor",
    "ClusterQueue",
    "RuntimeClass",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}
# volume types the `restricted` Pod Security profile allows
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
CREDENTIAL_IN_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@", re.IGNORECASE)
SECRETISH_ENV = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|API_KEY|ACCESS_KEY|BACKEND_STORE_URI", re.IGNORECASE)


@functools.cache
def _build(name: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not on PATH")
    out = subprocess.run(
        [kubectl, "kustomize", str(MANIFESTS / BUILDS[name])], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {BUILDS[name]} failed:\n{out.stderr}"
    docs = tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)
    assert docs, f"kubectl kustomize {BUILDS[name]} produced no objects"
    return docs


@pytest.fixture(params=list(BUILDS), ids=list(BUILDS))
def build(request) -> tuple[str, tuple[dict, ...]]:
    return request.param, _build(request.param)


def _group(doc: dict) -> str:
    api_version = doc["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def _find(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_spec(doc: dict) -> dict:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def _pod_labels(doc: dict) -> dict:
    if doc["kind"] == "Pod":
        return doc["metadata"].get("labels", {})
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["metadata"].get("labels", {})
    return doc["spec"]["template"]["metadata"].get("labels", {})


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _container(doc: dict, name: str) -> dict:
    found = [c for c in _pod_spec(doc)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{doc['kind']}/{doc['metadata']['name']} has no single container {name!r}"
    return found[0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _flags(argv: list[str]) -> dict[str, str | None]:
    """`--key=value` and `--key value` flags of a command line."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            key, value = arg.split("=", 1)
            flags[key] = value
        else:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags[arg] = nxt if nxt is not None and not nxt.startswith("--") else None
    return flags


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"probe port {port!r} is not a named port of {container['name']}"
    return named[port]


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


# -- structure and schemas ----------------------------------------------------------------------


def test_core_kinds_match_k8s_schema(build):
    import kubernetes_validate  # the test extra; bundles schemas for 1.25 .. 1.37, v1.32.0 included

    name, docs = build
    for doc in docs:
        ident = f"{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), ident
        group = _group(doc)
        if group in CRD_GROUPS:
            continue  # CRDs: no bundled schema; their shape is checked by the Kueue test below
        assert group in CORE_GROUPS, f"{ident}: API group {group!r} is neither a core group nor a known CRD group"
        version = DRA_K8S_VERSION if group == "resource.k8s.io" else K8S_VERSION
        try:
            validated = kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{ident} is not a valid {version} object at {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            pytest.fail(f"{ident}: {err.message}")
        minor = version.rsplit(".", 1)[0]
        assert validated == minor, f"{ident} validated against {validated}, not the bundled {minor} schemas"


def test_names_namespaces_and_common_labels(build):
    name, docs = build
    seen = set()
    for doc in docs:
        meta = doc["metadata"]
        ident = f"{name}: {doc['kind']}/{meta['name']}"
        assert (doc["kind"], meta.get("namespace"), meta["name"]) not in seen, f"{ident} appears twice"
        seen.add((doc["kind"], meta.get("namespace"), meta["name"]))
        assert meta.get("labels", {}).get("app.kubernetes.io/part-of") == "rlpipe", ident
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta, f"{ident} is cluster-scoped but has a namespace"
        else:
            assert meta.get("namespace") == NAMESPACE, f"{ident} is not in namespace {NAMESPACE}"
        if doc["kind"] in WORKLOAD_KINDS:
            assert _pod_labels(doc).get("app.kubernetes.io/part-of") == "rlpipe", f"{ident} pod template"
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("Namespace", NAMESPACE),
        ("ServiceAccount", "rlpipe-pipeline-runner"),
        ("Role", "rlpipe-pipeline-runner"),
        ("RoleBinding", "rlpipe-pipeline-runner"),
        ("Deployment", "mlflow"),
        ("Service", "mlflow"),
        ("PersistentVolumeClaim", "rlpipe-weights"),
        ("Deployment", "rlpipe-sampler"),
        ("Service", "rlpipe-sampler"),
        ("ClusterQueue", "rlpipe"),
        ("LocalQueue", "rlpipe"),
    ]:
        assert expected in kinds, f"{name}: {expected} missing"


def test_references_resolve(build):
    """ConfigMaps (hash-suffixed by the generator), PVCs and service accounts that pods name exist in
    the same build; Secrets are the exception: they are created out of band, and the README says how."""
    name, docs = build
    present = {(d["kind"], d["metadata"]["name"]) for d in docs}
    readme = (MANIFESTS / "README.md").read_text()
    for doc in docs:
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        pod = _pod_spec(doc)
        ident = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        assert ("ServiceAccount", pod.get("serviceAccountName", "default")) in present, ident
        for vol in pod.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in present, ident
        for c in _containers(pod):
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert ("ConfigMap", src["configMapRef"]["name"]) in present, ident
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ("ConfigMap", ref["configMapKeyRef"]["name"]) in present, ident
                if "secretKeyRef" in ref:
                    secret = ref["secretKeyRef"]["name"]
                    assert re.search(rf"kubectl (-n {NAMESPACE} )?create secret generic {secret}\b", readme), (
                        f"{ident} reads Secret {secret}; manifests/README.md must say how to create it"
                    )


# -- security -------------------------------------------------------------------------------------


def test_namespace_enforces_restricted_pod_security(build):
    _, docs = build
    labels = _find(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == "restricted", mode


def test_pod_templates_meet_restricted_profile(build):
    name, docs = build
    workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    assert {d["metadata"]["name"] for d in workloads} >= {"mlflow", "rlpipe-sampler"}
    for doc in workloads:
        ident = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        pod = _pod_spec(doc)
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, ident
        assert psc.get("runAsUser") == 1000 and psc.get("fsGroup") == 1000, ident
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", ident
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), f"{ident}: {host}"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for vol in volumes.values():
            types = set(vol) - {"name"}
            assert types <= RESTRICTED_VOLUMES, f"{ident}: volume {vol['name']} uses {types - RESTRICTED_VOLUMES}"
        for c in _containers(pod):
            where = f"{ident} container {c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, where
            assert not sc.get("privileged"), where
            assert sc.get("runAsUser", psc["runAsUser"]) != 0 and sc.get("runAsNonRoot", True) is True, where
            assert sc.get("seccompProfile", {}).get("type", "RuntimeDefault") in ("RuntimeDefault", "Localhost"), where
            assert all("hostPort" not in p for p in c.get("ports", [])), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], f"{where}: read-only root needs /tmp"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mount of undeclared volume {mount['name']}"


def test_rbac_is_namespaced_and_least_privilege(build):
    name, docs = build
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")], name
    role = _find(docs, "Role", "rlpipe-pipeline-runner")
    assert role["rules"], "the Role grants nothing"
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {field}: {rule}"
        assert not rule.get("nonResourceURLs"), rule
        verbs = set(rule["verbs"])
        if rule["apiGroups"] == [""]:
            # core resources: read only, and Secrets/ConfigMaps only by name
            assert verbs <= {"get", "list", "watch"}, rule
            if {"secrets", "configmaps"} & set(rule["resources"]):
                assert rule.get("resourceNames") and verbs == {"get"}, f"unrestricted read: {rule}"
            assert not {"pods/exec", "pods/attach", "pods/portforward"} & set(rule["resources"]), rule
        else:
            assert verbs <= {"get", "list", "watch", "create", "patch"}, rule
            assert "delete" not in verbs and "escalate" not in verbs and "bind" not in verbs, rule
    binding = _find(docs, "RoleBinding", "rlpipe-pipeline-runner")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "rlpipe-pipeline-runner",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlpipe-pipeline-runner", "namespace": NAMESPACE}]


def test_no_literal_credentials(build):
    name, docs = build
    assert not [d for d in docs if d["kind"] == "Secret"], f"{name}: Secrets are created out of band, never shipped"
    for doc in docs:
        ident = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        for text in _strings(doc):
            assert not CREDENTIAL_IN_URL.search(text), f"{ident}: credentials in a URL: {text!r}"
        if doc["kind"] in WORKLOAD_KINDS:
            for c in _containers(_pod_spec(doc)):
                for env_name, env in _env(c).items():
                    if SECRETISH_ENV.search(env_name):
                        assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), (
                            f"{ident}: {env_name} must come from a Secret by reference"
                        )
                assert not [a for a in c.get("args", []) + c.get("command", []) if "$(" in a and "URI" in a], (
                    f"{ident}: secret-bearing env expanded into argv"
                )
        if doc["kind"] == "ConfigMap":
            for key in doc.get("data", {}):
                assert not SECRETISH_ENV.search(key), f"{ident}: {key} belongs in a Secret"


# -- the pieces -------------------------------------------------------------------------------------


def test_weights_pvc_is_read_write_many_with_overlay_storage_class(build):
    name, docs = build
    pvc = _find(docs, "PersistentVolumeClaim", "rlpipe-weights")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"].get("storageClassName") == WEIGHTS_STORAGE_CLASS[name], pvc["spec"].get("storageClassName")
    assert pvc["spec"]["resources"]["requests"]["storage"]
    if name == "gke-lustre":
        sc = _find(docs, "StorageClass", "lustre")
        assert sc["provisioner"] == "lustre.csi.storage.gke.io"
        assert sc["parameters"]["perUnitStorageThroughput"] in {"125", "250", "500", "1000"}


def test_sampler(build):
    name, docs = build
    dep = _find(docs, "Deployment", "rlpipe-sampler")
    pod = _pod_spec(dep)
    c = _container(dep, "sampler")
    assert c["image"] == "ghcr.io/rlpipe/sampler:0.1.0"
    argv = c["command"] + c.get("args", [])
    assert argv[:3] == ["python", "-m", "rlpipe.services.samplers.fleet"]  # waits for the run's weights, execs vLLM
    flags = _flags(argv)
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "8000"
    env = _env(c)
    # the PVC sits where the steps mount it: sync_weights names weight dirs by the steps' paths
    assert env["RLPIPE_RUN_ROOT"]["value"].startswith("/mnt/rlpipe/runs/")
    assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"  # /collective_rpc reload_weights, /pause, /resume
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    probe = c["readinessProbe"]
    assert probe["httpGet"]["path"] == "/health" and _port_number(c, probe["httpGet"]["port"]) == 8000
    assert probe.get("initialDelaySeconds", 0) >= 30
    weights = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "rlpipe-weights"]
    assert len(weights) == 1
    assert {"name": weights[0]["name"], "mountPath": "/mnt/rlpipe", "readOnly": True} in c["volumeMounts"]

    gpu_req = c["resources"].get("requests", {}).get("nvidia.com/gpu")
    gpu_lim = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if name == "dev":
        assert gpu_req is None and gpu_lim is None, "the dev overlay is CPU-only"
        assert dep["spec"]["replicas"] == 1
    elif name == "shared-device":  # the claim instead of a GPU: tests/test_shared_device.py resolves it
        assert gpu_req is None and gpu_lim is None and c["resources"]["claims"] == [{"name": "device"}]
        (reference,) = pod["resourceClaims"]
        assert _find(docs, "ResourceClaim", reference["resourceClaimName"])["metadata"]["namespace"] == NAMESPACE
        assert c["args"] == ["--host=0.0.0.0", "--port=8000", "--enable-sleep-mode"]  # /sleep frees the device
    else:
        assert int(gpu_req) == 1 and int(gpu_lim) == 1
    if name in GKE_BUILDS:
        assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "sampler-pool"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    svc = _find(docs, "Service", "rlpipe-sampler")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    assert _port_number(c, svc["spec"]["ports"][0]["targetPort"]) == 8000


def test_mlflow(build):
    name, docs = build
    dep = _find(docs, "Deployment", "mlflow")
    pod = _pod_spec(dep)
    c = _container(dep, "mlflow")
    assert re.fullmatch(r"ghcr\.io/mlflow/mlflow:v\d+\.\d+\.\d+(-full)?", c["image"]), "pin the MLflow version"
    argv = c["command"] + c.get("args", [])
    assert argv[:2] == ["mlflow", "server"]
    flags = _flags(argv)
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "5000" and flags["--workers"] == "1"
    probe = c["readinessProbe"]
    assert probe["httpGet"]["path"] == "/health" and _port_number(c, probe["httpGet"]["port"]) == 5000
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind
    svc = _find(docs, "Service", "mlflow")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [5000]

    config = {}
    for src in c.get("envFrom", []):
        config.update(_find(docs, "ConfigMap", src["configMapRef"]["name"]).get("data", {}))
    assert "MLFLOW_SERVER_ALLOWED_HOSTS" in config  # in-cluster Host headers pass MLflow's rebinding guard
    env = _env(c)
    if name in GKE_BUILDS:
        assert c["image"].endswith("-full"), "Postgres and GCS need the -full image"
        assert "--backend-store-uri" not in flags, "the URI carries a password: env by reference only"
        ref = env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "mlflow-db", "key": "uri"}
        assert "--artifacts-destination" not in flags
        assert config["MLFLOW_ARTIFACTS_DESTINATION"].startswith("gs://")
        assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "mlflow-data"]
        assert all("persistentVolumeClaim" not in v for v in pod.get("volumes", []))
    else:
        assert flags["--backend-store-uri"].startswith("sqlite:////mlflow/")
        assert flags["--artifacts-destination"].startswith("/mlflow/")
        pvc = _find(docs, "PersistentVolumeClaim", "mlflow-data")
        assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
        data = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "mlflow-data"]
        assert len(data) == 1
        assert any(m["mountPath"] == "/mlflow" and m["name"] == data[0]["name"] for m in c["volumeMounts"])
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"  # one SQLite writer


def test_kueue(build):
    name, docs = build
    flavors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceFlavor"}
    for doc in docs:
        if _group(doc) == "kueue.x-k8s.io":
            assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta1", doc["kind"]
    assert {"trainer-gpu", "sampler-gpu"} <= set(flavors)
    pool_label = "cloud.google.com/gke-nodepool" if name in GKE_BUILDS else "rlpipe.io/pool"
    for flavor, pool in (("trainer-gpu", "trainer"), ("sampler-gpu", "sampler")):
        labels = flavors[flavor]["spec"]["nodeLabels"]
        assert labels == {pool_label: f"{pool}-pool" if name in GKE_BUILDS else pool}, (flavor, labels)

    cq = _find(docs, "ClusterQueue", "rlpipe")
    assert cq["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    groups = cq["spec"]["resourceGroups"]
    assert len(groups) == 1 and set(groups[0]["coveredResources"]) == {"cpu", "memory", "nvidia.com/gpu"}
    quota_flavors = [f["name"] for f in groups[0]["flavors"]]
    assert set(quota_flavors) <= set(flavors), "the ClusterQueue names a flavor that is not defined"
    for flavor in groups[0]["flavors"]:
        resources = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
        assert set(resources) == {"cpu", "memory", "nvidia.com/gpu"}, flavor["name"]
    if name != "dev":
        assert {"trainer-gpu", "sampler-gpu"} <= set(quota_flavors)
        for flavor in groups[0]["flavors"]:
            quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
            if flavor["name"].endswith("-gpu"):
                assert int(quota["nvidia.com/gpu"]) > 0, flavor["name"]

    lq = _find(docs, "LocalQueue", "rlpipe")
    assert lq["metadata"]["namespace"] == NAMESPACE and lq["spec"]["clusterQueue"] == "rlpipe"


def test_resident_trainer_is_compiled_not_shipped(build):
    """The manifests hold the resident trainer's identity; the trainer itself, sized by the run spec,
    comes from `rlpipe compile` (test_compiled_multi_node_trainer)."""
    name, docs = build
    account = _find(docs, "ServiceAccount", "rlpipe-trainer")
    assert account["automountServiceAccountToken"] is False
    assert not [d for d in docs if "trainer" in d["metadata"]["name"] and d["kind"] in WORKLOAD_KINDS | {"Service"}]


# -- the resident trainer `rlpipe compile` writes ---------------------------------------------------

JOBSET_SCHEMA = REPO / "tests" / "fixtures" / "jobset-v0.12.0-v1alpha2.schema.json"  # source: its $comment


def _compile_trainer(tmp_path: Path, *overrides: str) -> tuple[dict, dict, dict]:
    """(pipeline IR, JobSet, Service) of examples/addition-gke.yaml compiled with `overrides`."""

    out = tmp_path / "rl.yaml"
    command = [*RLPIPE, "compile", str(REPO / "examples" / "addition-gke.yaml")]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rl.trainer.yaml: the resident trainer" in done.stdout
    jobset, service = yaml.safe_load_all((tmp_path / "rl.trainer.yaml").read_text())
    return next(yaml.safe_load_all(out.read_text())), jobset, service


def test_compiled_multi_node_trainer(tmp_path: Path):
    """trainer.gpus: 8 on trainer.nodes: 2: a JobSet valid against JobSet's own CRD schema and a core
    Service, carrying torchrun (nnodes, nproc-per-node, a static rendezvous at pod 0), 8 GPUs per node,
    the trainer pool apart from the samplers' (as Kueue's trainer-gpu flavor), the RWX weights PVC and
    the restricted pod profile; the Service reaches rank 0's HTTP port at the pipeline's trainer.endpoint."""
    import jsonschema
    import kubernetes_validate

    pipeline, jobset, service = _compile_trainer(tmp_path, "trainer.gpus=8", "trainer.nodes=2", "trainer.resident=true")
    schema = strict_schema(json.loads(JOBSET_SCHEMA.read_text()))
    jsonschema.validate(jobset, schema)
    with pytest.raises(jsonschema.ValidationError):  # the strict schema does catch a misspelled field
        jsonschema.validate(json.loads(json.dumps(jobset).replace('"parallelism"', '"paralellism"')), schema)
    assert kubernetes_validate.validate(service, K8S_VERSION, strict=True) == "1.32"
    (node,) = jobset["spec"]["replicatedJobs"]
    job = node["template"]
    # the Job and its pod template are core objects too: validate them against the 1.32 schemas
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job["spec"]},
        K8S_VERSION,
        strict=True,
    )
    name = jobset["metadata"]["name"]
    assert jobset["metadata"]["namespace"] == service["metadata"]["namespace"] == NAMESPACE
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rlpipe"  # base/kueue.yaml's LocalQueue
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1  # a failed node restarts every node

    # torchrun: 2 nodes x 8 processes, node rank = the pod's completion index, rendezvous at pod 0
    assert node["replicas"] == 1 and job["spec"]["parallelism"] == job["spec"]["completions"] == 2
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    c = _container({"kind": "Pod", "spec": pod}, "trainer")
    argv = c["command"] + c["args"]
    assert argv[:3] == ["python3", "-m", "torch.distributed.run"]
    flags = _flags(argv)
    assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "8"
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    assert flags["--master-addr"] == f"{name}-{node['name']}-0-0.{network['subdomain']}"  # JobSet's pod DNS
    assert len(f"{name}-{node['name']}-0-0") <= 63  # a pod host name is one DNS label
    assert _port_number(c, "rendezvous") == int(flags["--master-port"])
    assert argv[argv.index("-m", 3) + 1] == "rlpipe.services.trainer.server" and flags["--device"] == "auto"
    rank = _env(c)["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.annotations['batch.kubernetes.io/job-completion-index']"

    # 8 GPUs per node, on the trainer pool (the gke overlay's trainer-gpu flavor), not the samplers'
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["nvidia.com/gpu"] == 8, kind
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "trainer-pool"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    gke = _build("gke")
    flavor = _find(gke, "ResourceFlavor", "trainer-gpu")["spec"]["nodeLabels"]
    assert pod["nodeSelector"] == flavor != _pod_spec(_find(gke, "Deployment", "rlpipe-sampler"))["nodeSelector"]

    # the shared weights volume, read-write where the pipeline's steps mount it; the restricted profile
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    weights = volumes[mounts["/mnt/rlpipe"]["name"]]
    assert weights["persistentVolumeClaim"] == {"claimName": "rlpipe-weights"} and not mounts["/mnt/rlpipe"].get(
        "readOnly"
    )
    assert all(set(v) - {"name"} <= RESTRICTED_VOLUMES for v in volumes.values())
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]] and "emptyDir" in volumes[mounts["/dev/shm"]["name"]]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["serviceAccountName"] == "rlpipe-trainer" and pod["restartPolicy"] == "Never"

    # the Service reaches rank 0 (node 0's pod) on the HTTP port, at the URL the pipeline's steps call
    assert service["spec"]["selector"] == {
        "jobset.sigs.k8s.io/jobset-name": name,
        "batch.kubernetes.io/job-completion-index": "0",
    }
    (port,) = service["spec"]["ports"]
    assert _port_number(c, port["targetPort"]) == int(flags["--port"]) == port["port"]
    spec = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    assert spec["trainer"]["endpoint"] == f"http://{name}.{NAMESPACE}.svc.cluster.local:{port['port']}"
    assert (spec["trainer"]["gpus"], spec["trainer"]["nodes"]) == (8, 2)


def test_compiled_trainer_on_cpu_requests_no_gpu(tmp_path: Path):
    """trainer.device cpu (a dev cluster): trainer.gpus gloo processes per node, no GPU requested."""
    _, jobset, _ = _compile_trainer(tmp_path, "trainer.gpus=2", "trainer.resident=true", "trainer.device=cpu")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    c = job["template"]["spec"]["containers"][0]
    assert _flags(c["command"])["--nproc-per-node"] == "2" and _flags(c["command"])["--nnodes"] == "1"
    assert job["parallelism"] == 1 and _flags(c["args"])["--device"] == "cpu"
    assert not any("gpu" in key for kind in c["resources"].values() for key in kind)


def test_optional_kfp_runtime_class_policy_validates():
    """manifests/optional/kfp-sandbox-runtime-class.yaml: the admission policy that gives a KFP score
    pod the runtimeClassName its annotation names, valid against the 1.34 schemas (its API is beta there)."""
    import kubernetes_validate

    from rlpipe.pipelines.cluster_settings import RUNTIME_CLASS_ANNOTATION, SANDBOX_LABEL

    docs = list(yaml.safe_load_all((MANIFESTS / "optional" / "kfp-sandbox-runtime-class.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34.0", strict=True)
    policy = docs[0]["spec"]
    assert SANDBOX_LABEL in policy["matchConditions"][0]["expression"]
    assert RUNTIME_CLASS_ANNOTATION in policy["matchConditions"][0]["expression"]
    assert f"annotations['{RUNTIME_CLASS_ANNOTATION}']" in policy["mutations"][0]["applyConfiguration"]["expression"]
    assert docs[1]["spec"]["policyName"] == docs[0]["metadata"]["name"]


def test_optional_rollout_producer_validates():
    """manifests/optional/rollout-producer.yaml: one producer (never two at once) for an asynchronous
    run, running rlpipe.services.producer.server with the weights PVC read-write (it writes the buffer)."""
    import kubernetes_validate

    docs = list(yaml.safe_load_all((MANIFESTS / "optional" / "rollout-producer.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment"]
    kubernetes_validate.validate(docs[0], "1.34.0", strict=True)
    spec = docs[0]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["python", "-m", "rlpipe.services.producer.server"]
    assert {e["name"] for e in c["env"]} >= {"RLPIPE_RUN_ROOT"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and "--port=8002" in c["args"]
    weights = next(v for v in pod["volumes"] if v["name"] == "weights")
    assert not weights["persistentVolumeClaim"].get("readOnly")
    assert not next(m for m in c["volumeMounts"] if m["name"] == "weights").get("readOnly")


def test_optional_environment_service_validates():
    """manifests/optional/environment-service.yaml: the environment server as a sandboxed Deployment (the
    deny-all-egress label), reachable only from rlpipe's pods, serving rlpipe.environments.server."""
    import kubernetes_validate

    from rlpipe.pipelines.cluster_settings import SANDBOX_LABEL

    docs = list(yaml.safe_load_all((MANIFESTS / "optional" / "environment-service.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "NetworkPolicy"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34.0", strict=True)
    pod = docs[0]["spec"]["template"]
    assert pod["metadata"]["labels"][SANDBOX_LABEL] == "true"
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "rlpipe.environments.server"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and "--port=8000" in c["args"]
    options = json.loads(next(a for a in c["args"] if a.startswith("--options=")).split("=", 1)[1])
    assert options["tools"] == ["python"]
    assert docs[1]["spec"]["selector"] == docs[0]["spec"]["selector"]["matchLabels"]
    assert docs[2]["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}]
