"""The spec crosses every process and KFP boundary unchanged: whatever a user wrote (explicit nulls,
ints, floats, tuples, free-form options) is what each step parses.

Specs are built with every field set to a value other than its default (None where the field allows
it), then sent through each boundary the spec crosses: the JSON string parameter (as a protobuf
Value, as the compiled pipeline's default, and through a real kfp.local run), spec.json, and the
JSON body of the resident trainer's requests."""

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from rlpipe.spec import RunSpec, SpecError, parse_spec, spec_from_json, spec_to_dict, spec_to_json

# Values a field's type and bounds cannot suggest (a pattern, a reference the parser checks).
CHOSEN = {
    "name": "round-trip",
    "loop.stop_when": "eval/accuracy_greedy >= 0.65",
    "reward.verifier": {"type": "math_equivalence", "answer_column": "answer"},
    "reward.functions": [
        "my_rewards:score",
        {"type": "regex", "pattern": "^[0-9]+$", "weight": 2.0, "count": 3, "unset": None, "nested": [1, {"k": 0.5}]},
    ],
    "data.options": {"digits": 3, "scale": 2.0, "none": None, "nested": [1, 2.0, {"deep": None}]},
    "algorithm.name": "dapo",
    "rollout.environment.type": "calculator",
    "tracking.model_registry.server_address": "https://model-registry.example:8443",
    **{
        f"cluster.{pod}.{key}": value
        for pod in ("trainer", "step")
        for key, value in {"cpu": "500m", "memory": "3Gi", "cpu_limit": "2", "memory_limit": "4Gi"}.items()
    },
    "reward.weights": [1.5, 0.25],
    "model.tiny.hidden_size": 192,  # divisible by num_heads, head size >= 32
    "model.tiny.num_heads": 3,
    "model.tiny.num_kv_heads": 1,
    "cluster.secrets": [{"secret": "hf", "key": "token", "env": "HF_TOKEN", "steps": ["track", "score"]}],
    "evaluation.harness.every": 10,
    "sharing.lease": "gpu-0",
    "sharing.claim.name": "shared-gpu",
    "sharing.claim.device_class": "gpu.nvidia.com",
    "sharing.claim.selector": 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"',
    "evaluation.sets": [  # every field, as spec_to_dict writes them
        {
            "name": "long",
            "path": None,
            "generator": "sorting",
            "options": {"min_digits": 20, "tail": None},
            "size": 7,
            "verifier": {"type": "exact_match", "answer_column": "answer"},
            "every": 10,
            "samples": 3,
        },
        {
            "name": "files",
            "path": "held_out.jsonl",
            "generator": None,
            "options": {},
            "size": 200,
            "verifier": None,
            "every": None,
            "samples": None,
        },
    ],  # fmt: skip
}
SHARING = {"sharing.enabled": True, "trainer.resident": True, "rollout.engine": "sampler"}
# Settings a field needs beside it (rules across fields, __post_init__).
COMPANIONS = {
    "data.path": {"data.generator": None},
    "data.format": {"data.path": "rows.jsonl", "data.generator": None},
    "data.config": {"data.path": "rows.jsonl", "data.generator": None},
    "data.split": {"data.path": "rows.jsonl", "data.generator": None},
    "data.eval_path": {"data.path": "rows.jsonl", "data.generator": None},
    "data.eval_split": {"data.path": "rows.jsonl", "data.generator": None},
    "data.eval_fraction": {"data.path": "rows.jsonl", "data.generator": None},
    "trainer.nodes": {"trainer.resident": True},
    "model.tiny.num_heads": {"model.tiny.hidden_size": 192, "model.tiny.num_kv_heads": 1},
    "reward.weights": {"reward.functions": CHOSEN["reward.functions"]},
    "rollout.environment": {"rollout.environment.type": "calculator"},
    "loop.overlap": {"loop.max_staleness": 1},
    "loop.partial_rollouts": {"loop.max_staleness": 1},
    **{  # the harness section needs its tasks
        f"evaluation.harness{key}": {"evaluation.harness.tasks": ["local_task"]}
        for key in ("", ".include_path", ".every", ".limit", ".num_fewshot", ".batch_size", ".max_gen_toks")
    },
    **{  # sharing: the resident trainer and the samplers take turns; a claim needs its device class
        key: SHARING | ({"sharing.claim.device_class": "gpu.nvidia.com"} if key.startswith("sharing.claim") else {})
        for key in (
            *(f"sharing.{k}" for k in ("enabled", "sleep_level", "offload_weights", "lease", "lease_root", "policy")),
            *(f"sharing.{k}" for k in ("lease_duration_s", "claim", "claim.name", "claim.device_class")),
            "sharing.claim.selector",
        )
    },
    "sharing.claim.count": SHARING | {"sharing.claim.device_class": "gpu.nvidia.com", "trainer.gpus": 2},
    **{  # the Kubeflow Model Registry section needs its address
        f"tracking.model_registry{key}": {"tracking.model_registry.server_address": "https://model-registry.example"}
        for key in ("", ".port", ".is_secure", ".author", ".token_env")
    },
}


def _arms(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        return (arms[0] if len(arms) == 1 else typing.Union[tuple(arms)]), len(arms) < len(typing.get_args(hint))
    return hint, False


def _number(kind: type, default: Any, bounds: dict[str, Any]) -> int | float:
    """A number of `kind` within `bounds`, other than `default`."""
    if kind is int:
        candidates = ([default + 1] if isinstance(default, int) else []) + [3, 7, 2, 1, 11]
    else:
        candidates = [0.35, 0.07, 1.5, 3.25, 0.9]
    for value in candidates:
        if value == default:
            continue
        if all(
            holds
            for bound, holds in (
                ("ge", value >= bounds.get("ge", value)),
                ("gt", value > bounds.get("gt", value - 1)),
                ("le", value <= bounds.get("le", value)),
                ("lt", value < bounds.get("lt", value + 1)),
            )
        ):
            return kind(value)
    raise AssertionError(f"no test value fits {kind} {bounds}")


def _value(hint: Any, default: Any, bounds: dict[str, Any], key: str) -> Any:
    """A value of `hint` that parses, other than `default`; nested sections get their own."""
    if key in CHOSEN:
        return CHOSEN[key]
    hint, nullable = _arms(hint)
    if nullable and default is not None:
        return None
    if dataclasses.is_dataclass(hint):
        return {}  # a section that was null: its own fields vary in their own keys
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return next(a for a in args if a != default)
    if hint is bool:
        return not default
    if hint in (int, float):
        return _number(hint, default, bounds)
    if hint is str:
        return f"{default or 'value'}-changed"
    if origin is tuple:
        return [0.8, 0.95]
    if origin is list and dataclasses.is_dataclass(args[0]):
        return [_section(args[0], f"{key}[0]")]
    if origin is list:
        return [*(default or []), _value(args[0], None, {}, f"{key}[]")]
    if origin is dict:
        return {"pool": "gpu-a100", "zone": "b"}
    raise AssertionError(f"{key}: no test value for {hint!r}")


def _section(cls: type, key: str) -> dict[str, Any]:
    """Every field of `cls` (an item of a list, e.g. a toleration) other than its default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        default = None if field.default is dataclasses.MISSING else field.default
        values[field.name] = _value(hints[field.name], default, dict(field.metadata), f"{key}.{field.name}")
    return values


def leaf_changes(cls: type = RunSpec, prefix: str = "") -> dict[str, Any]:
    """{dotted key: a non-default value} for every field of the spec, nested sections included
    (a section that defaults to null, model.lora, is set and its fields vary too)."""
    hints = typing.get_type_hints(cls)
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        hint, nullable = _arms(hints[field.name])
        if dataclasses.is_dataclass(hint):
            if nullable:
                changes[key] = {}
            changes |= leaf_changes(hint, f"{key}.")
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        changes[key] = _value(hints[field.name], default, dict(field.metadata), key)
    return changes


def _with(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


def _spec_of(changes: dict[str, Any]) -> RunSpec:
    data: dict[str, Any] = {"name": "round-trip"}
    for key in sorted(changes, key=lambda k: k.count(".")):  # sections before their fields
        _with(data, key, json.loads(json.dumps(changes[key])))
    return parse_spec(data)


def specs_covering_every_field() -> list[tuple[RunSpec, dict[str, Any]]]:
    """A few specs that between them set every field to a non-default value: each change joins the
    first spec it is compatible with (fields that exclude each other land in different specs)."""
    groups: list[dict[str, Any]] = []
    for key, value in leaf_changes().items():
        change = {key: value} | COMPANIONS.get(key, {})
        for group in groups:
            if any(group.get(k, v) != v for k, v in change.items()):
                continue
            try:
                _spec_of(group | change)
            except SpecError:
                continue
            group.update(change)
            break
        else:
            _spec_of(change)  # a change no spec accepts alone fails the test here, naming its key
            groups.append(dict(change))
    return [(_spec_of(group), group) for group in groups]


def _value_at(spec: RunSpec, key: str) -> Any:
    node: Any = spec_to_dict(spec)
    for part in key.split("."):
        node = node[part]
    return node


def _exactly(spec: RunSpec) -> str:
    """The spec with types visible: JSON tells 7 from 7.0, and spec_to_dict keeps nulls."""
    return json.dumps(spec_to_dict(spec), sort_keys=True)


@pytest.fixture(scope="module")
def covering() -> list[tuple[RunSpec, dict[str, Any]]]:
    return specs_covering_every_field()


def test_every_field_is_set_to_something_other_than_its_default(covering):
    set_somewhere = {key for _, group in covering for key in group}
    assert set_somewhere >= set(leaf_changes())
    for spec, group in covering:
        for key, value in group.items():
            if value == {}:  # a section set from null: its fields are checked as their own keys
                continue
            assert _value_at(spec, key) == json.loads(json.dumps(value)), key
    # what the old dict parameter lost: explicit nulls where the default is not null
    nulls = {key for _, group in covering for key, value in group.items() if value is None}
    assert {"model.warm_start.target_accuracy", "cluster.sandbox_runtime_class"} <= nulls


def test_the_json_parameter_round_trips_through_protobuf_and_spec_json(covering, tmp_path: Path):
    from google.protobuf import struct_pb2

    from rlpipe.store.run_root import read_json, write_json

    for spec, _ in covering:
        encoded = spec_to_json(spec)
        assert spec_from_json(encoded) == spec and _exactly(spec_from_json(encoded)) == _exactly(spec)
        # a KFP string parameter is a protobuf Value on the wire
        value = struct_pb2.Value(string_value=encoded)
        received = struct_pb2.Value.FromString(value.SerializeToString()).string_value
        assert _exactly(spec_from_json(received)) == _exactly(spec)
        # spec.json (the run root's record, the rollout producer's input) and a trainer request body
        write_json(str(tmp_path / "spec.json"), spec_to_dict(spec))
        assert _exactly(parse_spec(read_json(str(tmp_path / "spec.json")))) == _exactly(spec)
        request = json.loads(json.dumps({"spec": spec_to_dict(spec), "iteration": 3}))
        assert parse_spec(request["spec"]) == spec


def test_the_compiled_pipeline_and_a_kfp_local_run_hand_steps_the_same_spec(covering, tmp_path: Path):
    """`rlpipe compile` writes the spec as the pipeline parameter's default (read back here through
    the PipelineSpec proto), and a real kfp.local run hands it to a component, which parses it."""
    import yaml
    from google.protobuf import json_format
    from kfp import dsl, local
    from kfp.pipeline_spec import pipeline_spec_pb2

    from rlpipe.pipelines.compile import cluster_spec_and_root, compile_pipeline

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def parse_and_encode(spec: str) -> str:
        from rlpipe.spec import spec_from_json, spec_to_json

        return spec_to_json(spec_from_json(spec))

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    for i, (spec, _) in enumerate(covering):
        if spec.rollout.engine == "sampler" and not spec.samplers.endpoints:
            spec = dataclasses.replace(spec, samplers=dataclasses.replace(spec.samplers, endpoints=["http://s:8000"]))
        run_root = "gs://bucket/runs/round-trip"
        path = compile_pipeline(spec, tmp_path / f"spec{i}.yaml", run_root=run_root)
        ir = json_format.ParseDict(next(yaml.safe_load_all(path.read_text())), pipeline_spec_pb2.PipelineSpec())
        default = ir.root.input_definitions.parameters["spec"].default_value.string_value
        assert _exactly(spec_from_json(default)) == _exactly(cluster_spec_and_root(spec, run_root)[0])

        task = parse_and_encode(spec=spec_to_json(spec))
        assert _exactly(spec_from_json(task.output)) == _exactly(spec)
