"""Export for plain Argo Workflows: a WorkflowTemplate running the same steps with the same
images and cluster settings as the KFP pipeline, and a CronWorkflow that keeps the loop going.

    init -> evaluate (pending) -> [generate -> score -> advantages -> update -> sync-weights -> evaluate] x K
    onExit: track

Steps are `python3 -m rlpipe.pipelines.argo_steps STEP` (state-driven, see that module).
Built from hera's models (generated from the Argo schema), so field names are checked.
"""

import json
from pathlib import Path

import yaml
from hera.workflows import models as m

from rlpipe.pipelines.cluster_settings import SANDBOX_LABEL, security_context, task_gpus
from rlpipe.pipelines.compile import cluster_spec_and_root
from rlpipe.spec import PodSpec, RunSpec, spec_to_json
from rlpipe.steps import FUSED, iteration_steps, sandboxed, task_steps, uses_trainer_image

API_VERSION = "argoproj.io/v1alpha1"
VOLUME = "run-root"


def _template(name: str, step: str, spec: RunSpec) -> m.Template:
    cluster = spec.cluster
    computes = "warm_start" if step == "init" else step  # init runs prepare, warm_start and publish_warm_start
    pod: PodSpec = cluster.trainer if uses_trainer_image(computes, spec) else cluster.step
    requests = {"cpu": pod.cpu, "memory": pod.memory}
    limits = {key: value for key, value in (("cpu", pod.cpu_limit), ("memory", pod.memory_limit)) if value}
    if gpus := task_gpus(computes, spec):  # none with sharing: the trainer and samplers share the claim
        requests[pod.accelerator] = limits[pod.accelerator] = str(gpus)
    env = [
        m.EnvVar(name=s.env, value_from=m.EnvVarSource(secret_key_ref=m.SecretKeySelector(name=s.secret, key=s.key)))
        for s in cluster.secrets
        if s.steps is None or set(task_steps(step, spec)) & set(s.steps) or (step == "init" and "warm_start" in s.steps)
    ]
    pod_security, container_security = security_context(cluster)
    return m.Template(
        name=name,
        container=m.Container(
            image=pod.image,
            command=["python3", "-m", "rlpipe.pipelines.argo_steps", step],
            args=["--spec-json", "{{workflow.parameters.spec}}", "--run-root", "{{workflow.parameters.run_root}}"],
            env=env or None,
            resources=m.ResourceRequirements(requests=requests, limits=limits or None),
            volume_mounts=[m.VolumeMount(name=VOLUME, mount_path=cluster.mount_path)] if cluster.pvc else None,
            security_context=m.SecurityContext.model_validate(pod_security | container_security),
        ),
        node_selector=pod.node_selector or None,
        tolerations=[
            m.Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect) for t in pod.tolerations
        ]
        or None,
        retry_strategy=m.RetryStrategy(
            limit=m.IntOrString(cluster.retries), backoff=m.Backoff(duration=cluster.retry_backoff)
        )
        if cluster.retries
        else None,
        active_deadline_seconds=m.IntOrString(pod.timeout_s),
        **_sandbox_settings(step, spec),
    )


def _sandbox_settings(step: str, spec: RunSpec) -> dict:
    """A score step that runs candidates' code: labelled for the sandbox NetworkPolicy (no egress) and
    run under cluster.sandbox_runtime_class (Argo's podSpecPatch can set what KFP cannot)."""
    if not sandboxed(step, spec):
        return {}
    settings: dict = {"metadata": m.Metadata(labels={SANDBOX_LABEL: "true"})}
    if spec.cluster.sandbox_runtime_class:
        settings["pod_spec_patch"] = json.dumps({"runtimeClassName": spec.cluster.sandbox_runtime_class})
    return settings


def _dag(iterations_per_run: int, steps: tuple[str, ...]) -> m.Template:
    tasks = [m.DAGTask(name="init", template="init"), m.DAGTask(name="evaluate-0", template="evaluate", depends="init")]
    previous = "evaluate-0"
    for k in range(1, iterations_per_run + 1):
        for step in steps if steps == (FUSED,) else (*steps, "evaluate"):
            template = step.replace("_", "-")
            tasks.append(m.DAGTask(name=f"{template}-{k}", template=template, depends=previous))
            previous = f"{template}-{k}"
    return m.Template(name="loop", dag=m.DAGTemplate(tasks=tasks))


def build_argo(spec: RunSpec, run_root: str | None = None) -> tuple[m.WorkflowTemplate, m.CronWorkflow]:
    spec, run_root = cluster_spec_and_root(spec, run_root)
    name = f"rlpipe-{spec.name}".lower().replace("_", "-").replace(".", "-")
    every_iteration = (FUSED,) if spec.loop.fuse_steps else iteration_steps(spec)  # FUSED evaluates too
    steps = ("init", *every_iteration, "evaluate", "track")  # init: the init phase's steps in one pod
    templates = [_dag(spec.loop.iterations_per_run, every_iteration)]
    templates += [_template(s.replace("_", "-"), s, spec) for s in steps]
    cluster = spec.cluster
    workflow_spec = m.WorkflowSpec(
        entrypoint="loop",
        on_exit="track",
        service_account_name="rlpipe-pipeline-runner",
        arguments=m.Arguments(
            parameters=[
                m.Parameter(name="spec", value=spec_to_json(spec)),
                m.Parameter(name="run_root", value=run_root),
            ]
        ),
        volumes=[
            m.Volume(name=VOLUME, persistent_volume_claim=m.PersistentVolumeClaimVolumeSource(claim_name=cluster.pvc))
        ]
        if cluster.pvc
        else None,
        security_context=m.PodSecurityContext.model_validate(security_context(cluster)[0]),
        templates=templates,
    )
    template = m.WorkflowTemplate(
        api_version=API_VERSION, kind="WorkflowTemplate", metadata=m.ObjectMeta(name=name), spec=workflow_spec
    )
    cron = m.CronWorkflow(
        api_version=API_VERSION,
        kind="CronWorkflow",
        metadata=m.ObjectMeta(name=f"{name}-loop"),
        spec=m.CronWorkflowSpec(
            schedules=["0 * * * *"],
            concurrency_policy="Forbid",  # like KFP's max_concurrency=1: iterations never overlap
            starting_deadline_seconds=0,  # no catch-up of missed slots
            workflow_spec=m.WorkflowSpec(workflow_template_ref=m.WorkflowTemplateRef(name=name)),
        ),
    )
    return template, cron


def export_argo(spec: RunSpec, output: str | Path, run_root: str | None = None) -> Path:
    """Write the WorkflowTemplate and the CronWorkflow (hourly; edit `schedules`) as one YAML file."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    docs = [doc.model_dump(by_alias=True, exclude_none=True, mode="json") for doc in build_argo(spec, run_root)]
    output.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return output
