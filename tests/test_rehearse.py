"""What users upload is what is tested: `rlpipe compile` of the cluster example, the file loaded by KFP's own
loader and run by KFP's local runner (`rlpipe rehearse`), commits the weights `rlpipe run` of the same spec
commits, bit for bit: in processes, and in the images (marker containers) on KFP's DockerRunner."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, RLPIPE, compile_example

# the cluster example at a size that runs in well under a minute here; a reward with spread (completion
# length), so every update moves the weights and equal sha256s mean equal updates
SMALL = {
    "model.warm_start.max_steps": 10,
    "model.warm_start.validation_size": 16,
    "model.warm_start.batch_size": 16,
    "data.train_size": 200,
    "data.eval_size": 20,
    "reward.functions": '["tests.toy_plugins:async_length"]',
    "rollout.prompts_per_iteration": 8,
    "rollout.samples_per_prompt": 4,
    "trainer.mini_batches": 2,
    "trainer.threads": 1,
    "loop.iterations": 2,
    "loop.iterations_per_run": 2,
    "loop.eval_every": 2,
    "loop.stop_on_signs": "false",
}


def sets(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def rlpipe(*args: str) -> subprocess.CompletedProcess:
    ran = subprocess.run([*RLPIPE, *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return ran


def committed(run_root: Path) -> tuple[int, str]:
    state = json.loads((run_root / "state.json").read_text())
    return state["iteration"], state["weights_sha256"]


def rehearsed_and_run(tmp_path: Path, *flags: str) -> tuple[Path, Path]:
    """The cluster example compiled and rehearsed with `flags`, and run by `rlpipe run`: the two run roots."""
    compiled = tmp_path / "addition-gke.yaml"
    compile_example("addition-gke.yaml", "-o", str(compiled), *sets(SMALL), check=True, capture_output=True)
    cache = {"storage.cache": str(tmp_path / "cache")}
    rehearsed, ran = tmp_path / "rehearsed", tmp_path / "ran"
    said = rlpipe("rehearse", str(compiled), "--run-dir", str(rehearsed), *flags, *sets(cache)).stdout
    assert "its spec, with storage, tracking and services on this machine" in said and "iteration 2/2" in said
    example = str(REPO / "examples" / "addition-gke.yaml")
    rlpipe("run", example, "--run-dir", str(ran), *flags, *sets(SMALL | cache | {"tracking.uri": "null"}))
    return rehearsed, ran


@pytest.mark.slow  # a minute: two whole runs
def test_the_compiled_file_run_by_kfps_local_runner_commits_what_rlpipe_run_commits(tmp_path: Path):
    rehearsed, ran = rehearsed_and_run(tmp_path)
    iteration, sha256 = committed(rehearsed)
    assert (iteration, sha256) == committed(ran) and iteration == 2
    versions = [json.loads((rehearsed / "weights" / f"v{v:06d}" / "manifest.json").read_text()) for v in (0, 1, 2)]
    assert len({manifest["sha256"] for manifest in versions}) == 3  # each update moved the weights
    steps = json.loads((rehearsed / "summary.json").read_text())["steps"]
    assert steps["forked"] >= 8 and steps["fresh"] == 0  # the file's tasks are forks of the step server too


def test_a_file_that_is_not_a_compiled_rlpipe_pipeline_is_named(tmp_path: Path):
    (tmp_path / "other.yaml").write_text("name: not-a-pipeline\n")
    ran = subprocess.run([*RLPIPE, "rehearse", str(tmp_path / "other.yaml")], capture_output=True, text=True)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert f"pipeline file {tmp_path / 'other.yaml'} is not a pipeline KFP can load" in ran.stderr
    ran = subprocess.run([*RLPIPE, "rehearse", str(tmp_path / "absent.yaml")], capture_output=True, text=True)
    assert ran.returncode == 2 and "does not exist; write one with: rlpipe compile SPEC -o" in ran.stderr


@pytest.mark.containers
def test_the_compiled_file_in_its_images_commits_what_rlpipe_run_commits(tmp_path: Path, images):
    """KFP's DockerRunner runs each task of the file in the image the file names (`--containers`)."""
    rehearsed, ran = rehearsed_and_run(tmp_path, "--containers")
    assert committed(rehearsed) == committed(ran) and committed(rehearsed)[0] == 2
