"""`rlpipe compile` writes IR YAML that parses strictly into the KFP PipelineSpec proto."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from .conftest import REPO, RLPIPE, compile_example


def test_compiled_yaml_parses_strictly(tmp_path: Path):
    out = tmp_path / "rl.yaml"
    compile_example(
        "addition.yaml",
        "-o",
        str(out),
        "--run-root",
        "gs://bucket/runs/addition-demo",
        "--set",
        "trainer.endpoint=http://rlpipe-trainer.rlpipe.svc.cluster.local:8001",
        check=True,
    )
    docs = list(yaml.safe_load_all(out.read_text()))
    spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())  # unknown fields raise
    assert spec.pipeline_info.name == "rlpipe-run"
    executors = set(spec.deployment_spec["executors"].keys())
    for step in ("generate", "score", "advantages", "update", "sync-weights", "evaluate", "track"):
        assert f"exec-{step}" in executors
    defaults = spec.root.input_definitions.parameters
    assert defaults["run_root"].default_value.string_value == "gs://bucket/runs/addition-demo"
    assert json.loads(defaults["spec"].default_value.string_value)["name"] == "addition-demo"
    # one run unrolls loop.iterations_per_run iterations
    iteration_dags = [name for name in spec.components if name.startswith("comp-rlpipe-iteration")]
    assert len(iteration_dags) == 5
    # weights never travel as artifacts: update's only artifact input is the batch
    update = spec.components["comp-update"]
    assert list(update.input_definitions.artifacts) == ["batch"]


def _compile_gke(tmp_path: Path) -> tuple[str, dict, dict]:
    out = tmp_path / "gke.yaml"
    env = {**os.environ, "MLFLOW_TRACKING_PASSWORD": "hunter2-not-in-yaml", "HF_TOKEN": "hf_secret_value_xyz"}
    compile_example("addition-gke.yaml", "-o", str(out), check=True, env=env)
    text = out.read_text()
    docs = list(yaml.safe_load_all(text))
    assert len(docs) == 2
    json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())  # strict: unknown fields raise
    json_format.ParseDict(docs[1], pipeline_spec_pb2.PlatformSpec())
    return text, docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_gke_spec_carries_the_cluster_settings(tmp_path: Path):
    text, pipeline, platform = _compile_gke(tmp_path)
    executors = pipeline["deploymentSpec"]["executors"]
    for step in ("generate", "update"):  # GPUs on the trainer steps, the trainer image
        container = executors[f"exec-{step}"]["container"]
        assert container["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
        assert container["resources"]["accelerator"]["resourceCount"] == "1"
        assert container["image"] == "ghcr.io/rlpipe/trainer:0.1.0"
        assert platform[f"exec-{step}"]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "trainer-pool"}
        assert platform[f"exec-{step}"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    for step in ("score", "advantages", "sync-weights", "track"):  # light steps: no GPU, the CPU pool
        container = executors[f"exec-{step}"]["container"]
        assert "accelerator" not in container.get("resources", {})
        assert container["image"] == "ghcr.io/rlpipe/step:0.1.0"
        assert platform[f"exec-{step}"]["nodeSelector"]["labels"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}
    # the shared-FS PVC on every step that touches the run root, not on artifact-only steps
    for step in ("generate", "update", "sync-weights", "evaluate", "plan", "track", "warm-start"):
        assert platform[f"exec-{step}"]["pvcMount"][0]["mountPath"] == "/mnt/rlpipe"
        assert platform[f"exec-{step}"]["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": "1000",
            "runAsGroup": "1000",
        }
    assert "pvcMount" not in platform["exec-score"]
    # secrets by reference, only on the steps that need them
    track_env = {e["envVar"]: s["secretName"] for s in platform["exec-track"]["secretAsEnv"] for e in s["keyToEnv"]}
    assert track_env == {
        "MLFLOW_TRACKING_USERNAME": "mlflow-credentials",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-credentials",
    }
    assert platform["exec-warm-start"]["secretAsEnv"][0]["secretName"] == "hf-token"
    assert "secretAsEnv" not in platform["exec-generate"]
    assert "hunter2-not-in-yaml" not in text and "hf_secret_value_xyz" not in text
    # every task retries with backoff; timeouts per pool
    tasks = [t for c in pipeline["components"].values() for t in c.get("dag", {}).get("tasks", {}).values()]
    tasks += list(pipeline["root"]["dag"]["tasks"].values())
    executed = [
        t
        for t in tasks
        if t["componentRef"]["name"].startswith("comp-")
        and "dag" not in pipeline["components"][t["componentRef"]["name"]]
    ]
    assert executed and all(t["retryPolicy"]["maxRetryCount"] == 2 for t in executed)
    assert platform["exec-update"]["activeDeadlineSeconds"] == "7200"
    # the embedded spec points the steps at cluster storage, not at this machine
    spec = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    assert spec["storage"]["root"] == "/mnt/rlpipe/runs" and spec["storage"]["cache"] == "/mnt/rlpipe/cache"
    run_root = pipeline["root"]["inputDefinitions"]["parameters"]["run_root"]["defaultValue"]
    assert run_root == "/mnt/rlpipe/runs/addition-demo"


def test_local_storage_without_pvc_is_refused(tmp_path: Path):
    result = compile_example("addition.yaml", "-o", str(tmp_path / "x.yaml"), capture_output=True, text=True)
    assert result.returncode == 1
    assert "cluster steps cannot reach it" in result.stderr


def test_sampler_engine_on_a_cluster_needs_endpoints(tmp_path: Path):
    command = [*RLPIPE, "compile", str(REPO / "examples" / "addition-gke.yaml")]
    result = subprocess.run(
        command + ["-o", str(tmp_path / "x.yaml"), "--set", "rollout.engine=sampler"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "needs samplers.endpoints" in result.stderr


def test_sampler_engine_puts_generate_on_the_light_image(tmp_path: Path):
    """With rollout.engine sampler, generate is an HTTP client: step image, CPU pool, no GPU."""
    out = tmp_path / "gke-samplers.yaml"
    endpoints = '["http://rlpipe-sampler-pods.rlpipe.svc.cluster.local:8000"]'
    command = [*RLPIPE, "compile", str(REPO / "examples" / "addition-gke.yaml")]
    command += ["-o", str(out), "--set", "rollout.engine=sampler", "--set", f"samplers.endpoints={endpoints}"]
    subprocess.run(command, check=True)
    pipeline, platform = list(yaml.safe_load_all(out.read_text()))
    executors = pipeline["deploymentSpec"]["executors"]
    generate = executors["exec-generate"]["container"]
    assert generate["image"] == "ghcr.io/rlpipe/step:0.1.0" and "accelerator" not in generate.get("resources", {})
    assert executors["exec-update"]["container"]["image"] == "ghcr.io/rlpipe/trainer:0.1.0"
    nodes = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-generate"]["nodeSelector"]
    assert nodes["labels"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}
    spec = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    assert spec["samplers"]["endpoints"] == ["http://rlpipe-sampler-pods.rlpipe.svc.cluster.local:8000"]


def test_resident_trainer_on_a_cluster(tmp_path: Path):
    """trainer.resident: update, evaluate (and generate, torch engine: the trainer samples) run on the
    light image as clients of the trainer that compile writes beside the pipeline (its JobSet's Service
    is trainer.endpoint unless the spec names one: tests/test_manifests.py checks the JobSet)."""
    command = [*RLPIPE, "compile", str(REPO / "examples" / "addition-gke.yaml")]
    command += ["-o", str(tmp_path / "x.yaml"), "--set", "trainer.resident=true"]
    subprocess.run(command, check=True, capture_output=True)
    pipeline, _ = list(yaml.safe_load_all((tmp_path / "x.yaml").read_text()))
    executors = pipeline["deploymentSpec"]["executors"]
    for step in ("update", "generate", "evaluate"):
        container = executors[f"exec-{step}"]["container"]
        assert container["image"] == "ghcr.io/rlpipe/step:0.1.0" and "accelerator" not in container.get("resources", {})
    assert executors["exec-warm-start"]["container"]["image"] == "ghcr.io/rlpipe/trainer:0.1.0"
    spec = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    endpoint = "http://rlpipe-trainer-addition-demo.rlpipe.svc.cluster.local:8001"
    assert spec["trainer"]["endpoint"] == endpoint
    assert yaml.safe_load_all((tmp_path / "x.trainer.yaml").read_text())  # the JobSet and its Service

    mine = "http://my-trainer.rlpipe.svc.cluster.local:8001"
    subprocess.run(command + ["--set", f"trainer.endpoint={mine}"], check=True, capture_output=True)
    pipeline, _ = list(yaml.safe_load_all((tmp_path / "x.yaml").read_text()))
    spec = json.loads(pipeline["root"]["inputDefinitions"]["parameters"]["spec"]["defaultValue"])
    assert spec["trainer"]["endpoint"] == mine


def test_trainer_gpus_is_what_the_trainer_pods_request(tmp_path: Path):
    """trainer.gpus: 8 trains the update in 8 torchrun processes: its pod requests 8 GPUs; the other
    trainer-image steps compute on one device and request 1 (KFP and Argo alike); trainer.device cpu
    requests none (trainer.gpus are then gloo processes)."""
    rewards = "reward.functions=[{type: reward_model, path: gs://models/rm}]"  # puts score on the trainer image

    def compile_(device: str, target: str) -> dict:
        out = tmp_path / f"{device}-{target}.yaml"
        command = [
            sys.executable,
            "-m",
            "rlpipe.pipelines.cli",
            "compile",
            str(REPO / "examples" / "addition-gke.yaml"),
        ]
        command += ["--target", target, "-o", str(out), "--set", "trainer.gpus=8", "--set", f"trainer.device={device}"]
        subprocess.run([*command, "--set", rewards], check=True, capture_output=True)
        return next(yaml.safe_load_all(out.read_text()))

    steps = ("update", "warm-start", "generate", "evaluate", "score", "advantages", "sync-weights")
    for device, expected in (("auto", ("8", "1", "1", "1", "1", None, None)), ("cpu", (None,) * len(steps))):
        executors = compile_(device, "kfp")["deploymentSpec"]["executors"]
        accelerators = [executors[f"exec-{s}"]["container"].get("resources", {}).get("accelerator") for s in steps]
        assert [a and a["resourceCount"] for a in accelerators] == list(expected), device
    templates = {t["name"]: t for t in compile_("auto", "argo")["spec"]["templates"]}
    argo_steps = ("update", "init", "generate", "evaluate", "score", "advantages")  # init computes warm_start
    gpus = [templates[s]["container"]["resources"]["requests"].get("nvidia.com/gpu") for s in argo_steps]
    assert gpus == ["8", "1", "1", "1", "1", None]


def test_sandboxed_score_step_carries_the_runtime_class(tmp_path: Path):
    """A code_sandbox reward: the score pod is labelled for the deny-all NetworkPolicy and asks for
    gVisor. KFP has no runtimeClassName field (kubeflow/pipelines#8052), so the KFP YAML carries it as
    an annotation; the Argo export sets runtimeClassName itself. A reward model puts score on the
    trainer image (and its GPU)."""
    rewards = "reward.functions=[{type: code_sandbox}, {type: reward_model, path: gs://models/rm}]"
    spec = str(REPO / "examples" / "addition-gke.yaml")
    kfp_out, argo_out = tmp_path / "kfp.yaml", tmp_path / "argo.yaml"
    for target, out in (("kfp", kfp_out), ("argo", argo_out)):
        command = [*RLPIPE, "compile", spec, "--target", target]
        subprocess.run([*command, "-o", str(out), "--set", rewards], check=True, capture_output=True)
    pipeline, platform = yaml.safe_load_all(kfp_out.read_text())
    json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors["exec-score"]["podMetadata"] == {
        "labels": {"rlpipe.dev/sandbox": "true"},
        "annotations": {"rlpipe.dev/runtime-class": "gvisor"},
    }
    assert "podMetadata" not in executors["exec-update"]
    score = pipeline["deploymentSpec"]["executors"]["exec-score"]["container"]
    assert (
        score["image"] == "ghcr.io/rlpipe/trainer:0.1.0" and score["resources"]["accelerator"]["resourceCount"] == "1"
    )
    templates = {t["name"]: t for t in next(yaml.safe_load_all(argo_out.read_text()))["spec"]["templates"]}
    assert json.loads(templates["score"]["podSpecPatch"]) == {"runtimeClassName": "gvisor"}
    assert templates["score"]["metadata"]["labels"]["rlpipe.dev/sandbox"] == "true"
    assert "podSpecPatch" not in templates["update"]


def test_kfp_argo_and_the_trainer_jobset_run_pods_under_one_security_context(tmp_path: Path):
    """pipelines.cluster_settings.security_context is what every path's pods get: the KFP tasks' user
    fields (KFP 2.17's backend adds the container hardening), the Argo templates' pod and containers, the
    trainer JobSet's pod (plus fsGroup) and container (plus a read-only root filesystem)."""
    from rlpipe.pipelines.argo_export import build_argo
    from rlpipe.pipelines.cluster_settings import security_context
    from rlpipe.pipelines.trainer_jobset import trainer_manifests
    from rlpipe.spec import load_spec

    spec = load_spec(REPO / "examples" / "addition-gke.yaml")
    pod, container = security_context(spec.cluster)
    assert pod["runAsNonRoot"] and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}

    _, _, platform = _compile_gke(tmp_path)
    identity = {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in pod.items()}
    for executor in platform.values():
        assert executor["securityContext"] == {k: identity[k] for k in ("runAsNonRoot", "runAsUser", "runAsGroup")}

    template, _ = build_argo(spec, "/mnt/rlpipe/runs/addition")
    workflow = template.model_dump(by_alias=True, exclude_none=True, mode="json")["spec"]
    assert workflow["securityContext"] == pod
    for each in workflow["templates"]:
        if "container" in each:
            assert each["container"]["securityContext"] == pod | container, each["name"]

    resident = load_spec(REPO / "examples" / "addition-gke.yaml", {"trainer.resident": True})
    jobset = next(doc for doc in trainer_manifests(resident) if doc["kind"] == "JobSet")
    trainer_pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod.items() <= trainer_pod["securityContext"].items()
    assert container.items() <= trainer_pod["containers"][0]["securityContext"].items()


def test_fused_steps_compile_to_one_task_an_iteration(tmp_path: Path):
    """loop.fuse_steps on a cluster: each iteration is one pod on the trainer image with the GPU, the run
    root and every secret its steps take; KFP and Argo alike."""
    out = tmp_path / "fused.yaml"
    env = {**os.environ, "MLFLOW_TRACKING_PASSWORD": "x", "HF_TOKEN": "y"}
    compile_example("addition-gke.yaml", "-o", str(out), "--set", "loop.fuse_steps=true", check=True, env=env)
    pipeline, platform = list(yaml.safe_load_all(out.read_text()))
    executors = pipeline["deploymentSpec"]["executors"]
    assert "exec-iteration" in executors and not {"exec-generate", "exec-score", "exec-sync-weights"} & set(executors)
    container = executors["exec-iteration"]["container"]
    assert container["image"] == "ghcr.io/rlpipe/trainer:0.1.0"
    assert container["resources"]["accelerator"]["resourceCount"] == "1"
    fused = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-iteration"]
    assert fused["pvcMount"][0]["mountPath"] == "/mnt/rlpipe"
    iteration_dags = [c for name, c in pipeline["components"].items() if name.startswith("comp-rlpipe-iteration")]
    assert len(iteration_dags) == 5  # the iteration evaluates in its own task: no evaluate under it
    assert all(list(c["dag"]["tasks"]) == ["iteration"] for c in iteration_dags)
    argo = tmp_path / "argo.yaml"
    fused_args = ("--target", "argo", "-o", str(argo), "--set", "loop.fuse_steps=true")
    compile_example("addition-gke.yaml", *fused_args, check=True)
    template = next(yaml.safe_load_all(argo.read_text()))
    templates = {t["name"]: t for t in template["spec"]["templates"]}
    tasks = [t["name"] for t in templates["loop"]["dag"]["tasks"]]
    assert tasks == ["init", "evaluate-0", *(f"iteration-{k}" for k in range(1, 6))]
    assert templates["iteration"]["container"]["command"][-1] == "iteration"
