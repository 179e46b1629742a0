"""`rlpipe compile` writes IR YAML that parses strictly into the KFP PipelineSpec proto."""

import subprocess
import sys
from pathlib import Path

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from .conftest import REPO


def test_compiled_yaml_parses_strictly(tmp_path: Path):
    out = tmp_path / "rl.yaml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpipe.cli",
            "compile",
            str(REPO / "examples" / "addition.yaml"),
            "-o",
            str(out),
            "--run-root",
            "gs://bucket/runs/addition-demo",
        ],
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
    assert defaults["spec"].default_value.struct_value["name"] == "addition-demo"
    # one run unrolls loop.iterations_per_run iterations
    iteration_dags = [name for name in spec.components if name.startswith("comp-rlpipe-iteration")]
    assert len(iteration_dags) == 5
    # weights never travel as artifacts: update's only artifact input is the batch
    update = spec.components["comp-update"]
    assert list(update.input_definitions.artifacts) == ["batch"]
