"""Shared fixtures: tiny specs and initialized run roots, built offline in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rlpipe.spec import RunSpec, parse_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


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
        "loop": {"iterations": 3, "iterations_per_run": 2, "eval_every": 2},
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


@pytest.fixture
def initialized_run(tmp_path: Path, tiny_spec: RunSpec) -> tuple[RunSpec, str, str]:
    """(spec, run_root, cache_root) with data, v0 published and state.json at iteration 0."""
    from rlpipe.data import prepare_data
    from rlpipe.loop import sync_weights
    from rlpipe.training.warm_start import warm_start

    run_root = str(tmp_path / "runs" / "tiny")
    cache = str(tmp_path / "cache")
    prepare_data(tiny_spec, run_root)
    staged, metrics = warm_start(tiny_spec, run_root, cache)
    sync_weights(tiny_spec, run_root, staged, 0, metrics)
    return tiny_spec, run_root, cache


def set_state(run_root: str, **changes) -> None:
    """Merge `changes` into the run's state.json: a test's stand-in for the commits that write it in a run
    (rlpipe.store.commit)."""
    from rlpipe.store.run_root import read_state, state_uri, write_json

    write_json(state_uri(run_root), (read_state(run_root) or {"run_uid": "test-run"}) | changes)
