"""The configuration reference (rlpipe.spec.reference): docs/configuration.md's tables and the committed JSON
Schema are what the sections generate, name every key, accept every example, and reject what parse_spec rejects."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlpipe.pipelines.cli import main
from rlpipe.spec import RunSpec, SpecError, load_spec, parse_spec, spec_to_dict
from rlpipe.spec.reference import (
    REFERENCE_BEGIN,
    REFERENCE_END,
    SCHEMA_FILE,
    json_schema,
    json_schema_text,
    with_reference,
)

from .conftest import REPO

PAGE = REPO / "docs" / "configuration.md"
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((REPO / SCHEMA_FILE).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a section, walked here apart from the generator: sections inside Optional[...] and
    list[...] included, a list's item keys under `key[].`."""
    keys = []
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        keys.append(key)
        hint = typing.get_type_hints(cls)[field.name]
        inner = [hint, *typing.get_args(hint)]
        for arm in inner:
            if dataclasses.is_dataclass(arm):
                keys += _keys(arm, f"{key}[]." if typing.get_origin(hint) is list else f"{key}.")
    return keys


def _algorithm_keys() -> list[str]:
    """Each of rlpipe's algorithms' own options (beyond AlgorithmSpec's), walked here apart from the generator."""
    from rlpipe.algorithms import ALGORITHMS
    from rlpipe.spec import AlgorithmSpec

    common = {f.name for f in dataclasses.fields(AlgorithmSpec)}
    return [
        f"algorithm.{field.name}"
        for algorithm in ALGORITHMS.values()
        if algorithm.options.__module__.startswith("rlpipe.")
        for field in dataclasses.fields(algorithm.options)
        if field.name not in common
    ]


def _generated(text: str) -> str:
    return text.split(REFERENCE_BEGIN, 1)[1].split(REFERENCE_END, 1)[0]


def test_the_docs_reference_is_what_the_sections_generate():
    page = PAGE.read_text()
    assert REFERENCE_BEGIN in page and REFERENCE_END in page
    assert with_reference(page) == page, "docs/configuration.md's reference is stale: run `rlpipe schema --docs`"
    assert page.split(REFERENCE_BEGIN)[0].startswith("# The run spec")  # the hand-written part is kept
    assert "## Changes" in page.split(REFERENCE_BEGIN)[0]


def test_the_committed_schema_is_what_the_sections_generate():
    committed = (REPO / SCHEMA_FILE).read_text()
    assert committed == json_schema_text(), f"{SCHEMA_FILE} is stale: run `rlpipe schema -o {SCHEMA_FILE}`"
    assert SCHEMA_FILE.split("/")[-1] in PAGE.read_text()  # the docs name it


def test_every_key_of_the_spec_has_a_row_in_the_docs():
    keys = _keys(RunSpec)
    assert len(keys) >= 130 and len(set(keys)) == len(keys)
    assert {"trainer.micro_batch_tokens", "evaluation.sets[].name", "cluster.trainer.tolerations[].effect"} <= set(keys)
    keys += _algorithm_keys()  # each algorithm's table lists its own options
    assert {"algorithm.clip_eps", "algorithm.beta", "algorithm.gamma"} <= set(keys)
    rows = re.findall(r"^\| \[?`([^`]+)`", _generated(PAGE.read_text()), flags=re.M)
    assert sorted(rows) == sorted(keys), (
        f"in the spec, not the docs: {sorted(set(keys) - set(rows))}; "
        f"in the docs, not the spec: {sorted(set(rows) - set(keys))}: run `rlpipe schema --docs`"
    )


def test_a_row_says_type_default_bounds_and_doc():
    generated = _generated(PAGE.read_text())
    rows = {re.match(r"\| \[?`([^`]+)`", line)[1]: line for line in generated.splitlines() if line.startswith("| [`")}
    rows |= {re.match(r"\| `([^`]+)`", line)[1]: line for line in generated.splitlines() if line.startswith("| `")}
    assert rows["data.max_prompt_tokens"].startswith("| `data.max_prompt_tokens` | int or null | `null` | >= 1 | Drop")
    assert '"float32" \\| "bfloat16" | `float32`' in rows["trainer.dtype"]
    assert "| [float, float] | `[0.9, 0.999]` |" in rows["trainer.betas"]
    assert "| str | required | matches `^[a-z0-9_]+$` | Names its metrics" in rows["evaluation.sets[].name"]
    assert "| list of sections | `[]` |" in rows["evaluation.sets"]
    assert "absent: `{image: 'ghcr.io/rlpipe/trainer:0.1.0', cpu: '4', memory: 16Gi}`" in rows["cluster.trainer"]
    assert "> 0, \\<= 1" in rows["model.warm_start.target_accuracy"]
    assert "not empty" in rows["reward.functions"]
    assert "### `evaluation.sets[]`" in generated and "### `model.lora`" in generated
    dapo = generated.split("### `algorithm` of `name: dapo`")[1].split("###")[0]
    assert "| `algorithm.clip_eps_high` | float or null | `0.28` | > 0 |" in dapo  # its own default
    assert "`algorithm.beta`" not in dapo and "`algorithm.beta`" in generated.split("`name: dpo`")[1].split("###")[0]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_schema_accepts_every_example_and_each_points_at_it(example: Path):
    data = yaml.safe_load(example.read_text())
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _validator().iter_errors(data)]
    assert not errors, errors
    load_spec(example)  # and parse_spec agrees
    first = example.read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    assert (example.parent / first.split("$schema=")[1]).resolve() == (REPO / SCHEMA_FILE).resolve()


def test_every_default_is_valid_under_the_schema():
    """A spec with every key written out at its default (spec.json's form) passes: defaults, nulls and types agree."""
    full = spec_to_dict(parse_spec({"name": "x"}))
    _validator().validate(full)
    with_lists = copy.deepcopy(full)
    with_lists["evaluation"]["sets"] = [{"name": "three", "generator": "addition", "verifier": {"type": "exact_match"}}]
    with_lists["evaluation"]["harness"] = {"tasks": ["arc_easy"]}
    with_lists["model"]["lora"] = {"rank": 8, "targets": ["q_proj"]}
    with_lists["rollout"]["environment"] = {"type": "calculator"}
    with_lists["cluster"]["trainer"]["tolerations"] = [{"key": "nvidia.com/gpu", "effect": None}]
    with_lists["cluster"]["secrets"] = [{"secret": "mlflow", "key": "token", "env": "MLFLOW_TRACKING_TOKEN"}]
    _validator().validate(with_lists)
    parse_spec(with_lists)
    from rlpipe.algorithms import ALGORITHMS

    for name in ALGORITHMS:  # each algorithm's options written out at their defaults
        full = spec_to_dict(parse_spec({"name": "x", "algorithm": {"name": name}}))
        _validator().validate(full)


BAD = {  # key: (the spec's mistake, where the schema reports it, what parse_spec says)
    "trainer.learning_rate": ({"trainer": {"learning_rate": 3e-4}}, "trainer", "trainer.learning_rate: unknown key"),
    "rollout.samples_per_prompt": (
        {"rollout": {"samples_per_prompt": 1}},
        "rollout.samples_per_prompt",
        "rollout.samples_per_prompt: must be >= 2",
    ),
    "model.warm_start.target_accuracy": (
        {"model": {"warm_start": {"target_accuracy": 1.5}}},
        "model.warm_start.target_accuracy",
        "model.warm_start.target_accuracy: must be <= 1",
    ),
    "model.lora.dropout": (
        {"model": {"lora": {"dropout": 1.0}}},
        "model.lora.dropout",
        "model.lora.dropout: must be < 1",
    ),
    "rollout.engine": ({"rollout": {"engine": "tensorflow"}}, "rollout.engine", "rollout.engine: must be one of"),
    "cluster.trainer.cpu": (
        {"cluster": {"trainer": {"image": "trainer:1", "cpu": "4 cores"}}},
        "cluster.trainer.cpu",
        "cluster.trainer.cpu: must match",
    ),
    "evaluation.sets[].typo": (
        {"evaluation": {"sets": [{"name": "a", "generator": "addition", "typo": 1}]}},
        "evaluation.sets.0",
        "evaluation.sets[0].typo: unknown key",
    ),
    "trainer.betas": ({"trainer": {"betas": [0.9]}}, "trainer.betas", "trainer.betas: must be a list of 2 values"),
    "reward.functions": ({"reward": {"functions": []}}, "reward.functions", "reward.functions: must not be empty"),
    "algorithm.beta": (  # dpo's option, not grpo's
        {"algorithm": {"name": "grpo", "beta": 0.2}},
        "algorithm",
        "algorithm.beta is not an option of algorithm grpo",
    ),
    "algorithm.clip_eps": (
        {"algorithm": {"name": "dpo", "clip_eps": 0.2}},
        "algorithm",
        "not an option of algorithm dpo",
    ),
    "algorithm.gamma": (
        {"algorithm": {"name": "ppo", "gamma": 1.5}},
        "algorithm.gamma",
        "algorithm.gamma: must be <= 1",
    ),
}


@pytest.mark.parametrize("key", BAD)
def test_the_schema_and_parse_spec_both_reject(key: str):
    mistake, where, says = BAD[key]
    data = {"name": "x", **mistake}
    errors = list(_validator().iter_errors(data))
    assert where in {".".join(map(str, e.absolute_path)) for e in errors}, [e.message for e in errors]
    if "unknown key" in says or "not an option" in says:
        assert any(f"'{key.rsplit('.', 1)[1]}' was unexpected" in e.message for e in errors)
    with pytest.raises(SpecError, match=re.escape(says)):
        parse_spec(data)


def test_rlpipe_schema_prints_the_schema_and_writes_the_docs(capsys, tmp_path):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json_schema() and printed["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert printed["properties"]["trainer"]["additionalProperties"] is False

    assert main(["schema", "--out", str(tmp_path / "s.json")]) == 0
    assert (tmp_path / "s.json").read_text() == (REPO / SCHEMA_FILE).read_text()

    page = PAGE.read_text()
    stale = page.replace(_generated(page), "\n| `trainer.removed_key` | int |\n")
    (tmp_path / "configuration.md").write_text(stale)
    assert main(["schema", "--docs", str(tmp_path / "configuration.md")]) == 0
    assert (tmp_path / "configuration.md").read_text() == page
