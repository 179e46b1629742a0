"""Argo export: the WorkflowTemplate and CronWorkflow validate against the Argo models' schema,
carry the cluster settings, and the state-driven steps they run really advance the loop."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from hera.workflows import models as m

from rlpipe.pipelines.argo_steps import run_step
from rlpipe.store.run_root import read_state

from .conftest import compile_example, strict_schema


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("argo") / "argo.yaml"
    compile_example("addition-gke.yaml", "--target", "argo", "-o", str(out), check=True)
    return list(yaml.safe_load_all(out.read_text()))


def test_documents_validate_against_the_argo_schema(exported):
    template, cron = exported
    for doc, model in ((template, m.WorkflowTemplate), (cron, m.CronWorkflow)):
        jsonschema.validate(doc, strict_schema(model.model_json_schema(by_alias=True)))
        model.model_validate(doc)
    with pytest.raises(jsonschema.ValidationError):  # the strict schema does catch a typo
        bad = json.loads(json.dumps(template))
        bad["spec"]["templates"][1]["container"]["imagee"] = "x"
        jsonschema.validate(bad, strict_schema(m.WorkflowTemplate.model_json_schema(by_alias=True)))


def test_same_steps_images_and_settings_as_the_kfp_pipeline(exported):
    template, cron = exported
    templates = {t["name"]: t for t in template["spec"]["templates"]}
    for step in ("generate", "update"):
        container = templates[step]["container"]
        assert container["image"] == "ghcr.io/rlpipe/trainer:0.1.0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert templates[step]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "trainer-pool"}
        assert container["command"][-1] == step
    for step in ("score", "advantages", "sync-weights", "track"):
        assert templates[step]["container"]["image"] == "ghcr.io/rlpipe/step:0.1.0"
        assert templates[step]["retryStrategy"]["limit"] == 2
        assert templates[step]["container"]["securityContext"]["runAsNonRoot"] is True
    assert template["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "rlpipe-weights"
    assert templates["generate"]["container"]["volumeMounts"][0]["mountPath"] == "/mnt/rlpipe"
    secret_refs = [e["valueFrom"]["secretKeyRef"] for e in templates["track"]["container"]["env"]]
    assert {r["name"] for r in secret_refs} == {"mlflow-credentials"}
    assert "env" not in templates["generate"]["container"]
    tasks = [t["name"] for t in templates["loop"]["dag"]["tasks"]]
    assert tasks[:2] == ["init", "evaluate-0"] and tasks[-1] == "evaluate-5" and len(tasks) == 2 + 5 * 6
    assert template["spec"]["onExit"] == "track"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert cron["spec"]["workflowSpec"]["workflowTemplateRef"]["name"] == template["metadata"]["name"]


def test_argo_steps_run_the_loop_from_state(tiny_spec, tmp_path: Path):
    run_root = str(tmp_path / "runs" / "tiny")
    assert run_step("init", tiny_spec, run_root) == "published v0"
    assert run_step("init", tiny_spec, run_root) == "initialized already"
    assert run_step("evaluate", tiny_spec, run_root).startswith("eval/accuracy_greedy")
    for _ in range(tiny_spec.loop.iterations + 1):  # one extra pass: a no-op once the loop is done
        for step in ("generate", "score", "advantages", "update", "sync_weights", "evaluate"):
            run_step(step, tiny_spec, run_root)
    assert read_state(run_root)["iteration"] == tiny_spec.loop.iterations
    assert run_step("generate", tiny_spec, run_root) == f"loop done at iteration {tiny_spec.loop.iterations}"
    # iteration points 0..3 (0 = the warm start's metrics) and evals at 0, 2 (eval_every) and 3 (the last)
    # the tiny model never learns: every eval scores 0.0, so the registry has v0 (ties keep the earlier)
    assert run_step("track", tiny_spec, run_root).endswith("7 new points; registered iterations [0]")


def test_argo_and_in_process_iterations_write_the_reports_kfp_tasks_do(initialized_run, tmp_path: Path):
    """The step table's reports (rlpipe.steps.Step.reports: what the KFP components write as Markdown
    outputs, tests/test_structure.py) are written by the Argo steps and the in-process loop too: the same
    files, the same text where the inputs are the same (the iteration's rollouts and held-out eval)."""
    import re
    import shutil

    from rlpipe import loop
    from rlpipe.steps import BY_NAME
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized_run
    argo_root = str(tmp_path / "argo-run")
    shutil.copytree(run_root, argo_root)  # the same v0, data and state: the same iteration 1
    (tmp_path / "in-process").mkdir()
    loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, tmp_path / "in-process", cache)
    for step in ("generate", "score", "advantages", "update", "sync_weights"):
        run_step(step, spec, argo_root)
    run_step("evaluate", spec, argo_root)

    expected = {f"{name}.md" for step in ("advantages", "sync_weights", "evaluate") for name in BY_NAME[step].reports}
    assert expected == {"rollout_samples.md", "time_breakdown.md", "eval_samples.md"}
    in_process = {p.name: p.read_text() for p in (tmp_path / "in-process").glob("*.md")}
    argo = {p.name: p.read_text() for p in (Path(argo_root) / "work" / "iter_000001" / "reports").glob("*.md")}
    assert set(in_process) == set(argo) == expected
    assert in_process["rollout_samples.md"] == argo["rollout_samples.md"]
    assert in_process["rollout_samples.md"].startswith("## Rollouts of iteration 1")
    assert in_process["eval_samples.md"] == argo["eval_samples.md"]
    assert in_process["eval_samples.md"].startswith("## Held-out eval of iteration 1")

    def rows(text: str) -> list[str]:  # the time report's parts, without their seconds
        return sorted(re.findall(r"^\| (`[^`]+`) \| (?:compute|overhead) \|", text, re.M))

    assert rows(in_process["time_breakdown.md"]) == rows(argo["time_breakdown.md"])
    assert "`time/update_s`" in rows(argo["time_breakdown.md"])
